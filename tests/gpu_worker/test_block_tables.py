"""The worker's block tables: rows that follow the manager's deltas, growing on demand."""

from __future__ import annotations

import pytest
import torch

from gpu_worker.block_tables import BlockTables
from kv_manager_service.rpc.errors import FailedPreconditionError, RequestExistsError, RequestNotFoundError

CPU = torch.device("cpu")


def test_rows_follow_adds_updates_and_frees():
    tables = BlockTables(max_requests=8, max_blocks=[10, 10], device=CPU, initial_rows=2, initial_width=2)
    tables.add("a", [[1, 2], [3]])
    tables.add("b", [[4], [5, 6]])
    tables.update("a", 0, 2, [7, 8, 9])  # appended: the table grows past its initial width
    tables.update("b", 1, 1, [11, 12])  # copy-on-write: index 1 replaced, then one appended
    assert tables.block_ids("a", 0) == [1, 2, 7, 8, 9] and tables.block_ids("a", 1) == [3]
    assert tables.block_ids("b", 1) == [5, 11, 12] and tables.num_blocks("b", 1) == 3
    tables.add("c", [[13], [14]])  # a third row: the buffers double
    tables.remove("a")
    tables.add("d", [[15], [16]])  # reuses a's row; a's old blocks are not visible
    assert tables.block_ids("d", 0) == [15]
    batch = tables.batch(["d", "b"])
    assert batch[0].dtype == torch.int32 and batch[0].shape == (2, 1)
    assert batch[1].tolist() == [[16, 0, 0], [5, 11, 12]]


def test_mistakes_are_typed():
    tables = BlockTables(max_requests=1, max_blocks=[2], device=CPU)
    tables.add("a", [[1]])
    with pytest.raises(RequestExistsError):
        tables.add("a", [[2]])
    with pytest.raises(FailedPreconditionError, match="all 1 in use"):
        tables.add("b", [[2]])
    with pytest.raises(RequestNotFoundError):
        tables.num_blocks("zz", 0)
    with pytest.raises(FailedPreconditionError, match="past the 2"):
        tables.update("a", 0, 1, [2, 3])
