"""slot_mapping: the cache slot of every token of a batch, from the block tables.

For token t of the batch, belonging to request `req` (the one with
`query_start_loc[req] <= t < query_start_loc[req + 1]`), at absolute position
`pos = positions[t]` of that request:

    slot[t] = block_table[req, pos // block_size] * block_size + pos % block_size

and `slot[t] = -1` for the padded tail `num_tokens <= t < num_slots`.

Tokens are spread over programs evenly, whatever the batch's mix of prefill
and decode: each program takes BLOCK consecutive tokens and finds each one's
request by a binary search over query_start_loc (ceil(log2(num_reqs)) steps).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 1024


# The sizes of a batch (and the table width, its row stride) change every step: never
# specialised, so no batch shape compiles a new variant.
@triton.jit(do_not_specialize=["block_table_stride_req", "num_reqs", "num_tokens", "num_slots", "num_search_steps"])
def _slot_mapping_kernel(
    block_table_ptr,
    block_table_stride_req,
    block_table_stride_block,
    query_start_loc_ptr,
    query_start_loc_stride,
    positions_ptr,
    positions_stride,
    slots_ptr,
    num_reqs,
    num_tokens,
    num_slots,
    block_size,
    num_search_steps,
    BLOCK: tl.constexpr,
):
    tokens = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    is_token = tokens < num_tokens

    # req = the largest r < num_reqs with query_start_loc[r] <= token. The
    # window [req, req + size) always holds the answer and stays inside
    # [0, num_reqs), so every probe reads a real entry; an empty request
    # (query_start_loc[r] == query_start_loc[r + 1]) is passed over because
    # the search keeps the last start <= token.
    req = tl.zeros([BLOCK], dtype=tl.int64)
    size = num_reqs
    for _ in range(num_search_steps):
        half = size // 2
        probe = req + half
        start = tl.load(query_start_loc_ptr + probe * query_start_loc_stride)
        req = tl.where(start <= tokens, probe, req)
        size -= half

    positions = tl.load(positions_ptr + tokens * positions_stride, mask=is_token, other=0)
    block_ids = tl.load(
        block_table_ptr + req * block_table_stride_req + (positions // block_size) * block_table_stride_block,
        mask=is_token,
        other=0,
    ).to(tl.int64)
    slots = block_ids * block_size + positions % block_size
    slots = tl.where(is_token, slots, -1)
    tl.store(slots_ptr + tokens, slots, mask=tokens < num_slots)


def slot_mapping(
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    positions: torch.Tensor,
    block_size: int,
    num_slots: int | None = None,
) -> torch.Tensor:
    """The int64 `[num_slots]` slot of each token, -1 on the padded tail.

    block_table: int32 `[num_reqs, max_blocks]`, row i for request i.
    query_start_loc: int32 `[num_reqs + 1]`, non-decreasing from 0 to
    num_tokens. positions: int64 `[num_tokens]`, each token's absolute
    position within its request, below `max_blocks * block_size`.
    num_slots: the length of the result (default num_tokens, at least
    num_tokens). All tensors on one device; values are checked when they are
    on the CPU (a check on a GPU would wait for the device). Mutates nothing.

    Grid: one program per 1024 slots.
    """
    num_slots = _check_args(block_table, query_start_loc, positions, block_size, num_slots)
    num_tokens = positions.shape[0]
    slots = torch.empty(num_slots, dtype=torch.int64, device=positions.device)
    if num_tokens == 0:
        return slots.fill_(-1)
    num_reqs = block_table.shape[0]
    _slot_mapping_kernel[(triton.cdiv(num_slots, _BLOCK),)](
        block_table,
        *block_table.stride(),
        query_start_loc,
        query_start_loc.stride(0),
        positions,
        positions.stride(0),
        slots,
        num_reqs,
        num_tokens,
        num_slots,
        block_size,
        (num_reqs - 1).bit_length(),  # ceil(log2(num_reqs)) halvings
        BLOCK=_BLOCK,
    )
    return slots


def slot_mapping_reference(
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    positions: torch.Tensor,
    block_size: int,
    num_slots: int | None = None,
) -> torch.Tensor:
    """Torch twin of `slot_mapping`: same arguments, same contract, same result."""
    num_slots = _check_args(block_table, query_start_loc, positions, block_size, num_slots)
    num_tokens = positions.shape[0]
    num_reqs = block_table.shape[0]
    device = positions.device
    reqs = torch.repeat_interleave(
        torch.arange(num_reqs, device=device), query_start_loc.diff(), output_size=num_tokens
    )
    block_ids = block_table[reqs, positions // block_size].to(torch.int64)
    slots = torch.full((num_slots,), -1, dtype=torch.int64, device=device)
    slots[:num_tokens] = block_ids * block_size + positions % block_size
    return slots


def _check_args(
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    positions: torch.Tensor,
    block_size: int,
    num_slots: int | None,
) -> int:
    """Raise ValueError on a malformed call; return num_slots with its default filled in."""
    if block_table.dtype != torch.int32 or block_table.dim() != 2:
        raise ValueError(
            f"block_table must be int32 [num_reqs, max_blocks], got {block_table.dtype} {tuple(block_table.shape)}"
        )
    num_reqs, max_blocks = block_table.shape
    if query_start_loc.dtype != torch.int32 or tuple(query_start_loc.shape) != (num_reqs + 1,):
        raise ValueError(
            f"query_start_loc must be int32 [num_reqs + 1] = [{num_reqs + 1}], "
            f"got {query_start_loc.dtype} {tuple(query_start_loc.shape)}"
        )
    if positions.dtype != torch.int64 or positions.dim() != 1:
        raise ValueError(f"positions must be int64 [num_tokens], got {positions.dtype} {tuple(positions.shape)}")
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    num_tokens = positions.shape[0]
    if num_slots is None:
        num_slots = num_tokens
    elif isinstance(num_slots, bool) or not isinstance(num_slots, int) or num_slots < num_tokens:
        raise ValueError(f"num_slots must be an int >= num_tokens = {num_tokens}, got {num_slots!r}")
    for name, tensor in (("block_table", block_table), ("query_start_loc", query_start_loc)):
        if tensor.device != positions.device:
            raise ValueError(f"{name} must be on positions' device {positions.device}, got {tensor.device}")
    if positions.device.type == "cpu":
        if int(query_start_loc[0]) != 0 or int(query_start_loc[-1]) != num_tokens:
            raise ValueError(f"query_start_loc must run from 0 to num_tokens = {num_tokens}")
        if bool((query_start_loc.diff() < 0).any()):
            raise ValueError("query_start_loc must be non-decreasing")
        if num_tokens and (int(positions.min()) < 0 or int(positions.max()) >= max_blocks * block_size):
            raise ValueError(
                f"positions must lie in [0, {max_blocks * block_size}) (max_blocks * block_size of block_table)"
            )
    return num_slots
