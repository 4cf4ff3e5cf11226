"""What this worker's KV memory really holds, block by block: the guard in front of every read.

The manager counts a block as cached once a step allocates it; this worker
may not hold it (it started after that step, or refused it, or the step was
never executed here). `KVPresence` follows the same deltas as the block
tables and the compute, and knows, for every device block `b`,

    filled[b]   the leading slots of b that hold KV computed in this process
                for the request that last received b as a new block
                (0..block size of the group whose table holds b)

and for every host block `h`, `host_filled[h]`: whether it holds a full block.
A delta is followed in the order its copies run on the device:

    offloads     device d -> host h     host_filled[h] = filled[d] is the tier group's block size
    tables       rows_added             blocks at index >= ceil(num_hit_tokens / block size) are new: filled 0
                 blocks_appended        a block id that differs from the table's entry at its index
                                        (or lies past the table's end) is new: filled 0
                 requests_freed         no block changes
    onloads      host h -> device d     filled[d] = block size if host_filled[h] else 0
    copies       src -> dst             filled[dst] = filled[src]

Offloads come before the table rules: an offload copies a block the manager
evicted before the step's forward pass writes into it, even when the same
step hands the block out again as a new one.

The guard (`check`) runs before a forward pass: a request may read position
p (p < its start position, inside its group's window) of a non-null block b
only if `filled[b] > p % block_size`, or if a request of the same batch that
passes the guard writes that slot (every layer stores the whole batch's K/V
before attention reads it). After the forward pass `record_written` extends
`filled` over the slots the batch wrote.

A request that continues exactly where its last checked Execute here left
off (`num_computed_here`) is not scanned again: its earlier reads were
proven, and its blocks keep their contents while it holds them. Only its
first Execute here, a start elsewhere, or a table whose held blocks were
replaced, costs a scan of its blocks; a decode step costs O(batch).

The null block (id 0) is never read and never checked.

Pure Python: no torch, no network.
"""

from __future__ import annotations

from typing import Iterable, Iterator, NamedTuple, Sequence

from kv_manager_service.shared.errors import KVMissingError
from kvcache.v1 import kv_manager_pb2 as pb

NULL_BLOCK_ID = 0


class TokenSpan(NamedTuple):
    """The positions one request of an Execute computes: [start_position, start_position + num_tokens)."""

    request_id: str
    start_position: int
    num_tokens: int


class MissingKV(NamedTuple):
    """Requests of a batch that would read KV this worker does not hold, and the blocks that lack it."""

    request_indices: tuple[int, ...]  # into the batch, ascending
    request_ids: tuple[str, ...]  # the same requests
    device_block_ids: tuple[int, ...]  # non-null blocks read and not filled, ascending, each once


class UnfilledKVError(KVMissingError):
    """The guard refused a batch: nothing was computed. `missing` says which requests, and which blocks."""

    def __init__(self, missing: MissingKV, step_id: int) -> None:
        shown = ", ".join(repr(request_id) for request_id in missing.request_ids[:8])
        more = f" and {len(missing.request_ids) - 8} more" if len(missing.request_ids) > 8 else ""
        super().__init__(
            f"requests {shown}{more} would read KV this worker does not hold (blocks "
            f"{list(missing.device_block_ids[:16])}{'...' if len(missing.device_block_ids) > 16 else ''} "
            f"at step {step_id}): nothing was computed; run the others again without them",
            list(missing.request_ids),
            f"requests[{missing.request_indices[0]}]",
        )
        self.missing = missing


class _Read(NamedTuple):
    """Slots [first_slot, end_slot) of `block_id` that a request reads and `filled` does not cover."""

    block_id: int
    first_slot: int
    end_slot: int


class KVPresence:
    """Which device and host blocks hold KV computed in this process, and which requests may read them.

    Mutated only by `apply_step`, `add_unfilled`, `record_written` and
    `forget_written`. Invariants (`check_invariants`): every filled count lies
    in 0..block size of the group whose table holds the block; a request's
    `num_computed_here` exists only while it has a table.
    """

    def __init__(
        self, num_blocks: int, block_sizes: Sequence[int], sliding_windows: Sequence[int], num_host_blocks: int = 0
    ) -> None:
        """`block_sizes[g]`, `sliding_windows[g]` (0: full attention): group g of the pool.

        The host tier, if any, sits behind the full-attention group (one at most).
        """
        if len(block_sizes) != len(sliding_windows) or not block_sizes:
            raise ValueError(f"one block size and one window per group, got {block_sizes} and {sliding_windows}")
        self.block_sizes = list(block_sizes)
        self.sliding_windows = list(sliding_windows)
        full = [size for size, window in zip(block_sizes, sliding_windows) if window == 0]
        self.tier_block_size = full[0] if full else 0
        self.filled = [0] * num_blocks
        self.host_filled = bytearray(num_host_blocks)
        self.tables: dict[str, list[list[int]]] = {}
        self.num_computed_here: dict[str, int] = {}
        self.missing_host_block_ids: set[int] = set()  # onloads of unfilled host blocks, not yet reported

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.tables

    # -- following the manager -----------------------------------------------------------

    def add_unfilled(self, request_id: str, tables: Sequence[Sequence[int]]) -> None:
        """A request live before this process followed any step (the start-up snapshot): none of its KV is here.

        Its blocks keep filled 0 (nothing was computed in this process before it follows steps).
        """
        self.tables[request_id] = [list(block_ids) for block_ids in tables]

    def apply_step(self, delta: pb.StepDelta) -> None:
        """Follow one delta the runner accepted: its table changes and block moves (see the module docstring)."""
        filled, host_filled, tier_block_size = self.filled, self.host_filled, self.tier_block_size
        for move in delta.offloads:
            host_filled[move.host_block_id] = filled[move.device_block_id] == tier_block_size
        for row in delta.rows_added:
            per_group: list[list[int]] = [[] for _ in self.block_sizes]
            for group in row.groups:
                per_group[group.group_id] = list(group.block_ids)
            for block_ids, block_size in zip(per_group, self.block_sizes):
                for block_id in block_ids[-(-row.num_hit_tokens // block_size) :]:
                    filled[block_id] = 0
            self.tables[row.request_id] = per_group
            self.num_computed_here.pop(row.request_id, None)
        for update in delta.blocks_appended:
            table = self.tables[update.request_id][update.group_id]
            start, replaced = update.new_block_index, False
            for index, block_id in enumerate(update.block_ids, start):
                if index < len(table) and table[index] == block_id:
                    continue
                filled[block_id] = 0
                replaced = replaced or (index < len(table) and block_id != NULL_BLOCK_ID)
            del table[start:]
            table.extend(update.block_ids)
            if replaced:  # a block it read may be another one now: scan it at its next Execute
                self.num_computed_here.pop(update.request_id, None)
        for request_id in delta.requests_freed:
            del self.tables[request_id]
            self.num_computed_here.pop(request_id, None)
        for move in delta.onloads:
            if host_filled[move.host_block_id]:
                filled[move.device_block_id] = tier_block_size
            else:
                filled[move.device_block_id] = 0
                self.missing_host_block_ids.add(move.host_block_id)
        for copy in delta.copies:
            filled[copy.dst_block_id] = filled[copy.src_block_id]
        filled[NULL_BLOCK_ID] = 0

    # -- the guard -----------------------------------------------------------------------

    def check(self, spans: Sequence[TokenSpan]) -> MissingKV | None:
        """None when every request of the batch may read what it reads; else the ones that may not.

        A request passes when each slot it reads is filled, or written in this
        batch by a request that passes (a fixpoint over the batch). Every
        request must have a table long enough for its span (the runner checks
        that first). Mutates nothing.
        """
        unmet: list[tuple[int, list[_Read]]] = []
        for index, span in enumerate(spans):
            if self.num_computed_here.get(span.request_id) == span.start_position:
                continue
            reads = [read for read in self._reads(span) if self.filled[read.block_id] < read.end_slot]
            if reads:
                unmet.append((index, reads))
        if not unmet:
            return None
        waiting = {index for index, _ in unmet}
        written: dict[int, list[tuple[int, int]]] = {}
        for index, span in enumerate(spans):
            if index not in waiting:
                self._add_writes(written, span)
        progress = True
        while unmet and progress:
            progress, still = False, []
            for index, reads in unmet:
                if all(self._covered(read, written) for read in reads):
                    self._add_writes(written, spans[index])
                    progress = True
                else:
                    still.append((index, reads))
            unmet = still
        if not unmet:
            return None
        block_ids = {read.block_id for _, reads in unmet for read in reads if not self._covered(read, written)}
        indices = tuple(index for index, _ in unmet)
        return MissingKV(indices, tuple(spans[index].request_id for index in indices), tuple(sorted(block_ids)))

    def record_written(self, spans: Iterable[TokenSpan]) -> None:
        """After a forward pass over `spans`: their slots hold KV, and each request continues from its span's end.

        A block's filled count grows only over slots that continue its filled
        prefix; a write past a gap leaves it as it was.
        """
        filled, tables, block_sizes = self.filled, self.tables, self.block_sizes
        gapped: list[tuple[int, int, int]] = []
        for request_id, start, num_tokens in spans:
            end = start + num_tokens
            for table, block_size in zip(tables[request_id], block_sizes):
                if num_tokens == 1:  # a decode step: one slot
                    index, slot = divmod(start, block_size)
                    block_id = table[index]
                    if slot <= filled[block_id] and block_id != NULL_BLOCK_ID:
                        if slot >= filled[block_id]:
                            filled[block_id] = slot + 1
                        continue
                for index in range(start // block_size, (end - 1) // block_size + 1):
                    block_id = table[index]
                    if block_id == NULL_BLOCK_ID:
                        continue
                    base = index * block_size
                    first_slot, end_slot = max(start - base, 0), min(end - base, block_size)
                    if first_slot <= filled[block_id]:
                        if end_slot > filled[block_id]:
                            filled[block_id] = end_slot
                    else:
                        gapped.append((block_id, first_slot, end_slot))
            self.num_computed_here[request_id] = end
        gapped.sort(key=lambda write: write[1])
        for block_id, first_slot, end_slot in gapped:
            if first_slot <= filled[block_id]:
                filled[block_id] = max(filled[block_id], end_slot)

    def forget_written(self, spans: Iterable[TokenSpan]) -> None:
        """After a forward pass over `spans` failed part-way: the slots it may have written hold nothing.

        Each block it wrote keeps only the filled slots before its first write;
        each request is scanned again at its next Execute.
        """
        filled = self.filled
        for span in spans:
            if span.request_id not in self.tables:
                continue
            for block_id, first_slot, _ in self._writes(span):
                filled[block_id] = min(filled[block_id], first_slot)
            self.num_computed_here.pop(span.request_id, None)

    # -- reporting -----------------------------------------------------------------------

    def unfilled_blocks_from(self, request_id: str, start_position: int) -> list[int]:
        """The non-null blocks of the request, in every group, from the one holding `start_position` on,
        that are not full: what a refused Execute starting there left uncomputed. Mutates nothing."""
        blocks = []
        for table, block_size in zip(self.tables[request_id], self.block_sizes):
            for block_id in table[start_position // block_size :]:
                if block_id != NULL_BLOCK_ID and self.filled[block_id] < block_size:
                    blocks.append(block_id)
        return blocks

    def take_missing_host_block_ids(self) -> list[int]:
        """The host blocks onloaded since the last call while they held nothing here, ascending; forgets them."""
        taken = sorted(self.missing_host_block_ids)
        self.missing_host_block_ids.clear()
        return taken

    def check_invariants(self) -> None:
        """Raise AssertionError, with the counts that disagree, unless the invariants hold."""
        for request_id, tables in self.tables.items():
            assert len(tables) == len(self.block_sizes), (request_id, len(tables), len(self.block_sizes))
            for table, block_size in zip(tables, self.block_sizes):
                for block_id in table:
                    assert 0 <= self.filled[block_id] <= block_size, (request_id, block_id, self.filled[block_id])
        unknown = set(self.num_computed_here) - set(self.tables)
        assert not unknown, f"num_computed_here of requests without a table: {sorted(unknown)}"
        assert self.filled[NULL_BLOCK_ID] == 0, self.filled[NULL_BLOCK_ID]

    # -- positions to blocks -------------------------------------------------------------

    def _reads(self, span: TokenSpan) -> Iterator[_Read]:
        """Per group, the slots of non-null blocks that the span's first token may attend to, before its start.

        Token p attends to positions k <= p, and k > p - window in a windowed group.
        """
        start = span.start_position
        tables = self.tables[span.request_id]
        for table, block_size, window in zip(tables, self.block_sizes, self.sliding_windows):
            first = max(0, start - window + 1) if window else 0
            for index in range(first // block_size, -(-start // block_size)):
                block_id = table[index]
                if block_id != NULL_BLOCK_ID:
                    base = index * block_size
                    yield _Read(block_id, max(first - base, 0), min(start - base, block_size))

    def _writes(self, span: TokenSpan) -> Iterator[tuple[int, int, int]]:
        """Per group, (block_id, first_slot, end_slot) of every non-null block the span writes."""
        start, end = span.start_position, span.start_position + span.num_tokens
        tables = self.tables[span.request_id]
        for table, block_size in zip(tables, self.block_sizes):
            for index in range(start // block_size, -(-end // block_size)):
                block_id = table[index]
                if block_id != NULL_BLOCK_ID:
                    base = index * block_size
                    yield block_id, max(start - base, 0), min(end - base, block_size)

    def _add_writes(self, written: dict[int, list[tuple[int, int]]], span: TokenSpan) -> None:
        for block_id, first_slot, end_slot in self._writes(span):
            written.setdefault(block_id, []).append((first_slot, end_slot))

    def _covered(self, read: _Read, written: dict[int, list[tuple[int, int]]]) -> bool:
        """Whether the read's slots are filled, or written by the ranges in `written`."""
        reached = max(read.first_slot, self.filled[read.block_id])
        for first_slot, end_slot in sorted(written.get(read.block_id, ())):
            if first_slot > reached:
                break
            reached = max(reached, end_slot)
        return reached >= read.end_slot
