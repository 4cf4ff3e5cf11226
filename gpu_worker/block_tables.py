"""The worker's copy of the manager's block tables: one int32 table per KV-cache group.

Each live request owns one row index, the same in every group, from the
step that adds it until the step that frees it; freed rows are reused. A
row only ever changes from an index on (`update`): blocks appended, or a
copy-on-write block replacing a shared one, exactly as the manager's
StepDeltas describe. Rows live in CPU int32 buffers and are mirrored to the
device before compute (`batch`). The buffers start small and double when a
request or a table needs more, up to the manager's limits.
"""

from __future__ import annotations

from typing import Sequence

import torch

from kv_manager_service.rpc.errors import FailedPreconditionError, RequestExistsError, RequestNotFoundError


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
        self._sync()
        rows = [self._row(request_id) for request_id in request_ids]
        index = torch.tensor(rows, dtype=torch.int64, device=self.device)
        tables = []
        for group, table in enumerate(self.on_device):
            width = max(self.lengths[group][row] for row in rows)
            tables.append(table.index_select(0, index)[:, : max(width, 1)])
        return tables

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

    def _sync(self) -> None:
        """Copy the rows changed since the last sync to the device (nothing to do on a CPU)."""
        if self.dirty_rows and self.on_device is not self.host:
            index = torch.tensor(sorted(self.dirty_rows), dtype=torch.int64)
            device_index = index.to(self.device)
            for host, device in zip(self.host, self.on_device):
                device.index_copy_(0, device_index, host.index_select(0, index).to(self.device, non_blocking=True))
        self.dirty_rows.clear()

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
            self.on_device[group] = new.to(self.device)
