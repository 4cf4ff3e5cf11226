"""The trace replay with a host tier: hits split by tier, every pin released, the CLI reports both tiers."""

from __future__ import annotations

from pathlib import Path

import pytest

from kv_manager_service.cli.main import main
from kv_tooling.replay import ReplayConfig, ReplayResult, replay
from kv_manager_service.core import GroupKind, GroupSpec, KVCacheConfig, KVCacheManager
from kv_tooling.workload import TokenExpander, load_trace

EXCERPT = Path(__file__).parents[1] / "data" / "mooncake_excerpt.jsonl"
SCALE = 1 / 32  # 16 tokens per trace block: four 4-token KV blocks
BLOCK_SIZE = 4


def run(num_blocks: int, num_host_blocks: int) -> tuple[KVCacheManager, ReplayResult]:
    """Replays the excerpt, checking both tiers' invariants after every step."""
    config = KVCacheConfig(
        num_blocks, groups=(GroupSpec(GroupKind.FULL_ATTENTION, BLOCK_SIZE),), num_host_blocks=num_host_blocks
    )
    manager = KVCacheManager(config)
    replay_config = ReplayConfig(token_budget=256, max_num_running=16, progress_every_steps=1)
    records = load_trace(EXCERPT)
    result = replay(manager, records, TokenExpander(scale=SCALE), replay_config, lambda _: manager.check_invariants())
    return manager, result


def test_a_small_pool_with_a_host_tier_hits_on_both_tiers_and_releases_every_pin() -> None:
    _, alone = run(num_blocks=400, num_host_blocks=0)
    manager, tiered = run(num_blocks=400, num_host_blocks=4000)
    assert tiered.num_completed == tiered.num_requests == 30
    assert tiered.prefix_cache_host_hits > 0 and tiered.num_onloaded_blocks > 0 and tiered.num_offloaded_blocks > 0
    assert tiered.prefix_cache_host_hits == tiered.num_onloaded_blocks * BLOCK_SIZE
    assert tiered.device_hit_rate + tiered.host_hit_rate == pytest.approx(tiered.prefix_hit_rate)
    assert tiered.prefix_cache_hits > alone.prefix_cache_hits
    assert (alone.prefix_cache_host_hits, alone.num_offloaded_blocks) == (0, 0)
    tier = manager.host_tier_stats()
    assert tier.num_pending_tier_copies == 0 and tier.num_free_host_blocks == tier.num_host_blocks


def test_the_replay_command_reports_hits_per_tier(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["replay", "--trace", str(EXCERPT), "--scale", str(SCALE), "--block-size", str(BLOCK_SIZE)]
    assert main([*argv, "--num-blocks", "400", "--num-host-blocks", "4000"]) == 0
    report = capsys.readouterr().out
    for row in ("device hit rate (tokens)", "host hit rate (tokens)", "offloaded blocks", "onloaded blocks"):
        assert row in report
    assert main([*argv, "--num-blocks", "400"]) == 0
    assert "host hit rate" not in capsys.readouterr().out


def test_the_replay_command_refuses_a_negative_host_tier(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["replay", "--trace", str(EXCERPT), "--num-host-blocks", "-1"])
    assert exit_info.value.code == 2
    assert "argument --num-host-blocks: must be >= 0, got -1" in capsys.readouterr().err
