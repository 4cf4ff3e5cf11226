"""Decode steps through static buffers, padded to a few batch sizes, and on CUDA replayed from graphs.

A CUDA graph replays a fixed sequence of kernels on fixed addresses, so a
step that runs from one needs inputs at the same addresses every time and
nothing decided on the host from their values. A decode step (one token per
request) has that shape once its batch is padded to a size known in advance:

    step of n requests -> bucket b = the smallest batch size >= n
    host:   one staging copy (`gpu_worker.staging`), then copies of its arrays into
            the first n rows of the static inputs (`DecodeInputs`)
    device: the graph of bucket b: rows n..b-1 are padding, computed and dropped;
            their slots are -1, so they write no KV
    host:   the first n rows of the static outputs, in one copy back

A padding row is whatever an earlier step left in its row of the static
buffers: a real token id, a length >= 1 and a table row of block ids inside
the pool (the buffers start as token 0, length 1, block 0). It reads blocks
that may belong to another request, which is harmless, and never writes.

`DecodeGraphs` keeps the buckets and their static outputs. Without capture
(on a CPU, or before `capture`) each step runs the same body eagerly over
the same static buffers, so the padding, the copies and the bucket choice
are tested without a GPU; only the capture itself needs one.
"""

from __future__ import annotations

import bisect
from typing import Callable, NamedTuple, Sequence

import torch

DecodeOutputs = tuple[torch.Tensor, torch.Tensor]  # chosen token ids (int64), their log-probabilities (fp32)


def bucket_sizes(max_num_requests: int, largest: int = 256) -> tuple[int, ...]:
    """Powers of two up to the pool's request cap (or `largest`), and the cap itself when it is smaller."""
    top = min(max_num_requests, largest)
    sizes = [1 << i for i in range(top.bit_length()) if 1 << i <= top]
    return tuple(sorted(set(sizes) | {top}))


class DecodeInputs(NamedTuple):
    """The static inputs of a decode step, sized for the largest bucket (`rows`); a bucket uses their first rows."""

    token_ids: torch.Tensor  # int64 [rows]
    seq_lens: torch.Tensor  # int32 [rows]: each request's length with this step's token in
    query_start_loc: torch.Tensor  # int32 [rows + 1]: 0, 1, ..., rows, never written
    row_ids: torch.Tensor  # int64 [rows]: 0, 1, ..., rows - 1, never written
    num_rows: torch.Tensor  # int64 [1]: the requests of this step; rows past it are padding
    temperatures: torch.Tensor  # float32 [rows]: 0 for a greedy row
    noise_keys: torch.Tensor  # int64 [rows]
    block_tables: tuple[torch.Tensor, ...]  # int32 [rows, max_blocks] per KV-cache group

    @classmethod
    def allocate(cls, rows: int, max_blocks: Sequence[int], device: torch.device) -> "DecodeInputs":
        """Buffers whose every row is a valid padding row: token 0, length 1, block 0."""
        return cls(
            torch.zeros(rows, dtype=torch.int64, device=device),
            torch.ones(rows, dtype=torch.int32, device=device),
            torch.arange(rows + 1, dtype=torch.int32, device=device),
            torch.arange(rows, dtype=torch.int64, device=device),
            torch.zeros(1, dtype=torch.int64, device=device),
            torch.zeros(rows, dtype=torch.float32, device=device),
            torch.zeros(rows, dtype=torch.int64, device=device),
            tuple(torch.zeros((rows, width), dtype=torch.int32, device=device) for width in max_blocks),
        )

    def bucket(self, size: int) -> "DecodeInputs":
        """The first `size` rows: views, at the same addresses at every step."""
        return DecodeInputs(
            self.token_ids[:size], self.seq_lens[:size], self.query_start_loc[: size + 1], self.row_ids[:size],
            self.num_rows, self.temperatures[:size], self.noise_keys[:size],
            tuple(table[:size] for table in self.block_tables),
        )  # fmt: skip

    def fill(
        self,
        token_ids: torch.Tensor,
        seq_lens: torch.Tensor,
        temperatures: torch.Tensor,
        noise_keys: torch.Tensor,
        num_rows: torch.Tensor,
        block_tables: Sequence[torch.Tensor],
    ) -> None:
        """Copy one step's arrays (on the buffers' device) into the first rows; the padding rows keep theirs.

        A table narrower than the buffer fills its first columns: the columns past it are never read,
        since every length fits the table it came with.
        """
        n = token_ids.shape[0]
        self.token_ids[:n].copy_(token_ids)
        self.seq_lens[:n].copy_(seq_lens)
        self.temperatures[:n].copy_(temperatures)
        self.noise_keys[:n].copy_(noise_keys)
        self.num_rows.copy_(num_rows)
        for buffer, table in zip(self.block_tables, block_tables, strict=True):
            buffer[:n, : table.shape[1]].copy_(table)


class DecodeGraphs:
    """The decode body of each bucket, run eagerly or replayed from the CUDA graph `capture` recorded.

    `body(inputs)` computes a step from `inputs.bucket(size)` and returns its static outputs; it must
    launch the same work for the same size whatever the buffers hold (no host-side branch on values).
    """

    def __init__(self, inputs: DecodeInputs, sizes: Sequence[int], body: Callable[[DecodeInputs], DecodeOutputs]):
        if not sizes or min(sizes) < 1 or max(sizes) > inputs.token_ids.shape[0]:
            raise ValueError(f"batch sizes must lie in [1, {inputs.token_ids.shape[0]}], got {list(sizes)}")
        self.inputs = inputs
        self.sizes = tuple(sorted(set(sizes)))
        self.body = body
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, DecodeOutputs]] = {}

    def bucket_of(self, num_rows: int) -> int | None:
        """The smallest batch size that holds `num_rows` requests; None when none does."""
        index = bisect.bisect_left(self.sizes, num_rows)
        return self.sizes[index] if index < len(self.sizes) else None

    def capture(self, warmup_runs: int = 2) -> None:
        """Record one CUDA graph per batch size, largest first, all in one memory pool.

        Each size runs `warmup_runs` times eagerly first (compiling its kernels, settling the
        allocator) with no real row, so nothing is written to the KV cache.
        """
        device = self.inputs.token_ids.device
        assert device.type == "cuda", "CUDA graphs need a CUDA device"
        self.inputs.num_rows.zero_()
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.sizes):
            inputs = self.inputs.bucket(size)
            for _ in range(warmup_runs):
                self.body(inputs)
            torch.cuda.synchronize(device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                outputs = self.body(inputs)
            self.graphs[size] = (graph, outputs)
        torch.cuda.synchronize(device)

    def run(self, size: int) -> DecodeOutputs:
        """The outputs of bucket `size` for what the inputs hold now: a graph replay, or the body run eagerly."""
        captured = self.graphs.get(size)
        if captured is None:
            return self.body(self.inputs.bucket(size))
        graph, outputs = captured
        graph.replay()
        return outputs
