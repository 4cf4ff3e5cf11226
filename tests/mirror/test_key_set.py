"""The mirror's host key set, against a Python set: adds, discards, clears and reconciliations with a tier's copy."""

from __future__ import annotations

import hashlib

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kv_manager_service.core.host_index import HostIndex, HostKeys
from kv_manager_service.mirror.key_set import HostKeySet

# A small capacity, so that the set fills, frees slots and reuses them.
CAPACITY = 6
KEYS = [(i % 2, hashlib.sha256(bytes([i])).digest()) for i in range(16)]


def copy_of(keys: list[tuple[int, bytes]], capacity: int = CAPACITY) -> HostKeys:
    """What a replica's host tier of `capacity` blocks holding `keys` gives the mirror."""
    index = HostIndex(capacity, 2, 32)
    for block_id, key in enumerate(keys):
        index.insert(block_id, *key)
    group_ids, hashes, _ = index.columns()
    return HostKeys(group_ids, hashes, 32, capacity)


def test_a_full_set_refuses_one_more_key_and_names_its_size() -> None:
    key_set = HostKeySet(2, 32)
    key_set.add(KEYS[0])
    key_set.add(KEYS[1])
    key_set.add(KEYS[1])  # held already: no slot taken
    with pytest.raises(OverflowError, match=r"full \(2 keys"):
        key_set.add(KEYS[2])
    key_set.discard(KEYS[0])
    key_set.add(KEYS[2])  # the freed slot is reused
    assert set(key_set) == {KEYS[1], KEYS[2]}


def test_a_set_fits_only_copies_of_its_own_shape() -> None:
    key_set = HostKeySet.of(copy_of(KEYS[:3]))
    assert key_set.fits(copy_of([])) and not key_set.fits(copy_of([], capacity=CAPACITY + 1))
    assert set(key_set) == set(KEYS[:3])


class HostKeySetMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.key_set = HostKeySet(CAPACITY, 32)
        self.model: set[tuple[int, bytes]] = set()

    @rule(key=st.sampled_from(KEYS))
    def add(self, key: tuple[int, bytes]) -> None:
        if len(self.model) < CAPACITY or key in self.model:
            self.key_set.add(key)
            self.model.add(key)
        else:
            with pytest.raises(OverflowError):
                self.key_set.add(key)

    @rule(key=st.sampled_from(KEYS))
    def discard(self, key: tuple[int, bytes]) -> None:
        self.key_set.discard(key)
        self.model.discard(key)

    @rule()
    def clear(self) -> None:
        self.key_set.clear()
        self.model.clear()

    @rule(keys=st.lists(st.sampled_from(KEYS), unique=True, max_size=CAPACITY))
    def reconcile(self, keys: list[tuple[int, bytes]]) -> None:
        dropped = list(self.key_set.reconcile(copy_of(keys)))
        assert sorted(dropped) == sorted(self.model - set(keys)) and len(set(dropped)) == len(dropped)
        self.model = set(keys)

    @invariant()
    def agrees_with_the_set(self) -> None:
        assert len(self.key_set) == len(self.model)
        assert sorted(self.key_set) == sorted(self.model)
        assert all((key in self.key_set) == (key in self.model) for key in KEYS)


TestHostKeySetMachine = HostKeySetMachine.TestCase
