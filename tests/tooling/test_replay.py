"""The trace replay loop: every request completes, the cache hits, nothing leaks."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from kv_manager_service.core import GroupKind, GroupSpec, KVCacheConfig, KVCacheManager
from kv_tooling.replay import ReplayConfig, ReplayProgress, ReplayResult, replay
from kv_tooling.workload import TokenExpander, load_trace

EXCERPT = Path(__file__).parents[1] / "data" / "mooncake_excerpt.jsonl"
SCALE = 1 / 32  # 16 tokens per trace block: four 4-token KV blocks
BLOCK_SIZE = 4


def make_manager(num_blocks: int) -> KVCacheManager:
    return KVCacheManager(KVCacheConfig(num_blocks, groups=(GroupSpec(GroupKind.FULL_ATTENTION, BLOCK_SIZE),)))


def run(num_blocks: int, token_budget: int = 256) -> tuple[KVCacheManager, ReplayResult]:
    """Replays the excerpt, checking the manager's invariants after every step."""
    manager = make_manager(num_blocks)
    steps: list[ReplayProgress] = []

    def check(progress: ReplayProgress) -> None:
        manager.check_invariants()
        steps.append(progress)

    config = ReplayConfig(token_budget=token_budget, max_num_running=16, progress_every_steps=1)
    result = replay(manager, load_trace(EXCERPT), TokenExpander(scale=SCALE), config, check)
    assert len(steps) == result.num_steps
    return manager, result


def assert_clean(manager: KVCacheManager, result: ReplayResult) -> None:
    manager.check_invariants()
    stats = manager.stats()
    assert result.num_completed == result.num_requests == 30
    assert stats.num_requests == 0
    assert stats.usage == 0.0
    assert stats.num_pending_copies == 0


def test_replay_on_a_large_pool_completes_and_hits_the_prefix_cache() -> None:
    manager, result = run(num_blocks=4000)
    assert_clean(manager, result)
    assert result.num_preemptions == 0
    expander = TokenExpander(scale=SCALE)
    records = load_trace(EXCERPT)
    assert result.num_prompt_tokens == sum(expander.prompt_length(r) for r in records)
    assert result.num_output_tokens == sum(expander.output_length(r) for r in records)
    assert result.prefix_cache_queries == result.num_prompt_tokens  # each prompt looked up once
    # Lines 16 and 75 of the trace share their whole 2752-token prompt, and more share a part.
    assert 0 < result.prefix_cache_hits < result.prefix_cache_queries
    assert result.prefix_hit_rate == result.prefix_cache_hits / result.prefix_cache_queries
    assert 0 < result.peak_usage < 1


def test_replay_on_a_small_pool_preempts_and_still_completes() -> None:
    # The largest prompt needs 287 blocks, all prompts together about 2,800.
    manager, result = run(num_blocks=400, token_budget=512)
    assert_clean(manager, result)
    assert result.num_preemptions > 0
    assert result.prefix_cache_queries > result.num_prompt_tokens  # readmissions look up again
    assert result.peak_usage == 1.0


def test_replay_is_deterministic() -> None:
    _, first = run(num_blocks=400, token_budget=512)
    _, second = run(num_blocks=400, token_budget=512)
    ignore = {"wall_s": 0.0, "requests_per_s": 0.0}
    assert dataclasses.replace(first, **ignore) == dataclasses.replace(second, **ignore)


def test_a_request_larger_than_the_pool_is_refused() -> None:
    with pytest.raises(ValueError, match="does not fit in the pool even alone"):
        run(num_blocks=200, token_budget=64)
