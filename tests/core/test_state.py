"""Export and restore of the core's state: a restored core is indistinguishable from the original.

A random history runs on one core; its state is exported and restored into a
fresh core; then the same random ops run on both, and every result, error,
event, and the whole state (free-queue order, cache map order, tables, copies,
counters; with a host tier its free queue, index, pinned copies and counters
too) must agree after each op, with both cores' invariants holding.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kv_manager_service.core import (
    AllocateOp,
    ForkOp,
    FreeOp,
    GroupKind,
    GroupSpec,
    KVCacheConfig,
    KVCacheError,
    KVCacheManager,
    LoraRef,
    MMFeature,
)

CONFIGS = (
    KVCacheConfig(num_blocks=12, groups=(GroupSpec(GroupKind.FULL_ATTENTION, 4),), enable_events=True),
    KVCacheConfig(
        num_blocks=20,
        groups=(
            GroupSpec(GroupKind.FULL_ATTENTION, 4),
            GroupSpec(GroupKind.SLIDING_WINDOW, 2, sliding_window=5),
            GroupSpec(GroupKind.MAMBA, 4),
        ),
        enable_events=True,
        max_model_len=48,
    ),
    KVCacheConfig(
        num_blocks=16,
        groups=(GroupSpec(GroupKind.CHUNKED_LOCAL, 2, chunk_size=4), GroupSpec(GroupKind.CROSS_ATTENTION, 4)),
        enable_events=True,
    ),
    KVCacheConfig(num_blocks=10, enable_prefix_caching=False, enable_events=True),
    # A host tier smaller than the device pool: offloads, host hits, host evictions and dropped offloads.
    KVCacheConfig(
        num_blocks=8, groups=(GroupSpec(GroupKind.FULL_ATTENTION, 4),), enable_events=True, num_host_blocks=5
    ),
    KVCacheConfig(
        num_blocks=14,
        groups=(GroupSpec(GroupKind.FULL_ATTENTION, 2), GroupSpec(GroupKind.FULL_ATTENTION, 4)),
        enable_events=True,
        num_host_blocks=9,
    ),
    # The frequency order: its segment keys and its history are state.
    KVCacheConfig(
        num_blocks=10, groups=(GroupSpec(GroupKind.FULL_ATTENTION, 2),), enable_events=True, eviction_policy="frequency"
    ),
)
HOST_TIER_CONFIG = CONFIGS[4]
PREFIX = (1, 2, 3, 0, 2, 2, 1, 3, 0, 0, 1, 2, 3, 3, 2, 1)  # prompts share it, so hits and evictions are common
# Prefixes (PREFIX rotated) that take turns in a small pool: with a host tier, evicted prefixes come
# back as host hits (onloads), and the host evicts too.
PREFIXES = tuple(PREFIX[i:] + PREFIX[:i] for i in (0, 4, 8, 12))


@st.composite
def ops(draw: st.DrawFn, live: list[str], last_step_id: int, next_id: Callable[[], str]) -> Any:
    """One call: (name, argument) on the live requests `live`; sometimes an invalid one."""
    kinds = ["admit", "admit", "step"] + (["decode", "decode", "free", "fork"] if live else []) + ["ack", "reset"]
    kind = draw(st.sampled_from(kinds))
    tokens = st.lists(st.integers(0, 3), max_size=6)
    if kind == "admit":
        prompt = list(PREFIX[: draw(st.integers(0, len(PREFIX)))]) + draw(tokens) or [0]
        return kind, AllocateOp(
            next_id(),
            prompt,
            draw(st.integers(1, len(prompt) + 1)),
            draw(st.sampled_from([0, 0, 2])),
            draw(st.integers(0, 6)),
            draw(st.sampled_from([None, None, "salt"])),
            draw(st.sampled_from([None, None, LoraRef("a", "/a")])),
            draw(st.sampled_from([(), (), (MMFeature("img", 0, 1),)])),
            draw(st.booleans()),
        )
    if kind == "decode":
        request_id = draw(st.sampled_from(live + ["unknown"]))
        return kind, AllocateOp(request_id, draw(tokens), draw(st.integers(0, 4)), draw(st.sampled_from([0, 1])))
    if kind == "free":
        return kind, FreeOp(draw(st.lists(st.sampled_from(live), min_size=1, max_size=2, unique=True)))
    if kind == "fork":
        return kind, ForkOp(draw(st.sampled_from(live)), [next_id() for _ in range(draw(st.integers(1, 2)))])
    if kind == "step":
        return kind, [draw(ops(live, last_step_id, next_id))[1] for _ in range(draw(st.integers(0, 3)))]
    if kind == "ack":
        return kind, draw(st.integers(0, last_step_id + 1))
    return kind, None


@st.composite
def tier_ops(draw: st.DrawFn, live: list[str], last_step_id: int, next_id: Callable[[], str]) -> Any:
    """One call that moves blocks between the tiers: whole prompts of PREFIXES taking turns, frees,
    decodes, acks (rarer, so copies stay pinned), and now and then any call of `ops`."""
    kinds = ["admit", "admit"] + (["free", "free", "decode"] if live else []) + ["ack", "other"]
    kind = draw(st.sampled_from(kinds))
    if kind == "admit":
        prompt = list(draw(st.sampled_from(PREFIXES))[: draw(st.integers(4, len(PREFIX)))]) + [draw(st.integers(0, 3))]
        return kind, AllocateOp(next_id(), prompt, len(prompt))
    if kind == "free":
        return kind, FreeOp(draw(st.lists(st.sampled_from(live), min_size=1, max_size=2, unique=True)))
    if kind == "decode":
        return kind, AllocateOp(draw(st.sampled_from(live)), [draw(st.integers(0, 3))], 1)
    if kind == "ack":
        return kind, draw(st.integers(0, last_step_id))
    return draw(ops(live, last_step_id, next_id))


def call(manager: KVCacheManager, kind: str, argument: Any) -> Any:
    """Run one call; its result, or the error it raised, and the events it queued."""
    try:
        if kind == "ack":
            result = manager.ack(argument)
        elif kind == "reset":
            result = manager.reset_prefix_cache()
        elif kind == "step":
            result = manager.step([op for op in argument if not isinstance(op, list)])
        else:
            result = manager.step((argument,))
    except KVCacheError as error:
        result = (type(error), str(error))
    manager.check_invariants()
    return result, manager.take_events()


def observable(manager: KVCacheManager) -> dict[str, Any]:
    return {
        "state": manager.export_state(),
        "stats": manager.stats(),
        "tables": [manager.block_table(r) for r in manager.request_ids()],
        "ref_cnts": [b.ref_cnt for b in manager.pool.blocks[1:]],  # the null block's is not maintained
        "pending_copies": manager.pending_copies(),
        "pending_tier_copies": manager.pending_tier_copies(),
        "host_tier_stats": manager.host_tier_stats(),
        "host_ref_cnts": manager.host_tier.ref_cnts.tolist() if manager.host_tier is not None else None,
    }


def check_restore_behaves_as_the_original(config: KVCacheConfig, data: st.DataObject, op_strategy, history: int) -> None:
    """Up to `history` ops drawn from `op_strategy`, export, restore; then both answer every later op alike."""
    counter = iter(range(1 << 30))

    def next_id() -> str:
        return f"r{next(counter)}"

    original = KVCacheManager(config)
    for _ in range(data.draw(st.integers(0, history), label="history")):
        kind, argument = data.draw(op_strategy(original.request_ids(), original.last_step_id, next_id))
        call(original, kind, argument)

    restored = KVCacheManager.from_state(config, original.export_state())
    assert observable(restored) == observable(original)
    for _ in range(data.draw(st.integers(1, 20), label="after")):
        kind, argument = data.draw(op_strategy(original.request_ids(), original.last_step_id, next_id))
        assert call(restored, kind, argument) == call(original, kind, argument), (kind, argument)
        assert observable(restored) == observable(original)


@settings(deadline=None, suppress_health_check=(HealthCheck.too_slow,))
@given(config=st.sampled_from(CONFIGS), data=st.data())
def test_a_restored_core_behaves_exactly_as_the_original(config: KVCacheConfig, data: st.DataObject) -> None:
    check_restore_behaves_as_the_original(config, data, ops, history=30)


@settings(deadline=None, suppress_health_check=(HealthCheck.too_slow,))
@given(config=st.sampled_from(CONFIGS[4:6]), data=st.data())
def test_a_restored_host_tier_behaves_exactly_as_the_original(config: KVCacheConfig, data: st.DataObject) -> None:
    """As above, with histories that offload, onload, evict host blocks and keep copies pinned."""
    check_restore_behaves_as_the_original(config, data, tier_ops, history=40)


def test_a_state_whose_parts_disagree_is_refused() -> None:
    config = CONFIGS[0]
    manager = KVCacheManager(config)
    manager.allocate("a", list(PREFIX), len(PREFIX))
    manager.take_events()
    state = manager.export_state()
    held = state.requests[0].block_ids[0][0]
    with pytest.raises(ValueError, match="inconsistent"):  # a block both held and free
        KVCacheManager.from_state(config, dataclasses.replace(state, free_block_ids=state.free_block_ids + (held,)))
    with pytest.raises(ValueError, match="outside the pool"):
        KVCacheManager.from_state(config, dataclasses.replace(state, pending_copies=((1, held, 99),)))
    with pytest.raises(AssertionError, match="drain"):
        manager.allocate("b", list(PREFIX[:8]), 8)  # a cache event, not drained
        manager.export_state()


def test_a_host_tier_state_whose_parts_disagree_is_refused() -> None:
    config = HOST_TIER_CONFIG
    manager = KVCacheManager(config)
    manager.allocate("a", list(PREFIX), len(PREFIX))
    manager.free(["a"])
    manager.allocate("b", list(range(100, 128)), 28)  # evicts a's blocks: offloaded, pinned
    manager.take_events()
    state = manager.export_state()
    tier = state.host_tier
    assert tier is not None and tier.pending and tier.cached_host_block_ids
    pinned = tier.pending[0][3]
    with pytest.raises(ValueError, match="inconsistent"):  # a pinned host block also free
        KVCacheManager.from_state(
            config, dataclasses.replace(state, host_tier=dataclasses.replace(tier, free_host_block_ids=(pinned,)))
        )
    with pytest.raises(ValueError, match="outside the host tier"):
        KVCacheManager.from_state(
            config, dataclasses.replace(state, host_tier=dataclasses.replace(tier, free_host_block_ids=(99,)))
        )
    with pytest.raises(ValueError, match="has no host tier"):
        KVCacheManager.from_state(config, dataclasses.replace(state, host_tier=None))
    with pytest.raises(ValueError, match="has host tier"):
        KVCacheManager.from_state(CONFIGS[0], dataclasses.replace(state, free_block_ids=(), cached=(), requests=()))
