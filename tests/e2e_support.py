"""A manager process, a worker process and the reference scheduler, and the dense oracle they must match."""

from __future__ import annotations

import dataclasses
import json
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Iterator, Sequence

import torch
from processes import launch, stop_all

from gpu_worker.model import LlamaModel
from gpu_worker.model_config import resolve_model
from gpu_worker.sampling import GREEDY, SamplingParams, choose, gumbel_noise, noise_key
from gpu_worker.weights import load_safetensors, random_weights
from kv_manager_service.client import KVManagerClient
from kv_tooling.launch import LaunchedProcess
from kv_manager_service.shared.ready_line import MANAGER_READY_PREFIX, WORKER_READY_PREFIX
from reference_scheduler import ReferenceScheduler, Sampling, WorkerClient
from reference_scheduler.scheduler import Request


@dataclasses.dataclass
class Stack:
    manager: LaunchedProcess
    worker: LaunchedProcess
    manager_client: KVManagerClient
    worker_client: WorkerClient

    def scheduler(self) -> ReferenceScheduler:
        return ReferenceScheduler(self.manager_client, self.worker_client)


def start_stack(
    directory: Path,
    model: str,
    backend: str,
    pool: dict,
    seed: int = 0,
    worker_args: Sequence[str] = (),
    manager_args: Sequence[str] = (),
    device: str = "cpu",
    dtype: str = "float32",
) -> tuple[Stack, list[LaunchedProcess]]:
    """`kv-manager serve` and `gpu-worker` as real processes, as a user starts them; `*_args` are extra flags.

    The worker computes in `dtype` (float32 by default, the dense oracle's) on `device` ("cpu" or "cuda").
    """
    config_path = directory / "pool.json"
    config_path.write_text(json.dumps(pool))
    processes = []
    try:
        manager = launch(
            [sys.executable, "-m", "kv_manager_service.cli", "serve", "--port", "0", "--config", str(config_path),
             "--replica-id", f"replica-{directory.name}", *manager_args],
            MANAGER_READY_PREFIX,
            directory / "manager.log",
        )
        processes.append(manager)
        worker = launch_worker(
            directory / "worker.log", manager.address, model, backend, seed, worker_args, device, dtype=dtype
        )
        processes.append(worker)
    except BaseException:
        stop_all(processes)
        raise
    return Stack(manager, worker, KVManagerClient(manager.address), WorkerClient(worker.address)), processes


def launch_worker(
    log_path: Path,
    manager_address: str,
    model: str,
    backend: str,
    seed: int = 0,
    worker_args: Sequence[str] = (),
    device: str = "cpu",
    worker_id: str = "worker-0",
    dtype: str = "float32",
) -> LaunchedProcess:
    """A `gpu-worker` process following the manager at `manager_address`, as a user starts one."""
    return launch(
        [
            sys.executable, "-m", "gpu_worker.cli", "--manager", manager_address, "--port", "0",
            "--device", device, "--dtype", dtype, "--backend", backend, "--model", model, "--seed", str(seed),
            "--worker-id", worker_id, *worker_args,
        ],
        WORKER_READY_PREFIX,
        log_path,
    )  # fmt: skip


def stop_stack(stack: Stack, processes: list[LaunchedProcess]) -> list[str]:
    """Stop the worker, whose clean shutdown unregisters it from the manager, then the manager."""
    stack.worker_client.close()
    failures = stop_all([stack.worker])
    if not failures:
        registered = stack.manager_client.workers()
        if registered:
            failures.append(f"the worker's clean shutdown left the manager with registered workers {registered}")
    stack.manager_client.close()
    return failures + stop_all([process for process in processes if process is not stack.worker])


class DenseOracle:
    """The worker's model, run densely on the CPU: every token recomputed from the whole sequence, no cache.

    `dtype` is the weights' and activations' (the worker's own, for a like-for-like reference).
    """

    def __init__(self, model: str, seed: int = 0, dtype: torch.dtype = torch.float32) -> None:
        config, checkpoint = resolve_model(model)
        cpu = torch.device("cpu")
        if checkpoint is None:
            weights = random_weights(config, seed, dtype, cpu)
        else:
            weights = load_safetensors(checkpoint, config, dtype, cpu)
        self.model = LlamaModel(config, weights)

    def next_token(self, tokens: Sequence[int], sampling: SamplingParams) -> tuple[int, float]:
        logits = self.model.dense_logits(torch.tensor(list(tokens), dtype=torch.int64))
        return choose(logits, sampling, len(tokens))

    def check(self, request: Request, samplings: Iterator[Sampling] | None = None, logprob_atol: float = 1e-3) -> None:
        """Each output token equals the dense choice for the tokens before it.

        `samplings` yields the sampling used at each output index (default: the request's own).
        """
        tokens = request.tokens
        for index, token_id in enumerate(request.output):
            sampling = next(samplings) if samplings is not None else request.sampling
            position = len(request.prompt) + index
            expected, logprob = self.next_token(tokens[:position], SamplingParams(sampling.temperature, sampling.seed))
            assert token_id == expected, (
                f"{request.request_id}: output {index} (position {position}) is {token_id}, the dense pass chose {expected}"
            )
            assert abs(request.logprobs[index] - logprob) <= logprob_atol, (request.request_id, index, request.logprobs[index], logprob)


    def check_near(self, request: Request, logit_margin: float, logprob_atol: float) -> int:
        """Each output token is the dense choice or within `logit_margin` of it; returns how many are exactly it.

        The margin is on the score a choice maximises (logits / T + Gumbel noise, as `sampling` defines it,
        plain logits when greedy), scaled to logits; the worker's log-probability of its token is within
        `logprob_atol` of the dense one.
        """
        exact = 0
        for index, token_id in enumerate(request.output):
            position = len(request.prompt) + index
            logits = self.model.dense_logits(torch.tensor(request.tokens[:position], dtype=torch.int64))
            temperature = request.sampling.temperature
            scores = logits
            if temperature > 0:
                noise = gumbel_noise(torch.tensor([noise_key(request.sampling.seed, position)]), logits.shape[0])[0]
                scores = logits / temperature + noise
            best = int(scores.argmax())
            shortfall = float(scores[best] - scores[token_id]) * (temperature or 1.0)
            assert shortfall <= logit_margin, (
                f"{request.request_id}: output {index} (position {position}) is {token_id}, whose logit is "
                f"{shortfall:.4f} below the dense choice {best} (margin {logit_margin})"
            )
            logprob = float(torch.log_softmax(logits.float(), dim=-1)[token_id])
            assert abs(request.logprobs[index] - logprob) <= logprob_atol, (request.request_id, index, logprob)
            exact += token_id == best
        return exact


def greedy() -> Sampling:
    return Sampling(GREEDY.temperature, GREEDY.seed)


def run_interrupted(scheduler: ReferenceScheduler, interrupt: Callable[[], None], after_steps: int = 6) -> None:
    """Run `scheduler` to the end, with `interrupt` called in a thread once `after_steps` steps are done,
    10 ms later, so that it lands inside the scheduler's next Step or Execute. Fails unless it ran."""
    done = threading.Event()

    def run() -> None:
        time.sleep(0.01)
        interrupt()
        done.set()

    thread = threading.Thread(target=run)
    while scheduler.has_work:
        scheduler.step()
        if len(scheduler.timings) == after_steps:
            thread.start()
    scheduler.flush()
    thread.join(timeout=60)
    assert done.is_set(), "the interruption never ran"


def check_unchanged(model: str, reference: Sequence[Request], requests: Sequence[Request]) -> None:
    """Each request produced what its counterpart of an uninterrupted run did, and what the dense pass chooses."""
    for calm, request in zip(reference, requests, strict=True):
        assert request.output == calm.output, request.request_id
    oracle = DenseOracle(model)
    for request in requests:
        oracle.check(request)
