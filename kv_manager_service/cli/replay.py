"""Replay a trace through a `KVCacheManager` with a small continuous-batching loop.

No model runs: each scheduler step only asks the manager for blocks, and a
request "samples" a deterministic token whenever all its known tokens are
computed. One step of the loop:

1. Running requests, oldest first, in one `manager.step`: a prefill chunk
   (as many prompt tokens as the token budget leaves) or one decode token.
2. An op that gets NO_SPACE preempts the newest running request (freed and
   put back at the front of the waiting queue, to recompute from scratch
   with the prefix cache's help) and is retried, until it fits or has
   preempted itself.
3. If nothing was preempted, waiting requests are admitted in arrival order
   while `allocate` returns OK and budget and running slots remain.
4. Requests whose output is complete are freed together; the step is acked.

Arrival times are ignored: every record is waiting from the start, in trace
order (an offline replay). The loop does no I/O; it reports through the
optional `progress` callback.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Sequence

from kv_manager_service.core import AllocateOp, AllocateStatus, KVCacheManager
from kv_manager_service.workload import TokenExpander, TraceRecord


@dataclass(frozen=True)
class ReplayConfig:
    """Scheduler limits, as vLLM's `max_num_batched_tokens` and `max_num_seqs`."""

    token_budget: int = 8192
    max_num_running: int = 256
    progress_every_steps: int = 1000

    def __post_init__(self) -> None:
        for name in ("token_budget", "max_num_running", "progress_every_steps"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


@dataclass(frozen=True)
class ReplayProgress:
    num_steps: int
    num_completed: int
    num_running: int
    num_waiting: int
    usage: float


@dataclass(frozen=True)
class ReplayResult:
    """What one replay did. Token counts and hit rate cover this replay only."""

    num_requests: int
    num_completed: int
    num_steps: int
    num_preemptions: int
    num_prompt_tokens: int  # of the trace's prompts, counted once per request
    num_output_tokens: int
    prefix_cache_queries: int  # tokens looked up on admission (readmissions included)
    prefix_cache_hits: int  # of those, tokens found cached
    prefix_hit_rate: float
    peak_usage: float
    wall_s: float
    requests_per_s: float


class _Request:
    """A request as the loop sees it; `token_ids` is None until first admitted."""

    __slots__ = ("index", "request_id", "record", "token_ids", "num_prompt_tokens", "num_output_tokens",
                 "num_sent", "num_computed", "running")

    def __init__(self, index: int, record: TraceRecord, num_output_tokens: int) -> None:
        self.index = index
        self.request_id = f"replay-{index}"
        self.record = record
        self.token_ids: list[int] | None = None
        self.num_prompt_tokens = 0
        self.num_output_tokens = num_output_tokens  # to generate in all
        self.num_sent = 0  # tokens the manager knows
        self.num_computed = 0
        self.running = False


def sampled_token_id(request_index: int, position: int, vocab_size: int) -> int:
    """The token a request "samples" at `position`: any deterministic id will do."""
    return (request_index * 1_000_003 + position * 7_919) % vocab_size


def replay(
    manager: KVCacheManager,
    records: Sequence[TraceRecord],
    expander: TokenExpander,
    config: ReplayConfig = ReplayConfig(),
    progress: Callable[[ReplayProgress], None] | None = None,
) -> ReplayResult:
    """Run every record to completion through `manager`; returns what happened.

    Mutates `manager` (its requests, pool, cache and step ids); on return no
    request of this replay is live and every step is acked. Raises ValueError
    if a request can never fit in the pool (its prefill chunk when nothing is
    running, or its whole length once it runs alone).
    """
    vocab_size = expander.vocab_size
    waiting = deque(_Request(i, r, expander.output_length(r)) for i, r in enumerate(records))
    running: list[_Request] = []
    stats_before = manager.stats()
    num_steps = num_completed = num_preemptions = num_prompt_tokens = num_output_tokens = 0
    peak_usage = stats_before.usage
    start_ns = time.perf_counter_ns()

    def preempt_newest() -> _Request:
        nonlocal num_preemptions
        victim = running.pop()
        manager.free((victim.request_id,))
        victim.running = False
        victim.num_sent = victim.num_computed = 0
        waiting.appendleft(victim)
        num_preemptions += 1
        return victim

    while waiting or running:
        num_steps += 1
        budget = config.token_budget
        ops: list[AllocateOp] = []
        for request in running:
            if budget == 0:
                break
            num_tokens = min(len(request.token_ids) - request.num_computed, budget)
            ops.append(AllocateOp(request.request_id, request.token_ids[request.num_sent :], num_tokens))
            budget -= num_tokens
        results = manager.step(ops).results if ops else ()

        computed: list[_Request] = []  # every known token of these is computed after this step
        preempted = False
        for request, op, result in zip(running[: len(ops)], ops, results):
            if not request.running:
                continue  # preempted while fixing an earlier op of this step
            while result.status is AllocateStatus.NO_SPACE:
                preempted = True
                if preempt_newest() is request:
                    if not running:
                        raise ValueError(
                            f"request {request.index} ({len(request.token_ids)} tokens) does not fit in the "
                            f"pool even alone ({manager.pool.num_blocks} blocks)"
                        )
                    break
                result = manager.step((op,)).results[0]
            if request.running:
                _advance(request, result.num_computed_tokens + result.num_scheduled_tokens, computed)

        while waiting and budget > 0 and len(running) < config.max_num_running and not preempted:
            request = waiting[0]
            if request.token_ids is None:
                request.token_ids = expander.prompt_token_ids(request.record)
                request.num_prompt_tokens = len(request.token_ids)
                num_prompt_tokens += request.num_prompt_tokens
            result = manager.allocate(request.request_id, request.token_ids, budget)
            if result.status is AllocateStatus.NO_SPACE:
                if not running:
                    raise ValueError(
                        f"request {request.index}: its cached prefix plus a {budget}-token prefill chunk do not "
                        f"fit in an idle pool of {manager.pool.num_blocks} blocks; lower the token budget or "
                        "grow the pool"
                    )
                break
            waiting.popleft()
            request.running = True
            running.append(request)
            budget -= result.num_scheduled_tokens
            _advance(request, result.num_computed_tokens + result.num_scheduled_tokens, computed)

        peak_usage = max(peak_usage, manager.stats().usage)
        finished: list[_Request] = []
        for request in computed:
            num_output = len(request.token_ids) - request.num_prompt_tokens + 1
            num_output_tokens += 1
            if num_output == request.num_output_tokens:
                finished.append(request)
            else:
                request.token_ids.append(sampled_token_id(request.index, len(request.token_ids), vocab_size))
        if finished:
            manager.free([r.request_id for r in finished])
            for request in finished:
                request.running = False
                request.token_ids = None  # drop the tokens: the request is done
            running[:] = [r for r in running if r.running]
            num_completed += len(finished)
        manager.ack(manager.last_step_id)
        if progress is not None and num_steps % config.progress_every_steps == 0:
            progress(ReplayProgress(num_steps, num_completed, len(running), len(waiting), manager.stats().usage))

    wall_s = (time.perf_counter_ns() - start_ns) / 1e9
    stats = manager.stats()
    queries = stats.prefix_cache_queries - stats_before.prefix_cache_queries
    hits = stats.prefix_cache_hits - stats_before.prefix_cache_hits
    return ReplayResult(
        num_requests=len(records),
        num_completed=num_completed,
        num_steps=num_steps,
        num_preemptions=num_preemptions,
        num_prompt_tokens=num_prompt_tokens,
        num_output_tokens=num_output_tokens,
        prefix_cache_queries=queries,
        prefix_cache_hits=hits,
        prefix_hit_rate=hits / queries if queries else 0.0,
        peak_usage=peak_usage,
        wall_s=wall_s,
        requests_per_s=num_completed / wall_s if wall_s > 0 else 0.0,
    )


def _advance(request: _Request, num_computed: int, computed: list[_Request]) -> None:
    """Record an accepted allocate: the manager now knows and computes these tokens."""
    request.num_sent = len(request.token_ids)
    request.num_computed = num_computed
    if num_computed == len(request.token_ids):
        computed.append(request)
