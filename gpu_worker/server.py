"""The worker process: size the cache from the manager, load the model, follow steps, serve Execute."""

from __future__ import annotations

import dataclasses
import logging
import os
import secrets
import socket
import time
from concurrent import futures
from typing import NoReturn

import grpc
import torch
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

import kernels
from gpu_worker.decode_graphs import bucket_sizes
from gpu_worker.memory_budget import available_host_bytes, check_device_memory, check_host_memory
from gpu_worker.model import LlamaModel
from gpu_worker.model_config import ModelConfig, resolve_model
from gpu_worker.runner import CacheGroup, ModelRunner, PoolShape
from gpu_worker.service import EXECUTE_DURATION_BUCKETS_S, WorkerMetrics, WorkerServicer
from gpu_worker.step_follower import FollowerError, StepFollower
from gpu_worker.weights import load_safetensors, random_weights
from kv_manager_service.client import KVManagerClient, manager_addresses
from kv_manager_service.shared.rpc_metrics import RpcMetricsInterceptor, new_registry
from kv_manager_service.shared.connections import connection_options
from kv_manager_service.shared.metrics_endpoint import MetricsServer, metrics_access, start_metrics_server
from kv_manager_service.shared.parse_errors import ParseErrorInterceptor
from kv_manager_service.shared.ports import PortUnavailableError, check_port_free, listen
from kv_manager_service.shared.ready_line import WORKER_READY_PREFIX
from kv_manager_service.shared.security import BearerAuthInterceptor, ClientTLS, Role, ServerTLS, TokenTable
from kv_manager_service.shared.termination import TerminationSignals, exit_now
from kvcache.v1 import kv_manager_pb2 as manager_pb
from kvcache.v1 import worker_pb2 as pb
from kvcache.v1 import worker_pb2_grpc as pb_grpc

log = logging.getLogger("gpu_worker.server")

HANDSHAKE_TIMEOUT_S = 10.0  # a connection that has not finished its handshake by then is closed
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_WINDOWED_KINDS = {manager_pb.GROUP_KIND_FULL_ATTENTION: False, manager_pb.GROUP_KIND_SLIDING_WINDOW: True}


@dataclasses.dataclass(frozen=True)
class WorkerOptions:
    manager: str  # HOST:PORT of the kv-manager, or of each member of its HA group, comma-separated
    host: str = "127.0.0.1"
    port: int = 0  # 0: any free port
    device: str = "cpu"
    backend: str = "torch"
    model: str = "small"  # a built-in name or a checkpoint directory
    dtype: str | None = None  # None: float32 on a CPU, bfloat16 on CUDA
    seed: int = 0  # of the random weights, when the model has no checkpoint
    worker_id: str = dataclasses.field(default_factory=lambda: f"{socket.gethostname()}-{os.getpid()}")
    manager_timeout_s: float = 30.0  # to reach the manager at startup
    step_timeout_s: float = 30.0  # Execute waits this long for its step's delta
    metrics_port: int | None = None  # serve Prometheus metrics on host:metrics_port (0: any free port)
    tls: ServerTLS | None = None  # this worker's own server; None: plaintext
    tokens: TokenTable | None = None  # bearer tokens its callers must present; None: none
    manager_tls: ClientTLS | None = None  # how to reach the manager; None: plaintext
    manager_token: str | None = dataclasses.field(default=None, repr=False)  # an operator token of the manager
    cuda_graphs: bool = False  # decode steps replayed from CUDA graphs (`ModelRunner.use_decode_graphs`)

    def __post_init__(self) -> None:
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"--device must be cpu or cuda, got {self.device!r}")
        if self.backend not in kernels.BACKENDS:
            raise ValueError(f"--backend must be one of {', '.join(kernels.BACKENDS)}, got {self.backend!r}")
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port must be in 0..65535, got {self.port}")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"--metrics-port must be in 0..65535, got {self.metrics_port}")
        if self.metrics_port is not None and self.metrics_port == self.port != 0:
            raise ValueError(f"--metrics-port must differ from --port, both are {self.port}")
        if not self.manager_timeout_s > 0:
            raise ValueError(f"--manager-timeout-s must be > 0, got {self.manager_timeout_s:g}")
        if not self.worker_id:
            raise ValueError("--worker-id must not be empty")
        if self.cuda_graphs and (self.device, self.backend) != ("cuda", "triton"):
            raise ValueError(f"--cuda-graphs needs --device cuda --backend triton, got {self.device} and {self.backend}")
        try:
            manager_addresses(self.manager)
        except ValueError:
            raise ValueError(f"--manager must be HOST:PORT[,HOST:PORT...], got {self.manager!r}") from None

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype or ("bfloat16" if self.device == "cuda" else "float32")]


def pool_shape(config: manager_pb.GetConfigResponse) -> PoolShape:
    """The manager's pool and host tier as the runner needs them; refuses kinds of groups this worker cannot run."""
    groups = []
    for group in config.groups:
        if group.kind not in _WINDOWED_KINDS:
            raise ValueError(
                f"the manager's group {group.group_id} is {manager_pb.GroupKind.Name(group.kind)}; "
                "this worker runs full-attention and sliding-window groups"
            )
        window = group.sliding_window if _WINDOWED_KINDS[group.kind] else 0
        groups.append(CacheGroup(group.group_id, group.block_size, window))
    return PoolShape(
        config.num_blocks, tuple(groups), config.max_model_len, config.max_num_requests, config.num_host_blocks
    )


def check_prefix_caching(model_config: ModelConfig, enable_prefix_caching: bool) -> None:
    """Refuses dynamic RoPE scaling against a manager that reuses cached prefixes.

    Dynamic scaling rotates a token's key by its sequence's length at the step
    that computed it, so a block cached by one request holds keys another
    request, at another length, would have rotated differently.
    """
    if model_config.dynamic_rope and enable_prefix_caching:
        raise ValueError(
            f"model {model_config.name!r} uses dynamic RoPE scaling, whose cached keys depend on the sequence length "
            "they were computed at, and the manager reuses cached prefixes: start the manager with --no-prefix-caching"
        )


def warm_up_kernels(model_config: ModelConfig, pool: PoolShape, dtype: torch.dtype, device: torch.device) -> None:
    """Compile every Triton kernel variant the worker can launch (or load it from TRITON_CACHE_DIR), before serving."""
    # Imported here, not at the top: importing the kernel modules fixes Triton's reading of
    # TRITON_INTERPRET, which `kernels.load` must get to first.
    from kernels.warmup import KernelShapes, warm_up

    shapes = KernelShapes(
        model_config.num_heads, model_config.num_kv_heads, model_config.head_dim, dtype,
        tuple((group.block_size, group.sliding_window) for group in pool.groups), pool.max_model_len,
    )  # fmt: skip
    started = time.monotonic()
    count = warm_up(shapes, device, log.info)
    log.info("%d Triton kernel variants ready in %.1f s", count, time.monotonic() - started)


@dataclasses.dataclass
class RunningWorker:
    server: grpc.Server
    servicer: WorkerServicer
    address: str
    metrics: MetricsServer | None = None  # None: no --metrics-port

    @property
    def metrics_address(self) -> str | None:
        """HOST:PORT of the Prometheus endpoint (`/metrics`), or None when it is off."""
        return self.metrics.address if self.metrics is not None else None

    def stop(self, grace_s: float) -> None:
        self.server.stop(grace_s).wait()
        self.servicer.close()
        self.servicer.follower.leave()
        self.servicer.manager.close()
        if self.metrics is not None:
            self.metrics.stop()


def start_worker(options: WorkerOptions) -> RunningWorker:
    """Connect to the manager, build the model and cache, start serving; returns once it accepts calls.

    The cheap checks come first (ports, device, model name), then the wait for the manager, logged
    as it starts, and only then the slow work (kernels, weights).
    """
    check_port_free(options.host, options.port)
    if options.metrics_port is not None:
        check_port_free(options.host, options.metrics_port, "metrics port")
    device = torch.device(options.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is available to torch")
    model_config, checkpoint = resolve_model(options.model)
    manager = KVManagerClient(options.manager, tls=options.manager_tls, token=options.manager_token)
    group = len(manager.addresses) > 1
    log.info(
        "waiting up to %gs for %s at %s", options.manager_timeout_s, "a primary manager" if group else "the manager",
        options.manager, extra={"manager": options.manager},
    )  # fmt: skip
    try:
        manager.wait_ready(options.manager_timeout_s)
    except grpc.FutureTimeoutError:
        manager.close()
        if group:
            what = f"no manager of {options.manager} was the primary"
        else:
            what = f"the manager at {options.manager} did not answer"
        raise ConnectionError(
            f"{what} within {options.manager_timeout_s:g}s: start it first, or wait longer with --manager-timeout-s"
        ) from None
    try:
        manager_config = manager.get_config()
    except grpc.RpcError as error:  # a refused token, most likely
        raise ConnectionError(f"the manager at {manager.address} refused GetConfig: {error.code().name}: {error.details()}") from None
    pool = pool_shape(manager_config)
    check_prefix_caching(model_config, manager_config.enable_prefix_caching)

    kernel_set = kernels.load(options.backend, device.type)
    dtype = options.torch_dtype
    budget = check_device_memory(model_config, pool, dtype, device)  # before anything is allocated there
    check_host_memory(model_config, pool, dtype, available_host_bytes())
    if budget is not None:
        log.info(
            "%s: KV cache %.2f GiB + weights %.2f GiB + headroom %.2f GiB of %.2f GiB free; %d blocks would fit",
            device, budget.kv_cache_bytes / 2**30, budget.weight_bytes / 2**30, budget.headroom_bytes / 2**30,
            budget.free_bytes / 2**30, budget.max_num_blocks,
        )  # fmt: skip
    if checkpoint is None:
        weights = random_weights(model_config, options.seed, dtype, device)
    else:
        weights = load_safetensors(checkpoint, model_config, dtype, device)
    runner = ModelRunner(LlamaModel(model_config, weights), pool, kernel_set, device, dtype)
    if pool.num_host_blocks:
        log.info(
            "host tier: %d blocks, %.2f GiB of %s host memory", pool.num_host_blocks,
            runner.host_kv_cache_bytes / 2**30, "pinned" if device.type == "cuda" else "ordinary",
        )  # fmt: skip
    if options.backend == "triton" and device.type == "cuda":  # the CPU interpreter has nothing to compile
        warm_up_kernels(model_config, pool, dtype, device)
    if options.cuda_graphs:
        started = time.monotonic()
        runner.use_decode_graphs(bucket_sizes(pool.max_num_requests), capture=True)
        log.info("decode CUDA graphs captured for batch sizes %s in %.1f s", runner.decode_graphs.sizes,
                 time.monotonic() - started)  # fmt: skip

    # Start from the manager's present tables, none of whose KV is here; follow every later step.
    snapshot = manager.block_tables()
    for table in snapshot.tables:
        runner.add_unfilled(table.request_id, table.block_ids)
    runner.last_applied_step_id = snapshot.step_id
    if snapshot.tables:
        log.warning("%d requests were live before this worker started: their KV is not here", len(snapshot.tables))
    incarnation = secrets.randbits(64) or 1  # this process's memory, as the manager tells it from a restarted one
    follower = StepFollower(manager, options.worker_id, snapshot.step_id + 1, incarnation)
    follower.start()
    # Ready means registered: a worker that joins empties the manager's prefix cache as it registers
    # (its memory is empty), and a scheduler told "ready" must not see that happen after.
    try:
        follower.wait_registered(options.manager_timeout_s)
    except (FollowerError, TimeoutError) as error:
        follower.close()
        raise ConnectionError(f"{error}; the worker cannot follow its steps") from None

    info = pb.GetWorkerInfoResponse(
        worker_id=options.worker_id,
        model=model_config.name,
        device=options.device,
        backend=options.backend,
        dtype=str(dtype).removeprefix("torch."),
        num_layers=model_config.num_layers,
        vocab_size=model_config.vocab_size,
        num_blocks=pool.num_blocks,
        block_size=pool.groups[0].block_size,
        kv_cache_bytes=runner.kv_cache_bytes,
    )
    interceptors: list[grpc.ServerInterceptor] = []
    worker_metrics: WorkerMetrics | None = None
    metrics: MetricsServer | None = None
    if options.metrics_port is not None:
        registry = new_registry()
        worker_metrics = WorkerMetrics(registry, runner)
        service = pb.DESCRIPTOR.services_by_name["WorkerService"]
        interceptors.append(RpcMetricsInterceptor(service, registry, "gpu_worker", EXECUTE_DURATION_BUCKETS_S))
        # Every token of the worker may call every RPC, so every token may read the metrics.
        access = metrics_access(options.host, options.tls, options.tokens, reader_roles=tuple(Role))
        metrics = start_metrics_server(registry, options.host, options.metrics_port, access)
    if options.tokens is not None:
        interceptors.append(BearerAuthInterceptor(options.tokens))  # after the metrics: they count what it refuses
        if options.tls is None:
            log.warning("bearer tokens without --tls-cert travel in clear text: use TLS off a trusted network")
    interceptors.append(ParseErrorInterceptor())  # last: refuses unparsed and oversized requests (shared/bounds.py)
    servicer = WorkerServicer(runner, follower, manager, info, options.step_timeout_s, worker_metrics)
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix="worker-rpc"),
        interceptors=interceptors,
        options=[
            ("grpc.so_reuseport", 0),  # a second server on this port is refused, not handed half the calls
            *connection_options(None, HANDSHAKE_TIMEOUT_S),  # idle sockets cannot starve the scheduler
        ],
    )
    pb_grpc.add_WorkerServiceServicer_to_server(servicer, server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    try:
        port = listen(server, options.host, options.port, options.tls.credentials() if options.tls else None)
    except PortUnavailableError:
        if metrics is not None:
            metrics.stop()
        raise
    server.start()
    health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    log.info(
        "worker %s: model %s (%d layers) on %s/%s %s, %d blocks, KV cache %.1f MiB, following %s from step %d",
        options.worker_id, model_config.name, model_config.num_layers, options.device, options.backend, info.dtype,
        pool.num_blocks, runner.kv_cache_bytes / 2**20, options.manager, snapshot.step_id + 1,
        extra={"worker_id": options.worker_id, "manager": options.manager, "incarnation": incarnation},
    )  # fmt: skip
    if metrics is not None:
        readers = metrics.access.describe()
        log.info("metrics at %s, read with %s", metrics.url, readers, extra={"metrics_url": metrics.url})
    return RunningWorker(server, servicer, f"{options.host}:{port}", metrics)


def serve(options: WorkerOptions) -> NoReturn:
    """Run until SIGTERM or SIGINT, stop cleanly, then end the process with code 0 (`exit_now`)."""
    running = start_worker(options)
    signals = TerminationSignals()
    print(f"{WORKER_READY_PREFIX}{running.address}", flush=True)
    received = signals.wait()
    log.info("%s: shutting down, grace 5.0s", received.name)
    running.stop(grace_s=5.0)
    exit_now(0)
