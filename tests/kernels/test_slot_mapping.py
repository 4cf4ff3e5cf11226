"""slot_mapping: the Triton kernel and the torch reference agree with a per-token loop."""

from __future__ import annotations

import pytest
import torch
from devices import DEVICE  # "cuda" when torch has a GPU, else "cpu" (kernels in the interpreter)
from sm90_support import compile_for_sm90

from kernels.slot_mapping import _BLOCK, _slot_mapping_kernel, slot_mapping, slot_mapping_reference

# Kernels run on DEVICE; bad-argument tests stay on the CPU: they raise before any launch.

IMPLS = [slot_mapping, slot_mapping_reference]
BLOCK_SIZES = [1, 8, 16]
# name: (query length, first position) per request. A first position above 0
# means a prefix of the request is already in the cache.
BATCHES = {
    "mixed": [(1, 37), (5, 0), (16, 9)],
    "empty_request": [(5, 3), (0, 20), (1, 0), (16, 40)],
    "decode": [(1, p) for p in (0, 3, 15, 16, 17, 31, 32, 63, 8)],
    "one_prefill": [(16, 21)],
}


def make_batch(
    requests: list[tuple[int, int]], block_size: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """block_table (distinct block ids in a random order, spare columns), query_start_loc, positions."""
    max_blocks = max(-(-(start + length) // block_size) for length, start in requests) + 2
    num_reqs = len(requests)
    g = torch.Generator().manual_seed(seed)
    block_table = (torch.randperm(num_reqs * max_blocks, generator=g) + 1).to(torch.int32).view(num_reqs, max_blocks)
    lengths = torch.tensor([length for length, _ in requests])
    query_start_loc = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]).to(torch.int32)
    positions = torch.cat([torch.arange(start, start + length) for length, start in requests])
    return block_table, query_start_loc, positions


def loop_slots(block_table, query_start_loc, positions, block_size, num_slots) -> torch.Tensor:
    """An independent slot mapping: one token at a time, in plain Python."""
    table, starts, pos = block_table.tolist(), query_start_loc.tolist(), positions.tolist()
    slots = [-1] * num_slots
    for req in range(len(table)):
        for t in range(starts[req], starts[req + 1]):
            slots[t] = table[req][pos[t] // block_size] * block_size + pos[t] % block_size
    return torch.tensor(slots, dtype=torch.int64)


@pytest.mark.parametrize("num_padding", [0, 7])
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("batch", BATCHES)
def test_kernel_and_reference_agree_with_a_loop(batch, block_size, num_padding) -> None:
    block_table, query_start_loc, positions = make_batch(BATCHES[batch], block_size, seed=block_size)
    num_slots = positions.shape[0] + num_padding
    expected = loop_slots(block_table, query_start_loc, positions, block_size, num_slots)

    args = (block_table.to(DEVICE), query_start_loc.to(DEVICE), positions.to(DEVICE), block_size, num_slots)
    for impl in IMPLS:
        slots = impl(*args)
        assert slots.dtype == torch.int64 and slots.device.type == DEVICE
        assert torch.equal(slots.cpu(), expected)


@pytest.mark.parametrize("impl", IMPLS)
def test_slots_span_several_programs(impl) -> None:
    """More slots than one program covers (1024), with the padded tail split across programs."""
    block_table, query_start_loc, positions = make_batch([(600, 100), (1, 4), (500, 0)], 16, seed=3)
    num_slots = 2100
    expected = loop_slots(block_table, query_start_loc, positions, 16, num_slots)
    args = (block_table.to(DEVICE), query_start_loc.to(DEVICE), positions.to(DEVICE))
    assert torch.equal(impl(*args, 16, num_slots).cpu(), expected)


@pytest.mark.parametrize("impl", IMPLS)
def test_num_slots_defaults_to_num_tokens(impl) -> None:
    block_table, query_start_loc, positions = make_batch(BATCHES["mixed"], 8, seed=0)
    slots = impl(block_table.to(DEVICE), query_start_loc.to(DEVICE), positions.to(DEVICE), 8).cpu()
    assert torch.equal(slots, loop_slots(block_table, query_start_loc, positions, 8, positions.shape[0]))


@pytest.mark.parametrize("impl", IMPLS)
def test_an_empty_batch_is_all_padding(impl) -> None:
    block_table = torch.zeros(0, 4, dtype=torch.int32, device=DEVICE)
    query_start_loc = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    positions = torch.zeros(0, dtype=torch.int64, device=DEVICE)
    assert torch.equal(impl(block_table, query_start_loc, positions, 16, 5).cpu(), torch.full((5,), -1))
    assert impl(block_table, query_start_loc, positions, 16).shape == (0,)


# (argument the error names, what is wrong, call arguments built from a good call's)
BAD_CALLS = [
    ("block_table", "int64", lambda bt, q, p: (bt.long(), q, p, 8)),
    ("block_table", "1-D", lambda bt, q, p: (bt[0], q, p, 8)),
    ("query_start_loc", "int64", lambda bt, q, p: (bt, q.long(), p, 8)),
    ("query_start_loc", "length", lambda bt, q, p: (bt, q[:-1], p, 8)),
    ("query_start_loc", "not from 0", lambda bt, q, p: (bt, q + 1, p, 8)),
    ("query_start_loc", "short of num_tokens", lambda bt, q, p: (bt, q, torch.cat([p, p[:1]]), 8)),
    ("query_start_loc", "decreasing", lambda bt, q, p: (bt, torch.tensor([0, 6, 1, 22], dtype=torch.int32), p, 8)),
    ("positions", "int32", lambda bt, q, p: (bt, q, p.int(), 8)),
    ("positions", "negative", lambda bt, q, p: (bt, q, p - 1, 8)),
    ("positions", "past the table", lambda bt, q, p: (bt, q, p + 8 * bt.shape[1], 8)),
    ("block_size", "zero", lambda bt, q, p: (bt, q, p, 0)),
    ("block_size", "float", lambda bt, q, p: (bt, q, p, 8.0)),
    ("num_slots", "below num_tokens", lambda bt, q, p: (bt, q, p, 8, p.shape[0] - 1)),
]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("name,problem,make_args", BAD_CALLS, ids=[f"{n}-{p}" for n, p, _ in BAD_CALLS])
def test_bad_arguments_raise_value_error_naming_the_argument(impl, name, problem, make_args) -> None:
    block_table, query_start_loc, positions = make_batch(BATCHES["mixed"], 8, seed=0)
    with pytest.raises(ValueError, match=name):
        impl(*make_args(block_table, query_start_loc, positions))


def test_kernel_compiles_for_sm90(tmp_path) -> None:
    """The interpreter accepts what a GPU compiler refuses."""
    signature = {name: "i32" for name in _slot_mapping_kernel.arg_names}
    signature.update(block_table_ptr="*i32", query_start_loc_ptr="*i32", positions_ptr="*i64", slots_ptr="*i64")
    # num_reqs, num_tokens, num_slots, num_search_steps and the row stride are never specialised.
    ones = {"block_size": 1, "positions_stride": 1, "query_start_loc_stride": 1}
    variants = [{"BLOCK": _BLOCK}, {"BLOCK": _BLOCK, **ones}]
    compile_for_sm90(_slot_mapping_kernel, signature, variants, tmp_path)
