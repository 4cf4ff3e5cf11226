"""A small scheduler that drives a kv-manager and a GPU worker: the contract, end to end.

Every iteration is one manager `Step` (new requests' prompts and running
requests' last sampled tokens, as allocate ops) followed by one worker
`Execute` of the same step id. A request's state:

    tokens:  |<---- prompt ---->|<---- output ---->|
             |<-------- computed -------->|<-pending->|
                                         the last sampled token, not yet
                                         computed: the next step's input

A request whose prompt hits the prefix cache computes only its uncached tail.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Sequence

from kv_manager_service.client import KVManagerClient
from kv_manager_service.core import AllocateOp, AllocateResult, AllocateStatus, FreeOp
from reference_scheduler.worker_client import Scheduled, WorkerClient


class SchedulerError(RuntimeError):
    """The manager or worker could not serve what the scheduler holds (e.g. the pool is too small)."""


@dataclasses.dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0  # 0: greedy
    seed: int = 0


@dataclasses.dataclass
class Request:
    request_id: str
    prompt: list[int]
    max_new_tokens: int
    sampling: Sampling
    output: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_prompt_tokens: int = 0  # the prefix-cache hit of its first step
    admitted: bool = False

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def finished(self) -> bool:
        return len(self.output) >= self.max_new_tokens


@dataclasses.dataclass
class StepTiming:
    step_id: int
    num_requests: int
    num_tokens: int
    step_ms: float  # the manager's Step round trip
    execute_ms: float  # the worker's Execute round trip
    forward_ms: float  # model time inside Execute
    num_copies: int  # copy-on-write block copies the step asked for


class ReferenceScheduler:
    """Runs every admitted request each iteration (no token budget, no preemption)."""

    def __init__(self, manager: KVManagerClient, worker: WorkerClient) -> None:
        self.manager = manager
        self.worker = worker
        self.sequences: dict[str, Request] = {}
        self.timings: list[StepTiming] = []
        self.to_free: list[str] = []  # finished requests, freed by the next step

    def add(self, request_id: str, prompt: Sequence[int], max_new_tokens: int, sampling: Sampling = Sampling()) -> Request:
        if request_id in self.sequences:
            raise ValueError(f"request id {request_id!r} is already in use")
        if not prompt:
            raise ValueError(f"request {request_id!r}: the prompt must not be empty")
        if max_new_tokens < 1:
            raise ValueError(f"request {request_id!r}: max_new_tokens must be >= 1, got {max_new_tokens}")
        sequence = Request(request_id, list(prompt), max_new_tokens, sampling)
        self.sequences[request_id] = sequence
        return sequence

    def fork(self, parent_id: str, children: dict[str, Sampling], max_new_tokens: int) -> list[Request]:
        """Children that share everything the parent computed, as one manager step.

        Each child then appends the parent's pending token and continues with
        its own sampling, generating up to `max_new_tokens` tokens in all.
        """
        parent = self.sequences[parent_id]
        if not parent.admitted or not parent.output:
            raise ValueError(f"request {parent_id!r} must have run at least one step before it is forked")
        self.manager.fork(parent_id, list(children))
        forked = []
        for child_id, sampling in children.items():
            child = dataclasses.replace(
                parent, request_id=child_id, output=list(parent.output), logprobs=list(parent.logprobs),
                max_new_tokens=max_new_tokens, sampling=sampling,
            )  # fmt: skip
            self.sequences[child_id] = child
            forked.append(child)
        return forked

    def step(self) -> list[Request]:
        """One iteration over every unfinished request; returns those that finished.

        Finished requests are freed with the next step (or by `flush`).
        """
        running = [s for s in self.sequences.values() if not s.finished]
        if not running:
            self.flush()
            return []
        ops: list[AllocateOp | FreeOp] = [FreeOp(self.to_free)] if self.to_free else []
        self.to_free = []
        for sequence in running:
            if sequence.admitted:
                ops.append(AllocateOp(sequence.request_id, sequence.output[-1:], 1))
            else:
                ops.append(AllocateOp(sequence.request_id, sequence.prompt, len(sequence.prompt)))
        started = time.perf_counter()
        step = self.manager.step(ops)
        step_ms = (time.perf_counter() - started) * 1e3
        scheduled = []
        for sequence, result in zip(running, step.results[len(ops) - len(running) :]):
            if result.status is AllocateStatus.NO_SPACE:
                raise SchedulerError(
                    f"no free blocks for request {sequence.request_id!r} at step {step.step_id}: "
                    "the pool is too small for this batch (this scheduler does not preempt)"
                )
            if not sequence.admitted:
                sequence.admitted = True
                sequence.num_cached_prompt_tokens = result.num_computed_tokens
            tokens = sequence.tokens
            start = result.num_computed_tokens
            scheduled.append(
                Scheduled(
                    sequence.request_id, tokens[start : start + result.num_scheduled_tokens], start,
                    sequence.sampling.temperature, sequence.sampling.seed,
                )
            )  # fmt: skip
            sequence.num_computed_tokens = start + result.num_scheduled_tokens
        started = time.perf_counter()
        executed = self.worker.execute(step.step_id, scheduled)
        execute_ms = (time.perf_counter() - started) * 1e3
        for sequence, output in zip(running, executed.outputs):
            assert output.request_id == sequence.request_id, (output, sequence.request_id)
            sequence.output.append(output.token_id)
            sequence.logprobs.append(output.logprob)
        self.timings.append(
            StepTiming(step.step_id, len(scheduled), sum(len(s.token_ids) for s in scheduled), step_ms, execute_ms, executed.forward_ms,
                       sum(len(r.copies) for r in step.results if isinstance(r, AllocateResult)))
        )
        finished = [s for s in running if s.finished]
        self.to_free += [s.request_id for s in finished]
        return finished

    def flush(self) -> None:
        """Free the finished requests now."""
        if self.to_free:
            self.manager.free(self.to_free)
            self.to_free = []

    def run(self) -> None:
        """Step until every request has finished, then free them."""
        while any(not s.finished for s in self.sequences.values()):
            self.step()
        self.flush()
