"""One staging buffer per step: every array comes back with its values, dtype and shape."""

from __future__ import annotations

import pytest
import torch

from gpu_worker.staging import ALIGN_BYTES, Staging
from devices import DEVICE

CPU = torch.device("cpu")
CUDA = pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA device")


def stage_a_step(staging: Staging, table: torch.Tensor) -> list:
    """The arrays of a mixed step, each of a size that is not a multiple of 8 bytes."""
    return [
        staging.add([7, 1 << 40, -3], torch.int64),
        staging.add([0, 3, 4], torch.int32),
        staging.add([2.5, 0.1], torch.float32),
        staging.add([], torch.int64),
        staging.add([1, 2, 3, 4, 5, 6], torch.int64, (3, 2)),
        staging.add([0.1], torch.float64),
        staging.add_rows(table, [2, 0]),
    ]


def check_the_step(arrays: list, device: torch.device) -> None:
    expected = [
        torch.tensor([7, 1 << 40, -3]),
        torch.tensor([0, 3, 4], dtype=torch.int32),
        torch.tensor([2.5, 0.1], dtype=torch.float32),
        torch.tensor([], dtype=torch.int64),
        torch.tensor([[1, 2], [3, 4], [5, 6]]),
        torch.tensor([0.1], dtype=torch.float64),
        torch.tensor([[6, 7, 8], [0, 1, 2]], dtype=torch.int32),
    ]
    for staged, want in zip(arrays, expected, strict=True):
        got = staged.tensor
        assert got.device.type == device.type and got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(got.cpu(), want), (got, want)


def test_every_array_round_trips_in_one_buffer_with_aligned_starts():
    table = torch.arange(9, dtype=torch.int32).view(3, 3)
    staging = Staging()
    arrays = stage_a_step(staging, table)
    staging.to(CPU)
    check_the_step(arrays, CPU)
    assert all(array.offset % ALIGN_BYTES == 0 for array in arrays)
    assert staging.num_bytes == 32 + 16 + 16 + 0 + 48 + 16 + 32
    first = arrays[0].tensor
    assert all(array.tensor.untyped_storage().data_ptr() == first.untyped_storage().data_ptr() for array in arrays)


@pytest.mark.parametrize("num_tokens", [1, 2, 3, 5, 16, 17])
@pytest.mark.parametrize("num_reqs", [1, 2, 3, 4])
def test_every_array_of_a_step_starts_16_byte_aligned(num_tokens, num_reqs):
    """Triton specialises on 16-byte alignment: a step's arrays must be aligned whatever its counts."""
    staging = Staging()
    arrays = [
        staging.add(list(range(num_tokens)), torch.int64),  # token ids, as the runner stages them
        staging.add(list(range(num_reqs + 1)), torch.int32),  # query_start_loc
        staging.add([1] * num_reqs, torch.int32),  # seq_lens
        staging.add(list(range(num_reqs)), torch.int64),  # block-table rows
        staging.add([0.5] * num_reqs, torch.float32),
    ]
    staging.to(CPU)
    assert all(array.tensor.data_ptr() % 16 == 0 for array in arrays), [array.offset for array in arrays]


def test_table_rows_are_read_when_moved_and_kept_from_then_on():
    table = torch.zeros(3, 2, dtype=torch.int32)
    staging = Staging()
    rows = staging.add_rows(table, [1])
    table[1] = torch.tensor([4, 5])  # a change before the move travels
    staging.to(CPU)
    table[1] = torch.tensor([8, 9])  # a change after it does not
    assert rows.tensor.tolist() == [[4, 5]]


def test_mistakes_are_caught():
    staging = Staging()
    array = staging.add([1], torch.int64)
    with pytest.raises(AssertionError):
        _ = array.tensor  # before the move
    with pytest.raises(OverflowError):
        staging.add([1 << 31], torch.int32)
    staging.to(CPU)
    with pytest.raises(AssertionError):
        staging.add([1], torch.int64)
    with pytest.raises(AssertionError):
        staging.to(CPU)


def test_an_empty_staging_moves_nothing():
    staging = Staging()
    staging.to(CPU)
    assert staging.num_bytes == 0


@pytest.mark.gpu
@CUDA
def test_a_cuda_step_round_trips_through_pinned_memory():
    table = torch.arange(9, dtype=torch.int32).view(3, 3).pin_memory()
    staging = Staging()
    arrays = stage_a_step(staging, table)
    staging.to(torch.device("cuda"))
    table.zero_()  # the rows were copied into the staging buffer before the move
    check_the_step(arrays, torch.device("cuda"))
