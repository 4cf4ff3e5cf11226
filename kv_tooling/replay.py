"""Replay a trace through a `KVCacheManager` with the reference scheduler's loop.

The loop is `reference_scheduler.ReferenceScheduler`'s (continuous batching
within a token budget, chunked prefill, preemption of the newest running
request on NO_SPACE; its module docstring has the details). Here it drives
the core in this process (`InProcessManager`: each step is acknowledged at
once, since no worker holds copies) and a worker that runs no model: it
"samples" `sampled_token_id` of the request and position, so every run of
the same trace is the same.

Its semantics are the scheduler's. Each step carries the running requests'
ops and, unless a running request was refused in the step before, the
admissions, front of the queue first, that the budget and the free running
slots allow. An op refused NO_SPACE preempts the newest running request and
is retried in the next step, once the victim's blocks are freed (not within
the same step); a refused admission waits while later ones may still be
admitted. Finished requests are freed with the next step.

With a host tier (`num_host_blocks` > 0 in the manager's config) the result
also splits the hits by tier and counts the tier's copies, in blocks.

Arrival times are ignored: every record is waiting from the start, in trace
order (an offline replay); the records are expanded into tokens as the
scheduler's queue needs them. The loop does no I/O; it reports through the
optional `progress` callback.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Sequence

from kv_tooling.in_process import InProcessManager
from kv_manager_service.core import KVCacheManager
from kv_tooling.workload import TokenExpander, TraceRecord
from reference_scheduler.interfaces import ExecuteResult, NextToken, Scheduled
from reference_scheduler.scheduler import ReferenceScheduler, RequestTooLargeError, Sampling, SchedulerConfig


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
    # The host tier's share, all 0 without one: hit tokens loaded from the host (within
    # `prefix_cache_hits`), and the tier's copies and host evictions, in blocks.
    prefix_cache_host_hits: int = 0
    num_offloaded_blocks: int = 0
    num_onloaded_blocks: int = 0
    num_host_evictions: int = 0
    num_dropped_offloads: int = 0

    @property
    def device_hit_rate(self) -> float:
        """Hit tokens found on the device, over the tokens looked up."""
        hits = self.prefix_cache_hits - self.prefix_cache_host_hits
        return hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0

    @property
    def host_hit_rate(self) -> float:
        """Hit tokens loaded from the host tier, over the tokens looked up."""
        return self.prefix_cache_host_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0


def sampled_token_id(request_index: int, position: int, vocab_size: int) -> int:
    """The token a request "samples" at `position`: any deterministic id will do."""
    return (request_index * 1_000_003 + position * 7_919) % vocab_size


class SampledTokenWorker:
    """A worker without a model: a request with sampling seed `index` samples `sampled_token_id(index, position)`."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size

    def execute(self, step_id: int, requests: Sequence[Scheduled]) -> ExecuteResult:
        vocab_size = self.vocab_size
        outputs = [
            NextToken(r.request_id, sampled_token_id(r.seed, r.start_position + len(r.token_ids), vocab_size), 0.0)
            for r in requests
        ]
        return ExecuteResult(step_id, tuple(outputs), 0.0)


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
    if a request can never fit in the pool (refused while it runs alone, or
    refused admission to an idle pool).
    """
    worker = SampledTokenWorker(expander.vocab_size)
    scheduler = ReferenceScheduler(
        InProcessManager(manager), worker, SchedulerConfig(config.token_budget, config.max_num_running)
    )
    stats_before = manager.stats()
    tier_before = manager.host_tier_stats()
    num_added = num_steps = num_completed = num_prompt_tokens = num_output_tokens = 0
    peak_usage = stats_before.usage
    start_ns = time.perf_counter_ns()
    while True:
        # A step looks at no more of the queue than the free running slots: keeping that many
        # there is the same as queueing every record from the start.
        while num_added < len(records) and len(scheduler.waiting) < config.max_num_running - len(scheduler.running):
            record = records[num_added]
            request_id = f"replay-{num_added}"  # its trace index is its sampling seed
            prompt = expander.prompt_token_ids(record)
            num_prompt_tokens += len(prompt)
            scheduler.add(request_id, prompt, expander.output_length(record), Sampling(seed=num_added))
            num_added += 1
        if not scheduler.has_work:
            break
        try:
            finished = scheduler.step()
        except RequestTooLargeError as error:
            raise ValueError(
                f"request {scheduler.sequences[error.request_id].sampling.seed} does not fit in the pool even alone "
                f"({manager.stats().num_blocks} blocks): {error}"
            ) from error
        num_steps += 1
        for request in finished:
            num_output_tokens += request.num_output_tokens
            scheduler.discard(request.request_id)  # drop its tokens: the request is done
        num_completed += len(finished)
        usage = manager.stats().usage
        peak_usage = max(peak_usage, usage)
        if progress is not None and num_steps % config.progress_every_steps == 0:
            num_waiting = len(scheduler.waiting) + len(records) - num_added
            progress(ReplayProgress(num_steps, num_completed, len(scheduler.running), num_waiting, usage))
    scheduler.flush()

    wall_s = (time.perf_counter_ns() - start_ns) / 1e9
    stats = manager.stats()
    queries = stats.prefix_cache_queries - stats_before.prefix_cache_queries
    hits = stats.prefix_cache_hits - stats_before.prefix_cache_hits
    tier = manager.host_tier_stats()
    tier_counts = {}
    if tier is not None:
        tier_counts = {
            name: getattr(tier, tier_name) - getattr(tier_before, tier_name)
            for name, tier_name in (
                ("prefix_cache_host_hits", "prefix_cache_host_hits"),
                ("num_offloaded_blocks", "num_offloaded_blocks"),
                ("num_onloaded_blocks", "num_onloaded_blocks"),
                ("num_host_evictions", "num_host_evictions"),
                ("num_dropped_offloads", "num_dropped_offloads"),
            )
        }
    return ReplayResult(
        num_requests=len(records),
        num_completed=num_completed,
        num_steps=num_steps,
        num_preemptions=scheduler.num_preemptions,
        num_prompt_tokens=num_prompt_tokens,
        num_output_tokens=num_output_tokens,
        prefix_cache_queries=queries,
        prefix_cache_hits=hits,
        prefix_hit_rate=hits / queries if queries else 0.0,
        peak_usage=peak_usage,
        wall_s=wall_s,
        requests_per_s=num_completed / wall_s if wall_s > 0 else 0.0,
        **tier_counts,
    )
