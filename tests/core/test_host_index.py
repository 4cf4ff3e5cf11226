"""The host tier's open-addressing hash index, against a dict: same answers, every entry reachable."""

from __future__ import annotations

import hashlib

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kv_manager_service.core.host_index import EMPTY, HostIndex

# Few blocks, so the table (two slots a block) is small and runs of colliding entries are common.
NUM_BLOCKS = 8
HASHES = [hashlib.sha256(bytes([i])).digest() for i in range(24)]


def test_a_hash_of_another_length_is_refused_on_insert_and_never_found() -> None:
    index = HostIndex(4, 1, 32)
    with pytest.raises(ValueError, match="32 bytes, got 16"):
        index.insert(0, 0, HASHES[0][:16])
    index.insert(0, 0, HASHES[0])
    assert index.get(0, HASHES[0][:16]) == EMPTY and index.get(0, HASHES[0]) == 0


def test_the_same_hash_in_two_groups_names_two_blocks() -> None:
    index = HostIndex(4, 2, 32)
    index.insert(3, 1, HASHES[0])
    index.insert(1, 0, HASHES[0])
    assert (index.get(0, HASHES[0]), index.get(1, HASHES[0])) == (1, 3)
    assert list(index.items()) == [(0, HASHES[0], 1), (1, HASHES[0], 3)]  # block id order
    group_ids, hashes, block_ids = index.columns()
    assert (list(group_ids), hashes, list(block_ids)) == ([0, 1], HASHES[0] * 2, [1, 3])


class HostIndexMachine(RuleBasedStateMachine):
    """Random inserts, removals and clears; the model is {(group id, hash): block id}."""

    def __init__(self) -> None:
        super().__init__()
        self.index = HostIndex(NUM_BLOCKS, 2, 32)
        self.model: dict[tuple[int, bytes], int] = {}

    def hashed(self) -> list[int]:
        return sorted(self.model.values())

    @rule(data=st.data(), group_id=st.integers(0, 1), hash_index=st.integers(0, len(HASHES) - 1))
    @precondition(lambda self: len(self.model) < NUM_BLOCKS)
    def insert(self, data: st.DataObject, group_id: int, hash_index: int) -> None:
        key = (group_id, HASHES[hash_index])
        if key in self.model:
            return
        block_id = data.draw(st.sampled_from([b for b in range(NUM_BLOCKS) if b not in self.model.values()]))
        self.index.insert(block_id, *key)
        self.model[key] = block_id

    @rule(data=st.data())
    @precondition(lambda self: self.model)
    def remove(self, data: st.DataObject) -> None:
        block_id = data.draw(st.sampled_from(self.hashed()))
        self.index.remove(block_id)
        self.model = {key: b for key, b in self.model.items() if b != block_id}

    @rule()
    def clear(self) -> None:
        self.index.clear()
        self.model.clear()

    @invariant()
    def agrees_with_the_dict(self) -> None:
        index = self.index
        for group_id in (0, 1):
            for block_hash in HASHES:
                assert index.get(group_id, block_hash) == self.model.get((group_id, block_hash), EMPTY)
        by_block = {b: key for key, b in self.model.items()}
        assert list(index.items()) == [(*by_block[b], b) for b in sorted(by_block)]
        for b in range(NUM_BLOCKS):
            assert index.group_id(b) == (by_block[b][0] if b in by_block else EMPTY)
            assert index.block_hash(b) == (by_block[b][1] if b in by_block else None)
        in_table = [b for b in index.slots() if b != EMPTY]
        assert sorted(in_table) == self.hashed() and len(index) == len(self.model)


TestHostIndexMachine = HostIndexMachine.TestCase
