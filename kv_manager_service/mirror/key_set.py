"""The host tier's keys as the mirror published them: a set of (group id, block hash) in flat arrays.

The host tier can hold tens of millions of blocks. A Python set of
(group, hash) tuples costs about 200 bytes a key; this set costs the host
index's 46 bytes a slot (sha256) plus 4 for a free slot id, whatever it
holds, and its reconciliation with a new copy of the tier's keys adds one
byte a slot and four per new key (`reconcile`).
"""

from __future__ import annotations

from array import array
from typing import Iterator

from kv_manager_service.core.host_index import EMPTY, HostIndex, HostKeys
from kv_manager_service.mirror.schema import BlockKey

MAX_GROUPS = 2**15 - 1
"""The host index's limit on group ids; the set holds whatever group the events name below it."""


class HostKeySet:
    """At most `capacity` keys: a HostIndex whose block ids are slots handed out by the set.

    Slots below `_next_unused` that hold no key are on the `_free` stack, so
    an empty set costs no loop over its capacity.
    """

    def __init__(self, capacity: int, hash_num_bytes: int) -> None:
        self.capacity = capacity
        self.hash_num_bytes = hash_num_bytes
        self._index = HostIndex(capacity, MAX_GROUPS, hash_num_bytes)
        self._free = array("i")
        self._next_unused = 0

    @classmethod
    def of(cls, keys: HostKeys) -> HostKeySet:
        """A set of `keys`, sized as the index they were copied from."""
        key_set = cls(keys.capacity, keys.hash_num_bytes)
        for key in keys:
            key_set.add(key)
        return key_set

    def fits(self, keys: HostKeys) -> bool:
        """Whether `keys` come from an index of this set's capacity and hash width."""
        return keys.capacity == self.capacity and keys.hash_num_bytes == self.hash_num_bytes

    def __len__(self) -> int:
        return len(self._index)

    @property
    def nbytes(self) -> int:
        """Bytes held by its arrays: the index's, and the free slots'."""
        return self._index.nbytes + len(self._free) * self._free.itemsize

    def __contains__(self, key: BlockKey) -> bool:
        return self._index.get(*key) != EMPTY

    def __iter__(self) -> Iterator[BlockKey]:
        for group_id, block_hash, _ in self._index.items():
            yield group_id, block_hash

    def add(self, key: BlockKey) -> None:
        """Hold `key`. OverflowError when the set is full: the tier it follows never holds more."""
        if self._index.get(*key) == EMPTY:
            self._index.insert(self._take_slot(), *key)

    def _take_slot(self) -> int:
        if self._free:
            return self._free.pop()
        if self._next_unused == self.capacity:
            raise OverflowError(f"the mirror's host key set is full ({self.capacity} keys, the host tier's size)")
        self._next_unused += 1
        return self._next_unused - 1

    def discard(self, key: BlockKey) -> None:
        slot = self._index.get(*key)
        if slot != EMPTY:
            self._index.remove(slot)
            self._free.append(slot)

    def clear(self) -> None:
        self._index.clear()
        self._free = array("i")
        self._next_unused = 0

    def reconcile(self, keys: HostKeys) -> Iterator[BlockKey]:
        """Make the set hold exactly `keys` (which `fits` it), yielding each key it drops, as it drops it:
        read it to the end.

        Three passes: mark the slots whose key `keys` holds and note the
        position of each key it lacks; drop the unmarked keys; add the noted
        ones. The set never holds more than either side, so it never
        overflows.
        """
        assert self.fits(keys), "a host key set reconciles with copies of an index of its own shape"
        index = self._index
        kept = bytearray(self._next_unused)
        missing = array("i")
        for position, key in enumerate(keys):
            slot = index.get(*key)
            if slot == EMPTY:
                missing.append(position)
            else:
                kept[slot] = 1
        slot = kept.find(0)  # the unmarked slots, found in C: a resync keeps most keys
        while slot != -1:
            group_id = index.group_id(slot)
            if group_id != EMPTY:
                key = group_id, index.block_hash(slot)
                index.remove(slot)
                self._free.append(slot)
                yield key
            slot = kept.find(0, slot + 1)
        for position in missing:
            index.insert(self._take_slot(), *keys[position])
