"""The worker's block tables: rows that follow the manager's deltas, grow on demand, and reach the device staged."""

from __future__ import annotations

import pytest
import torch

from gpu_worker.block_tables import BlockTables
from gpu_worker.staging import Staging
from kv_manager_service.shared.errors import FailedPreconditionError, RequestExistsError, RequestNotFoundError

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


def mirrored(max_requests: int, max_blocks: list[int], **sizes: int) -> BlockTables:
    """Tables whose device copy is a separate CPU tensor, as it is on a GPU: changes reach it only by staging."""
    tables = BlockTables(max_requests, max_blocks, CPU, **sizes)
    tables.on_device = [host.clone() for host in tables.host]
    return tables


def test_changed_rows_travel_with_the_batch_and_the_device_copy_follows_the_host():
    tables = mirrored(max_requests=8, max_blocks=[10, 10], initial_rows=2, initial_width=2)
    tables.add("a", [[1, 2], [3]])
    tables.add("b", [[4], [5, 6]])
    staging = Staging()
    staged = tables.stage(["b", "a"], staging)
    assert staged.changed is not None and staged.changed.rows == [0, 1]
    staging.to(CPU)
    batch = staged.tables()
    assert batch[0].tolist() == [[4, 0], [1, 2]] and batch[1].tolist() == [[5, 6], [3, 0]]
    assert not tables.dirty_rows

    tables.update("a", 0, 2, [7, 8, 9])  # grows the width: the device copy is replaced whole
    tables.add("c", [[13], [14]])  # grows the rows
    tables.remove("b")
    tables.add("d", [[15], [16]])  # b's row, reused
    staging = Staging()
    staged = tables.stage(["d", "a", "c"], staging)
    staging.to(CPU)
    batch = staged.tables()
    assert batch[0].tolist() == [[15, 0, 0, 0, 0], [1, 2, 7, 8, 9], [13, 0, 0, 0, 0]]
    assert batch[1].tolist() == [[16], [3], [14]]
    for host, device in zip(tables.host, tables.on_device):
        assert device is not host and torch.equal(host, device)

    tables.update("c", 1, 1, [17])
    assert tables.batch(["c"])[1].tolist() == [[14, 17]]  # `batch` stages and moves by itself


def test_rows_staged_but_never_moved_stay_changed():
    tables = mirrored(max_requests=4, max_blocks=[4])
    tables.add("a", [[1]])
    tables.stage(["a"], Staging())  # the step failed before its staging moved
    assert tables.dirty_rows == {0}
    assert tables.batch(["a"])[0].tolist() == [[1]]
    assert not tables.dirty_rows


def test_a_cpu_device_needs_no_mirror():
    tables = BlockTables(max_requests=4, max_blocks=[4], device=CPU)
    tables.add("a", [[1, 2]])
    staging = Staging()
    staged = tables.stage(["a"], staging)
    assert staged.changed is None and not tables.dirty_rows
    staging.to(CPU)
    assert staged.tables()[0].tolist() == [[1, 2]]
