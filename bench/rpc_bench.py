"""Benchmarks of the gRPC service against a real server subprocess on loopback.

Starts `python -m kv_manager_service.cli serve --port 0` as a user would,
keeps the client in this process, and measures in one run:

1. floor: the empty RPC, a GetStats round trip (raw stub, prebuilt request).
2. decode Steps of 1, 64 and 256 ops: every request is admitted first with a
   1000-token prompt (the pool is big enough), then decodes one token per
   Step through the columnar `StepRequest.decode` (DecodeBatch). Sent through
   the raw stub with prebuilt requests; for 256 ops also as pre-serialized
   bytes (no client-side proto work), through `KVManagerClient.decode`, as
   nested `ops` (one AllocateRequest per op, prebuilt) and through
   `KVManagerClient.step(ops)`.
3. the same 256 decode entries in-process, on a core built from the same
   flags as the server's (events on, as the server runs it): as the
   `DecodeBatch` the server applies (`KVCacheManager.step((), decode=...)`),
   and as 256 `AllocateOp(rid, [tok], 1)`; building the input is not timed.
4. throughput: request-steps per second with back-to-back 256-op Steps from
   one client, and from two clients in threads (separate connections and
   request sets), with the CPU seconds each process spent per Step.
5. where a 256-op Step's server time goes: the servicer's pipeline run
   in-process without gRPC, phase by phase, on another identical core
   (proto decode, wire.step_ops, the replica's checks, core step,
   wire.step_delta, the step-log append, event publishing, response
   assembly with wire.decode_results, response encode), plus the
   client's own proto work.

Every round measures all of these, in-process right after the RPC it is
compared with, so ratios come from the same moment (single runs on a 2-core
machine swing by up to 2x). Each figure is the median over rounds of the
per-round figure; the spread shows the lowest and highest round's p50.

With --vllm-python, --vllm-source and --vllm-baseline (the baselines kit's
interpreter, vLLM source folder and program), each round also runs vLLM's own
KV-cache manager in-process, right after this round's columnar Steps: 256
requests of random 1,000-token prompts admitted, then as many 256-request
decode steps as a series has calls. Section 5 gives the ratios of this
round's Step round trip and admission Step to vLLM's in-process step and
admission, medians over rounds: same-run ratios, which a noisy machine
does not skew the way figures from different runs do.

With --profile-server PATH, a last phase runs py-spy (--gil: the thread
holding the GIL, i.e. Python CPU) on the server subprocess during
back-to-back 256-op decode Steps, writes the raw collapsed stacks to PATH
and adds a table of samples by category (proto decode, step_ops, core,
_delta, decode_results, events, encode, gRPC's Python glue).

    python bench/rpc_bench.py            # full run, about a minute on 2 cores
    python bench/rpc_bench.py --quick    # smoke run, seconds
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import json
import os
import platform
import random
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import grpc
from google.protobuf import __version__ as protobuf_version
from google.protobuf.internal import api_implementation

from bench_stats import Series, fmt, med, print_round, row
from process_cpu import cpu_s
from kv_manager_service.cli.flags import build_config
from kv_manager_service.cli.main import make_parser as serve_parser
from kv_manager_service import wire
from kv_manager_service.client import KVManagerClient
from kv_tooling.launch import LaunchedProcess, launch
from kv_manager_service.shared.ready_line import MANAGER_READY_PREFIX, NotReadyError
from kv_manager_service.core import AllocateOp, AllocateStatus, DecodeBatch, KVCacheConfig, KVCacheManager
from kv_manager_service.server.replica import Replica
from kv_manager_service.server.servicer import KVManagerServicer
from kvcache.v1 import kv_manager_pb2 as pb

ROOT = Path(__file__).resolve().parents[1]
BLOCK_SIZE = 16  # the server's default pool: one full-attention group of 16-token blocks
PROMPT_LEN = 1000
VOCAB_SIZE = 150_000
NUM_PREBUILT = 16  # distinct prebuilt decode requests, cycled (tokens differ between them)
STEP_METHOD = "/kvcache.v1.KVManagerService/Step"

# Targets (see the brief): 1.5x vLLM 0.33's in-process 256-request decode step
# (1.4-1.65 ms on this machine kind), and the serving rate a 256-op Step must sustain.
TARGET_STEP_256_P50_MS = 2.2
TARGET_REQUEST_STEPS_PER_S = 100_000

OK = pb.ALLOCATE_STATUS_OK
now_ns = time.perf_counter_ns


# -- plumbing --------------------------------------------------------------------


def start_server(num_blocks: int, directory: Path) -> LaunchedProcess:
    """`kv-manager serve --port 0` in a subprocess, as a user starts it; its log goes to `directory`."""
    argv = [
        sys.executable, "-m", "kv_manager_service.cli", "serve",
        "--port", "0", "--num-blocks", str(num_blocks), "--replica-id", "rpc-bench", "--log-level", "WARNING",
    ]  # fmt: skip
    try:
        return launch(argv, MANAGER_READY_PREFIX, directory / "server.log", cwd=ROOT)
    except NotReadyError as error:
        raise SystemExit(f"the server did not start: {error}") from None


def make_client(address: str, own_connection: bool = False) -> KVManagerClient:
    options = [("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20)]
    if own_connection:  # channels with equal options otherwise share one subchannel (one TCP connection)
        options.append(("grpc.use_local_subchannel_pool", 1))
    client = KVManagerClient(address, channel=grpc.insecure_channel(address, options=options))
    client.wait_ready()
    return client


def server_config(num_blocks: int) -> KVCacheConfig:
    """The core the server builds from `serve --num-blocks N`: the same flags, then events on (start_server)."""
    args = serve_parser().parse_args(["serve", "--num-blocks", str(num_blocks)])
    return dataclasses.replace(build_config(args), enable_events=True)


class Workload:
    """Request ids, prompts and prebuilt decode messages for one set of `n` requests."""

    def __init__(self, tag: str, n: int, rng: random.Random) -> None:
        self.request_ids = [f"{tag}-{i}" for i in range(n)]
        self.prompts = [[rng.randrange(VOCAB_SIZE) for _ in range(PROMPT_LEN)] for _ in range(n)]
        self.tokens = [[rng.randrange(VOCAB_SIZE) for _ in range(n)] for _ in range(NUM_PREBUILT)]
        self.decode_requests = [
            pb.StepRequest(decode=pb.DecodeBatch(request_ids=self.request_ids, token_ids=t)) for t in self.tokens
        ]
        self.decode_bytes = [r.SerializeToString() for r in self.decode_requests]
        self.nested_requests = [
            pb.StepRequest(
                ops=[pb.StepOp(allocate=pb.AllocateRequest(request_id=r, token_ids=[tok], num_new_tokens=1))
                     for r, tok in zip(self.request_ids, t)]
            )
            for t in self.tokens
        ]

    def admit_request(self) -> pb.StepRequest:
        return pb.StepRequest(
            ops=[pb.StepOp(allocate=pb.AllocateRequest(request_id=r, token_ids=p, num_new_tokens=len(p)))
                 for r, p in zip(self.request_ids, self.prompts)]
        )

    def admit_ops(self) -> list[AllocateOp]:
        return [AllocateOp(r, p, len(p)) for r, p in zip(self.request_ids, self.prompts)]

    def decode_batch(self, step: int) -> DecodeBatch:
        return DecodeBatch(self.request_ids, self.tokens[step % NUM_PREBUILT])

    def decode_ops(self, step: int) -> list[AllocateOp]:
        return [AllocateOp(r, [t], 1) for r, t in zip(self.request_ids, self.tokens[step % NUM_PREBUILT])]


def admit_rpc(client: KVManagerClient, work: Workload) -> float:
    """Admit every prompt of `work` in one Step; its wall time in ms (the request built beforehand)."""
    request = work.admit_request()
    start = now_ns()
    response = client.stub.Step(request, timeout=60)
    elapsed_ms = (now_ns() - start) / 1e6
    assert all(r.allocate.status == OK for r in response.results), "admission failed: pool too small?"
    return elapsed_ms


@dataclass(frozen=True)
class VllmBaseline:
    """vLLM's own KV-cache manager, in-process in its own interpreter: the baselines kit's program.

    `program N P D` admits N requests of P-token prompts (request construction with sha256_cbor
    hashing, cache lookup, allocation), then runs D decode steps of one token per request, and
    prints one JSON line with `step_ms_p50` (one N-request decode step) and `prefill_ms_total`.
    """

    python: Path  # an interpreter with vLLM's Python dependencies
    source: Path  # the folder holding vLLM's pure-Python source (`vllm/`), put on PYTHONPATH
    program: Path

    def run(self, num_requests: int, prompt_len: int, num_steps: int) -> tuple[float, float]:
        """(decode step p50 ms, admission ms) of one run."""
        env = {**os.environ, "PYTHONPATH": str(self.source)}
        done = subprocess.run(
            [str(self.python), str(self.program), str(num_requests), str(prompt_len), str(num_steps)],
            capture_output=True, text=True, env=env, timeout=600, check=False,
        )  # fmt: skip
        if done.returncode != 0:
            raise RuntimeError(f"the vLLM baseline failed ({done.returncode}): {done.stderr[-2000:]}")
        report = json.loads(done.stdout.strip().splitlines()[-1])
        return float(report["step_ms_p50"]), float(report["prefill_ms_total"])


def check_decode(response: pb.StepResponse, n: int) -> bool:
    """Asserts every op got OK; returns whether any table changed (the step filled a block)."""
    statuses = response.decode.statuses
    assert len(statuses) == n and all(s == OK for s in statuses), "a decode op got NO_SPACE: pool too small?"
    return len(response.decode.changes) > 0


def check_nested(response: pb.StepResponse) -> None:
    assert all(r.allocate.status == OK for r in response.results), "a nested op got NO_SPACE: pool too small?"


def timed_calls(
    call: Callable[[int], Any], check: Callable[[Any], Any], warmup: int, steps: int, flags: list | None = None
) -> list[int]:
    """`call(i)` `warmup` times untimed, then `steps` timed calls; `check` runs outside the timing.

    With `flags`, what `check` returns for each timed call is appended to it.
    """
    for i in range(warmup):
        check(call(i))
    samples = []
    for i in range(steps):
        start = now_ns()
        response = call(i)
        samples.append(now_ns() - start)
        flag = check(response)
        if flags is not None:
            flags.append(flag)
    return samples


# -- the measurements of one round -------------------------------------------------


@dataclass
class Plan:
    rounds: int
    warmup: int  # untimed calls before each timed series
    steps: int  # timed calls per series and round
    floor_calls: int  # GetStats calls per round
    throughput_steps: int  # back-to-back Steps per client per round
    profile_s: float
    vllm: "VllmBaseline | None" = None  # run vLLM's own manager in each round, for same-run ratios

    @property
    def tokens_per_request(self) -> int:
        """Longest request of a round: the 256-op set runs 5 latency series (raw, bytes, client.decode, nested,
        client.step), then the throughput runs."""
        return PROMPT_LEN + 5 * (self.warmup + self.steps) + self.throughput_steps + BLOCK_SIZE

    @property
    def num_blocks(self) -> int:
        per_request = -(-self.tokens_per_request // BLOCK_SIZE) + 1
        return (256 + 256 + 64 + 1) * per_request + 1024


@dataclass
class Results:
    series: dict[str, Series] = field(default_factory=dict)
    phases: dict[str, Series] = field(default_factory=dict)

    def get(self, key: str) -> Series:
        return self.series.setdefault(key, Series())

    def phase(self, key: str) -> Series:
        return self.phases.setdefault(key, Series())


PHASES = (
    ("decode", "proto decode: StepRequest.FromString"),
    ("step_ops", "wire.step_ops: the DecodeBatch's two columns as lists"),
    ("checks", "Replica.step: token/op limits"),
    ("core", "core: KVCacheManager.step (its StepDelta included)"),
    ("log", "step log append (BroadcastLog, the StepDelta value)"),
    ("events", "_publish_events: take_events (converted when sent)"),
    ("delta", "wire.step_delta + SerializeToString: the delta a worker's stream sends, once per step, off the lock"),
    ("assemble", "StepResponse + wire.decode_results (columns in place)"),
    ("encode", "response encode: SerializeToString"),
)
CLIENT_PHASES = (
    ("c_build", "client: build StepRequest from lists (client.decode)"),
    ("c_encode", "client: request SerializeToString"),
    ("c_parse", "client: response FromString"),
    ("c_tuples", "client: DecodeStepResult tuples (client.decode)"),
)


def measure_breakdown(results: Results, servicer: KVManagerServicer, work: Workload, plan: Plan) -> None:
    """The servicer's Step pipeline (KVManagerServicer.Step and Replica.step, inlined in order), phase by phase."""
    replica = servicer.replica
    manager = replica.manager
    # The handlers as written, without the coroutine wrapper that gRPC awaits (`servicer._unary`).
    step = functools.partial(KVManagerServicer.Step.__wrapped__, servicer)
    free = functools.partial(KVManagerServicer.Free.__wrapped__, servicer)
    admit = step(work.admit_request(), None)
    assert all(r.allocate.status == OK for r in admit.results)
    phase_ns: dict[str, list[int]] = {key: [] for key, _ in PHASES + CLIENT_PHASES}
    whole_ns, whole_nogc_ns = [], []
    for i in range(plan.warmup + plan.steps):
        data = work.decode_bytes[i % NUM_PREBUILT]
        t0 = now_ns()
        request = pb.StepRequest.FromString(data)
        t1 = now_ns()
        ops, decode = wire.step_ops(request)
        t2 = now_ns()
        num_tokens = sum(len(op.token_ids) for op in ops if type(op) is AllocateOp) + len(decode.token_ids)
        num_ops = len(ops) + len(decode.request_ids)
        assert num_tokens <= replica.limits.max_tokens_per_call and num_ops <= replica.limits.max_ops_per_step
        with replica.lock:
            t3 = now_ns()
            result = manager.step(ops, decode=decode)
            t4 = now_ns()
            replica.steps.append(result.delta)
            t5 = now_ns()
            replica._publish_events()
            t6 = now_ns()
        wire.step_delta(result.delta).SerializeToString()  # the workers' stream, once per step (servicer)
        t7 = now_ns()
        response = pb.StepResponse(step_id=result.step_id)
        response.results.extend([wire.step_result(r) for r in result.results])
        wire.decode_results(result.decode, response.decode)
        t9 = now_ns()
        out = response.SerializeToString()
        t10 = now_ns()
        # The client's side of client.decode, on the same bytes.
        ids, tokens = work.request_ids, work.tokens[i % NUM_PREBUILT]
        c0 = now_ns()
        message = pb.StepRequest(decode=pb.DecodeBatch(request_ids=ids, token_ids=tokens))
        c1 = now_ns()
        message.SerializeToString()
        c2 = now_ns()
        parsed = pb.StepResponse.FromString(out)
        c3 = now_ns()
        d = parsed.decode
        (
            parsed.step_id,
            tuple(AllocateStatus(s) for s in d.statuses),
            tuple(d.num_computed_tokens),
            tuple((c.op_index, c.group_id, c.new_block_index, tuple(c.new_block_ids)) for c in d.changes),
            tuple((c.src_block_id, c.dst_block_id) for c in d.copies),
        )
        c4 = now_ns()
        check_decode(parsed, len(ids))
        if i >= plan.warmup:
            for key, start, end in (
                ("decode", t0, t1), ("step_ops", t1, t2), ("checks", t2, t3), ("core", t3, t4),
                ("log", t4, t5), ("events", t5, t6), ("delta", t6, t7), ("assemble", t7, t9), ("encode", t9, t10),
                ("c_build", c0, c1), ("c_encode", c1, c2), ("c_parse", c2, c3), ("c_tuples", c3, c4),
            ):
                phase_ns[key].append(end - start)
    # The servicer itself, end to end (bytes in, bytes out), with and without the cyclic GC.
    for i in range(plan.warmup + plan.steps):
        data = work.decode_bytes[i % NUM_PREBUILT]
        start = now_ns()
        step(pb.StepRequest.FromString(data), None).SerializeToString()
        if i >= plan.warmup:
            whole_ns.append(now_ns() - start)
    gc.disable()
    try:
        for i in range(plan.warmup + plan.steps):
            data = work.decode_bytes[i % NUM_PREBUILT]
            start = now_ns()
            step(pb.StepRequest.FromString(data), None).SerializeToString()
            if i >= plan.warmup:
                whole_nogc_ns.append(now_ns() - start)
    finally:
        gc.enable()
    for key, samples in phase_ns.items():
        series = results.phase(key)
        series.add_samples(samples, 1e3)  # us
        results.phase(key + ":mean").add_value(statistics.fmean(samples) / 1e3)
    pipeline = [sum(phase_ns[k][j] for k, _ in PHASES) for j in range(plan.steps)]
    results.phase("pipeline").add_samples(pipeline, 1e3)
    results.phase("pipeline:mean").add_value(statistics.fmean(pipeline) / 1e3)
    results.phase("whole").add_samples(whole_ns, 1e3)
    results.phase("whole:mean").add_value(statistics.fmean(whole_ns) / 1e3)
    results.phase("whole_nogc").add_samples(whole_nogc_ns, 1e3)
    results.phase("whole_nogc:mean").add_value(statistics.fmean(whole_nogc_ns) / 1e3)
    free(pb.FreeRequest(request_ids=work.request_ids), None)


def throughput(clients: Sequence[KVManagerClient], works: Sequence[Workload], steps: int) -> tuple[float, float]:
    """Back-to-back 256-op Steps, one thread per client; returns (request-steps/s, wall s)."""
    barrier = threading.Barrier(len(clients) + 1)
    errors: list[BaseException] = []

    def loop(client: KVManagerClient, work: Workload) -> None:
        step = client.stub.Step
        requests = work.decode_requests
        barrier.wait()
        try:
            response = None
            for i in range(steps):
                response = step(requests[i % NUM_PREBUILT], timeout=30)
            check_decode(response, len(work.request_ids))
        except BaseException as error:  # noqa: BLE001 - reported by the caller
            errors.append(error)

    threads = [threading.Thread(target=loop, args=(c, w)) for c, w in zip(clients, works)]
    for thread in threads:
        thread.start()
    barrier.wait()
    start = now_ns()
    for thread in threads:
        thread.join()
    wall = (now_ns() - start) / 1e9
    if errors:
        raise errors[0]
    return sum(len(w.request_ids) for w in works) * steps / wall, wall


def run_round(
    index: int,
    plan: Plan,
    server: LaunchedProcess,
    client: KVManagerClient,
    client2: KVManagerClient,
    manager: KVCacheManager,
    servicer: KVManagerServicer,
    results: Results,
) -> None:
    rng = random.Random(index)
    w1 = Workload(f"r{index}-one", 1, rng)
    w64 = Workload(f"r{index}-64", 64, rng)
    w256 = Workload(f"r{index}-256", 256, rng)
    w256b = Workload(f"r{index}-256b", 256, rng)
    for work in (w1, w64, w256, w256b):
        admitted_ms = admit_rpc(client, work)
        if work is w256:
            results.get("admit256").add_value(admitted_ms)
    stub = client.stub
    warmup, steps = plan.warmup, plan.steps

    # 1. the empty-RPC floor
    stats_request = pb.GetStatsRequest()
    server_cpu, client_cpu = cpu_s(server.pid), time.process_time()
    floor = timed_calls(lambda i: stub.GetStats(stats_request, timeout=10), lambda r: None, warmup, plan.floor_calls)
    calls = warmup + plan.floor_calls
    results.get("floor_server_cpu_ms").add_value((cpu_s(server.pid) - server_cpu) / calls * 1e3)
    results.get("floor_client_cpu_ms").add_value((time.process_time() - client_cpu) / calls * 1e3)
    results.get("floor").add_samples(floor)

    # 2. columnar decode through the raw stub, prebuilt requests
    for work in (w1, w64, w256):
        n = len(work.request_ids)
        filled: list[bool] = []
        samples = timed_calls(
            lambda i: stub.Step(work.decode_requests[i % NUM_PREBUILT], timeout=10),
            lambda r: check_decode(r, n), warmup, steps, filled,
        )
        results.get(f"raw{n}").add_samples(samples)
        if n == 256:
            results.get("raw256_fill").add_samples([t for t, f in zip(samples, filled) if f])
            results.get("raw256_nofill").add_samples([t for t, f in zip(samples, filled) if not f])
    raw256_p50 = results.get("raw256").p50[-1]

    # 2v. vLLM's own manager, in-process, right after the Steps it is compared with
    if plan.vllm is not None:
        vllm_step_ms, vllm_admit_ms = plan.vllm.run(256, PROMPT_LEN, warmup + steps)
        results.get("vllm_step").add_value(vllm_step_ms)
        results.get("vllm_admit").add_value(vllm_admit_ms)
        results.get("ratio_raw_vllm").add_value(raw256_p50 / vllm_step_ms)
        results.get("ratio_admit_vllm").add_value(results.get("admit256").p50[-1] / vllm_admit_ms)

    # 3. in-process, right after the RPC it is compared with
    admitted = manager.step(w256.admit_ops())
    assert all(r.status is AllocateStatus.OK for r in admitted.results)
    manager.take_events()
    inproc, inproc_ops = [], []
    for i in range(warmup + steps):
        batch = w256.decode_batch(i)
        start = now_ns()
        result = manager.step((), decode=batch)
        elapsed = now_ns() - start
        manager.take_events()  # the server drains them every step; not timed, as in core_bench
        assert all(status is AllocateStatus.OK for status in result.decode.statuses)
        ops = w256.decode_ops(i)
        start = now_ns()
        result = manager.step(ops)
        elapsed_ops = now_ns() - start
        manager.take_events()
        assert all(r.status is AllocateStatus.OK for r in result.results)
        if i >= warmup:
            inproc.append(elapsed)
            inproc_ops.append(elapsed_ops)
    results.get("inproc").add_samples(inproc)
    results.get("inproc_ops").add_samples(inproc_ops)
    inproc_p50 = results.get("inproc").p50[-1]
    manager.free(w256.request_ids)
    manager.take_events()

    # 2b. the other ways to send the same 256 ops
    raw_step = client.channel.unary_unary(STEP_METHOD)  # bytes in, bytes out: no client-side proto work
    samples = timed_calls(lambda i: raw_step(w256.decode_bytes[i % NUM_PREBUILT], timeout=10),
                          lambda r: check_decode(pb.StepResponse.FromString(r), 256), warmup, steps)
    results.get("bytes256").add_samples(samples)
    ids = w256.request_ids

    def check_result(r: Any) -> None:
        assert all(s is AllocateStatus.OK for s in r.statuses)

    samples = timed_calls(lambda i: client.decode(ids, w256.tokens[i % NUM_PREBUILT]), check_result, warmup, steps)
    results.get("client256").add_samples(samples)
    samples = timed_calls(
        lambda i: stub.Step(w256.nested_requests[i % NUM_PREBUILT], timeout=10),
        check_nested, warmup, steps,
    )
    results.get("nested256").add_samples(samples)

    def check_step(r: Any) -> None:
        assert all(x.status is AllocateStatus.OK for x in r.results)

    samples = timed_calls(lambda i: client.step(w256.decode_ops(i)), check_step, warmup, steps)
    results.get("clientstep256").add_samples(samples)

    # ratios of this round
    results.get("ratio_raw_inproc").add_value(raw256_p50 / inproc_p50)
    results.get("ratio_client_inproc").add_value(results.get("client256").p50[-1] / inproc_p50)
    results.get("ratio_nested_raw").add_value(results.get("nested256").p50[-1] / raw256_p50)
    if plan.vllm is not None:
        results.get("ratio_client_vllm").add_value(results.get("client256").p50[-1] / results.get("vllm_step").p50[-1])
    results.get("over_floor").add_value(raw256_p50 - results.get("floor").p50[-1])

    # 4. throughput, with CPU per Step of each process
    server_cpu, client_cpu = cpu_s(server.pid), time.process_time()
    rate, wall = throughput([client], [w256], plan.throughput_steps)
    server_cpu, client_cpu = cpu_s(server.pid) - server_cpu, time.process_time() - client_cpu
    results.get("tput1").add_value(rate)
    results.get("tput1_step_ms").add_value(wall / plan.throughput_steps * 1e3)
    results.get("server_cpu_ms").add_value(server_cpu / plan.throughput_steps * 1e3)
    results.get("client_cpu_ms").add_value(client_cpu / plan.throughput_steps * 1e3)
    rate, _ = throughput([client, client2], [w256, w256b], plan.throughput_steps)
    results.get("tput2").add_value(rate)

    # 5. the servicer's pipeline without gRPC
    measure_breakdown(results, servicer, Workload(f"r{index}-bd", 256, random.Random(1000 + index)), plan)

    client.free(w1.request_ids + w64.request_ids + w256.request_ids + w256b.request_ids)


# -- profile -----------------------------------------------------------------------

# Categories of py-spy stacks, first match wins (a frame anywhere in the stack).
PROFILE_CATEGORIES = (
    ("events", "event publishing (_publish_events, wire.kv_event)", ("_publish_events (",)),
    ("delta", "wire.step_delta (a delta serialized for the workers' streams)", ("step_delta (kv_manager_service/wire.py",)),
    ("log", "step log append", ("(kv_manager_service/broadcast_log.py",)),
    ("core", "core step (KVCacheManager.step)", ("KVCacheManager.step (",)),
    ("step_ops", "wire.step_ops (the decode columns as lists)", ("step_ops (", "step_ops.<locals>")),
    ("decode_results", "wire.decode_results", ("decode_results (", "decode_results.<locals>")),
    ("apply", "Replica.step, rest (limits, live-request checks, lock)", ("Replica.step (",)),
    ("step", "service.Step, rest (StepResponse, CopyFrom)", ("KVManagerServicer.Step (",)),
    ("proto_decode", "proto decode (grpc deserialize -> FromString)", ("deserialize (grpc/_common.py",)),
    ("proto_encode", "response encode (grpc serialize -> SerializeToString)", ("serialize (grpc/_common.py",)),
    ("handler_other", "servicer, rest (_unary wrapper: frees ops/results on return)", ("(kv_manager_service/",)),
    ("grpc_send", "gRPC: _status (start the send batch)", ("_status (grpc/_server.py",)),
    ("grpc_poll", "gRPC: poll thread _serve (C-core poll, event dispatch, pool submit)", ("_serve (grpc/_server.py",)),
    ("grpc_pool", "gRPC: thread-pool worker loop (_worker)", ("_worker (concurrent/futures/thread.py",)),
    ("grpc_other", "gRPC Python, rest (request thunk, context)", ("(grpc/",)),
)
SERVICER_CATEGORIES = {"events", "delta", "log", "core", "step_ops", "decode_results", "apply", "step",
                       "proto_decode", "proto_encode", "handler_other"}


def categorize(raw: str) -> dict[str, int]:
    counts: dict[str, int] = {}
    for line in raw.splitlines():
        if not line.strip():
            continue
        stack, _, number = line.rpartition(" ")
        category = "other"
        for key, _, patterns in PROFILE_CATEGORIES:
            if any(p in stack for p in patterns):
                category = key
                break
        counts[category] = counts.get(category, 0) + int(number)
    return counts


def profile_server(
    server: LaunchedProcess, client: KVManagerClient, plan: Plan, path: Path, gil_only: bool, rate: int, nonblocking: bool
) -> list[str]:
    """py-spy on the server during back-to-back 256-op Steps; a table of samples by category."""
    py_spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if not Path(py_spy).exists():
        raise SystemExit("--profile-server needs py-spy: pip install py-spy")
    work = Workload("profile", 256, random.Random(99))
    admit_rpc(client, work)
    stub = client.stub
    for i in range(plan.warmup):
        stub.Step(work.decode_requests[i % NUM_PREBUILT], timeout=10)
    # Every round's requests are freed by now: the whole pool is there (evictable cached blocks included).
    max_steps = ((plan.num_blocks - 1024) // 256 - 2) * BLOCK_SIZE - PROMPT_LEN - plan.warmup
    argv = [py_spy, "record", "--pid", str(server.pid), "--format", "raw", "-o", str(path),
            "--duration", str(max(1, round(plan.profile_s))), "--rate", str(rate)]
    flags = [f"--rate {rate}"]
    if nonblocking:
        flags.append("--nonblocking")
    if gil_only:
        flags.append("--gil")
    argv += [f for f in flags if not f.startswith("--rate")]
    spy = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    time.sleep(0.5)  # attach
    steps, cpu0, start = 0, cpu_s(server.pid), now_ns()
    while spy.poll() is None and steps < max_steps:
        stub.Step(work.decode_requests[steps % NUM_PREBUILT], timeout=10)
        steps += 1
    wall, cpu = (now_ns() - start) / 1e9, cpu_s(server.pid) - cpu0
    _, err = spy.communicate(timeout=60)
    client.free(work.request_ids)
    if spy.returncode != 0 or not path.exists():
        raise SystemExit(f"py-spy failed ({spy.returncode}): {err}")
    counts = categorize(path.read_text())
    total = sum(counts.values()) or 1
    servicer_total = sum(counts.get(k, 0) for k in SERVICER_CATEGORIES) or 1
    labels = {key: label for key, label, _ in PROFILE_CATEGORIES} | {"other": "other"}
    steps = max(steps, 1)
    what = ("samples of the thread holding the GIL (Python CPU; C-core work without the GIL is not seen)"
            if gil_only else "samples of every thread py-spy deems active (gRPC rows may include waits)")
    lines = [
        "",
        f"## Server profile: py-spy record {' '.join(flags)} --pid {server.pid}",
        "",
        f"{steps} back-to-back 256-op decode Steps in {wall:.1f} s ({wall / steps * 1e3:.2f} ms each with the "
        f"profiler attached, which shares the 2 cores); server CPU {cpu / steps * 1e3:.2f} ms per Step. "
        f"{sum(counts.values()):,} {what}. ms per Step = samples / rate / Steps. Raw stacks: `{path}`.",
        "",
        "| category | samples | of all | of servicer + codec | ms per Step |",
        "|---|---:|---:|---:|---:|",
    ]
    for key in sorted(counts, key=counts.get, reverse=True):
        share = f"{counts[key] / servicer_total:.1%}" if key in SERVICER_CATEGORIES else ""
        per_step = counts[key] / rate / steps * 1e3
        lines.append(f"| {labels[key]} | {counts[key]:,} | {counts[key] / total:.1%} | {share} | {fmt(per_step)} |")
    return lines


# -- report ------------------------------------------------------------------------


def render(results: Results, plan: Plan, command: str, seconds: float, server_argv: Sequence[str]) -> list[str]:
    s = results.series
    lines = [
        "# RPC benchmarks",
        "",
        f"Command: `{command}`",
        "",
        f"Python {platform.python_version()} ({platform.python_implementation()}), {platform.system()} "
        f"{platform.machine()}, {os.cpu_count()} CPUs; grpcio {grpc.__version__}, protobuf {protobuf_version} "
        f"({api_implementation.Type()}); server `{shlex.join(['python', *server_argv[1:]])}` on loopback, "
        f"client in the bench process; {plan.rounds} alternating rounds, each {plan.steps} timed calls per "
        f"series after {plan.warmup} warm-up ({plan.floor_calls} for GetStats, {plan.throughput_steps} Steps per "
        f"client for throughput); medians over rounds of per-round p50 / p99; total {seconds:.0f} s.",
        "",
        "| # | metric | p50 | p99 | unit | spread (round p50s) | target | note |",
        "|---|---|---:|---:|---|---|---|---|",
        row("1", "empty RPC: GetStats round trip", s["floor"], "ms", note="raw stub, prebuilt request"),
        row("1", "  server process CPU per GetStats", s["floor_server_cpu_ms"], "ms", note="/proc/PID/stat"),
        row("1", "  client process CPU per GetStats", s["floor_client_cpu_ms"], "ms", note="time.process_time"),
        row("2", "Step, 1 decode op (columnar)", s["raw1"], "ms", note="raw stub, prebuilt request"),
        row("2", "Step, 64 decode ops (columnar)", s["raw64"], "ms", note="raw stub, prebuilt request"),
        row("2", "Step, 256 decode ops (columnar)", s["raw256"], "ms", f"<= {TARGET_STEP_256_P50_MS}",
            "raw stub, prebuilt request", met=med(s["raw256"]) <= TARGET_STEP_256_P50_MS),
        row("2", "  of which Steps that fill a block in every request (1 in 16)", s["raw256_fill"], "ms",
            note="hashing, 256 table changes, 256 events"),
        row("2", "  of which the other Steps", s["raw256_nofill"], "ms"),
        row("2", "Step, 256 decode ops, pre-serialized bytes", s["bytes256"], "ms",
            note="no client-side proto encode/decode"),
        row("2", "Step, 256 decode ops via KVManagerClient.decode", s["client256"], "ms", f"<= {TARGET_STEP_256_P50_MS}",
            "builds the request, typed result", met=med(s["client256"]) <= TARGET_STEP_256_P50_MS),
        row("2", "Step, 256 ops as nested `ops` (AllocateRequest each)", s["nested256"], "ms",
            note="raw stub, prebuilt request"),
        row("2", "Step, 256 ops via KVManagerClient.step(AllocateOps)", s["clientstep256"], "ms",
            note="nested ops, client converts both ways"),
        row("3", "in-process KVCacheManager.step, 256-entry DecodeBatch", s["inproc"], "ms",
            note="identical core (events on), as the server applies it; input not timed"),
        row("3", "in-process KVCacheManager.step, the same as 256 AllocateOps", s["inproc_ops"], "ms",
            note="the op-per-request form; op list not timed"),
        row("3", "ratio: columnar raw Step p50 / in-process p50", s["ratio_raw_inproc"], "x",
            note="per round, same round"),
        row("3", "ratio: KVManagerClient.decode p50 / in-process p50", s["ratio_client_inproc"], "x"),
        row("3", "ratio: nested ops p50 / columnar p50 (what columns save)", s["ratio_nested_raw"], "x"),
        row("3", "256-op columnar Step p50 minus GetStats p50", s["over_floor"], "ms",
            note="the ops' own cost over the floor"),
        row("4", "throughput, 256-op Steps, 1 client back-to-back", s["tput1"], "req-steps/s",
            f">= {TARGET_REQUEST_STEPS_PER_S:,}", met=med(s["tput1"]) >= TARGET_REQUEST_STEPS_PER_S),
        row("4", "  mean wall per Step in that run", s["tput1_step_ms"], "ms"),
        row("4", "  server process CPU per Step (all threads)", s["server_cpu_ms"], "ms", note="/proc/PID/stat"),
        row("4", "  client process CPU per Step", s["client_cpu_ms"], "ms", note="time.process_time"),
        row("4", "throughput, 256-op Steps, 2 clients in threads", s["tput2"], "req-steps/s",
            f">= {TARGET_REQUEST_STEPS_PER_S:,}", "own connection and request set each",
            met=med(s["tput2"]) >= TARGET_REQUEST_STEPS_PER_S),
    ]
    if "vllm_step" in s:
        lines += [
            row("5", "vLLM's own manager, in-process: 256-request decode step", s["vllm_step"], "ms",
                note="one run per round, right after this round's Steps; its p50 over the run"),
            row("5", "**ratio: columnar Step round trip p50 / vLLM in-process step p50**", s["ratio_raw_vllm"], "x",
                "<= 1.0", "per round, same round", met=med(s["ratio_raw_vllm"]) <= 1.0),
            row("5", "ratio: KVManagerClient.decode p50 / vLLM in-process step p50", s["ratio_client_vllm"], "x"),
            row("5", "admission of 256 random 1,000-token prompts, one Step", s["admit256"], "ms",
                note="hashing, lookup, allocation; one per round"),
            row("5", "vLLM's own manager: the same admission, in-process", s["vllm_admit"], "ms",
                note="request construction with hashing, lookup, allocation"),
            row("5", "**ratio: admission Step / vLLM in-process admission**", s["ratio_admit_vllm"], "x",
                "<= 1.0", met=med(s["ratio_admit_vllm"]) <= 1.0),
        ]
    p = results.phases
    mean_total = med(p["pipeline:mean"])
    lines += [
        "",
        "## Where a 256-op decode Step's time goes (servicer pipeline in-process, no gRPC)",
        "",
        "KVManagerServicer.Step / Replica.step inlined phase by phase on another identical core, fed the same serialized",
        "request bytes; the client rows are client.decode's own proto work on the same bytes. p50 and mean",
        "over the round's Steps (1 in 16 Steps fills a block in every request: delta, events and",
        "decode_results grow there), medians over rounds.",
        "",
        "| phase | p50 | p99 | mean | unit | share of mean pipeline |",
        "|---|---:|---:|---:|---|---:|",
    ]
    for key, label in PHASES:
        mean = med(p[key + ":mean"])
        lines.append(f"| {label} | {fmt(med(p[key]))} | {fmt(med(p[key], 'p99'))} | "
                     f"{fmt(mean)} | us | {mean / mean_total:.1%} |")
    for key, label in (("pipeline", "**sum of the server phases**"),
                       ("whole", "servicer.Step end to end (FromString .. SerializeToString)"),
                       ("whole_nogc", "  the same with gc disabled")):
        lines.append(f"| {label} | {fmt(med(p[key]))} | {fmt(med(p[key], 'p99'))} | "
                     f"{fmt(med(p[key + ':mean']))} | us | |")
    for key, label in CLIENT_PHASES:
        lines.append(f"| {label} | {fmt(med(p[key]))} | {fmt(med(p[key], 'p99'))} | "
                     f"{fmt(med(p[key + ':mean']))} | us | |")
    whole_ms = med(p["whole:mean"]) / 1e3
    lines += [
        "",
        f"gRPC's share, by difference: server CPU per Step {fmt(med(s['server_cpu_ms']))} ms minus the servicer's mean "
        f"{fmt(whole_ms)} ms = {fmt(med(s['server_cpu_ms']) - whole_ms)} ms per Step in gRPC (C-core + Python "
        f"glue, thread hand-offs); the columnar round trip p50 {fmt(med(s['raw256']))} ms vs the servicer's p50 "
        f"{fmt(med(p['whole']) / 1e3)} ms.",
    ]
    return lines


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a fast smoke run: fewer rounds and calls")
    parser.add_argument("--rounds", type=int, default=None, help="alternating rounds (default 5, quick 2)")
    parser.add_argument("--steps", type=int, default=None, help="timed calls per series and round (default 400, quick 60)")
    parser.add_argument("--profile-server", type=Path, default=None,
                        help="also run py-spy on the server during 256-op Steps; raw stacks go to this file")
    parser.add_argument("--profile-seconds", type=float, default=None, help="py-spy duration (default 8, quick 3)")
    parser.add_argument("--profile-all-threads", action="store_true",
                        help="sample every active thread, not only the one holding the GIL (py-spy without --gil)")
    parser.add_argument("--profile-rate", type=int, default=250, help="py-spy samples per second (default %(default)s)")
    vllm = parser.add_argument_group(
        "vLLM's own manager, run in each round for same-run ratios (all three, or none)")
    vllm.add_argument("--vllm-python", type=Path, help="an interpreter with vLLM's Python dependencies")
    vllm.add_argument("--vllm-source", type=Path, help="the folder holding vLLM's source (vllm/), put on PYTHONPATH")
    vllm.add_argument("--vllm-baseline", type=Path,
                      help="the baselines kit's program (vllm_step_baseline.py: N P D -> JSON step_ms_p50, prefill_ms_total)")
    parser.add_argument("--profile-nonblocking", action="store_true",
                        help="py-spy --nonblocking: no pauses, but racy stacks and line numbers")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = make_parser()
    args = parser.parse_args(argv)
    quick = args.quick
    vllm_args = (args.vllm_python, args.vllm_source, args.vllm_baseline)
    if any(vllm_args) and not all(vllm_args):
        parser.error("--vllm-python, --vllm-source and --vllm-baseline go together")
    for name, path in zip(("--vllm-python", "--vllm-source", "--vllm-baseline"), vllm_args):
        if path is not None and not path.exists():
            parser.error(f"{name} {path}: no such file or folder")
    plan = Plan(
        rounds=args.rounds or (2 if quick else 5),
        warmup=8 if quick else 32,
        steps=args.steps or (60 if quick else 400),
        floor_calls=300 if quick else 2000,
        throughput_steps=100 if quick else 500,
        profile_s=args.profile_seconds or (3 if quick else 8),
        vllm=VllmBaseline(*vllm_args) if all(vllm_args) else None,
    )
    started = now_ns()
    log_directory = tempfile.TemporaryDirectory(prefix="rpc_bench_")
    server = start_server(plan.num_blocks, Path(log_directory.name))
    try:
        client = make_client(server.address)
        client2 = make_client(server.address, own_connection=True)
        config = server_config(plan.num_blocks)
        manager = KVCacheManager(config)
        servicer = KVManagerServicer(Replica(KVCacheManager(config), "rpc-bench", 1))
        results = Results()
        for index in range(plan.rounds):
            round_start = now_ns()
            run_round(index, plan, server, client, client2, manager, servicer, results)
            vllm = f", vLLM in-process {results.get('vllm_step').p50[-1]:.2f} ms" if plan.vllm else ""
            print_round(index, plan.rounds, f"{(now_ns() - round_start) / 1e9:.1f} s, 256-op Step p50 "
                        f"{results.get('raw256').p50[-1]:.2f} ms, in-process {results.get('inproc').p50[-1]:.2f} ms{vllm}")
        profile_lines = []
        if args.profile_server is not None:
            profile_lines = profile_server(
                server, client, plan, args.profile_server, not args.profile_all_threads, args.profile_rate, args.profile_nonblocking
            )
        client.close()
        client2.close()
    finally:
        server.stop(timeout_s=15)
        log_directory.cleanup()
    command = shlex.join(["python", *sys.argv])
    print("\n".join(render(results, plan, command, (now_ns() - started) / 1e9, server.args) + profile_lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
