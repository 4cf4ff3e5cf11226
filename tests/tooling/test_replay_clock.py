"""The time-driven replay: arrivals at their timestamps, the simulated clock, and what the report counts."""

from __future__ import annotations

from pathlib import Path

import pytest

from kv_manager_service.core import GroupKind, GroupSpec, KVCacheConfig, KVCacheManager
from kv_tooling.cost_model import StepCostModel
from kv_tooling.replay import ReplayConfig, ReplayProgress, ReplayResult, arrival_times_s, replay
from kv_tooling.workload import TokenExpander, TraceRecord, load_trace

EXCERPT = Path(__file__).parents[1] / "data" / "mooncake_excerpt.jsonl"
SCALE = 1 / 32  # 16 tokens per trace block: four 4-token KV blocks
BLOCK_SIZE = 4
# Round costs: a prefill token 1 ms, a decode step 2 ms whatever its rows, nothing else.
ROUND = StepCostModel(prefill_us_per_token=1000.0, decode_step_ms=2.0, decode_us_per_row=0.0, kv_bytes_per_token=0)


def make_manager(num_blocks: int, num_host_blocks: int = 0, caching: bool = True) -> KVCacheManager:
    groups = (GroupSpec(GroupKind.FULL_ATTENTION, BLOCK_SIZE),)
    return KVCacheManager(
        KVCacheConfig(num_blocks, groups=groups, num_host_blocks=num_host_blocks, enable_prefix_caching=caching)
    )


def apart(gap_ms: int, num_requests: int = 4) -> list[TraceRecord]:
    """Requests `gap_ms` apart, sharing nothing: 64-token prompts and 8 output tokens at SCALE."""
    return [TraceRecord(i * gap_ms, 2048, 256, tuple(range(4 * i, 4 * i + 4))) for i in range(num_requests)]


def run(
    records: list[TraceRecord], manager: KVCacheManager, progress=None, **config: object
) -> ReplayResult:
    replay_config = ReplayConfig(**{"token_budget": 256, "max_num_running": 16, "progress_every_steps": 1, **config})
    return replay(manager, records, TokenExpander(scale=SCALE), replay_config, progress)


def test_trace_arrivals_start_at_the_first_timestamp_and_stretch_with_the_time_scale() -> None:
    records = [TraceRecord(t, 16, 1, (0,)) for t in (5000, 5000, 6500, 9000)]
    assert arrival_times_s(records, "trace", 1.0) == [0.0, 0.0, 1.5, 4.0]
    assert arrival_times_s(records, "trace", 2.0) == [0.0, 0.0, 3.0, 8.0]
    assert arrival_times_s(records, "asap", 2.0) == [0.0] * 4
    with pytest.raises(ValueError, match="record 1 has timestamp 10 ms, before"):
        arrival_times_s([TraceRecord(20, 16, 1, (0,)), TraceRecord(10, 16, 1, (0,))], "trace", 1.0)


def test_no_request_is_admitted_before_its_arrival() -> None:
    # At zero cost the clock moves only by jumps to the next arrival, so a request the manager holds
    # after a step must have arrived by the clock's reading.
    records = load_trace(EXCERPT)
    released = arrival_times_s(records, "trace", 1.0)
    manager = make_manager(4000)
    clocks = []

    def check(p: ReplayProgress) -> None:
        clocks.append(p.clock_s)
        for request_id in manager.requests:
            assert released[int(request_id.removeprefix("replay-").partition("#")[0])] <= p.clock_s

    free = StepCostModel(prefill_us_per_token=0.0, decode_step_ms=0.0, decode_us_per_row=0.0, kv_bytes_per_token=0)
    result = run(records, manager, check, arrivals="trace", cost_model=free)
    assert result.num_completed == 30
    assert sorted(set(clocks)) == sorted(set(released))  # the clock stopped at every arrival, and only there
    assert result.makespan_s == released[-1]
    assert result.ttft_ms_p99 == 0.0


def test_requests_far_apart_never_overlap_and_wait_one_prefill_for_their_first_token() -> None:
    running = []
    result = run(apart(gap_ms=1_000_000), make_manager(4000), lambda p: running.append(p.num_running),
                 arrivals="trace", cost_model=ROUND)  # fmt: skip
    assert max(running) == 1
    # Each 64-token prompt is one prefill step (64 ms) that samples the first token; 7 decode steps follow.
    assert (result.ttft_ms_p50, result.ttft_ms_p99) == pytest.approx((64.0, 64.0))
    assert result.tpot_ms_p50 == pytest.approx(2.0)
    assert result.makespan_s == pytest.approx(3 * 1000 + 0.064 + 7 * 0.002)


def test_the_time_scale_stretches_the_gaps() -> None:
    records = apart(gap_ms=1_000_000)
    once = run(records, make_manager(4000), arrivals="trace", cost_model=ROUND)
    twice = run(records, make_manager(4000), arrivals="trace", cost_model=ROUND, time_scale=2.0)
    assert twice.makespan_s - once.makespan_s == pytest.approx(3 * 1000)
    assert twice.ttft_ms_p99 == pytest.approx(once.ttft_ms_p99)
    # Squeezed together, they queue behind each other's prefill.
    squeezed = run(records, make_manager(4000), arrivals="trace", cost_model=ROUND, time_scale=1e-9)
    assert squeezed.ttft_ms_p99 > once.ttft_ms_p99
    assert squeezed.makespan_s < once.makespan_s


def test_asap_releases_everything_at_once_and_keeps_the_counts_of_an_offline_replay() -> None:
    records = load_trace(EXCERPT)
    offline = run(records, make_manager(4000), arrivals="asap", cost_model=ROUND)
    timed = run(records, make_manager(4000), arrivals="trace", cost_model=ROUND)
    assert offline.makespan_s < timed.makespan_s  # nobody waits for an arrival
    assert offline.num_prompt_tokens == timed.num_prompt_tokens
    assert offline.num_decode_rows == timed.num_decode_rows


def test_without_preemption_or_hits_every_prompt_token_is_prefilled_once() -> None:
    records = load_trace(EXCERPT)
    result = run(records, make_manager(4000, caching=False), arrivals="trace")
    assert result.num_preemptions == 0 and result.num_prefix_hit_tokens == 0
    assert result.num_prefill_tokens_computed == result.num_prompt_tokens
    # The prefill samples each request's first token; a decode row computes each of the others.
    assert result.num_decode_rows == result.num_output_tokens - result.num_requests


def test_without_preemption_the_hits_are_what_prefill_skipped() -> None:
    result = run(load_trace(EXCERPT), make_manager(4000), arrivals="trace")
    figures = result.figures()
    assert result.num_preemptions == 0 and figures["readmission_hit_tokens"] == 0
    assert 0 < figures["prefix_hit_tokens"] == result.prefix_cache_hits  # each prompt looked up once
    assert figures["prefill_tokens_computed"] == figures["prompt_tokens"] - figures["prefix_hit_tokens"]
    assert figures["device_hit_tokens"] == figures["prefix_hit_tokens"] and figures["host_hit_tokens"] == 0


def test_preemptions_recompute_and_their_hits_are_not_the_workloads() -> None:
    records = load_trace(EXCERPT)
    roomy = run(records, make_manager(4000), token_budget=512, arrivals="asap")
    cramped = run(records, make_manager(400), token_budget=512, arrivals="asap")
    assert roomy.num_preemptions == 0 < cramped.num_preemptions
    # Preempted requests compute their prompt and outputs so far again.
    assert cramped.num_prefill_tokens_computed > cramped.num_prompt_tokens - cramped.num_prefix_hit_tokens
    assert cramped.num_prefill_tokens_computed > roomy.num_prefill_tokens_computed
    # A re-admission's hits are looked up and found by the core, but are counted apart.
    assert cramped.num_readmission_hit_tokens > 0
    assert cramped.prefix_cache_hits == cramped.num_prefix_hit_tokens + cramped.num_readmission_hit_tokens
    assert cramped.num_decode_rows <= cramped.num_output_tokens - cramped.num_requests


def test_host_hits_on_first_admission_are_a_share_of_the_tiers_hits() -> None:
    records = load_trace(EXCERPT)
    result = run(records, make_manager(400, num_host_blocks=4000), token_budget=512, arrivals="asap")
    figures = result.figures()
    assert figures["host_hit_tokens"] > 0 and figures["onloaded_blocks"] > 0 and figures["offloaded_blocks"] > 0
    assert figures["device_hit_tokens"] + figures["host_hit_tokens"] == figures["prefix_hit_tokens"]
    assert figures["host_hit_tokens"] <= result.prefix_cache_host_hits == figures["onloaded_blocks"] * BLOCK_SIZE
    assert figures["prefill_tokens_computed"] >= figures["prompt_tokens"] - figures["prefix_hit_tokens"]


def test_the_host_tiers_copies_take_time_on_the_link() -> None:
    records = load_trace(EXCERPT)
    link_only = StepCostModel(prefill_us_per_token=0.0, decode_step_ms=0.0, decode_us_per_row=0.0,
                              kv_bytes_per_token=1000, hbm_gb_per_s=1e12, link_gb_per_s=1.0)  # fmt: skip
    result = run(records, make_manager(400, num_host_blocks=4000), token_budget=512, arrivals="asap",
                 cost_model=link_only)  # fmt: skip
    copied_tokens = (result.num_offloaded_blocks + result.num_onloaded_blocks) * BLOCK_SIZE
    # Decode rows' reads at 1e12 GB/s are a rounding error next to the copies at 1 GB/s.
    assert result.makespan_s == pytest.approx(copied_tokens * 1000 / 1e9, rel=1e-6)
