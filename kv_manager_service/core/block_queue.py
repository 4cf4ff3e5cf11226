"""KV-cache blocks and the intrusive free queue that orders their reuse."""

from __future__ import annotations

from typing import Iterable, Iterator

from kv_manager_service.core.hashing import BlockHash


class KVCacheBlock:
    """One physical block of KV memory.

    `ref_cnt` counts the table slots that point at the block plus the pending
    copies that retain it. `block_hash` is set while the block is in the
    prefix cache of group `group_id`; a free block keeps its hash (lazy
    eviction) until it is popped for reuse.
    """

    __slots__ = ("block_id", "ref_cnt", "block_hash", "group_id", "prev_free", "next_free", "is_null")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None
        self.group_id = -1
        # Links of the free queue; both None while the block is in use.
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None
        self.is_null = False

    def __repr__(self) -> str:
        cached = self.block_hash.hex()[:8] if self.block_hash is not None else None
        return f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt}, hash={cached})"


class FreeBlockQueue:
    """Doubly linked list of free blocks, threaded through the blocks themselves.

    Every operation is O(1) per block and allocates nothing: the links live in
    the blocks, and two sentinels remove the head/tail special cases. The head
    is reused first. A block is in the queue iff both its links are set.
    """

    def __init__(self, blocks: Iterable[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free_blocks = 0
        self.append_n(list(blocks))

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free
        if block is self._tail:
            raise ValueError("no free blocks left")
        self._unlink(block)
        return block

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        if n > self.num_free_blocks:
            raise ValueError(f"asked for {n} free blocks, only {self.num_free_blocks} left")
        blocks = []
        block = self._head.next_free
        for _ in range(n):
            blocks.append(block)
            following = block.next_free
            block.prev_free = block.next_free = None
            block = following
        self._head.next_free = block
        block.prev_free = self._head
        self.num_free_blocks -= n
        return blocks

    def remove(self, block: KVCacheBlock) -> None:
        """Take `block` out of the middle of the queue."""
        if block.prev_free is None or block.next_free is None:
            raise ValueError(f"block {block.block_id} is not in the free queue")
        self._unlink(block)

    def append_n(self, blocks: list[KVCacheBlock]) -> None:
        """Put `blocks`, in order, at the tail (reused last)."""
        self._insert_after(self._tail.prev_free, blocks)

    def prepend_n(self, blocks: list[KVCacheBlock]) -> None:
        """Put `blocks`, in order, at the head (reused first)."""
        self._insert_after(self._head, blocks)

    def insert_before(self, anchor: KVCacheBlock, blocks: list[KVCacheBlock]) -> None:
        """Put `blocks`, in order, right before `anchor`, a block in the queue."""
        self._insert_after(anchor.prev_free, blocks)

    def first(self) -> KVCacheBlock | None:
        """The head (reused first), or None when the queue is empty."""
        block = self._head.next_free
        return None if block is self._tail else block

    def __iter__(self) -> Iterator[KVCacheBlock]:
        block = self._head.next_free
        while block is not self._tail:
            yield block
            block = block.next_free

    def _unlink(self, block: KVCacheBlock) -> None:
        block.prev_free.next_free = block.next_free
        block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def _insert_after(self, anchor: KVCacheBlock, blocks: list[KVCacheBlock]) -> None:
        if not blocks:
            return
        after = anchor.next_free
        previous = anchor
        for block in blocks:
            block.prev_free = previous
            previous.next_free = block
            previous = block
        previous.next_free = after
        after.prev_free = previous
        self.num_free_blocks += len(blocks)
