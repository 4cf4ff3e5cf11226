"""Paged attention: the Triton kernel against the torch reference, the reference against SDPA.

Every cache block a request does not own, the unused tail of its last block, the null block
(0) and blocks a sliding window has dropped from the table are NaN: a stray read poisons the
output. Block tables are shuffled. Without a GPU the kernel runs in Triton's interpreter.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
import torch.nn.functional as F
from devices import DEVICE  # "cuda" when torch has a GPU, else "cpu" (kernels in the interpreter)

import kernels
import kernels.paged_attention as pa
from kernels.paged_attention import (
    PagedAttentionConfig,
    paged_attention,
    paged_attention_config,
    paged_attention_launches,
    paged_attention_reference,
)

# (atol, rtol) of the kernel against the reference, per dtype.
TOLERANCES = {
    torch.float32: (1e-5, 1e-5),
    torch.float16: (3e-3, 3e-3),
    torch.bfloat16: (2e-2, 2e-2),
}

# (query length, KV length) per request: every query length (1, 5, 16) and KV length
# (1, 15, 16, 17, 64) of the test plan, decodes and prefills mixed, one request with no
# query tokens this step.
MIXED = [(1, 1), (5, 15), (16, 16), (1, 17), (16, 64), (0, 9), (5, 64), (1, 64), (16, 17)]
DECODE = [(1, 1), (1, 15), (1, 16), (1, 17), (1, 64), (1, 40)]


class Batch:
    """A batch over a NaN-poisoned paged cache; `dense_kv(r)` gives request r's K/V contiguous."""

    def __init__(
        self,
        lens: list[tuple[int, int]],
        num_q_heads: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        block_size: int = 16,
        sliding_window: int = 0,
        seed: int = 0,
    ) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.lens = lens
        self.sliding_window = sliding_window
        self.scale = 1.0 / math.sqrt(head_dim)
        blocks_per_req = [-(-kv_len // block_size) for _, kv_len in lens]
        max_blocks = max(blocks_per_req) + 1  # one column no request uses
        num_blocks = sum(blocks_per_req) + 3  # null block 0 and two spare blocks, all NaN
        shape = (num_blocks, 2, block_size, num_kv_heads, head_dim)
        kv_cache = torch.full(shape, float("nan"), dtype=dtype)
        block_table = torch.zeros((len(lens), max_blocks), dtype=torch.int32)
        free = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
        self.dense = []
        for r, (q_len, kv_len) in enumerate(lens):
            kv = torch.randn((2, kv_len, num_kv_heads, head_dim), generator=gen).to(dtype)
            self.dense.append(kv)
            for b in range(blocks_per_req[r]):
                block_id = free.pop()
                block_table[r, b] = block_id
                n = min(block_size, kv_len - b * block_size)
                kv_cache[block_id, :, :n] = kv[:, b * block_size : b * block_size + n]
            if sliding_window:
                # Blocks no query token of this step can see go back to the null block.
                first_visible = max(0, kv_len - q_len - sliding_window + 1)
                block_table[r, : first_visible // block_size] = 0
        q_lens = torch.tensor([q for q, _ in lens])
        self.query = torch.randn((int(q_lens.sum()), num_q_heads, head_dim), generator=gen).to(dtype).to(DEVICE)
        self.kv_cache = kv_cache.to(DEVICE)
        self.block_table = block_table.to(DEVICE)
        self.query_start_loc = torch.cat([torch.zeros(1), q_lens.cumsum(0)]).to(torch.int32).to(DEVICE)
        self.seq_lens = torch.tensor([kv for _, kv in lens], dtype=torch.int32, device=DEVICE)

    def args(self) -> tuple:
        return (self.query, self.kv_cache, self.block_table, self.query_start_loc, self.seq_lens, self.scale,
                self.sliding_window)


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    atol, rtol = TOLERANCES[expected.dtype]
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    assert not actual.isnan().any(), "NaN in the output: a masked position was read"
    torch.testing.assert_close(actual.float(), expected.float(), atol=atol, rtol=rtol)


def run_with_config(batch: Batch, config: PagedAttentionConfig) -> torch.Tensor:
    """The launcher's launches, with tile sizes and splits forced."""
    out = torch.empty_like(batch.query)
    launches = paged_attention_launches(out, *batch.args()[:6], batch.sliding_window, config,
                                        upcast=kernels.interpreting())
    for launch in launches:
        launch.kernel[launch.grid](*launch.args, **launch.kwargs)
    return out


HEADS = [(4, 4), (8, 2), (5, 1)]


@pytest.mark.parametrize("sliding_window", [0, 8])
@pytest.mark.parametrize("head_dim", [16, 40])
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"q{h[0]}kv{h[1]}")
@pytest.mark.parametrize("dtype", list(TOLERANCES), ids=str)
def test_mixed_batch_matches_reference(dtype, heads, head_dim, sliding_window):
    batch = Batch(MIXED, *heads, head_dim, dtype, sliding_window=sliding_window)
    assert_close(paged_attention(*batch.args()), paged_attention_reference(*batch.args()))


@pytest.mark.parametrize(
    "heads, num_kv_splits, sliding_window",
    [((4, 4), 2, 5), ((8, 2), 3, 0), ((8, 2), 7, 5), ((5, 1), 7, 0), ((5, 1), 3, 5)],
)
def test_split_kv_matches_reference(heads, num_kv_splits, sliding_window):
    """Splits, including more splits than a request has key tiles (empty splits), merged."""
    batch = Batch(DECODE + MIXED[:3], *heads, 40, torch.bfloat16, sliding_window=sliding_window)
    out = paged_attention(*batch.args(), num_kv_splits=num_kv_splits)
    assert_close(out, paged_attention_reference(*batch.args()))


@pytest.mark.parametrize("num_kv_splits", [1, 3])
@pytest.mark.parametrize("sliding_window", [0, 20])
@pytest.mark.parametrize("heads", [(8, 2), (5, 1)], ids=lambda h: f"q{h[0]}kv{h[1]}")
def test_small_tiles_many_iterations(heads, sliding_window, num_kv_splits):
    """16-key tiles and 16-row programs: several KV tiles per split, windows across tiles."""
    group = heads[0] // heads[1]
    config = PagedAttentionConfig(16, 16 // group, 16, 4, 2, num_kv_splits, 4, 4)
    batch = Batch([(1, 64), (16, 64), (5, 33), (1, 17)], *heads, 16, torch.float32, sliding_window=sliding_window)
    assert_close(run_with_config(batch, config), paged_attention_reference(*batch.args()))


@pytest.mark.parametrize("block_size", [1, 5, 32])
def test_other_block_sizes(block_size):
    batch = Batch(MIXED, 8, 2, 16, torch.float16, block_size=block_size, sliding_window=11)
    assert_close(paged_attention(*batch.args()), paged_attention_reference(*batch.args()))


def test_strided_query():
    """A query that is a view into a fused QKV tensor (token stride > heads x head_dim)."""
    batch = Batch(MIXED[:4], 8, 2, 16, torch.float32, sliding_window=4)
    qkv = torch.randn((batch.query.shape[0], 12, 16), device=DEVICE)
    qkv[:, :8] = batch.query
    batch.query = qkv[:, :8]
    assert not batch.query.is_contiguous()
    assert_close(paged_attention(*batch.args(), num_kv_splits=2), paged_attention_reference(*batch.args()))


def test_decode_only_batch_with_automatic_splits():
    batch = Batch(DECODE, 8, 2, 40, torch.bfloat16)
    config = paged_attention_config(len(DECODE), len(DECODE), 8, 2, 40, max_kv_len=64 * 16, num_sms=132)
    assert config.num_kv_splits > 1
    assert_close(run_with_config(batch, config), paged_attention_reference(*batch.args()))
    assert_close(paged_attention(*batch.args()), paged_attention_reference(*batch.args()))


def test_split_heuristic():
    # Decode with few programs splits, each split keeping >= 256 keys; prefill does not split.
    decode = paged_attention_config(8, 8, 32, 8, 128, max_kv_len=4096, num_sms=132)
    assert decode.block_m == 16 and 1 < decode.num_kv_splits <= 4096 // 256
    assert paged_attention_config(8, 8, 32, 8, 128, max_kv_len=300, num_sms=132).num_kv_splits == 1
    prefill = paged_attention_config(8192, 4, 32, 8, 128, max_kv_len=8192, num_sms=132)
    assert prefill.num_kv_splits == 1 and prefill.block_m == 64
    assert paged_attention_config(8, 8, 32, 8, 128, 4096, 132, num_kv_splits=5).num_kv_splits == 5


def sdpa_expected(batch: Batch) -> torch.Tensor:
    """The batch's attention from its dense K/V, per request with SDPA, in fp32 (the oracle)."""
    num_q_heads, num_kv_heads = batch.query.shape[1], batch.dense[0].shape[2]
    starts = batch.query_start_loc.tolist()
    expected = torch.zeros(batch.query.shape, device=DEVICE)
    for r, (q_len, kv_len) in enumerate(batch.lens):
        if q_len == 0:
            continue
        k, v = (x.to(DEVICE).float().transpose(0, 1).repeat_interleave(num_q_heads // num_kv_heads, 0)
                for x in batch.dense[r])
        q = batch.query[starts[r] : starts[r + 1]].float().transpose(0, 1)
        pos = torch.arange(kv_len - q_len, kv_len, device=DEVICE)[:, None]
        k_pos = torch.arange(kv_len, device=DEVICE)[None, :]
        visible = k_pos <= pos
        if batch.sliding_window:
            visible &= k_pos > pos - batch.sliding_window
        attended = F.scaled_dot_product_attention(q, k, v, attn_mask=visible, scale=batch.scale)
        expected[starts[r] : starts[r + 1]] = attended.transpose(0, 1)
    return expected


@pytest.mark.parametrize("sliding_window", [0, 6])
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"q{h[0]}kv{h[1]}")
def test_reference_matches_sdpa(heads, sliding_window):
    batch = Batch(MIXED, *heads, 40, torch.float32, block_size=5, sliding_window=sliding_window)
    torch.testing.assert_close(paged_attention_reference(*batch.args()), sdpa_expected(batch), atol=1e-5, rtol=1e-5)


# Decodes and prefills in one batch whose KV lengths differ up to 300-fold.
SPREAD = [(1, 1), (1, 300), (7, 7), (1, 2), (40, 300), (1, 129), (3, 260), (1, 17)]


@pytest.mark.parametrize("sliding_window", [0, 5, 24])
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"q{h[0]}kv{h[1]}")
def test_reference_batches_very_different_lengths(heads, sliding_window):
    batch = Batch(SPREAD, *heads, 16, torch.float32, sliding_window=sliding_window)
    torch.testing.assert_close(paged_attention_reference(*batch.args()), sdpa_expected(batch), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("sliding_window", [0, 24])
def test_reference_never_reads_unused_table_entries(sliding_window):
    """Table entries past a request's last block, and before a window, name blocks no cache has."""
    batch = Batch(SPREAD, 8, 2, 16, torch.float32, sliding_window=sliding_window)
    missing = batch.kv_cache.shape[0] + 1000  # any read of it fails
    for r, (q_len, kv_len) in enumerate(SPREAD):
        batch.block_table[r, -(-kv_len // 16) :] = missing
        if sliding_window:
            batch.block_table[r, : max(0, kv_len - q_len - sliding_window + 1) // 16] = missing
    torch.testing.assert_close(paged_attention_reference(*batch.args()), sdpa_expected(batch), atol=1e-5, rtol=1e-5)


def reference_groups(batch: Batch) -> list[list]:
    """The reference's plan for the batch: its groups of query segments."""
    shape = pa._Shape(batch.kv_cache.shape[2], batch.query.shape[1],
                      2 * batch.kv_cache.shape[3] * batch.kv_cache.shape[4])
    segments = pa._plan_segments(batch.query_start_loc.tolist(), batch.seq_lens.tolist(), batch.query.shape[0],
                                 batch.block_table.shape[1], batch.sliding_window, shape)
    return pa._plan_groups(segments, shape)


@pytest.mark.parametrize("sliding_window", [0, 5, 24])
@pytest.mark.parametrize(
    "max_elements, max_padding",
    [(1, 1.25), (1 << 13, 1.25), (1 << 40, 1e9)],
    ids=["every-segment-alone", "several-groups", "one-padded-group"],
)
def test_reference_chunking_changes_nothing(monkeypatch, sliding_window, max_elements, max_padding):
    """Forced plans give the oracle's output.

    A cap so small that prefills split into segments of the fewest queries allowed and no two
    segments share a group; a small cap; no cap and no padding bound (all in one group).
    """
    batch = Batch(SPREAD + MIXED, 8, 2, 16, torch.float32, sliding_window=sliding_window)
    monkeypatch.setattr(pa, "_REFERENCE_MAX_ELEMENTS", max_elements)
    monkeypatch.setattr(pa, "_REFERENCE_MAX_PADDING", max_padding)
    monkeypatch.setattr(pa, "_REFERENCE_PADDING_SLACK", 0)
    groups = reference_groups(batch)
    if max_elements == 1:
        min_queries = 2 * 2 * 16 // 8  # a segment's scores outnumber its K/V
        assert all(len(group) == 1 for group in groups)
        assert max(group[0].num_queries for group in groups) == min_queries
    elif max_padding > 2:
        assert len(groups) == 1
    else:
        assert 1 < len(groups) < sum(len(group) for group in groups)
    torch.testing.assert_close(paged_attention_reference(*batch.args()), sdpa_expected(batch), atol=1e-5, rtol=1e-5)


def test_reference_plan_bounds_a_long_prompt():
    """A 16k-token prompt beside decodes, in Llama-3.2-1B's shape: no num_tokens x keys x heads scores.

    Each group fits the cap, or is one segment with the fewest queries allowed, whose workspace
    is then about 3x its request's K/V.
    """
    block_size, num_q_heads, kv_row_elements = 16, 32, 2 * 8 * 64
    shape = pa._Shape(block_size, num_q_heads, kv_row_elements)
    lens, q_lens = [16384, 300, 5000], [16384, 1, 1]
    starts = [0, *itertools.accumulate(q_lens)]
    segments = pa._plan_segments(starts, lens, starts[-1], 1024, 0, shape)
    covered = sorted(token for s in segments for token in range(s.token, s.token + s.num_queries))
    assert covered == list(range(starts[-1]))
    min_queries = kv_row_elements // num_q_heads
    for group in pa._plan_groups(segments, shape):
        size = shape.elements(len(group), max(s.num_queries for s in group), max(s.num_blocks for s in group))
        assert size <= pa._REFERENCE_MAX_ELEMENTS or (len(group) == 1 and group[0].num_queries <= min_queries)
        assert size <= 3 * 16384 * kv_row_elements


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_reference_computes_in_fp32(dtype):
    """Half-precision inputs give exactly the fp32 result on the same values, rounded once."""
    batch = Batch(SPREAD, 8, 2, 16, dtype, sliding_window=24)
    out = paged_attention_reference(*batch.args())
    query, kv_cache, *rest = batch.args()
    expected = paged_attention_reference(query.float(), kv_cache.float(), *rest)
    assert out.dtype == dtype
    torch.testing.assert_close(out, expected.to(dtype), atol=0, rtol=0)


@pytest.mark.parametrize("attention", [paged_attention, paged_attention_reference])
def test_no_window_as_none(attention):
    batch = Batch([(3, 20), (1, 33)], 4, 2, 16, torch.float32)
    torch.testing.assert_close(attention(*batch.args()[:6], None), attention(*batch.args()[:6], 0), atol=0, rtol=0)


@pytest.mark.parametrize("attention", [paged_attention, paged_attention_reference])
def test_empty_batch(attention):
    batch = Batch([(0, 3), (0, 20)], 4, 4, 16, torch.float32)
    assert attention(*batch.args()).shape == (0, 4, 16)


def _bad(batch: Batch, name: str, value) -> dict:
    args = dict(zip(["query", "kv_cache", "block_table", "query_start_loc", "seq_lens", "scale", "sliding_window"],
                    batch.args()))
    args[name] = value
    return args


@pytest.mark.parametrize("attention", [paged_attention, paged_attention_reference])
def test_bad_arguments_name_the_argument(attention):
    batch = Batch([(2, 20)], 8, 2, 16, torch.float32)
    q, kv = batch.query, batch.kv_cache
    cases = [
        (_bad(batch, "query", q[0]), "query"),
        (_bad(batch, "query", q.half()), "kv_cache dtype"),
        (_bad(batch, "query", q[:, :, :8]), "head_dim"),
        (_bad(batch, "query", q[:, :3]), "multiple of kv_cache heads"),
        (_bad(batch, "query", q.double()), "query dtype"),
        (_bad(batch, "kv_cache", kv[:, 0]), "kv_cache must be"),
        (_bad(batch, "block_table", batch.block_table.long()), "block_table"),
        (_bad(batch, "block_table", batch.block_table[:0]), "block_table"),
        (_bad(batch, "query_start_loc", batch.query_start_loc[:1]), "query_start_loc"),
        (_bad(batch, "seq_lens", batch.seq_lens[0]), "seq_lens"),
        (_bad(batch, "sliding_window", -1), "sliding_window"),
        ({**_bad(batch, "sliding_window", 0), "num_kv_splits": 0}, "num_kv_splits"),
    ]
    for kwargs, match in cases:
        with pytest.raises(ValueError, match=match):
            attention(**kwargs)


def test_reference_checks_lengths():
    batch = Batch([(2, 20)], 4, 4, 16, torch.float32)
    with pytest.raises(ValueError, match="request 0"):
        paged_attention_reference(**_bad(batch, "seq_lens", batch.seq_lens - 19))
    with pytest.raises(ValueError, match="block_table row"):
        paged_attention_reference(**_bad(batch, "seq_lens", batch.seq_lens + 64))


@pytest.mark.parametrize("num_kv_splits", [1, 3])
def test_rows_past_the_last_token_stay_unwritten(num_kv_splits):
    """A query padded past query_start_loc[-1]: neither kernel writes the padded rows of `out`."""
    batch = Batch(DECODE, 8, 2, 16, torch.float32)
    num_tokens, padding = batch.query.shape[0], 5
    batch.query = torch.cat([batch.query, torch.randn((padding, 8, 16), device=DEVICE)])
    config = paged_attention_config(num_tokens + padding, len(DECODE), 8, 2, 16, max_kv_len=64 * 16, num_sms=1,
                                    num_kv_splits=num_kv_splits, dtype=torch.float32)
    sentinel = 7.25  # not NaN: a row computed from unwritten split buffers may well be NaN itself
    out = torch.full_like(batch.query, sentinel)
    launches = paged_attention_launches(out, *batch.args()[:6], batch.sliding_window, config,
                                        upcast=kernels.interpreting())
    assert len(launches) == (2 if num_kv_splits > 1 else 1)
    for launch in launches:
        launch.kernel[launch.grid](*launch.args, **launch.kwargs)
    assert bool((out[num_tokens:] == sentinel).all()), "a kernel wrote rows past the last token"
    assert_close(out[:num_tokens], paged_attention_reference(*batch.args())[:num_tokens])


@pytest.mark.parametrize("attention", [paged_attention, paged_attention_reference])
def test_block_table_rows_must_have_unit_stride(attention):
    batch = Batch([(2, 40), (1, 20)], 4, 2, 16, torch.float32)
    expected = attention(*batch.args())
    strided = batch.block_table.t().contiguous().t()  # the same table, column-major
    assert strided.stride(1) != 1
    with pytest.raises(ValueError, match=r"block_table\.stride\(1\) == 1"):
        attention(**_bad(batch, "block_table", strided))
    # Rows sliced from a wider table (row stride > width) are fine.
    wide = torch.cat([batch.block_table, torch.zeros_like(batch.block_table)], dim=1)
    sliced = wide[:, : batch.block_table.shape[1]]
    torch.testing.assert_close(attention(**_bad(batch, "block_table", sliced)), expected, atol=0, rtol=0)
