"""The worker's copy of the manager's block tables: one int32 table per KV-cache group.

Each live request owns one row index, the same in every group, from the
step that adds it until the step that frees it; freed rows are reused. A
row only ever changes from an index on (`update`): blocks appended, or a
copy-on-write block replacing a shared one, exactly as the manager's
StepDeltas describe. Rows live in CPU int32 buffers (pinned when the device
is CUDA) and are mirrored to the device before compute: `stage` puts the rows
changed since the last mirror, and the batch's row indices, into the step's
`Staging` buffer, so they travel in the step's one host-to-device copy, and
`StagedBatch.tables` then updates the device tables and gathers the batch's
rows there. The buffers start small and double when a request or a table
needs more, up to the manager's limits.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import torch

from gpu_worker.staging import StagedArray, Staging
from kv_manager_service.shared.errors import FailedPreconditionError, RequestExistsError, RequestNotFoundError


class BlockTables:
    def __init__(
        self, max_requests: int, max_blocks: Sequence[int], device: torch.device, initial_rows: int = 64, initial_width: int = 64
    ) -> None:
        """`max_blocks[g]`: the longest table group g can hold (max model length / block size)."""
        self.device = device
        self.max_requests = max_requests
        self.max_blocks = list(max_blocks)
        rows = min(initial_rows, max_requests)
        self.host = [self._alloc(rows, min(initial_width, n)) for n in max_blocks]
        self.on_device = self.host if device.type == "cpu" else [t.to(device) for t in self.host]
        self.lengths = [[0] * rows for _ in max_blocks]
        self.rows: dict[str, int] = {}
        self.free_rows = list(range(rows - 1, -1, -1))  # pop() hands out row 0 first
        self.dirty_rows: set[int] = set()

    def add(self, request_id: str, tables: Sequence[Sequence[int]]) -> None:
        """A new request with its whole table in each group."""
        if request_id in self.rows:
            raise RequestExistsError(f"request {request_id!r} already has a block table", "request_id")
        if not self.free_rows:
            self._grow_rows(request_id)
        self.rows[request_id] = row = self.free_rows.pop()
        for group, block_ids in enumerate(tables):
            self.lengths[group][row] = 0
            self._write(group, row, 0, block_ids)

    def update(self, request_id: str, group: int, new_block_index: int, block_ids: Sequence[int]) -> None:
        """Group `group`'s table of `request_id` from `new_block_index` on is `block_ids`."""
        row = self._row(request_id)
        length = self.lengths[group][row]
        assert new_block_index <= length, f"{request_id}: update at {new_block_index} leaves a gap after {length}"
        self._write(group, row, new_block_index, block_ids)

    def remove(self, request_id: str) -> None:
        self.free_rows.append(self.rows.pop(request_id))

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.rows

    def num_blocks(self, request_id: str, group: int) -> int:
        return self.lengths[group][self._row(request_id)]

    def block_ids(self, request_id: str, group: int) -> list[int]:
        row = self._row(request_id)
        return self.host[group][row, : self.lengths[group][row]].tolist()

    def batch(self, request_ids: Sequence[str]) -> list[torch.Tensor]:
        """Per group, the int32 `[len(request_ids), max_blocks]` table of this batch, on the device."""
        staging = Staging()
        staged = self.stage(request_ids, staging)
        staging.to(self.device)
        return staged.tables()

    def stage(self, request_ids: Sequence[str], staging: Staging) -> StagedBatch:
        """Add the batch's row indices, and the rows changed since the last mirror, to `staging`.

        Raises RequestNotFoundError (nothing staged) for a request with no
        table. The changed rows are read from the host buffers when `staging`
        is moved; they count as mirrored once `StagedBatch.tables` has run.
        """
        rows = [self._row(request_id) for request_id in request_ids]
        widths = [max(max(lengths[row] for row in rows), 1) for lengths in self.lengths]
        changed = None
        if self.on_device is self.host:
            self.dirty_rows.clear()  # the device tables are the host ones
        elif self.dirty_rows:
            dirty = sorted(self.dirty_rows)
            contents = [staging.add_rows(host, dirty) for host in self.host]
            changed = ChangedRows(dirty, staging.add(dirty, torch.int64), contents)
        return StagedBatch(self, staging.add(rows, torch.int64), widths, changed)

    def _row(self, request_id: str) -> int:
        try:
            return self.rows[request_id]
        except KeyError:
            raise RequestNotFoundError(f"request {request_id!r} has no block table on this worker", "request_id") from None

    def _write(self, group: int, row: int, start: int, block_ids: Sequence[int]) -> None:
        end = start + len(block_ids)
        if end > self.host[group].shape[1]:
            self._grow_width(group, end)
        if block_ids:
            self.host[group][row, start:end] = torch.tensor(block_ids, dtype=torch.int32)
        self.lengths[group][row] = end
        self.dirty_rows.add(row)

    def _alloc(self, rows: int, width: int) -> torch.Tensor:
        return torch.zeros((rows, width), dtype=torch.int32, pin_memory=self.device.type == "cuda")

    def _grow_rows(self, request_id: str) -> None:
        rows = len(self.lengths[0])
        if rows >= self.max_requests:
            raise FailedPreconditionError(f"no free block-table row for {request_id!r}: all {rows} in use", "request_id")
        new_rows = min(2 * rows, self.max_requests)
        for group, old in enumerate(self.host):
            self._replace(group, old, self._alloc(new_rows, old.shape[1]))
            self.lengths[group].extend([0] * (new_rows - rows))
        self.free_rows = list(range(new_rows - 1, rows - 1, -1)) + self.free_rows

    def _grow_width(self, group: int, needed: int) -> None:
        if needed > self.max_blocks[group]:
            raise FailedPreconditionError(
                f"a group-{group} table grows to {needed} blocks, past the {self.max_blocks[group]} of the max model length"
            )
        old = self.host[group]
        self._replace(group, old, self._alloc(old.shape[0], min(max(needed, 2 * old.shape[1]), self.max_blocks[group])))

    def _replace(self, group: int, old: torch.Tensor, new: torch.Tensor) -> None:
        """Swap in a larger buffer holding `old` in its top-left corner, on the host and the device."""
        new[: old.shape[0], : old.shape[1]] = old
        self.host[group] = new
        if self.on_device is not self.host:
            self.on_device[group] = new.to(self.device, copy=True)  # blocking: `new` changes with the next delta


class ChangedRows(NamedTuple):
    """Rows of the host tables not yet mirrored on the device, as staged."""

    rows: list[int]
    index: StagedArray  # int64 [len(rows)]
    contents: list[StagedArray]  # per group, int32 [len(rows), width of the group's table]


class StagedBatch(NamedTuple):
    """What `BlockTables.stage` added to a step's staging; `tables()` finishes on the device."""

    owner: BlockTables
    rows: StagedArray  # int64 [num_reqs]: each request's row
    widths: list[int]  # per group, the longest table of the batch (at least 1)
    changed: ChangedRows | None

    def tables(self) -> list[torch.Tensor]:
        """Per group, the batch's int32 `[num_reqs, width]` table on the device (after the staging moved).

        First copies the staged changed rows into the device tables.
        """
        owner, index = self.owner, self.rows.tensor
        if self.changed is not None:
            for device, contents in zip(owner.on_device, self.changed.contents):
                device.index_copy_(0, self.changed.index.tensor, contents.tensor)
            owner.dirty_rows.difference_update(self.changed.rows)
        return [table[:, :width].index_select(0, index) for table, width in zip(owner.on_device, self.widths)]
