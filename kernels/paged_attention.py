"""Unified varlen paged attention: prefill and decode tokens of one batch in one launch.

Token j (0-based) of request r, whose query has `q = query_start_loc[r + 1] - query_start_loc[r]`
tokens, sits at position `p = seq_lens[r] - q + j`; its own K/V are already in the cache. It
attends to the KV positions

    k <= p                         (causal)
    k >  p - sliding_window        (only when sliding_window > 0: the window's most recent keys)

and the output is `softmax(scale * q . K^T) V` over those positions, in the query's dtype.

Positions map to the cache through the request's block table:

    position k  ->  kv_cache[block_table[r, k // block_size], :, k % block_size]

Only positions in that range are ever read (the loads themselves are masked), so blocks a
request does not own, the unused tail of its last block, and blocks a sliding window has
given back may hold anything, NaN included.

`paged_attention` is the Triton launcher and `paged_attention_reference` the torch version
(the "torch" backend on a CPU); both take the same arguments. `paged_attention_config` is the
one place launch parameters are chosen, `paged_attention_launches` the exact launches the
launcher makes, so that an offline compile for a GPU builds what runs on it, and
`paged_attention_variants` every distinct pair of compiled kernels the launcher can choose, so
that a worker compiles them all before it serves (`kernels.warmup`).

Triton compiles a kernel once per combination of its constexprs, launch options and the
specialisation of its other arguments (an int equal to 1 or divisible by 16 becomes a
compile-time fact). Sizes that change from step to step (`num_reqs`, `num_kv_splits`, the block
table's row stride) are therefore `do_not_specialize`: a new batch shape never compiles.

It stays one module past 700 lines: the two kernels, the config, the launch list, the launcher
and the reference share the tile and split parameters and the position rules above, and are read
together. A second attention kernel would be the point to move config and launch planning out.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

_LOG2_E = 1.4426950408889634
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# Split-KV bounds: each split gets at least this many keys, and at most this many splits.
_MIN_KEYS_PER_SPLIT = 256
_MAX_KV_SPLITS = 32


# Per program: one request, BLOCK_Q of its query tokens, and the G = num_q_heads / num_kv_heads
# query heads that share one KV head, packed as the M rows of the dot (row m is token m // G,
# head m % G; BLOCK_M = next power of two >= BLOCK_Q * G, at least 16), over one of the
# NUM_KV_SPLITS segments of that tile's KV range. Keys are tiled by position, BLOCK_N at a
# time; each key's physical slot is gathered from the block table, so no dot dimension
# depends on the block size. Online softmax in base 2 (scale folded with log2 e):
#
#     m' = max(m, max_j s_j)        p_j = 2^(s_j - m')        alpha = 2^(m - m')
#     l' = l * alpha + sum_j p_j    acc' = acc * alpha + p V
#
# With one split the program writes acc / l. With several it writes acc / l and
# lse = m + log2 l to fp32 buffers; `_merge_kv_splits_kernel` combines them.
@triton.jit(do_not_specialize=["num_reqs", "num_kv_splits", "stride_bt"])
def _paged_attention_kernel(
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    query_ptr,
    kv_cache_ptr,
    block_table_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    scale_log2,
    num_reqs,
    num_q_heads,
    num_kv_splits,
    stride_qt,
    stride_qh,
    stride_qd,
    stride_ot,
    stride_oh,
    stride_od,
    stride_cb,
    stride_ckv,
    stride_cs,
    stride_ch,
    stride_cd,
    stride_bt,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    NUM_QUERIES_PER_KV: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SLIDING_WINDOW: tl.constexpr,
    WRITE_PARTIAL: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    tile_id = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    # Request r owns the query tiles starting at query_start_loc[r] // BLOCK_Q + r: enough
    # for its tokens, so the grid is sized from shapes alone. Find r by binary search.
    lo = 0
    hi = num_reqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_tile = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        go_right = first_tile <= tile_id
        lo = tl.where(go_right, mid + 1, lo)
        hi = tl.where(go_right, hi, mid)
    req = lo - 1
    q_start = tl.load(query_start_loc_ptr + req)
    q_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    q_tile = tile_id - (q_start // BLOCK_Q + req)
    if q_tile * BLOCK_Q >= q_len:
        return
    context_len = tl.load(seq_lens_ptr + req) - q_len

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM_P)
    offs_n = tl.arange(0, BLOCK_N)
    q_idx = q_tile * BLOCK_Q + offs_m // NUM_QUERIES_PER_KV
    head = kv_head * NUM_QUERIES_PER_KV + offs_m % NUM_QUERIES_PER_KV
    row_ok = (offs_m < BLOCK_Q * NUM_QUERIES_PER_KV) & (q_idx < q_len)
    d_ok = offs_d < HEAD_DIM
    token = (q_start + q_idx).to(tl.int64)
    q_mask = row_ok[:, None] & d_ok[None, :]
    q = tl.load(
        query_ptr + token[:, None] * stride_qt + head[:, None].to(tl.int64) * stride_qh + offs_d[None, :] * stride_qd,
        mask=q_mask,
        other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)
    pos = context_len + q_idx

    # KV range of the whole tile: [kv_begin, kv_end), then this split's share of its
    # BLOCK_N-aligned key tiles.
    kv_end = context_len + tl.minimum(q_tile * BLOCK_Q + BLOCK_Q, q_len)
    if SLIDING_WINDOW > 0:
        kv_begin = tl.maximum(context_len + q_tile * BLOCK_Q - SLIDING_WINDOW + 1, 0)
    else:
        kv_begin = 0
    first_kv_tile = kv_begin // BLOCK_N
    num_kv_tiles = tl.cdiv(kv_end, BLOCK_N) - first_kv_tile
    tiles_per_split = tl.cdiv(num_kv_tiles, num_kv_splits)
    tile_lo = first_kv_tile + split * tiles_per_split
    tile_hi = tl.minimum(tile_lo + tiles_per_split, first_kv_tile + num_kv_tiles)

    block_table_row = block_table_ptr + req.to(tl.int64) * stride_bt
    head_offset = kv_head.to(tl.int64) * stride_ch
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_P], tl.float32)
    for kv_tile in range(tile_lo, tile_hi):
        k_pos = kv_tile * BLOCK_N + offs_n
        k_ok = (k_pos >= kv_begin) & (k_pos < kv_end)
        block_id = tl.load(block_table_row + k_pos // BLOCK_SIZE, mask=k_ok, other=0)
        slot = block_id.to(tl.int64) * stride_cb + (k_pos % BLOCK_SIZE).to(tl.int64) * stride_cs + head_offset
        k = tl.load(
            kv_cache_ptr + slot[None, :] + offs_d[:, None] * stride_cd,
            mask=k_ok[None, :] & d_ok[:, None],
            other=0.0,
        )
        v = tl.load(
            kv_cache_ptr + stride_ckv + slot[:, None] + offs_d[None, :] * stride_cd,
            mask=k_ok[:, None] & d_ok[None, :],
            other=0.0,
        )
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, k, input_precision=DOT_PRECISION) * scale_log2
        visible = k_pos[None, :] <= pos[:, None]
        if SLIDING_WINDOW > 0:
            visible = visible & (k_pos[None, :] > pos[:, None] - SLIDING_WINDOW)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row that has seen no visible key yet keeps m = -inf: shift by 0 there, not by -inf.
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - m_shift[:, None])
        alpha = tl.math.exp2(m_i - m_shift)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    acc = acc / l_safe[:, None]
    if WRITE_PARTIAL:
        # Buffers [num_tokens, num_q_heads, num_kv_splits, HEAD_DIM] and [..., num_kv_splits].
        row = (token * num_q_heads + head) * num_kv_splits + split
        tl.store(part_out_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=q_mask)
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.math.log2(l_safe))
        tl.store(part_lse_ptr + row, lse, mask=row_ok)
    else:
        tl.store(
            out_ptr + token[:, None] * stride_ot + head[:, None].to(tl.int64) * stride_oh + offs_d[None, :] * stride_od,
            acc.to(out_ptr.dtype.element_ty),
            mask=q_mask,
        )


# out = sum_s 2^(lse_s - M) o_s / sum_s 2^(lse_s - M), M = max_s lse_s; a split that saw no
# key has lse = -inf and weight 0. One program: one token, BLOCK_H heads, all splits. Programs
# of tokens past query_start_loc[num_reqs] exit: their rows of `out` stay unwritten.
@triton.jit(do_not_specialize=["num_reqs", "num_kv_splits"])
def _merge_kv_splits_kernel(
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    query_start_loc_ptr,
    num_reqs,
    num_q_heads,
    num_kv_splits,
    stride_ot,
    stride_oh,
    stride_od,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P: tl.constexpr,
    BLOCK_H: tl.constexpr,
    SPLITS_P: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    if token >= tl.load(query_start_loc_ptr + num_reqs):
        return
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_s = tl.arange(0, SPLITS_P)
    offs_d = tl.arange(0, HEAD_DIM_P)
    h_ok = offs_h < num_q_heads
    hs_ok = h_ok[:, None] & (offs_s[None, :] < num_kv_splits)
    row = (token * num_q_heads + offs_h[:, None]) * num_kv_splits + offs_s[None, :]
    lse = tl.load(part_lse_ptr + row, mask=hs_ok, other=float("-inf"))
    lse_max = tl.max(lse, 1)
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)
    weight = tl.math.exp2(lse - lse_max[:, None])
    total = tl.sum(weight, 1)
    total = tl.where(total == 0.0, 1.0, total)
    hsd_ok = hs_ok[:, :, None] & (offs_d[None, None, :] < HEAD_DIM)
    part = tl.load(part_out_ptr + row[:, :, None] * HEAD_DIM + offs_d[None, None, :], mask=hsd_ok, other=0.0)
    merged = tl.sum(part * weight[:, :, None], 1) / total[:, None]
    tl.store(
        out_ptr + token * stride_ot + offs_h[:, None].to(tl.int64) * stride_oh + offs_d[None, :] * stride_od,
        merged.to(out_ptr.dtype.element_ty),
        mask=h_ok[:, None] & (offs_d[None, :] < HEAD_DIM),
    )


# True when this module's kernels were built for Triton's CPU interpreter (TRITON_INTERPRET=1
# when it was imported: Triton decides then). The interpreter computes bf16 arithmetic wrongly,
# so the launcher upcasts loaded tiles to fp32 exactly then; fixed once, at import.
INTERPRETED: bool = isinstance(_paged_attention_kernel, InterpretedFunction)

if INTERPRETED:
    # Triton imports its gluon package lazily, at the first launch, and that import requires the
    # interpreter to be on at that moment (Triton 3.7 asserts it): import it now, while
    # TRITON_INTERPRET is set, so that a later change of the variable cannot break a launch.
    try:
        import triton.experimental.gluon  # noqa: F401
    except ImportError:  # a Triton without gluon imports nothing lazily
        pass


class PagedAttentionConfig(NamedTuple):
    """Launch parameters of one paged attention call (see `paged_attention_config`)."""

    block_m: int  # rows of the dot: block_q tokens x the query heads of one KV head, padded
    block_q: int  # query tokens per program
    block_n: int  # keys per inner iteration
    num_warps: int
    num_stages: int
    num_kv_splits: int
    merge_block_h: int  # query heads per program of the merge kernel
    merge_num_warps: int


class Launch(NamedTuple):
    """One kernel launch: `kernel[grid](*args, **kwargs)`; kwargs hold constexprs and launch options."""

    kernel: Any
    grid: tuple[int, ...]
    args: tuple
    kwargs: dict


def paged_attention_config(
    num_tokens: int,
    num_reqs: int,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    max_kv_len: int,
    num_sms: int,
    num_kv_splits: int | None = None,
    dtype: torch.dtype = torch.bfloat16,
) -> PagedAttentionConfig:
    """Tile sizes, warps and KV splits, from shapes only (no device sync, no driver call).

    `max_kv_len` bounds the longest request (the launcher passes block table width x block
    size). With `num_kv_splits=None`, decode-shaped batches whose programs would not fill
    `num_sms` several times over split the KV range, each split keeping at least
    `_MIN_KEYS_PER_SPLIT` keys; prefill-sized batches have programs enough and never split.
    float32 (exact fp32 dots, no tensor-core shortcut) takes the smallest tiles: larger ones
    spill registers on sm_90.
    """
    group = num_q_heads // num_kv_heads
    avg_query_len = -(-num_tokens // max(num_reqs, 1))
    max_block_m = 16 if dtype == torch.float32 else 64
    block_m = min(max_block_m, max(16, triton.next_power_of_2(avg_query_len * group)))
    block_m = max(block_m, triton.next_power_of_2(group))
    block_q = block_m // group
    head_dim_p = _head_dim_p(head_dim)
    if dtype == torch.float32:
        block_n = 16
    else:
        block_n = 64 if head_dim_p <= 128 else 32
    decode_shaped = avg_query_len * group <= 16
    num_warps = 4
    num_stages = 3 if decode_shaped else 2

    if num_kv_splits is None:
        busy_tiles = max(-(-num_tokens // block_q), min(num_tokens, num_reqs))
        programs = max(busy_tiles * num_kv_heads, 1)
        wanted = -(-4 * num_sms // programs)
        num_kv_splits = max(1, min(wanted, max_kv_len // _MIN_KEYS_PER_SPLIT, _MAX_KV_SPLITS))
    splits_p = triton.next_power_of_2(num_kv_splits)
    merge_block_h = max(1, min(triton.next_power_of_2(num_q_heads), 4096 // (splits_p * head_dim_p)))
    return PagedAttentionConfig(block_m, block_q, block_n, num_warps, num_stages, num_kv_splits, merge_block_h, 4)


def compile_variant(config: PagedAttentionConfig) -> PagedAttentionConfig:
    """The config with the same compiled kernels as `config` whose `num_kv_splits` is a power of two.

    The split count reaches the compiled kernels only as `splits > 1` (the main kernel's
    WRITE_PARTIAL) and as the merge kernel's SPLITS_P, its next power of two (which also sets
    `merge_block_h`); the count itself is a runtime argument that is never specialised.
    """
    return config._replace(num_kv_splits=triton.next_power_of_2(config.num_kv_splits))


def paged_attention_variants(
    num_q_heads: int, num_kv_heads: int, head_dim: int, max_kv_len: int, dtype: torch.dtype
) -> list[PagedAttentionConfig]:
    """Every `compile_variant` of the configs `paged_attention_config` can choose, without repeats.

    Covers every batch whose block table spans at most `max_kv_len` keys, any number of tokens
    and requests, any SM count, with automatic splits (`num_kv_splits=None`). May hold a variant
    no batch reaches (split counts are taken up to the cap whatever the SM count), never miss one.
    """
    max_splits = max(1, min(max_kv_len // _MIN_KEYS_PER_SPLIT, _MAX_KV_SPLITS))
    split_counts = [1 << i for i in range(triton.next_power_of_2(max_splits).bit_length())]
    # The tiles depend on the average query length only through next_power_of_2(avg * group),
    # which grows with avg: the ends of each interval (2^k, 2^(k+1)] of avg, cut at max_kv_len,
    # give every value it takes there.
    ends = {n for k in range(max_kv_len.bit_length()) for n in (1 << k, (1 << k) + 1)}
    avg_query_lens = sorted({n for n in ends if n <= max_kv_len} | {max_kv_len})
    variants = {}
    for avg_query_len in avg_query_lens:
        for splits in split_counts:
            config = paged_attention_config(avg_query_len, 1, num_q_heads, num_kv_heads, head_dim, max_kv_len,
                                            num_sms=1, num_kv_splits=splits, dtype=dtype)
            variants[compile_variant(config)] = None
    return list(variants)


def _head_dim_p(head_dim: int) -> int:
    return max(16, triton.next_power_of_2(head_dim))


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


def _check_args(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    sliding_window: int,
    num_kv_splits: int | None,
) -> None:
    """Shape, dtype and device checks that need no look at the data; ValueError names the argument."""
    if query.dim() != 3:
        raise ValueError(f"query must be [num_tokens, num_q_heads, head_dim], got shape {tuple(query.shape)}")
    if kv_cache.dim() != 5 or kv_cache.shape[1] != 2:
        raise ValueError(
            f"kv_cache must be [num_blocks, 2, block_size, num_kv_heads, head_dim], got shape {tuple(kv_cache.shape)}"
        )
    num_q_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads = kv_cache.shape[3]
    if kv_cache.shape[4] != head_dim:
        raise ValueError(f"kv_cache head_dim {kv_cache.shape[4]} differs from query head_dim {head_dim}")
    if num_kv_heads == 0 or num_q_heads % num_kv_heads:
        raise ValueError(f"query heads ({num_q_heads}) must be a multiple of kv_cache heads ({num_kv_heads})")
    if query.dtype not in _DTYPES:
        raise ValueError(f"query dtype must be float16, bfloat16 or float32, got {query.dtype}")
    if kv_cache.dtype != query.dtype:
        raise ValueError(f"kv_cache dtype {kv_cache.dtype} differs from query dtype {query.dtype}")
    for name, t, dim in (("block_table", block_table, 2), ("query_start_loc", query_start_loc, 1),
                         ("seq_lens", seq_lens, 1)):
        if t.dim() != dim or t.dtype != torch.int32:
            raise ValueError(f"{name} must be a {dim}-D int32 tensor, got {t.dim()}-D {t.dtype}")
        if t.device != query.device:
            raise ValueError(f"{name} is on {t.device}, query on {query.device}")
    if kv_cache.device != query.device:
        raise ValueError(f"kv_cache is on {kv_cache.device}, query on {query.device}")
    num_reqs = seq_lens.shape[0]
    if query_start_loc.shape[0] != num_reqs + 1:
        raise ValueError(
            f"query_start_loc must have num_reqs + 1 = {num_reqs + 1} entries, got {query_start_loc.shape[0]}"
        )
    if block_table.shape[0] < num_reqs:
        raise ValueError(f"block_table has {block_table.shape[0]} rows for {num_reqs} requests")
    if block_table.shape[1] > 1 and block_table.stride(1) != 1:
        raise ValueError(
            f"block_table must have unit stride along a row (block_table.stride(1) == 1), got strides "
            f"{tuple(block_table.stride())}: pass block_table.contiguous()"
        )
    if sliding_window < 0:
        raise ValueError(f"sliding_window must be >= 0 (0: no window), got {sliding_window}")
    if num_kv_splits is not None and num_kv_splits < 1:
        raise ValueError(f"num_kv_splits must be >= 1 or None, got {num_kv_splits}")


def paged_attention_launches(
    out: torch.Tensor,
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int,
    config: PagedAttentionConfig,
    upcast: bool,
) -> list[Launch]:
    """The kernel launches that write attention into `out`, in order (allocates the split buffers)."""
    num_tokens, num_q_heads, head_dim = query.shape
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    num_reqs = seq_lens.shape[0]
    group = num_q_heads // num_kv_heads
    assert 1 <= config.block_q and config.block_q * group <= config.block_m, config
    assert min(config.block_m, config.block_n) >= 16, config  # tl.dot needs every dimension >= 16
    head_dim_p = _head_dim_p(head_dim)
    splits = config.num_kv_splits
    if splits > 1:
        part_out = torch.empty((num_tokens, num_q_heads, splits, head_dim), dtype=torch.float32, device=query.device)
        part_lse = torch.empty((num_tokens, num_q_heads, splits), dtype=torch.float32, device=query.device)
    else:
        part_out = part_lse = out  # not read: WRITE_PARTIAL is off
    grid = (num_tokens // config.block_q + num_reqs, num_kv_heads, splits)
    main = Launch(
        _paged_attention_kernel,
        grid,
        (
            out, part_out, part_lse, query, kv_cache, block_table, query_start_loc, seq_lens,
            scale * _LOG2_E, num_reqs, num_q_heads, splits,
            *query.stride(), *out.stride(), *kv_cache.stride(), block_table.stride(0),
        ),
        dict(
            HEAD_DIM=head_dim,
            HEAD_DIM_P=head_dim_p,
            BLOCK_SIZE=block_size,
            NUM_QUERIES_PER_KV=group,
            BLOCK_M=config.block_m,
            BLOCK_Q=config.block_q,
            BLOCK_N=config.block_n,
            SLIDING_WINDOW=sliding_window,
            WRITE_PARTIAL=splits > 1,
            UPCAST=upcast,
            DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
            num_warps=config.num_warps,
            num_stages=config.num_stages,
        ),
    )
    if splits == 1:
        return [main]
    merge = Launch(
        _merge_kv_splits_kernel,
        (num_tokens, triton.cdiv(num_q_heads, config.merge_block_h)),
        (out, part_out, part_lse, query_start_loc, num_reqs, num_q_heads, splits, *out.stride()),
        dict(
            HEAD_DIM=head_dim,
            HEAD_DIM_P=head_dim_p,
            BLOCK_H=config.merge_block_h,
            SPLITS_P=triton.next_power_of_2(splits),
            num_warps=config.merge_num_warps,
        ),
    )
    return [main, merge]


def paged_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = 0,
    num_kv_splits: int | None = None,
) -> torch.Tensor:
    """Attention of every query token over its request's paged KV (Triton); a new tensor like `query`.

    Needs, unchecked (checking would sync with the device): `0 <= query lengths <= seq_lens`,
    `seq_lens[r] <= block_table.shape[1] * block_size`, and the K/V of every position a token
    sees already stored. Tokens past `query_start_loc[-1]` are left unwritten. Checked: shapes,
    dtypes, devices, and block table rows of unit stride (any row stride: a slice of a wider table).
    """
    sliding_window = sliding_window or 0  # None, as a group config without a window says
    _check_args(query, kv_cache, block_table, query_start_loc, seq_lens, sliding_window, num_kv_splits)
    out = torch.empty_like(query)
    num_reqs = seq_lens.shape[0]
    if query.shape[0] == 0 or num_reqs == 0:
        return out
    config = paged_attention_config(
        query.shape[0], num_reqs, query.shape[1], kv_cache.shape[3], query.shape[2],
        max_kv_len=block_table.shape[1] * kv_cache.shape[2],
        num_sms=_num_sms(query.device),
        num_kv_splits=num_kv_splits,
        dtype=query.dtype,
    )
    launches = paged_attention_launches(
        out, query, kv_cache, block_table, query_start_loc, seq_lens, scale, sliding_window, config,
        upcast=INTERPRETED,
    )
    for launch in launches:
        launch.kernel[launch.grid](*launch.args, **launch.kwargs)
    return out


# The reference cuts each request's query tokens into segments and attends segments of similar
# shape together, padded to one shape (a group): one gather each of the group's K and V blocks,
# one masked softmax, whatever the number of requests. Sizes count the fp32 elements of a group's
# workspace: gathered K/V ([2, segments, keys, kv_heads, head_dim]), scores and probabilities
# (each [kv_heads, segments, queries * q_heads / kv_heads, keys]).
#
# A group holds at most _REFERENCE_MAX_ELEMENTS (8 MiB, so that its passes stay in cache). One
# segment alone may hold more: its keys are never split, and it keeps at least enough queries
# that its scores outnumber its K/V (so re-gathering a long request's keys for each segment costs
# no more than attending them). A long prompt's segment thus holds about 3x the K/V of its
# request, never num_tokens x keys.
_REFERENCE_MAX_ELEMENTS = 1 << 21
# Padding to a group's most queries and blocks adds at most 25% to its segments' own elements,
# plus a slack worth about the fixed cost of one more group's tensor operations.
_REFERENCE_MAX_PADDING = 1.25
_REFERENCE_PADDING_SLACK = 1 << 18


class _Segment(NamedTuple):
    """Query tokens `token .. token + num_queries - 1` of request `req`, the first at position `first_pos`.

    They see keys in `[kv_begin, kv_end)` (`kv_end`: one past the last token's position), held
    by the block table columns `first_block .. first_block + num_blocks - 1`.
    """

    req: int
    token: int
    num_queries: int
    first_pos: int
    kv_begin: int
    kv_end: int
    first_block: int
    num_blocks: int


class _Shape(NamedTuple):
    """The sizes that price a workspace."""

    block_size: int
    num_q_heads: int
    kv_row_elements: int  # 2 * num_kv_heads * head_dim: one key position's K and V

    def elements(self, num_segments: int, num_queries: int, num_blocks: int) -> int:
        """Workspace elements of `num_segments` segments padded to these query and block counts."""
        scores = num_queries * self.num_q_heads
        return num_segments * num_blocks * self.block_size * (2 * scores + self.kv_row_elements)


def _plan_segments(starts: list[int], lens: list[int], num_tokens: int, table_width: int, sliding_window: int,
                   shape: _Shape) -> list[_Segment]:
    """Every request's query tokens as segments sized to the element cap; ValueError on bad lengths."""
    block_size = shape.block_size
    min_queries = -(-shape.kv_row_elements // shape.num_q_heads)
    segments = []
    for r, seq_len in enumerate(lens):
        q_start, q_end = starts[r], starts[r + 1]
        q_len = q_end - q_start
        if q_len < 0 or q_len > seq_len or q_end > num_tokens:
            raise ValueError(
                f"request {r}: query_start_loc gives {q_len} tokens at {q_start}, seq_lens {seq_len}, "
                f"query has {num_tokens} tokens"
            )
        if seq_len > table_width * block_size:
            raise ValueError(f"request {r}: seq_lens {seq_len} exceeds its block_table row")
        if q_len == 0:
            continue
        context_len = seq_len - q_len
        # Sized by the request's whole key range, which holds every one of its segments' ranges.
        kv_begin = max(0, context_len - sliding_window + 1) if sliding_window else 0
        range_blocks = -(-seq_len // block_size) - kv_begin // block_size
        per_query = shape.elements(1, 1, range_blocks) - shape.elements(1, 0, range_blocks)
        step = max(min_queries, (_REFERENCE_MAX_ELEMENTS - shape.elements(1, 0, range_blocks)) // per_query)
        for first in range(0, q_len, step):
            num_queries = min(step, q_len - first)
            first_pos = context_len + first
            kv_end = first_pos + num_queries
            kv_begin = max(0, first_pos - sliding_window + 1) if sliding_window else 0
            first_block = kv_begin // block_size
            segments.append(_Segment(r, q_start + first, num_queries, first_pos, kv_begin, kv_end, first_block,
                                     -(-kv_end // block_size) - first_block))
    return segments


def _plan_groups(segments: list[_Segment], shape: _Shape) -> list[list[_Segment]]:
    """The segments in groups within the element cap and the padding bound (a lone segment always fits).

    Sorted by query count, then key blocks: a decode batch groups by context length, apart
    from the segments of prefills.
    """
    groups: list[list[_Segment]] = []
    group: list[_Segment] = []
    own = max_queries = max_blocks = 0
    for segment in sorted(segments, key=lambda s: (s.num_queries, s.num_blocks)):
        cost = shape.elements(1, segment.num_queries, segment.num_blocks)
        queries, blocks = max(max_queries, segment.num_queries), max(max_blocks, segment.num_blocks)
        padded = shape.elements(len(group) + 1, queries, blocks)
        too_padded = padded > _REFERENCE_MAX_PADDING * (own + cost) + _REFERENCE_PADDING_SLACK
        if group and (padded > _REFERENCE_MAX_ELEMENTS or too_padded):
            groups.append(group)
            group, own, queries, blocks = [], 0, segment.num_queries, segment.num_blocks
        group.append(segment)
        own, max_queries, max_blocks = own + cost, queries, blocks
    if group:
        groups.append(group)
    return groups


def _attend_group(
    out: torch.Tensor,
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    group: list[_Segment],
    scale: float,
    sliding_window: int,
) -> None:
    """Writes into `out` the rows of the group's query tokens: their attention, computed in fp32.

    Segments are padded to the group's most queries and blocks. One indexed read each gathers
    the group's K and V blocks: a segment's padding columns repeat its first block, so no table
    entry past its range is read. Gathered values of positions outside `[kv_begin, kv_end)` (the
    padding, the tail of the last block, positions before a window) are zeroed and their scores
    masked, so whatever the cache holds there (NaN included) never reaches the output.
    """
    num_q_heads, head_dim = query.shape[1], query.shape[2]
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    queries_per_kv = num_q_heads // num_kv_heads
    device = query.device
    num_segments = len(group)
    max_queries = max(s.num_queries for s in group)
    max_blocks = max(s.num_blocks for s in group)
    num_keys = max_blocks * block_size
    num_rows = max_queries * queries_per_kv  # row m of a segment's scores: query m // G, head m % G
    req, token, num_queries, first_pos, kv_begin, kv_end, first_block, num_blocks = (
        torch.tensor(group, dtype=torch.int64).to(device).t()[:, :, None]  # each [segments, 1]
    )

    column = torch.arange(max_blocks, device=device)
    column = first_block + torch.where(column < num_blocks, column, 0)
    block_ids = block_table[req, column].view(-1).long()
    # One allocation holds the group's large tensors. Fresh ones each layer would have the host
    # allocator map new pages and fault them in, step after step: on a CPU that measured about
    # as much as the attention itself.
    num_kv = 2 * num_segments * num_keys * num_kv_heads * head_dim
    workspace = query.new_empty(num_kv + 2 * num_kv_heads * num_segments * num_rows * num_keys, dtype=torch.float32)
    kv = workspace[:num_kv].view(2, num_segments * max_blocks, block_size, num_kv_heads, head_dim)
    scores, probs = workspace[num_kv:].view(2, num_kv_heads, num_segments, num_rows, num_keys)
    for i in (0, 1):
        if kv_cache.dtype == torch.float32:
            torch.index_select(kv_cache[:, i], 0, block_ids, out=kv[i])
        else:
            kv[i].copy_(kv_cache[:, i].index_select(0, block_ids))
    k, v = kv.view(2, num_segments, num_keys, num_kv_heads, head_dim)
    k_pos = first_block * block_size + torch.arange(num_keys, device=device)  # [segments, keys]
    outside = ((k_pos < kv_begin) | (k_pos >= kv_end)).view(-1).nonzero().squeeze(1)
    # Their scores are masked below, but a probability of 0 times a NaN value is NaN.
    v.view(num_segments * num_keys, num_kv_heads * head_dim).index_fill_(0, outside, 0.0)

    row = torch.arange(max_queries, device=device)
    is_query = row < num_queries  # [segments, max_queries]
    token_ids = token + torch.where(is_query, row, 0)
    q = query.index_select(0, token_ids.view(-1)).float()
    q = q.view(num_segments, max_queries, num_kv_heads, queries_per_kv, head_dim).permute(2, 0, 1, 3, 4)
    q = q.reshape(num_kv_heads, num_segments, num_rows, head_dim)
    # One matmul per KV head over strided views of the gathered K/V, which no copy reorders.
    for head in range(num_kv_heads):
        torch.bmm(q[head], k[:, :, head].transpose(1, 2), out=scores[head])
    scores.mul_(scale)
    pos = first_pos + row  # [segments, max_queries]
    visible = k_pos[:, None, :] <= pos[:, :, None]
    if sliding_window:
        visible &= k_pos[:, None, :] > pos[:, :, None] - sliding_window
    # A real token sees its own position, so none of its rows is all -inf; padding rows are dropped.
    scores.view(num_kv_heads, num_segments, max_queries, queries_per_kv, num_keys).masked_fill_(
        ~visible[None, :, :, None, :], float("-inf")
    )
    torch.softmax(scores, dim=-1, out=probs)
    o = q.new_empty((num_kv_heads, num_segments, num_rows, head_dim))
    for head in range(num_kv_heads):
        torch.bmm(probs[head], v[:, :, head], out=o[head])
    o = o.view(num_kv_heads, num_segments, max_queries, queries_per_kv, head_dim).permute(1, 2, 0, 3, 4)
    o = o.reshape(num_segments, max_queries, num_q_heads, head_dim)
    if max_queries > 1 and not bool(is_query.all()):
        token_ids, o = token_ids[is_query], o[is_query]
    out.index_copy_(0, token_ids.view(-1), o.reshape(-1, num_q_heads, head_dim).to(out.dtype))


def paged_attention_reference(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = 0,
    num_kv_splits: int | None = None,
) -> torch.Tensor:
    """`paged_attention` in torch, fp32 math, the batch's requests attended together.

    A decode batch costs a few tensor operations per group of similar context lengths, not per
    request; memory stays bounded (`_REFERENCE_MAX_ELEMENTS`). Reads the lengths on the host, so
    it also checks them (ValueError). `num_kv_splits` changes nothing here (it is accepted so that
    both backends share one signature).
    """
    sliding_window = sliding_window or 0  # None, as a group config without a window says
    _check_args(query, kv_cache, block_table, query_start_loc, seq_lens, sliding_window, num_kv_splits)
    shape = _Shape(kv_cache.shape[2], query.shape[1], 2 * kv_cache.shape[3] * kv_cache.shape[4])
    segments = _plan_segments(
        query_start_loc.tolist(), seq_lens.tolist(), query.shape[0], block_table.shape[1], sliding_window, shape
    )
    out = torch.empty_like(query)
    for group in _plan_groups(segments, shape):
        _attend_group(out, query, kv_cache, block_table, group, scale, sliding_window)
    return out
