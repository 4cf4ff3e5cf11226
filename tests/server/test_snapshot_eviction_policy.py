"""A snapshot of a core under the frequency eviction order carries its segment keys and its history."""

from __future__ import annotations

from kv_manager_service.core import GroupKind, GroupSpec, KVCacheConfig, KVCacheManager
from kv_manager_service.server.snapshot import core_from_proto, core_to_proto
from kvcache.journal.v1 import journal_pb2 as jpb

CONFIG = KVCacheConfig(num_blocks=10, groups=(GroupSpec(GroupKind.FULL_ATTENTION, 2),), eviction_policy="frequency")


def traffic(m: KVCacheManager, rounds: range) -> list:
    """Prompts that share prefixes and come back, in a pool too small for them: evictions by frequency."""
    results = []
    for i in rounds:
        tokens = [i % 3, 1, i % 2, 5, i % 5, 7, 8]
        results.append(m.allocate(f"r{i}", tokens, len(tokens)))
        if results[-1].status.name == "OK":
            m.free([f"r{i}"])
    return results


def test_a_frequency_core_survives_the_snapshot_and_behaves_the_same_after_it():
    m = KVCacheManager(CONFIG)
    traffic(m, range(12))
    state = m.export_state()
    assert state.seen and state.frequency_classes, "the traffic left a history and free blocks seen more than once"
    wire_bytes = core_to_proto(state).SerializeToString()
    restored = core_from_proto(jpb.CoreSnapshot.FromString(wire_bytes))
    assert restored == state
    twin = KVCacheManager.from_state(CONFIG, restored)
    assert traffic(twin, range(12, 30)) == traffic(m, range(12, 30))
    assert twin.export_state() == m.export_state()
