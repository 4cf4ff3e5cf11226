"""A soak load: the reference scheduler's loop, trace-driven, against one kv-manager for a bounded time.

Shared by the soak test (tests/service/test_service_soak.py, schedulers in
threads) and `bench/soak_bench.py` (schedulers in processes). Each soak
scheduler is a `ReferenceScheduler` (continuous batching, preemption of the
newest running request on NO_SPACE, every answer checked against its own
view) with its own `KVManagerClient` and request ids, on a pool the others
share (`SchedulerConfig.shared_pool`). Around the loop it:

- keeps a few trace requests waiting (whole prompts: the budget is
  unlimited), cycling through its share of the trace;
- every few iterations forks a running request into one or two children,
  whose first writes into the shared last block go through copy-on-write,
  and aborts one;
- at the deadline, frees everything it holds.

Its manager, `ColumnarManager`, sends each loop step as two Steps: first the
nested ops (frees, admissions), then the decodes as columns
(`client.decode`), the bench's two kinds of round trip. Its worker,
`AckingWorker`, runs no model: it returns random tokens and acknowledges
the steps every few calls, which releases the copies' blocks. Steps go
unkeyed: a remembered key per Step would grow the manager's memory, which
the bench measures. Any RPC error or disagreement raises.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Callable, NamedTuple, Sequence

from kv_manager_service.client import (
    AllocateOp,
    AllocateResult,
    AllocateStatus,
    ForkResult,
    FreeOp,
    FreeResult,
    KVLossCause,
    KVManagerClient,
    Op,
    StepResult,
)
from kv_manager_service.shared.errors import FailedPreconditionError
from kv_tooling.workload import DEFAULT_TRACE, TokenExpander, load_trace, scaled_length
from kvcache.v1 import kv_manager_pb2 as pb
from reference_scheduler.interfaces import ExecuteResult, NextToken, Scheduled
from reference_scheduler.scheduler import ReferenceScheduler, Sampling, SchedulerConfig

VOCAB_SIZE = 32000  # TokenExpander's default: sampled tokens come from the same range
_VOCABULARY = range(VOCAB_SIZE)
OK = AllocateStatus.OK
NO_SPACE = AllocateStatus.NO_SPACE


class RequestSpec(NamedTuple):
    """One request of the workload: its prompt and how many tokens it generates."""

    prompt_token_ids: list[int]
    num_output_tokens: int


def trace_requests(
    scale: float,
    output_scale: float,
    max_num_tokens: int,
    index: int = 0,
    stride: int = 1,
    path: Path = DEFAULT_TRACE,
) -> list[RequestSpec]:
    """Records index, index + stride, ... of the Mooncake trace, scaled.

    Prompts are scaled by `scale` (`TokenExpander`), outputs by
    `output_scale`; a record whose prompt plus output exceeds
    `max_num_tokens` is left out, so that no request needs more of the pool
    than its share.
    """
    expander = TokenExpander(VOCAB_SIZE, scale)
    specs = []
    for record in load_trace(path)[index::stride]:
        num_output = scaled_length(record.output_length, output_scale)
        if expander.prompt_length(record) + num_output <= max_num_tokens:
            specs.append(RequestSpec(expander.prompt_token_ids(record), num_output))
    if not specs:
        raise ValueError(f"no trace record fits in {max_num_tokens} tokens at scale {scale}")
    return specs


@dataclass(frozen=True)
class SoakConfig:
    """One soak scheduler's knobs. Every `*_every` counts iterations (ack_every: Execute calls)."""

    scheduler_id: str  # prefixes its request ids
    duration_s: float
    max_running: int = 64
    max_admit_per_step: int = 8  # trace requests kept waiting
    fork_every: int = 25  # fork one running request into one or two children
    abort_every: int = 40  # free one running request before it finishes
    ack_every: int = 8  # AckSteps(worker_id, the step just executed)
    worker_id: str = "soak-worker"  # one fake worker for every scheduler of a run
    seed: int = 0

    def __post_init__(self) -> None:
        if self.duration_s <= 0:
            raise ValueError(f"duration_s must be > 0, got {self.duration_s}")
        for name in ("max_running", "max_admit_per_step", "fork_every", "abort_every", "ack_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


@dataclass
class SoakCounters:
    """What one soak scheduler did; `add` sums schedulers."""

    num_iterations: int = 0
    num_steps: int = 0  # manager steps: Step RPCs of both kinds, and Forks
    num_decode_steps: int = 0
    num_request_steps: int = 0  # decode entries that got OK
    num_requests: int = 0  # trace requests started, and fork children
    num_admitted: int = 0  # admissions that got OK, re-admissions included
    num_readmitted: int = 0
    num_finished: int = 0
    num_aborted: int = 0
    num_preempted: int = 0  # for NO_SPACE
    num_kv_lost: int = 0  # running requests preempted because their KV was lost
    num_forks: int = 0
    num_fork_children: int = 0
    num_no_space_admit: int = 0
    num_no_space_decode: int = 0
    num_copies: int = 0
    num_acks: int = 0
    num_prompt_tokens: int = 0  # admitted (a re-admission's output so far included)
    num_hit_tokens: int = 0  # of which prefix-cache hits
    num_freed_at_end: int = 0
    last_step_id: int = 0

    def add(self, other: SoakCounters) -> None:
        for f in fields(self):
            if f.name == "last_step_id":
                self.last_step_id = max(self.last_step_id, other.last_step_id)
            else:
                setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))


class LatencyBucket(NamedTuple):
    """Step round trips of one scheduler that ended in one whole second since the shared start."""

    scheduler_id: str
    second: int
    decode_us: list[int]  # Steps carrying the decode columns
    ops_us: list[int]  # Steps carrying nested ops (admissions, frees), and Forks


class _Buckets:
    """Collects round trips per second; hands each finished second to `sink`."""

    def __init__(self, scheduler_id: str, start_s: float, sink: Callable[[LatencyBucket], None]) -> None:
        self.start_s = start_s
        self.sink = sink
        self.current = LatencyBucket(scheduler_id, 0, [], [])

    def add(self, end_s: float, latency_s: float, decode: bool) -> None:
        second = int(end_s - self.start_s)
        if second != self.current.second:
            self.flush()
            self.current = LatencyBucket(self.current.scheduler_id, second, [], [])
        (self.current.decode_us if decode else self.current.ops_us).append(round(latency_s * 1e6))

    def flush(self) -> None:
        if self.current.decode_us or self.current.ops_us:
            self.sink(self.current)


class ColumnarManager:
    """A `KVManagerClient` that sends a loop step as up to two Steps: the nested ops, then the decode columns.

    A decode is an op that appends one token to a live request and computes
    it; the columns carry those, the nested Step everything else (frees,
    admissions, prefill chunks), first, so that the decodes can use what it
    frees. The results come back in the ops' order, under the later Step's
    id. The columns do not say which entry made which copy: the entries'
    `copies` are empty, and `counters.num_copies` counts them all.
    """

    def __init__(self, client: KVManagerClient, buckets: _Buckets, counters: SoakCounters) -> None:
        self.client = client
        self.buckets = buckets
        self.counters = counters  # Steps, decodes and copies are counted here
        self.live: set[str] = set()  # request ids the manager holds

    def step(self, ops: Sequence[Op], *, auto_key: bool = False) -> StepResult:
        nested: list[int] = []  # indices into ops
        columns: list[int] = []
        live = self.live
        for index, op in enumerate(ops):
            is_decode = (
                type(op) is AllocateOp
                and op.num_new_tokens == 1
                and len(op.token_ids) == 1
                and op.request_id in live
            )
            (columns if is_decode else nested).append(index)
        results: list[AllocateResult | FreeResult | None] = [None] * len(ops)
        lost_requests: tuple[tuple[str, KVLossCause], ...] = ()
        if nested:
            started = time.monotonic()
            answer = self.client.step([ops[i] for i in nested], auto_key=auto_key)
            self._count(started, answer.step_id, decode=False)
            lost_requests = answer.lost_requests
            for index, result in zip(nested, answer.results):
                results[index] = result
                self._track(ops[index], result)
        if columns:
            started = time.monotonic()
            decoded = self.client.decode(
                [ops[i].request_id for i in columns], [ops[i].token_ids[0] for i in columns], auto_key=auto_key
            )
            self._count(started, decoded.step_id, decode=True)
            counters = self.counters
            counters.num_decode_steps += 1
            counters.num_copies += len(decoded.copies)
            step_id = decoded.step_id
            num_ok = 0
            for index, status, num_computed in zip(columns, decoded.statuses, decoded.num_computed_tokens):
                if status is OK:
                    results[index] = AllocateResult(status, num_computed, 1, (), (), step_id)
                    num_ok += 1
                else:
                    results[index] = AllocateResult(status, num_computed, 0, (), (), step_id)
            counters.num_request_steps += num_ok
            counters.num_no_space_decode += decoded.statuses.count(NO_SPACE)
            lost_requests = decoded.lost_requests  # the later of the two steps: the newer list
        return StepResult(self.counters.last_step_id, tuple(results), lost_requests=lost_requests)

    def fork(self, parent_request_id: str, child_request_ids: Sequence[str]) -> ForkResult:
        started = time.monotonic()
        result = self.client.fork(parent_request_id, child_request_ids)
        self._count(started, result.step_id, decode=False)
        self.live.update(child_request_ids)
        return result

    def _count(self, started: float, step_id: int, decode: bool) -> None:
        ended = time.monotonic()
        self.buckets.add(ended, ended - started, decode)
        self.counters.num_steps += 1
        self.counters.last_step_id = max(self.counters.last_step_id, step_id)

    def _track(self, op: Op, result: object) -> None:
        """Keep `live` as the manager's: admissions join it, frees leave it."""
        if type(op) is FreeOp:
            self.live.difference_update(op.request_ids)
        elif type(op) is AllocateOp and type(result) is AllocateResult:
            self.counters.num_copies += len(result.copies)
            if result.status is OK:
                self.live.add(op.request_id)


class AckingWorker:
    """A worker without a model: random tokens, and an AckSteps every `ack_every` calls (releasing copies)."""

    def __init__(
        self, client: KVManagerClient, config: SoakConfig, rng: random.Random, counters: SoakCounters
    ) -> None:
        self.client = client
        self.worker_id = config.worker_id
        self.ack_every = config.ack_every
        self.rng = rng
        self.counters = counters  # AckSteps are counted here
        self.num_calls = 0

    def execute(self, step_id: int, requests: Sequence[Scheduled]) -> ExecuteResult:
        self.num_calls += 1
        if self.num_calls % self.ack_every == 0:
            try:
                self.client.ack_steps(self.worker_id, step_id)
            except FailedPreconditionError:  # not registered yet, or silent past --worker-timeout-s
                register_worker(self.client, self.worker_id)
                self.client.ack_steps(self.worker_id, step_id)
            self.counters.num_acks += 1
        token_ids = self.rng.choices(_VOCABULARY, k=len(requests))
        return ExecuteResult(
            step_id, tuple([NextToken(r.request_id, t, 0.0) for r, t in zip(requests, token_ids)]), 0.0
        )


def run_soak(
    client: KVManagerClient,
    config: SoakConfig,
    specs: Sequence[RequestSpec],
    start_s: float,
    sink: Callable[[LatencyBucket], None],
) -> SoakCounters:
    """Schedule `specs` (cycled; each pass gets new request ids) from `start_s` (time.monotonic) for
    `config.duration_s`, then free every request this scheduler holds.

    `sink` gets the Step round trips second by second. Raises on any RPC
    error and on any answer that disagrees with the scheduler's view.
    """
    rng = random.Random(config.seed)
    counters = SoakCounters()
    buckets = _Buckets(config.scheduler_id, start_s, sink)
    manager = ColumnarManager(client, buckets, counters)
    worker = AckingWorker(client, config, random.Random(rng.random()), counters)
    scheduler = ReferenceScheduler(
        manager, worker, SchedulerConfig(max_num_running=config.max_running, keyed_steps=False, shared_pool=True)
    )
    deadline = start_s + config.duration_s
    next_spec = 0

    def new_id() -> str:
        counters.num_requests += 1
        return f"{config.scheduler_id}-{counters.num_requests}"

    time.sleep(max(0.0, start_s - time.monotonic()))
    while time.monotonic() < deadline:
        counters.num_iterations += 1
        iteration = counters.num_iterations
        while len(scheduler.waiting) < config.max_admit_per_step:
            spec = specs[next_spec % len(specs)]
            next_spec += 1
            scheduler.add(new_id(), spec.prompt_token_ids, spec.num_output_tokens)
        if iteration % config.fork_every == 0 and 0 < len(scheduler.running) < config.max_running:
            parent = rng.choice(scheduler.running)
            children = {new_id(): Sampling() for _ in range(rng.randint(1, 2))}
            num_left = parent.max_new_tokens - parent.num_output_tokens
            scheduler.fork(parent.request_id, children, parent.num_output_tokens + rng.randint(1, num_left))
            counters.num_forks += 1
            counters.num_fork_children += len(children)
        for request in scheduler.step():
            scheduler.discard(request.request_id)
            counters.num_finished += 1
        if iteration % config.abort_every == 0 and scheduler.running:
            victim = rng.choice(scheduler.running)
            scheduler.abort(victim.request_id)
            scheduler.discard(victim.request_id)
            counters.num_aborted += 1
        if not scheduler.running:
            time.sleep(0.002)  # the other schedulers hold the pool: let them run

    counters.num_freed_at_end = len(scheduler.to_free) + len(scheduler.running)
    for request in list(scheduler.running):
        scheduler.abort(request.request_id)
    scheduler.flush()
    buckets.flush()

    loop = scheduler.counters
    counters.num_admitted = loop.num_admitted
    counters.num_readmitted = loop.num_readmitted
    counters.num_prompt_tokens = loop.num_admitted_tokens
    counters.num_hit_tokens = loop.num_cached_tokens
    counters.num_no_space_admit = loop.num_refused_admissions
    counters.num_preempted = loop.num_preemptions
    counters.num_kv_lost = loop.num_kv_lost
    return counters


class EndState(NamedTuple):
    """The pool as the service reports it once every scheduler has stopped."""

    num_blocks: int
    num_free_blocks: int
    usage: float
    num_requests: int
    num_pending_copies: int
    last_step_id: int
    num_tables: int  # GetBlockTables, all requests
    num_listed_pending_copies: int  # GetBlockTables.pending_copies

    def violations(self) -> list[str]:
        """What an idle pool must satisfy and this one does not (empty when drained)."""
        found = []
        if self.num_requests or self.num_tables:
            found.append(f"{self.num_requests} requests live ({self.num_tables} block tables)")
        if self.num_pending_copies or self.num_listed_pending_copies:
            found.append(f"{self.num_pending_copies} pending copies ({self.num_listed_pending_copies} listed)")
        if self.num_free_blocks != self.num_blocks - 1:
            found.append(f"{self.num_free_blocks} free blocks, expected {self.num_blocks - 1} (all but the null block)")
        if self.usage != 0.0:
            found.append(f"usage {self.usage}, expected 0")
        return found


def register_worker(client: KVManagerClient, worker_id: str, timeout_s: float = 30.0) -> None:
    """Register `worker_id` as having done every step so far, as a worker registers: with a WatchSteps
    stream (from the next step), closed here once GetStats lists the worker. It then stays registered
    while it acknowledges often enough (the manager's --worker-timeout-s)."""
    last_step_id = client.stub.GetStats(pb.GetStatsRequest(), timeout=client.timeout_s).last_step_id
    stream = client.watch_steps(worker_id, last_step_id + 1)
    try:
        deadline = time.monotonic() + timeout_s
        while worker_id not in {w.worker_id for w in client.workers()}:
            if time.monotonic() > deadline:
                raise TimeoutError(f"worker {worker_id} was not registered within {timeout_s:g}s")
            time.sleep(0.01)
    finally:
        stream.cancel()


def settle(client: KVManagerClient, worker_id: str) -> EndState:
    """Acknowledge, as `worker_id`, every step issued so far (releasing all copies), then read the pool."""
    step_id = client.stub.GetStats(pb.GetStatsRequest(), timeout=client.timeout_s).last_step_id
    if step_id:
        register_worker(client, worker_id)
        client.ack_steps(worker_id, step_id)
    stats = client.stub.GetStats(pb.GetStatsRequest(), timeout=client.timeout_s)
    tables = client.block_tables()
    return EndState(
        stats.num_blocks,
        stats.num_free_blocks,
        stats.usage,
        stats.num_requests,
        stats.num_pending_copies,
        stats.last_step_id,
        len(tables.tables),
        len(tables.pending_copies),
    )
