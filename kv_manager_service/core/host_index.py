"""The host tier's hash index: (group id, block hash) -> host block id, in flat arrays."""

from __future__ import annotations

from array import array
from typing import Iterator

from kv_manager_service.core.hashing import BlockHash

EMPTY = -1
"""A table slot that names no block; also the group id of a block with no hash."""


class HostIndex:
    """Each host block's hash and group, and an open-addressing table from (group, hash) to block id.

    Per block: its hash in one bytearray (`hash_num_bytes` each, 32 for
    sha256), its group id in an int16 array (EMPTY: the block has no hash)
    and its home slot (int32, so that a removal never rehashes). The table
    has two int32 slots per block, so it is at most half full; a slot holds
    EMPTY or the id of a hashed block. With sha256 that is 32 + 2 + 4 + 8 =
    46 bytes per block, against about 150 for a dict entry with its bytes
    key and a block object.

    Linear probing from the home slot `hash(block_hash) % num_slots`:
    Python's hash of the bytes, as a dict would use, so a prompt crafted to
    collide cannot build long probe runs (it is salted per process; the
    layout is never observable, exports go in block id order). A removal
    shifts the rest of its run back instead of leaving a tombstone, so the
    table never needs rebuilding however many hashes come and go.

    Invariants (checked by `core.invariants`): a block whose group id is not
    EMPTY is in exactly one slot, reachable from its home slot without
    crossing an EMPTY slot; no other block is in the table; a key names at
    most one block.
    """

    def __init__(self, num_blocks: int, num_groups: int, hash_num_bytes: int) -> None:
        if not 0 < num_groups < 2**15:
            raise ValueError(f"a host index holds 1 to 2**15 - 1 groups, got {num_groups}")
        if not 0 < num_blocks < 2**30:  # its slots, two a block, are numbered in int32
            raise ValueError(f"a host index holds 1 to 2**30 - 1 blocks, got {num_blocks}")
        self.num_blocks = num_blocks
        self.num_groups = num_groups
        self.hash_num_bytes = hash_num_bytes
        self.num_slots = 2 * num_blocks
        self._hashes = bytearray(hash_num_bytes * num_blocks)
        self._homes = array("i", bytes(4 * num_blocks))  # a hashed block's home slot
        self.clear()

    def __len__(self) -> int:
        return self._num_entries

    def get(self, group_id: int, block_hash: BlockHash) -> int:
        """The block that holds `block_hash` in group `group_id`, or EMPTY."""
        table, homes, hashes, w = self._table, self._homes, self._hashes, self.hash_num_bytes
        if len(block_hash) != w:
            return EMPTY
        num_slots = self.num_slots
        slot = home = hash(block_hash) % num_slots
        while (block_id := table[slot]) != EMPTY:
            # Blocks of the run with another home hold other hashes: skipped without reading them.
            # startswith at an offset compares in place: no slice is copied out.
            if (
                homes[block_id] == home
                and hashes.startswith(block_hash, block_id * w)
                and self._group_ids[block_id] == group_id
            ):
                return block_id
            slot += 1
            if slot == num_slots:
                slot = 0
        return EMPTY

    def group_id(self, block_id: int) -> int:
        """The group whose hash `block_id` holds; EMPTY when it holds none."""
        return self._group_ids[block_id]

    def block_hash(self, block_id: int) -> BlockHash | None:
        """The hash `block_id` holds, or None."""
        if self._group_ids[block_id] == EMPTY:
            return None
        w = self.hash_num_bytes
        return BlockHash(bytes(self._hashes[block_id * w : block_id * w + w]))

    def insert(self, block_id: int, group_id: int, block_hash: BlockHash) -> None:
        """Index the unhashed `block_id` under a key no block holds."""
        assert self._group_ids[block_id] == EMPTY, f"host block {block_id} is indexed already"
        w = self.hash_num_bytes
        if len(block_hash) != w:
            raise ValueError(f"a host block hash has {w} bytes, got {len(block_hash)}")
        self._hashes[block_id * w : block_id * w + w] = block_hash
        self._group_ids[block_id] = group_id
        table, num_slots = self._table, self.num_slots
        slot = self._homes[block_id] = hash(block_hash) % num_slots
        while table[slot] != EMPTY:
            slot += 1
            if slot == num_slots:
                slot = 0
        table[slot] = block_id
        self._num_entries += 1

    def remove(self, block_id: int) -> None:
        """Take the hashed `block_id` out of the index; it holds no hash after."""
        table, homes, num_slots = self._table, self._homes, self.num_slots
        slot = homes[block_id]
        while table[slot] != block_id:
            slot += 1
            if slot == num_slots:
                slot = 0
        # Shift back every later entry of the run that may move to the hole:
        # one whose home slot is not cyclically in (hole, its slot].
        hole = slot
        while True:
            slot = slot + 1 if slot + 1 < num_slots else 0
            moved = table[slot]
            if moved == EMPTY:
                break
            home = homes[moved]
            if (home <= hole or home > slot) if hole <= slot else (home <= hole and home > slot):
                table[hole] = moved
                hole = slot
        table[hole] = EMPTY
        self._group_ids[block_id] = EMPTY
        self._num_entries -= 1

    def clear(self) -> None:
        """Forget every hash."""
        self._group_ids = array("h", [EMPTY]) * self.num_blocks
        self._table = array("i", [EMPTY]) * self.num_slots
        self._num_entries = 0

    def items(self) -> Iterator[tuple[int, BlockHash, int]]:
        """(group id, block hash, block id) of every hashed block, in block id order; nothing is copied ahead."""
        hashes, w = self._hashes, self.hash_num_bytes
        for block_id, group_id in enumerate(self._group_ids):
            if group_id != EMPTY:
                yield group_id, BlockHash(bytes(hashes[block_id * w : block_id * w + w])), block_id

    def columns(self) -> tuple[array, bytes, array]:
        """A copy of every entry in block id order, as three columns: group ids (int16), the hashes
        end to end, block ids (int32). 2 + hash_num_bytes + 4 bytes per entry, no object per entry."""
        group_ids, hashes, w = self._group_ids, self._hashes, self.hash_num_bytes
        if self._num_entries == self.num_blocks:  # every block hashed, a full tier's steady state: copied whole
            return array("h", group_ids), bytes(hashes), array("i", range(self.num_blocks))
        block_ids = array("i", [block_id for block_id, group_id in enumerate(group_ids) if group_id != EMPTY])
        packed = bytearray()
        for block_id in block_ids:
            packed += hashes[block_id * w : block_id * w + w]
        return array("h", [group_ids[block_id] for block_id in block_ids]), bytes(packed), block_ids

    def slots(self) -> array:
        """The table itself (EMPTY or a block id per slot): for integrity checks."""
        return self._table

    @property
    def nbytes(self) -> int:
        """Bytes held by the hashes, the group ids and the table."""
        return len(self._hashes) + len(self._group_ids) * 2 + (len(self._homes) + len(self._table)) * 4



class HostKeys:
    """A copy of a host index's keys: iterable as (group id, block hash), in block id order.

    2 + hash_num_bytes bytes per key (34 with sha256) where a set of tuples
    costs about 200; later changes to the index do not show in it, so it is
    taken under the replica's lock and read after. `capacity`: the index's
    number of blocks, the most keys it can hold.
    """

    __slots__ = ("group_ids", "hashes", "hash_num_bytes", "capacity")

    def __init__(self, group_ids: array, hashes: bytes, hash_num_bytes: int, capacity: int) -> None:
        assert len(hashes) == len(group_ids) * hash_num_bytes <= capacity * hash_num_bytes
        self.group_ids = group_ids
        self.hashes = hashes
        self.hash_num_bytes = hash_num_bytes
        self.capacity = capacity

    def __len__(self) -> int:
        return len(self.group_ids)

    def __getitem__(self, position: int) -> tuple[int, BlockHash]:
        w = self.hash_num_bytes
        return self.group_ids[position], BlockHash(self.hashes[position * w : position * w + w])

    def __iter__(self) -> Iterator[tuple[int, BlockHash]]:
        hashes, w = self.hashes, self.hash_num_bytes
        for i, group_id in enumerate(self.group_ids):
            yield group_id, BlockHash(hashes[i * w : i * w + w])
