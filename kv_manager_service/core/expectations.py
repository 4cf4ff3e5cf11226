"""Expected requests: prompts a scheduler has queued but not admitted, told to the manager ahead.

A scheduler knows its waiting queue; the manager does not. An expect op
(`ExpectOp`) gives it a waiting request's prompt: while the request is
expected, every cached block its prompt holds is evicted only after the
blocks no expected request needs (BlockPool's `wanted` band), so the prefix
is still there at admission, and its host-tier copies become the most
recently used. Belady's order read from the queue is what
this approximates (kv_tooling/eviction_oracle.py, "belady-queued").

An expectation ends when the request is admitted (its first allocate with
that id), or withdrawn (a free of that id). Expected and live request ids
never overlap. It is advice: it changes which cached blocks are evicted
first, never what a request hits or is allocated.

The blocks of requests expected earlier are kept longer: a queue admits
them sooner (BlockPool's rank keys).

Room: the expected prompts keep at most `max_blocks` hash blocks in all
(`KVCacheConfig.expected_blocks_room`), which bounds the memory they take.
An expectation past the room keeps the prefix of its prompt that fits,
possibly none; the op's result says how many tokens were kept.
"""

from __future__ import annotations

from typing import Sequence

from kv_manager_service.core.block_pool import BlockPool
from kv_manager_service.core.hashing import BlockHash


class Expectations:
    """request id -> the block hashes of its prompt kept as wanted, in prompt order; oldest first.

    Each expectation has a sequence number, increasing in the order they
    were made: the pool keeps the blocks of earlier ones longer (BlockPool's
    rank keys), as a queue admits them sooner. Invariant: the pool's
    `wanted` holds, for each kept hash, exactly the sequence numbers of the
    expectations that kept it, ascending; `num_blocks` is the number of kept
    hashes, at most `max_blocks`.
    """

    def __init__(self, pool: BlockPool, max_blocks: int) -> None:
        self.pool = pool
        self.max_blocks = max_blocks
        self.by_request: dict[str, tuple[BlockHash, ...]] = {}
        self.seqs: dict[str, int] = {}
        self.next_seq = 0
        self.num_blocks = 0

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.by_request

    def __len__(self) -> int:
        return len(self.by_request)

    def expect(self, request_id: str, block_hashes: Sequence[BlockHash]) -> int:
        """Expect `request_id` (not expected yet) with the prompt of `block_hashes`; returns how many of them
        were kept (its first ones, within the room)."""
        assert request_id not in self.by_request, f"request {request_id!r} is already expected"
        kept = tuple(block_hashes[: max(0, self.max_blocks - self.num_blocks)])
        seq = self.next_seq
        self.next_seq += 1
        self.by_request[request_id] = kept
        self.seqs[request_id] = seq
        self.num_blocks += len(kept)
        self.pool.want(kept, seq)
        return len(kept)

    def end(self, request_id: str) -> None:
        """The expectation of `request_id` ends: it was admitted or withdrawn."""
        kept = self.by_request.pop(request_id)
        self.num_blocks -= len(kept)
        self.pool.unwant(kept, self.seqs.pop(request_id))

    def restore(self, expected: Sequence[tuple[str, tuple[BlockHash, ...]]]) -> None:
        """The expectations of a snapshot (core/state.py), oldest first, into a core that has none. They are
        numbered again from 0: only their order matters."""
        assert not self.by_request and not self.pool.wanted, "expectations are restored once, into an empty core"
        wanted = self.pool.wanted
        for seq, (request_id, kept) in enumerate(expected):
            if request_id in self.by_request:
                raise ValueError(f"the state expects request {request_id!r} twice")
            self.by_request[request_id] = kept
            self.seqs[request_id] = seq
            self.num_blocks += len(kept)
            for block_hash in kept:
                wanted.setdefault(block_hash, []).append(seq)
        self.next_seq = len(expected)
        if self.num_blocks > self.max_blocks:
            raise ValueError(
                f"the state's expected requests hold {self.num_blocks} blocks; this core's room is {self.max_blocks}"
            )
