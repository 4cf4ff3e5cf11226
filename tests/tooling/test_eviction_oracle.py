"""The replay's reference eviction orders (kv_tooling/eviction_oracle.py): Belady's next use, and the same from the
queue; and `kv-manager replay --eviction-policy` choosing them or an online policy."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kv_manager_service.cli.main import main
from kv_manager_service.core import GroupKind, GroupSpec, KVCacheConfig, KVCacheManager
from kv_manager_service.core.block_queue import KVCacheBlock
from kv_tooling.eviction_oracle import NextUseOracle
from kv_tooling.replay import ReplayConfig, ReplayResult, arrival_times_s, replay
from kv_tooling.workload import DEFAULT_TRACE, TokenExpander, TraceRecord

SCALE = 1 / 32  # 16 tokens per trace block: four 4-token KV blocks
BLOCK_SIZE = 4


def cycle(gap_ms: int, rounds: int = 3) -> list[TraceRecord]:
    """Three prompts of 4 trace blocks sharing nothing, X Y Z X Y Z ...: LRU's worst case in a pool that holds two."""
    return [
        TraceRecord(i * gap_ms, 2048, 16, tuple(range(100 * (i % 3), 100 * (i % 3) + 4))) for i in range(3 * rounds)
    ]


def run(records: list[TraceRecord], order: str | None, arrivals: str = "trace") -> ReplayResult:
    """A pool of 40 blocks (a prompt takes 16, and 1 more as it decodes), one request at a time under "trace"."""
    config = KVCacheConfig(40, groups=(GroupSpec(GroupKind.FULL_ATTENTION, BLOCK_SIZE),))
    manager = KVCacheManager(config)
    expander = TokenExpander(scale=SCALE)
    oracle = None
    if order is not None:
        released = arrival_times_s(records, arrivals, 1.0) if order == "belady-queued" else None
        oracle = NextUseOracle(records, expander, manager.hasher, released)
        manager.pool.set_ranker(oracle.key)
    result = replay(manager, records, expander, ReplayConfig(token_budget=256, arrivals=arrivals), oracle=oracle)
    manager.check_invariants()
    return result


def test_next_use_skips_admitted_requests_and_the_queued_order_sees_only_arrivals():
    records = [TraceRecord(0, 32, 1, (1, 2)), TraceRecord(1000, 16, 1, (7,)), TraceRecord(2000, 32, 1, (1, 2))]
    expander = TokenExpander(scale=SCALE)
    config = KVCacheConfig(40, groups=(GroupSpec(GroupKind.FULL_ATTENTION, BLOCK_SIZE),))
    hasher = KVCacheManager(config).hasher
    first = hasher.hash_blocks(hasher.root_hash, expander.prompt_token_ids(records[0]))
    oracle = NextUseOracle(records, expander, hasher)
    assert oracle.next_use(first[0]) == 0 and oracle.next_use(b"\x00" * 32) is None
    oracle.admitted(0)
    assert oracle.next_use(first[-1]) == 2
    queued = NextUseOracle(records, expander, hasher, arrival_times_s(records, "trace", 1.0))
    queued.admitted(0)
    block = manager_block(first[0])
    assert queued.key(block) == 0  # request 2 has not arrived: no key
    queued.advance(2.0)
    assert queued.key(block) == len(records) - 2


def manager_block(block_hash: bytes) -> KVCacheBlock:
    """A cached block holding `block_hash`, as the pool would key it."""
    block = KVCacheBlock(1)
    block.block_hash = block_hash
    return block


def test_belady_beats_lru_on_a_cycle_larger_than_the_pool_and_the_queue_sees_it_only_when_requests_wait():
    apart, together = cycle(gap_ms=60_000), cycle(gap_ms=0)
    lru, belady = run(apart, None), run(apart, "belady")
    assert belady.num_prefix_hit_tokens > lru.num_prefix_hit_tokens  # LRU evicts each prompt before it returns
    assert belady.num_prefill_tokens_computed < lru.num_prefill_tokens_computed
    # Far apart, nothing waits, so the queue knows nothing; all at once, it knows what Belady knows.
    assert run(apart, "belady-queued").num_prefill_tokens_computed == lru.num_prefill_tokens_computed
    assert (
        run(together, "belady-queued", "asap").num_prefill_tokens_computed
        == run(together, "belady", "asap").num_prefill_tokens_computed
    )


@pytest.mark.parametrize("order", ["frequency", "belady", "belady-queued"])
def test_the_replay_command_takes_each_order_and_names_it_in_the_report(tmp_path: Path, order: str) -> None:
    path = tmp_path / "replay.json"
    args = ["replay", "--trace", str(DEFAULT_TRACE), "--requests", "6", "--scale", "0.03125", "--num-blocks", "300"]
    assert main([*args, "--eviction-policy", order, "--report-json", str(path)]) == 0
    report = json.loads(path.read_text())
    assert report["eviction_policy"] == order and report["num_completed"] == 6


def test_serve_refuses_a_reference_order(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--port", "0", "--eviction-policy", "belady"])
    assert exit_info.value.code == 2
    assert "--eviction-policy" in capsys.readouterr().err
