"""A continuous-batching scheduler: the one loop that drives a kv-manager and a worker through the contract.

Every iteration is one manager `Step` followed by one worker `Execute` of
the same step id. A request's tokens:

    token_ids:  |<---- prompt ---->|<---- output ---->|
                |<-------- computed -------->|<-pending->|
                                            known to the scheduler, not yet
                                            computed: the next steps' input

One iteration, within a token budget (vLLM's max_num_batched_tokens):

1. Running requests, oldest first, each get their pending tokens: a prefill
   chunk, or the one sampled token of a decode.
2. Waiting requests are admitted, front first, while budget and running
   slots remain; the manager adopts any cached prefix, so only the uncached
   tail is computed (in chunks if it exceeds the budget). After a step in
   which a running request was refused, none are: the blocks go to the
   running ones first.
3. An op of a running request that gets NO_SPACE (nothing changed) preempts
   the newest running request: it is freed with the next step and goes back
   to the front of the waiting queue, to be recomputed (with the prefix
   cache's help) under a new manager request id. A running request whose KV
   is lost (its op gets KV_LOST, or the Step lists it in `lost_requests`) is
   preempted the same way itself, and stands in for one NO_SPACE victim. A
   refused admission simply waits. On a pool of its own (not
   `SchedulerConfig.shared_pool`), a request refused while it runs alone
   keeps its blocks and retries in the next step; refused again in a step
   that freed nothing, or refused admission to an idle pool, it can never
   fit: `RequestTooLargeError`.
4. Every op the manager accepted is executed, so every block the manager
   counts as computed really holds its K/V. The exception, a request lost
   in this step, has its op dropped and is freed saying how many of its
   tokens were computed (`FreeOp.num_computed_tokens`). A worker that
   refuses the batch with `KVMissingError` computed none of it: the
   requests it names are lost too, and the rest is executed again under the
   same step id. A request samples a token when all its known tokens are
   computed; finished requests are freed with the next step.

Every answer is checked against the scheduler's own view (where an op's
tokens start, how many were scheduled); a disagreement raises
`SchedulerError`. Every Step carries a fresh idempotency key (unless
`SchedulerConfig.keyed_steps` is off), so the client retries one whose
response was lost (UNAVAILABLE, DEADLINE_EXCEEDED: a manager restarting
from its journal) and the manager applies it once.

The loop drives any `Manager` and `Worker` (`interfaces.py`): the gRPC
clients (the demo), an in-process core (`kv-manager replay`), or a columnar
client shared with other schedulers (the soak load, `kv_tooling.soak`).

It runs past 500 lines because admission, chunked prefill, preemption, fork
and the check of every answer share one view of each request and the step's
token budget; the manager and the worker it drives stay behind `interfaces.py`.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import time
from typing import Sequence

from kv_manager_service.client import AllocateOp, AllocateResult, AllocateStatus, ExpectOp, FreeOp, KVMissingError, Op
from reference_scheduler.interfaces import ExecuteResult, Manager, Scheduled, Worker

log = logging.getLogger("reference_scheduler")

OK = AllocateStatus.OK
KV_LOST = AllocateStatus.KV_LOST


class SchedulerError(RuntimeError):
    """The manager or worker answered something the scheduler cannot reconcile with what it holds."""


class RequestTooLargeError(SchedulerError):
    """A request that does not fit in the pool even when no other request holds any of it."""

    def __init__(self, request_id: str, message: str) -> None:
        super().__init__(message)
        self.request_id = request_id


@dataclasses.dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0  # 0: greedy
    seed: int = 0


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    token_budget: int = 1 << 30  # tokens per step
    max_num_running: int = 1 << 30  # requests running at once
    keyed_steps: bool = True  # an idempotency key on every Step, so that a lost one is retried
    # Other schedulers hold blocks of the same pool: a request refused while this
    # scheduler holds nothing waits for them instead of raising RequestTooLargeError.
    shared_pool: bool = False
    # Tell the manager each waiting request's prompt ahead (ExpectOp), so that the cached blocks
    # the queue needs are evicted last. Off for a multi-tenant manager, which refuses expect ops.
    expect_waiting: bool = True

    def __post_init__(self) -> None:
        for name in ("token_budget", "max_num_running"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


@dataclasses.dataclass(eq=False)
class Request:
    """One generation as the scheduler holds it; `token_ids` grows by one per sampled token."""

    request_id: str
    token_ids: list[int]  # the prompt, then the output so far
    num_prompt_tokens: int
    max_new_tokens: int
    sampling: Sampling
    logprobs: list[float] = dataclasses.field(default_factory=list)
    num_sent: int = 0  # tokens the manager knows, this attempt
    num_computed_tokens: int = 0  # this attempt
    num_cached_prompt_tokens: int = 0  # the prefix-cache hit of its first admission
    num_preemptions: int = 0
    running: bool = False
    expected: bool = False  # the manager expects this attempt (`manager_id`): an ExpectOp was sent
    # The id under which the manager holds the current attempt: a new one after each preemption.
    manager_id: str = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        self.manager_id = manager_id_of(self.request_id, self.num_preemptions)

    @property
    def prompt(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def tokens(self) -> list[int]:
        """The prompt and the output (the scheduler's own list: read, do not change)."""
        return self.token_ids

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def finished(self) -> bool:
        return len(self.token_ids) - self.num_prompt_tokens >= self.max_new_tokens


def manager_id_of(request_id: str, num_preemptions: int) -> str:
    """The manager's id for an attempt: the request id, with `#N` after the N-th preemption."""
    return f"{request_id}#{num_preemptions}" if num_preemptions else request_id


@dataclasses.dataclass
class StepTiming:
    step_id: int
    num_requests: int  # executed
    num_tokens: int  # executed
    step_ms: float  # the manager's Step round trip
    execute_ms: float  # the worker's Execute round trip (0 when nothing ran)
    forward_ms: float  # model time inside Execute
    num_copies: int  # copy-on-write block copies the step asked for
    num_preemptions: int  # of the newest running requests, for NO_SPACE
    num_kv_lost: int = 0  # running requests preempted because their KV was lost


@dataclasses.dataclass
class SchedulerCounters:
    """What the loop did, summed over its steps."""

    num_admitted: int = 0  # admissions the manager accepted, re-admissions included
    num_readmitted: int = 0  # of those, of preempted requests
    num_admitted_tokens: int = 0  # tokens those admissions carried
    num_cached_tokens: int = 0  # of those, prefix-cache hits
    num_refused_admissions: int = 0  # NO_SPACE
    num_refused_running: int = 0  # NO_SPACE for ops of running requests
    num_preemptions: int = 0  # for NO_SPACE
    num_kv_lost: int = 0  # preemptions of requests whose KV was lost


class ReferenceScheduler:
    """The loop of the module docstring over one `Manager` and one `Worker`, which it alone drives."""

    def __init__(self, manager: Manager, worker: Worker, config: SchedulerConfig = SchedulerConfig()) -> None:
        self.manager = manager
        self.worker = worker
        self.config = config
        self.sequences: dict[str, Request] = {}  # every request added and not yet discarded
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []  # oldest first
        # Freed by the next step: manager id -> None, or how many of its tokens were computed
        # when that is fewer than the manager counts (tokens scheduled and not executed).
        self.to_free: dict[str, int | None] = {}
        self.timings: list[StepTiming] = []
        self.counters = SchedulerCounters()
        self.running_refused = False  # a running request got NO_SPACE in the last step
        self.unexpected: list[Request] = []  # waiting requests not expected yet (`expect_waiting`), in queue order

    @property
    def num_preemptions(self) -> int:
        return self.counters.num_preemptions

    def add(self, request_id: str, prompt: Sequence[int], max_new_tokens: int, sampling: Sampling = Sampling()) -> Request:
        if request_id in self.sequences or "#" in request_id:
            raise ValueError(f"request id {request_id!r} is already in use or contains '#'")
        if not prompt:
            raise ValueError(f"request {request_id!r}: the prompt must not be empty")
        if max_new_tokens < 1:
            raise ValueError(f"request {request_id!r}: max_new_tokens must be >= 1, got {max_new_tokens}")
        request = Request(request_id, list(prompt), len(prompt), max_new_tokens, sampling)
        self.sequences[request_id] = request
        self.waiting.append(request)
        self.unexpected.append(request)
        return request

    def fork(self, parent_id: str, children: dict[str, Sampling], max_new_tokens: int) -> list[Request]:
        """Children that share everything the parent computed, as one manager step.

        Each child then computes the parent's pending token and continues
        with its own sampling, generating up to `max_new_tokens` tokens in all.
        """
        parent = self.sequences[parent_id]
        if not parent.running or not parent.num_output_tokens:
            raise ValueError(f"request {parent_id!r} must be running and have sampled a token to be forked")
        for child_id in children:
            if child_id in self.sequences or "#" in child_id:
                raise ValueError(f"request id {child_id!r} is already in use or contains '#'")
        self.manager.fork(parent.manager_id, list(children))
        forked = []
        for child_id, sampling in children.items():
            child = dataclasses.replace(
                parent, request_id=child_id, token_ids=list(parent.token_ids), logprobs=list(parent.logprobs),
                max_new_tokens=max_new_tokens, sampling=sampling, num_preemptions=0,
            )  # fmt: skip
            self.sequences[child_id] = child
            self.running.append(child)
            forked.append(child)
        return forked

    def abort(self, request_id: str) -> Request:
        """Stop a waiting or running request; what the manager holds of it is freed with the next step."""
        request = self.sequences[request_id]
        if request.running:
            self.running.remove(request)
            request.running = False
            self.to_free[request.manager_id] = None
        elif request in self.waiting:
            self.waiting.remove(request)
            if request.expected:
                self.to_free[request.manager_id] = None  # withdraws the expectation
            elif request in self.unexpected:
                self.unexpected.remove(request)
        else:
            raise ValueError(f"request {request_id!r} is neither waiting nor running")
        return request

    def discard(self, request_id: str) -> Request:
        """Forget a finished or aborted request (`sequences` keeps each one until then, for its output).

        Its id may be added again once the next step has freed it.
        """
        request = self.sequences[request_id]
        if request.running or request in self.waiting:
            raise ValueError(f"request {request_id!r} is still waiting or running")
        return self.sequences.pop(request_id)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def step(self) -> list[Request]:
        """One iteration (see the module docstring); returns the requests that finished in it."""
        if not self.has_work:
            self.flush()
            return []
        ops = self._take_free_ops()
        num_frees = len(ops)
        num_running, admissions = self._plan(ops)
        if self.config.expect_waiting:
            expects = self._expect_ops(admissions)
            ops[:0] = expects  # first: a preempted request's blocks, freed after, land as expected
            num_frees += len(expects)
        if not ops:
            return []
        started = time.perf_counter()
        # Keyed: a Step whose response is lost (a manager restarting) is retried and applied once.
        step = self.manager.step(ops, auto_key=self.config.keyed_steps)
        step_ms = (time.perf_counter() - started) * 1e3

        executing, batch, num_preempt, lost = self._accept(
            ops[num_frees:], step.results[num_frees:], num_running, admissions, freed=bool(num_frees)
        )
        lost.update((request_id, cause.name) for request_id, cause in step.lost_requests)
        num_kv_lost = 0
        if lost:
            # Each one's free gives blocks back, as preempting the newest would.
            executing, batch, num_kv_lost = self._preempt_lost(executing, batch, lost)
        num_preempt = max(0, num_preempt - num_kv_lost)
        for _ in range(num_preempt):
            self._preempt_newest()

        execute_ms = forward_ms = 0.0
        finished = []
        executed = None
        if batch:
            started = time.perf_counter()
            executing, batch, executed, num_missing = self._execute(step.step_id, executing, batch)
            execute_ms = (time.perf_counter() - started) * 1e3
            num_kv_lost += num_missing
        if executed is not None:
            forward_ms = executed.forward_ms
            for request, sent, output in zip(executing, batch, executed.outputs):
                if output.request_id != sent.request_id:
                    raise SchedulerError(f"the worker answered {output.request_id!r} for {sent.request_id!r}")
                token_ids = request.token_ids
                if request.num_computed_tokens < len(token_ids):
                    continue  # a prefill chunk, or preempted: the sampled token is not the next one
                token_ids.append(output.token_id)
                request.logprobs.append(output.logprob)
                if request.running and len(token_ids) - request.num_prompt_tokens >= request.max_new_tokens:
                    request.running = False
                    finished.append(request)
        if finished:
            self.running = [r for r in self.running if r.running]
            self.to_free.update(dict.fromkeys(r.manager_id for r in finished))
        copies = sum(len(r.copies) for r in step.results if type(r) is AllocateResult)
        self.timings.append(
            StepTiming(step.step_id, len(batch), sum(len(s.token_ids) for s in batch), step_ms, execute_ms,
                       forward_ms, copies, num_preempt, num_kv_lost)
        )  # fmt: skip
        return finished

    def flush(self) -> None:
        """Free the finished and preempted requests now."""
        if self.to_free:
            self.manager.step(self._take_free_ops(), auto_key=self.config.keyed_steps)

    def _take_free_ops(self) -> list[Op]:
        """The FreeOps of `to_free`, which it empties: one for the requests whose every scheduled token was
        executed, one that says how many were computed for the others."""
        to_free = self.to_free
        self.to_free = {}
        ops: list[Op] = []
        if None in to_free.values():
            ops.append(FreeOp([manager_id for manager_id, count in to_free.items() if count is None]))
        uncomputed = {manager_id: count for manager_id, count in to_free.items() if count is not None}
        if uncomputed:
            ops.append(FreeOp(list(uncomputed), list(uncomputed.values())))
        return ops

    def _expect_ops(self, admissions: list[Request]) -> list[Op]:
        """An ExpectOp for each waiting request not expected yet, but for those this step tries to admit (they
        stay in `unexpected`, in case the manager refuses them)."""
        if not self.unexpected:
            return []
        ops: list[Op] = []
        admitting = {id(request) for request in admissions}
        unexpected = []
        for request in self.unexpected:
            if request.num_sent or request.expected:
                continue  # admitted since (maybe finished already)
            if id(request) in admitting:
                unexpected.append(request)
            else:
                ops.append(ExpectOp(request.manager_id, request.token_ids))
                request.expected = True
        self.unexpected = unexpected
        return ops

    def run(self) -> None:
        """Step until every request has finished, then free them."""
        while self.has_work:
            self.step()
        self.flush()

    def _plan(self, ops: list[Op]) -> tuple[int, list[Request]]:
        """Append this step's allocate ops to `ops`: one for each of the first N running requests, then one
        for each admission. Returns N and the requests to admit, in op order."""
        budget = self.config.token_budget
        num_ops = len(ops)
        append = ops.append
        for request in self.running:
            if budget == 0:
                break
            token_ids = request.token_ids
            count = len(token_ids) - request.num_computed_tokens
            if count > budget:
                count = budget
            append(AllocateOp(request.manager_id, token_ids[request.num_sent :], count))
            budget -= count
        num_running = len(ops) - num_ops
        admissions: list[Request] = []
        if self.running_refused:
            return num_running, admissions
        slots = self.config.max_num_running - len(self.running)
        for request in itertools.islice(self.waiting, max(0, slots)):
            if budget == 0:
                break
            token_ids = request.token_ids
            count = min(len(token_ids), budget)
            append(AllocateOp(request.manager_id, token_ids, count))
            admissions.append(request)
            budget -= count
        return num_running, admissions

    def _accept(
        self,
        ops: Sequence[AllocateOp],
        results: Sequence[AllocateResult],
        num_running: int,
        admissions: list[Request],
        freed: bool,
    ) -> tuple[list[Request], list[Scheduled], int, dict[str, str]]:
        """Apply the manager's answers to the planned ops (see `_plan`): admit, advance, count refusals.

        Returns the requests to execute, what to execute of each (in the
        same order), how many running requests to preempt, and the running
        requests whose ops got KV_LOST (manager id -> why). Raises
        RequestTooLargeError for a request that cannot fit even alone
        (unless the pool is shared), SchedulerError on a disagreement.
        """
        counters = self.counters
        executing: list[Request] = []
        batch: list[Scheduled] = []
        lost: dict[str, str] = {}
        refused_admission: tuple[Request, AllocateOp] | None = None
        refused_running: list[tuple[Request, AllocateOp]] = []
        for request, op, result in zip(itertools.chain(self.running[:num_running], admissions), ops, results):
            admitting = not request.running
            if result.status is KV_LOST:
                if admitting:
                    raise SchedulerError(f"admitting {request.manager_id!r}: the manager answered KV_LOST")
                lost[request.manager_id] = KV_LOST.name
                continue
            if result.status is not OK:
                if admitting:
                    counters.num_refused_admissions += 1
                    refused_admission = refused_admission or (request, op)
                else:
                    counters.num_refused_running += 1
                    refused_running.append((request, op))
                continue
            start = result.num_computed_tokens
            count = result.num_scheduled_tokens
            if admitting:
                self._admit(request, op, start, count)
                computing = request.token_ids[start : start + count]
            elif start != request.num_computed_tokens or count != op.num_new_tokens:
                raise SchedulerError(
                    f"{request.manager_id!r}: the manager computes tokens {start}..{start + count}, the scheduler "
                    f"expected {request.num_computed_tokens}..{request.num_computed_tokens + op.num_new_tokens}"
                )
            elif start == request.num_sent and count == len(op.token_ids):
                computing = op.token_ids  # a decode: the tokens it sent are the ones it computes
            else:
                computing = request.token_ids[start : start + count]
            request.num_sent = len(request.token_ids)
            request.num_computed_tokens = start + count
            sampling = request.sampling
            executing.append(request)
            batch.append(Scheduled(request.manager_id, computing, start, sampling.temperature, sampling.seed))
        self.running_refused = bool(refused_running)
        if self.config.shared_pool:
            return executing, batch, len(refused_running), lost
        if refused_admission is not None and not self.running and not batch and not freed:
            request, op = refused_admission
            raise RequestTooLargeError(
                request.request_id,
                f"request {request.request_id!r} ({len(request.token_ids)} tokens) does not fit in the idle pool: "
                f"its cached prefix and a {op.num_new_tokens}-token prefill chunk need more blocks than the pool "
                "holds; lower the token budget or grow the pool",
            )
        if refused_running and len(self.running) == 1:
            # Alone, nobody can give blocks back: it keeps its own and retries,
            # unless this step freed nothing either.
            request, op = refused_running[0]
            if not freed:
                self.abort(request.request_id)
                self.flush()
                raise RequestTooLargeError(
                    request.request_id,
                    f"request {request.request_id!r} ({len(request.token_ids)} tokens) was refused "
                    f"{op.num_new_tokens} more tokens while it ran alone and nothing was left to free: it needs "
                    "more blocks than the pool holds; grow the pool",
                )
            return executing, batch, 0, lost
        return executing, batch, len(refused_running), lost

    def _admit(self, request: Request, op: AllocateOp, start: int, count: int) -> None:
        """Move a waiting request whose admission the manager accepted (computing `count` tokens from `start`)
        to the running ones; SchedulerError if that is not what the scheduler asked for."""
        num_tokens = len(request.token_ids)
        if count != min(op.num_new_tokens, num_tokens - start) or start >= num_tokens:
            raise SchedulerError(
                f"admitting {request.manager_id!r}: the manager computes tokens {start}..{start + count} of "
                f"{num_tokens}, asked for {op.num_new_tokens}"
            )
        self.waiting.remove(request)
        self.running.append(request)
        request.running = True
        request.expected = False  # the admission ended the manager's expectation
        counters = self.counters
        counters.num_admitted += 1
        counters.num_readmitted += request.num_preemptions > 0
        counters.num_admitted_tokens += num_tokens
        counters.num_cached_tokens += start
        if not request.num_preemptions and num_tokens == request.num_prompt_tokens:
            request.num_cached_prompt_tokens = start

    def _execute(
        self, step_id: int, executing: list[Request], batch: list[Scheduled]
    ) -> tuple[list[Request], list[Scheduled], ExecuteResult | None, int]:
        """Execute `batch` as step `step_id`. A worker that refuses it with KVMissingError computed none of it:
        the requests it names are preempted as lost, and the rest is executed again.

        Returns what was executed (of `executing` and `batch`), the worker's
        answer (None if nothing was left), and the number of lost requests.
        """
        num_kv_lost = 0
        while batch:
            try:
                return executing, batch, self.worker.execute(step_id, batch), num_kv_lost
            except KVMissingError as error:
                missing = dict.fromkeys(error.request_ids, "KV missing on the worker")
                if not any(scheduled.request_id in missing for scheduled in batch):
                    raise SchedulerError(
                        f"the worker refused step {step_id} for requests it does not hold: {error.request_ids}"
                    ) from error
                executing, batch, num_lost = self._preempt_lost(executing, batch, missing)
                num_kv_lost += num_lost
        return executing, batch, None, num_kv_lost

    def _preempt_lost(
        self, executing: list[Request], batch: list[Scheduled], lost: dict[str, str]
    ) -> tuple[list[Request], list[Scheduled], int]:
        """Preempt the running requests whose manager ids `lost` names (id -> why), and drop what `batch`
        holds of them: each is freed saying it computed only the tokens before this step's.

        Ids of no running request are ignored (freed already, or another
        scheduler's). Returns the rest of `executing` and `batch`, and the
        number of requests preempted.
        """
        victims = [request for request in self.running if request.manager_id in lost]
        if victims:
            self.running = [request for request in self.running if request.manager_id not in lost]
            for victim in reversed(victims):  # the oldest ends up at the front of the queue
                self._requeue(victim, f"its KV is lost ({lost[victim.manager_id]})")
            self.counters.num_kv_lost += len(victims)
        kept_requests: list[Request] = []
        kept_batch: list[Scheduled] = []
        for request, scheduled in zip(executing, batch):
            if scheduled.request_id in lost:
                # Freed next (a NO_SPACE victim of this step already was), its tokens of this step not computed.
                self.to_free[scheduled.request_id] = scheduled.start_position
            else:
                kept_requests.append(request)
                kept_batch.append(scheduled)
        return kept_requests, kept_batch, len(victims)

    def _preempt_newest(self) -> None:
        self._requeue(self.running.pop(), "no free blocks")
        self.counters.num_preemptions += 1

    def _requeue(self, victim: Request, why: str) -> None:
        """Free `victim`, no longer in `running`, with the next step and put it at the front of the queue, to be
        recomputed under a new manager id."""
        victim.running = False
        self.to_free[victim.manager_id] = None
        victim.num_preemptions += 1
        victim.manager_id = manager_id_of(victim.request_id, victim.num_preemptions)
        victim.num_sent = victim.num_computed_tokens = 0
        self.waiting.appendleft(victim)
        self.unexpected.append(victim)
        log.info("preempted %s: %s; it will be recomputed", victim.request_id, why,
                 extra={"request_id": victim.request_id, "attempt": victim.num_preemptions})  # fmt: skip
