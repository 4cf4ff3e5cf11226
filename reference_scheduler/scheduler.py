"""A continuous-batching scheduler that drives a kv-manager and a GPU worker: the contract, end to end.

Every iteration is one manager `Step` followed by one worker `Execute` of
the same step id. A request's tokens:

    tokens:  |<---- prompt ---->|<---- output ---->|
             |<-------- computed -------->|<-pending->|
                                         known to the scheduler, not yet
                                         computed: the next steps' input

One iteration, within a token budget (vLLM's max_num_batched_tokens):

1. Running requests, oldest first, each get their pending tokens: a prefill
   chunk, or the one sampled token of a decode.
2. Waiting requests are admitted, front first, while budget and running
   slots remain; the manager adopts any cached prefix, so only the uncached
   tail is computed (in chunks if it exceeds the budget).
3. An op of a running request that gets NO_SPACE (nothing changed) preempts
   the newest running request: it is freed with the next step and goes back
   to the front of the waiting queue, to be recomputed (with the prefix
   cache's help) under a new manager request id. A refused admission simply
   waits.
4. Every op the manager accepted is executed, so every block the manager
   counts as computed really holds its K/V. A request samples a token when
   all its known tokens are computed; finished requests are freed with the
   next step.

Every Step carries a fresh idempotency key, so the client retries one whose
response was lost (UNAVAILABLE, DEADLINE_EXCEEDED: a manager restarting from
its journal) and the manager applies it once.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import time
from typing import Sequence

from kv_manager_service.client import KVManagerClient
from kv_manager_service.core import AllocateOp, AllocateResult, AllocateStatus, FreeOp
from reference_scheduler.worker_client import Scheduled, WorkerClient

log = logging.getLogger("reference_scheduler")


class SchedulerError(RuntimeError):
    """The manager or worker cannot serve what the scheduler holds (e.g. a request never fits the pool)."""


@dataclasses.dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0  # 0: greedy
    seed: int = 0


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    token_budget: int = 1 << 30  # tokens per step
    max_num_running: int = 1 << 30  # requests running at once

    def __post_init__(self) -> None:
        for name in ("token_budget", "max_num_running"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


@dataclasses.dataclass
class Request:
    request_id: str
    prompt: list[int]
    max_new_tokens: int
    sampling: Sampling
    output: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    num_sent: int = 0  # tokens the manager knows, this attempt
    num_computed_tokens: int = 0  # this attempt
    num_cached_prompt_tokens: int = 0  # the prefix-cache hit of its first admission
    num_preemptions: int = 0
    running: bool = False

    @property
    def manager_id(self) -> str:
        """The id under which the manager holds the current attempt (a new one after each preemption)."""
        return self.request_id if not self.num_preemptions else f"{self.request_id}#{self.num_preemptions}"

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def finished(self) -> bool:
        return len(self.output) >= self.max_new_tokens


@dataclasses.dataclass
class StepTiming:
    step_id: int
    num_requests: int  # executed
    num_tokens: int  # executed
    step_ms: float  # the manager's Step round trip
    execute_ms: float  # the worker's Execute round trip (0 when nothing ran)
    forward_ms: float  # model time inside Execute
    num_copies: int  # copy-on-write block copies the step asked for
    num_preemptions: int


class ReferenceScheduler:
    def __init__(self, manager: KVManagerClient, worker: WorkerClient, config: SchedulerConfig = SchedulerConfig()) -> None:
        self.manager = manager
        self.worker = worker
        self.config = config
        self.sequences: dict[str, Request] = {}
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []  # oldest first
        self.to_free: list[str] = []  # manager ids, freed by the next step
        self.timings: list[StepTiming] = []
        self.num_preemptions = 0

    def add(self, request_id: str, prompt: Sequence[int], max_new_tokens: int, sampling: Sampling = Sampling()) -> Request:
        if request_id in self.sequences or "#" in request_id:
            raise ValueError(f"request id {request_id!r} is already in use or contains '#'")
        if not prompt:
            raise ValueError(f"request {request_id!r}: the prompt must not be empty")
        if max_new_tokens < 1:
            raise ValueError(f"request {request_id!r}: max_new_tokens must be >= 1, got {max_new_tokens}")
        request = Request(request_id, list(prompt), max_new_tokens, sampling)
        self.sequences[request_id] = request
        self.waiting.append(request)
        return request

    def fork(self, parent_id: str, children: dict[str, Sampling], max_new_tokens: int) -> list[Request]:
        """Children that share everything the parent computed, as one manager step.

        Each child then computes the parent's pending token and continues
        with its own sampling, generating up to `max_new_tokens` tokens in all.
        """
        parent = self.sequences[parent_id]
        if not parent.running or not parent.output:
            raise ValueError(f"request {parent_id!r} must be running and have sampled a token to be forked")
        self.manager.fork(parent.manager_id, list(children))
        forked = []
        for child_id, sampling in children.items():
            child = dataclasses.replace(
                parent, request_id=child_id, output=list(parent.output), logprobs=list(parent.logprobs),
                max_new_tokens=max_new_tokens, sampling=sampling, num_preemptions=0,
            )  # fmt: skip
            self.sequences[child_id] = child
            self.running.append(child)
            forked.append(child)
        return forked

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def step(self) -> list[Request]:
        """One iteration (see the module docstring); returns the requests that finished in it."""
        if not self.has_work:
            self.flush()
            return []
        ops: list[AllocateOp | FreeOp] = [FreeOp(self.to_free)] if self.to_free else []
        num_frees = len(ops)
        had_frees = bool(self.to_free)
        self.to_free = []
        planned = self._plan(ops)
        started = time.perf_counter()
        # Keyed: a Step whose response is lost (a manager restarting) is retried and applied once.
        step = self.manager.step(ops, auto_key=True) if ops else None
        step_ms = (time.perf_counter() - started) * 1e3
        if step is None:
            return []

        scheduled: list[tuple[Request, Scheduled]] = []
        admission_refused = False
        num_preempt = 0
        for (request, admitting), result in zip(planned, step.results[num_frees:]):
            if result.status is AllocateStatus.NO_SPACE:
                if admitting:
                    admission_refused = True
                else:
                    num_preempt += 1
                continue
            if admitting:
                self.waiting.remove(request)
                self.running.append(request)
                request.running = True
                if not request.num_preemptions and not request.output:
                    request.num_cached_prompt_tokens = result.num_computed_tokens
            start, count = result.num_computed_tokens, result.num_scheduled_tokens
            tokens = request.tokens
            request.num_sent = len(tokens)
            request.num_computed_tokens = start + count
            scheduled.append(
                (request, Scheduled(request.manager_id, tokens[start : start + count], start,
                                    request.sampling.temperature, request.sampling.seed))
            )  # fmt: skip
        for _ in range(num_preempt):
            self._preempt_newest()
        if admission_refused and not self.running and not scheduled and not had_frees:
            request = self.waiting[0]
            raise SchedulerError(
                f"request {request.request_id!r} ({len(request.tokens)} tokens) does not fit in the idle pool: "
                "lower the token budget or grow the pool"
            )

        execute_ms = forward_ms = 0.0
        finished = []
        if scheduled:
            started = time.perf_counter()
            executed = self.worker.execute(step.step_id, [s for _, s in scheduled])
            execute_ms = (time.perf_counter() - started) * 1e3
            forward_ms = executed.forward_ms
            for (request, sent), output in zip(scheduled, executed.outputs):
                assert output.request_id == sent.request_id, (output, sent.request_id)
                if request.num_computed_tokens < len(request.tokens):
                    continue  # a prefill chunk, or preempted: the sampled token is not the next one
                request.output.append(output.token_id)
                request.logprobs.append(output.logprob)
                if request.finished and request.running:
                    finished.append(request)
        for request in finished:
            self.running.remove(request)
            request.running = False
            self.to_free.append(request.manager_id)
        copies = sum(len(r.copies) for r in step.results if isinstance(r, AllocateResult))
        self.timings.append(
            StepTiming(step.step_id, len(scheduled), sum(len(s.token_ids) for _, s in scheduled), step_ms,
                       execute_ms, forward_ms, copies, num_preempt)
        )  # fmt: skip
        return finished

    def flush(self) -> None:
        """Free the finished and preempted requests now."""
        if self.to_free:
            self.manager.step([FreeOp(self.to_free)], auto_key=True)
            self.to_free = []

    def run(self) -> None:
        """Step until every request has finished, then free them."""
        while self.has_work:
            self.step()
        self.flush()

    def _plan(self, ops: list) -> list[tuple[Request, bool]]:
        """Append this step's allocate ops to `ops`; (request, is an admission) for each."""
        budget = self.config.token_budget
        planned = []
        for request in self.running:
            if budget == 0:
                break
            tokens = request.tokens
            count = min(len(tokens) - request.num_computed_tokens, budget)
            ops.append(AllocateOp(request.manager_id, tokens[request.num_sent :], count))
            planned.append((request, False))
            budget -= count
        slots = self.config.max_num_running - len(self.running)
        for request in list(self.waiting)[: max(0, slots)]:
            if budget == 0:
                break
            tokens = request.tokens
            count = min(len(tokens), budget)
            ops.append(AllocateOp(request.manager_id, tokens, count))
            planned.append((request, True))
            budget -= count
        return planned

    def _preempt_newest(self) -> None:
        victim = self.running.pop()
        victim.running = False
        self.to_free.append(victim.manager_id)
        victim.num_preemptions += 1
        victim.num_sent = victim.num_computed_tokens = 0
        self.waiting.appendleft(victim)
        self.num_preemptions += 1
        log.info("preempted %s: no free blocks; it will be recomputed", victim.request_id,
                 extra={"request_id": victim.request_id, "attempt": victim.num_preemptions})  # fmt: skip
