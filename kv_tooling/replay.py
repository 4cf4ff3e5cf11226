"""Replay a trace through a `KVCacheManager` with the reference scheduler's loop, on a simulated clock.

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

Arrivals (`ReplayConfig.arrivals`):

- "asap": every record is waiting from the start, in trace order (an offline
  replay): concurrency is whatever the pool and the running slots allow.
- "trace": a record is released at its trace timestamp, relative to the
  first record's and multiplied by `time_scale`; it is never admitted before.

With `splice_turns`, a record that continues an earlier one (a
conversation's next turn, `turn_splicing.py`) runs with that turn's prompt
and generated tokens at the start of its prompt, and is released no earlier
than the end of that turn.

Either way a simulated clock starts at 0 and advances by each step's cost
(`cost_model.StepCostModel`: its prefill tokens, decode rows, the KV those
rows read and the host tier's copies); when nothing is waiting or running,
it jumps to the next arrival. A request's TTFT is the end of the step that
sampled its first output token less its arrival; its TPOT the time from
then to the end of the step that sampled its last, over its other tokens.

What is counted, and how:

- `num_prefill_tokens_computed`: every token the worker computes in a
  prefill pass, i.e. every token not computed by a decode row (a decode row
  computes exactly the one pending token of a request whose prompt and
  earlier outputs are all computed). After a preemption the prompt and the
  request's outputs so far are computed again, and counted again.
- `num_prefix_hit_tokens`: tokens found cached when each request is first
  admitted (split by tier: `num_host_hit_tokens` of them loaded from the
  host). A re-admission after preemption finds the request's own blocks,
  which is no hit of the workload: those are `num_readmission_hit_tokens`.
  `prefix_cache_queries` and `prefix_cache_hits` are the core's own counts,
  re-admissions included. Without preemption,
  num_prefill_tokens_computed == num_prompt_tokens - num_prefix_hit_tokens.

The loop does no I/O; it reports through the optional `progress` callback.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable, Literal, Mapping, Sequence

from kv_manager_service.core import KVCacheManager, StepResult
from kv_manager_service.shared.ops import AllocateOp, AllocateResult, AllocateStatus, FreeOp, Op
from kv_tooling.cost_model import StepCostModel, StepWork
from kv_tooling.eviction_oracle import NextUseOracle
from kv_tooling.in_process import InProcessManager
from kv_tooling.turn_splicing import TurnSplicer
from kv_tooling.workload import TokenExpander, TraceRecord
from reference_scheduler.interfaces import ExecuteResult, NextToken, Scheduled
from reference_scheduler.scheduler import ReferenceScheduler, Request, RequestTooLargeError, Sampling, SchedulerConfig

Arrivals = Literal["asap", "trace"]
ARRIVALS: tuple[Arrivals, ...] = ("asap", "trace")


@dataclass(frozen=True)
class ReplayConfig:
    """Scheduler limits, as vLLM's `max_num_batched_tokens` and `max_num_seqs`; arrivals and the step costs.

    Arrivals default to "asap" here, as the core's benchmarks replay; `kv-manager replay` defaults to "trace".
    """

    token_budget: int = 8192
    max_num_running: int = 256
    progress_every_steps: int = 1000
    arrivals: Arrivals = "asap"
    time_scale: float = 1.0  # multiplies the gaps between trace timestamps ("trace" arrivals)
    cost_model: StepCostModel = field(default_factory=StepCostModel)
    expect_waiting: bool = True  # the scheduler tells the manager the waiting requests' prompts (ExpectOp)
    splice_turns: bool = False  # a conversation's next turn starts with its previous turn's tokens (turn_splicing.py)

    def __post_init__(self) -> None:
        for name in ("token_budget", "max_num_running", "progress_every_steps"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.arrivals not in ARRIVALS:
            raise ValueError(f"arrivals must be one of {', '.join(ARRIVALS)}, got {self.arrivals!r}")
        if not self.time_scale > 0:
            raise ValueError(f"time_scale must be > 0, got {self.time_scale!r}")


@dataclass(frozen=True)
class ReplayProgress:
    num_steps: int
    num_completed: int
    num_running: int
    num_waiting: int  # released and not admitted, or not yet released
    usage: float
    clock_s: float = 0.0  # the simulated clock


@dataclass(frozen=True)
class ReplayResult:
    """What one replay did; the module docstring defines the counts. Token counts cover this replay only."""

    num_requests: int
    num_completed: int
    num_steps: int
    num_preemptions: int
    num_prompt_tokens: int  # of the trace's prompts, counted once per request
    num_output_tokens: int
    prefix_cache_queries: int  # tokens looked up on admission (re-admissions included)
    prefix_cache_hits: int  # of those, tokens found cached
    prefix_hit_rate: float
    peak_usage: float
    wall_s: float
    requests_per_s: float
    num_prefix_hit_tokens: int  # found cached on each request's first admission
    num_host_hit_tokens: int  # of those, loaded from the host tier
    num_readmission_hit_tokens: int  # found cached on re-admissions after preemption
    num_prefill_tokens_computed: int
    num_decode_rows: int
    makespan_s: float  # simulated: from 0 to the end of the last step
    ttft_ms_p50: float  # simulated, over the completed requests (0 if none)
    ttft_ms_p99: float
    tpot_ms_p50: float  # simulated, over the completed requests with 2 or more output tokens (0 if none)
    # The host tier's share, all 0 without one: hit tokens loaded from the host (within
    # `prefix_cache_hits`), and the tier's copies and host evictions, in blocks.
    prefix_cache_host_hits: int = 0
    num_offloaded_blocks: int = 0
    num_onloaded_blocks: int = 0
    num_host_evictions: int = 0
    num_dropped_offloads: int = 0
    # With `splice_turns`: records whose prompt was spliced, and records held until their predecessor finished.
    num_spliced_turns: int = 0
    num_held_turns: int = 0

    @property
    def device_hit_rate(self) -> float:
        """Hit tokens found on the device, over the tokens looked up."""
        hits = self.prefix_cache_hits - self.prefix_cache_host_hits
        return hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0

    @property
    def host_hit_rate(self) -> float:
        """Hit tokens loaded from the host tier, over the tokens looked up."""
        return self.prefix_cache_host_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0

    def figures(self) -> dict[str, int | float]:
        """The figures as `kv-manager replay --report-json` names them (`prefill_tokens_computed` and
        `num_preemptions` mean what they mean in the demo's report)."""
        return {
            "num_requests": self.num_requests,
            "num_completed": self.num_completed,
            "prompt_tokens": self.num_prompt_tokens,
            "output_tokens": self.num_output_tokens,
            "prefix_hit_tokens": self.num_prefix_hit_tokens,
            "device_hit_tokens": self.num_prefix_hit_tokens - self.num_host_hit_tokens,
            "host_hit_tokens": self.num_host_hit_tokens,
            "readmission_hit_tokens": self.num_readmission_hit_tokens,
            "prefill_tokens_computed": self.num_prefill_tokens_computed,
            "decode_rows": self.num_decode_rows,
            "num_preemptions": self.num_preemptions,
            "offloaded_blocks": self.num_offloaded_blocks,
            "onloaded_blocks": self.num_onloaded_blocks,
            "ttft_ms_p50": self.ttft_ms_p50,
            "ttft_ms_p99": self.ttft_ms_p99,
            "tpot_ms_p50": self.tpot_ms_p50,
            "makespan_s": self.makespan_s,
            "spliced_turns": self.num_spliced_turns,
            "held_turns": self.num_held_turns,
            "num_steps": self.num_steps,
            "peak_usage": self.peak_usage,
            "wall_s": self.wall_s,
        }


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


@dataclass
class ExecutedWork:
    """What a `MeteredWorker` executed since it was last taken (see the module docstring for the split)."""

    num_prefill_tokens: int = 0
    num_decode_rows: int = 0
    num_decode_kv_tokens: int = 0  # tokens of K and V the decode rows read: each row's position + 1
    first_token_seeds: list[int] = field(default_factory=list)  # requests that sampled their first token


class MeteredWorker(SampledTokenWorker):
    """A `SampledTokenWorker` that splits what it executes into prefill tokens and decode rows.

    `requests` must be the scheduler's own map (request id -> `Request`): it
    is read while a batch executes, before the scheduler appends the tokens
    the batch samples.
    """

    def __init__(self, vocab_size: int) -> None:
        super().__init__(vocab_size)
        self.requests: Mapping[str, Request] = {}
        self.work = ExecutedWork()

    def take(self) -> ExecutedWork:
        """What was executed since the last call."""
        work, self.work = self.work, ExecutedWork()
        return work

    def execute(self, step_id: int, requests: Sequence[Scheduled]) -> ExecuteResult:
        work = self.work
        for scheduled in requests:
            request = self.requests[scheduled.request_id.partition("#")[0]]
            num_tokens = len(scheduled.token_ids)
            num_known = len(request.token_ids)
            end = scheduled.start_position + num_tokens
            if num_tokens == 1 and end == num_known > request.num_prompt_tokens:
                work.num_decode_rows += 1
                work.num_decode_kv_tokens += end
            else:
                work.num_prefill_tokens += num_tokens
                if end == num_known == request.num_prompt_tokens:
                    work.first_token_seeds.append(scheduled.seed)
        return super().execute(step_id, requests)


class MeteredManager(InProcessManager):
    """An `InProcessManager` that counts each admission's cached prefix, by tier, and the host tier's copies.

    An admission is the first accepted op of a manager id (a preempted
    request comes back under a new one, `name#N`); ids are forgotten when
    freed. Host hit tokens of an admission are counted as the core counts
    them: the onloaded blocks of its hit, in the group where they span most.
    """

    def __init__(self, manager: KVCacheManager) -> None:
        super().__init__(manager)
        self.block_sizes = [group.block_size for group in manager.config.groups]
        self.live: set[str] = set()
        self.num_prefix_hit_tokens = self.num_host_hit_tokens = self.num_readmission_hit_tokens = 0
        self.num_copied_blocks = 0  # offloads and onloads since the last `take_num_copied_blocks`
        self.oracle: NextUseOracle | None = None  # told each request's first admission

    def step(self, ops: Sequence[Op], *, auto_key: bool = False) -> StepResult:
        result = super().step(ops, auto_key=auto_key)
        live = self.live
        for op, op_result in zip(ops, result.results):
            if type(op) is FreeOp:
                live.difference_update(op.request_ids)
            elif type(op) is AllocateOp and op_result.status is AllocateStatus.OK and op.request_id not in live:
                live.add(op.request_id)
                if "#" in op.request_id:
                    self.num_readmission_hit_tokens += op_result.num_computed_tokens
                else:
                    self.num_prefix_hit_tokens += op_result.num_computed_tokens
                    self.num_host_hit_tokens += self._host_hit_tokens(op_result)
                    if self.oracle is not None:
                        self.oracle.admitted(request_index(op.request_id))
        if result.delta is not None:
            self.num_copied_blocks += len(result.delta.offloads) + len(result.delta.onloads)
        return result

    def take_num_copied_blocks(self) -> int:
        """The host tier's copies, both ways, since the last call."""
        num_copied, self.num_copied_blocks = self.num_copied_blocks, 0
        return num_copied

    def _host_hit_tokens(self, result: AllocateResult) -> int:
        if not result.onloads:
            return 0
        onloaded = {copy.device_block_id for copy in result.onloads}
        return max(
            sum(1 for block_id in group.hit_block_ids if block_id in onloaded) * self.block_sizes[group.group_id]
            for group in result.groups
        )


def arrival_times_s(records: Sequence[TraceRecord], arrivals: Arrivals, time_scale: float) -> list[float]:
    """Each record's release time on the simulated clock: 0 for "asap"; for "trace", its timestamp less the
    first's, times `time_scale`. Raises ValueError on a "trace" whose timestamps go back in time."""
    if arrivals == "asap" or not records:
        return [0.0] * len(records)
    first_ms = records[0].timestamp_ms
    for index in range(1, len(records)):
        if records[index].timestamp_ms < records[index - 1].timestamp_ms:
            raise ValueError(
                f"trace record {index} has timestamp {records[index].timestamp_ms} ms, before the record ahead "
                f"of it ({records[index - 1].timestamp_ms} ms): --arrivals trace needs them in time order"
            )
    return [(record.timestamp_ms - first_ms) / 1e3 * time_scale for record in records]


def replay(
    manager: KVCacheManager,
    records: Sequence[TraceRecord],
    expander: TokenExpander,
    config: ReplayConfig = ReplayConfig(),
    progress: Callable[[ReplayProgress], None] | None = None,
    oracle: NextUseOracle | None = None,
) -> ReplayResult:
    """Run every record to completion through `manager`; returns what happened. With `oracle`, keyed
    evictions (`BlockPool.set_ranker(oracle.key)`) read the trace ahead: it is told each first admission
    and the clock after each step.

    Mutates `manager` (its requests, pool, cache and step ids); on return no
    request of this replay is live and every step is acked. Raises ValueError
    if a request can never fit in the pool (refused while it runs alone, or
    refused admission to an idle pool), or for "trace" arrivals out of order.
    """
    released_s = arrival_times_s(records, config.arrivals, config.time_scale)
    cost_model = config.cost_model
    copy_block_size = manager.config.groups[0].block_size  # the cost model prices one full-attention group
    metered = MeteredManager(manager)
    metered.oracle = oracle
    worker = MeteredWorker(expander.vocab_size)
    limits = SchedulerConfig(config.token_budget, config.max_num_running, expect_waiting=config.expect_waiting)
    scheduler = ReferenceScheduler(metered, worker, limits)
    worker.requests = scheduler.sequences
    stats_before = manager.stats()
    tier_before = manager.host_tier_stats()
    num_added = num_steps = num_completed = num_prompt_tokens = num_output_tokens = 0
    num_prefill_tokens = num_decode_rows = 0
    first_token_s = [math.nan] * len(records)
    ttft_s: list[float] = []
    tpot_s: list[float] = []
    clock_s = 0.0
    peak_usage = stats_before.usage
    start_ns = time.perf_counter_ns()
    splicer = TurnSplicer(records) if config.splice_turns else None

    def start(index: int, predecessor: int | None) -> None:
        """Queue `records[index]`, whose trace index is its sampling seed (request_index); the queue
        tells the manager its prompt."""
        nonlocal num_prompt_tokens
        record = records[index]
        prompt = expander.prompt_token_ids(record)
        if splicer is not None:
            prompt = splicer.started(index, prompt, predecessor)
        num_prompt_tokens += len(prompt)
        scheduler.add(f"replay-{index}", prompt, expander.output_length(record), Sampling(seed=index))

    while True:
        while num_added < len(records) and released_s[num_added] <= clock_s:
            found = splicer.predecessor(num_added) if splicer is not None else None
            if found is not None and found[1]:
                splicer.hold(num_added, found[0])  # its user has not read the predecessor's output yet
            else:
                start(num_added, found[0] if found is not None else None)
            num_added += 1
        if not scheduler.has_work:
            if num_added == len(records):
                break
            assert released_s[num_added] > clock_s, "an idle scheduler has free slots for every released record"
            clock_s = released_s[num_added]
            continue
        try:
            finished = scheduler.step()
        except RequestTooLargeError as error:
            raise ValueError(
                f"request {scheduler.sequences[error.request_id].sampling.seed} does not fit in the pool even alone "
                f"({manager.stats().num_blocks} blocks): {error}"
            ) from error
        num_steps += 1
        work = worker.take()
        num_prefill_tokens += work.num_prefill_tokens
        num_decode_rows += work.num_decode_rows
        copied_tokens = metered.take_num_copied_blocks() * copy_block_size
        clock_s += cost_model.step_s(
            StepWork(work.num_prefill_tokens, work.num_decode_rows, work.num_decode_kv_tokens, copied_tokens)
        )
        for seed in work.first_token_seeds:
            first_token_s[seed] = clock_s
        if oracle is not None:
            oracle.advance(clock_s)
        for request in finished:
            seed = request.sampling.seed
            assert not math.isnan(first_token_s[seed]), f"request {seed} finished without a first token"
            ttft_s.append(first_token_s[seed] - released_s[seed])
            if request.num_output_tokens > 1:
                tpot_s.append((clock_s - first_token_s[seed]) / (request.num_output_tokens - 1))
            num_output_tokens += request.num_output_tokens
            if splicer is not None:
                for held in splicer.finished(seed, request.token_ids):
                    released_s[held] = clock_s
                    start(held, seed)
            scheduler.discard(request.request_id)  # drop its tokens: the request is done
        num_completed += len(finished)
        usage = manager.stats().usage
        peak_usage = max(peak_usage, usage)
        if progress is not None and num_steps % config.progress_every_steps == 0:
            num_waiting = len(scheduler.waiting) + len(records) - num_added
            if splicer is not None:
                num_waiting += splicer.num_holding  # released, waiting for their previous turn
            progress(ReplayProgress(num_steps, num_completed, len(scheduler.running), num_waiting, usage, clock_s))
    scheduler.flush()

    wall_s = (time.perf_counter_ns() - start_ns) / 1e9
    stats = manager.stats()
    queries = stats.prefix_cache_queries - stats_before.prefix_cache_queries
    hits = stats.prefix_cache_hits - stats_before.prefix_cache_hits
    tier = manager.host_tier_stats()
    tier_counts = {}
    if tier is not None:
        tier_counts = {
            name: getattr(tier, name) - getattr(tier_before, name)
            for name in ("prefix_cache_host_hits", "num_offloaded_blocks", "num_onloaded_blocks",
                         "num_host_evictions", "num_dropped_offloads")
        }  # fmt: skip
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
        num_prefix_hit_tokens=metered.num_prefix_hit_tokens,
        num_host_hit_tokens=metered.num_host_hit_tokens,
        num_readmission_hit_tokens=metered.num_readmission_hit_tokens,
        num_prefill_tokens_computed=num_prefill_tokens,
        num_decode_rows=num_decode_rows,
        makespan_s=clock_s,
        ttft_ms_p50=percentile(ttft_s, 50) * 1e3,
        ttft_ms_p99=percentile(ttft_s, 99) * 1e3,
        tpot_ms_p50=percentile(tpot_s, 50) * 1e3,
        **tier_counts,
        num_spliced_turns=splicer.num_spliced if splicer is not None else 0,
        num_held_turns=splicer.num_held if splicer is not None else 0,
    )


def request_index(request_id: str) -> int:
    """The trace index of a replay request id, `replay-N` (not a re-admission's `replay-N#K`)."""
    return int(request_id.rpartition("-")[2])


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile, q in (0, 100]; 0 for no values."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)] if ordered else 0.0
