"""A step's small host arrays, moved to the device in one copy.

The runner adds every array a step needs (token ids, query starts, lengths,
block-table rows, sampling parameters), then calls `to` once: it packs them
into one host buffer, copies that buffer to the device, and hands each array
back as a view of the device copy. Layout, in the order added, each array
starting on a 16-byte boundary:

    | token ids (int64) | query_start_loc (int32) | ... | table rows (int32 [n, width]) |

The 16 bytes matter on a GPU: Triton compiles a kernel once per combination
of its pointer arguments being 16-byte aligned or not. With every staged
array 16-byte aligned (the device copy starts on an allocator boundary), a
step's `query_start_loc` or `seq_lens` is aligned whatever the counts before
it, so serving launches the variants the warm-up compiled.

On a CUDA device the host buffer is pinned, so the copy is asynchronous and
the host goes on queueing work. Every step gets a new buffer: torch's
pinned-memory cache hands a buffer out again only once the copies that read
it have completed, so a later step never overwrites what an earlier copy
still reads. On a CPU there is no copy: the views are of the host buffer.
"""

from __future__ import annotations

import array
import math
from typing import Sequence

import torch

ALIGN_BYTES = 16
# The `array` type code of each dtype a Staging packs from Python numbers.
_TYPECODES = {torch.int64: "q", torch.int32: "i", torch.float32: "f", torch.float64: "d"}


class StagedArray:
    """One array of a `Staging`: where it sits in the buffer; `tensor` is its device view once moved."""

    def __init__(self, offset: int, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
        self.offset = offset
        self.dtype = dtype
        self.shape = shape
        self.num_bytes = math.prod(shape) * dtype.itemsize
        self._tensor: torch.Tensor | None = None

    @property
    def tensor(self) -> torch.Tensor:
        assert self._tensor is not None, "read a staged array before Staging.to moved it"
        return self._tensor

    def view_of(self, buffer: torch.Tensor) -> torch.Tensor:
        """This array inside the uint8 `buffer` the staging packed (host or device copy)."""
        view = buffer[self.offset : self.offset + self.num_bytes].view(self.dtype)
        return view if len(self.shape) == 1 else view.view(self.shape)


class Staging:
    """Collects a step's arrays; `to(device)` moves them all in one host-to-device copy.

    Use once: add every array, then call `to`. Python numbers are packed
    when added; rows of host tensors are read when `to` runs.
    """

    def __init__(self) -> None:
        self.arrays: list[StagedArray] = []
        self.packed: list[tuple[int, bytes]] = []  # (offset, bytes) of the arrays of Python numbers
        self.gathers: list[tuple[StagedArray, torch.Tensor, Sequence[int]]] = []
        self.num_bytes = 0
        self.moved = False

    def add(
        self, values: Sequence[int] | Sequence[float], dtype: torch.dtype, shape: tuple[int, ...] | None = None
    ) -> StagedArray:
        """`values` (Python numbers, row-major) as a `dtype` array of `shape` (default: 1-D).

        dtype: int64, int32, float32 or float64. Raises OverflowError when an
        integer does not fit the dtype.
        """
        shape = (len(values),) if shape is None else shape
        assert math.prod(shape) == len(values), (shape, len(values))
        staged = self._append(dtype, shape)
        self.packed.append((staged.offset, array.array(_TYPECODES[dtype], values).tobytes()))
        return staged

    def add_rows(self, source: torch.Tensor, rows: Sequence[int]) -> StagedArray:
        """Rows `rows` of the 2-D host tensor `source`, as read when `to` runs: `[len(rows), source.shape[1]]`."""
        assert source.dim() == 2 and source.device.type == "cpu", (source.shape, source.device)
        staged = self._append(source.dtype, (len(rows), source.shape[1]))
        self.gathers.append((staged, source, rows))
        return staged

    def to(self, device: torch.device) -> None:
        """Pack the arrays into one host buffer (pinned on CUDA), copy it to `device`, set every `tensor`."""
        assert not self.moved, "a Staging moves its arrays once"
        self.moved = True
        # torch's host allocators align a buffer to 64 bytes or more: every array is 16-byte aligned here too.
        host = torch.empty(self.num_bytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
        if self.packed:
            written = memoryview(host.numpy())
            for offset, data in self.packed:
                written[offset : offset + len(data)] = data
        for staged, source, rows in self.gathers:
            torch.index_select(source, 0, torch.tensor(rows, dtype=torch.int64), out=staged.view_of(host))
        moved = host.to(device, non_blocking=True)
        for staged in self.arrays:
            staged._tensor = staged.view_of(moved)

    def _append(self, dtype: torch.dtype, shape: tuple[int, ...]) -> StagedArray:
        assert not self.moved, "add every array before Staging.to"
        staged = StagedArray(self.num_bytes, dtype, shape)
        self.num_bytes += -(-staged.num_bytes // ALIGN_BYTES) * ALIGN_BYTES
        self.arrays.append(staged)
        return staged
