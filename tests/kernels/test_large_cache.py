"""A KV cache past 2^31 elements: the kernels address its last blocks in 64-bit arithmetic (needs CUDA).

A bf16 cache of 65,538 blocks of [2, 16, 8, 128] holds 2^31 + 65,536 elements (4.3 GB): a block id
times the block stride overflows int32 for the last blocks. Tokens are stored into them by slots
from `slot_mapping`, then read back by paged attention, against the torch references run on a
small cache holding copies of the same blocks.
"""

from __future__ import annotations

import pytest
import torch
from devices import DEVICE

from kernels.paged_attention import paged_attention, paged_attention_reference
from kernels.slot_mapping import slot_mapping
from kernels.store_kv import store_kv

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA device")]

BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, NUM_Q_HEADS = 16, 8, 128, 32
BLOCK_ELEMENTS = 2 * BLOCK_SIZE * NUM_KV_HEADS * HEAD_DIM
NUM_BLOCKS = 2**31 // BLOCK_ELEMENTS + 2


def test_store_and_attention_reach_the_blocks_past_2_31_elements():
    cuda = torch.device("cuda")
    cache = torch.zeros((NUM_BLOCKS, 2, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM), dtype=torch.bfloat16, device=cuda)
    assert cache.numel() > 2**31 and (NUM_BLOCKS - 1) * cache.stride(0) >= 2**31
    table_ids = [3, NUM_BLOCKS - 2, NUM_BLOCKS - 1]  # one low block, the last two
    num_tokens = 40  # fills the first two blocks and part of the last
    generator = torch.Generator().manual_seed(0)
    key = torch.randn((num_tokens, NUM_KV_HEADS, HEAD_DIM), generator=generator).to(cuda, torch.bfloat16)
    value = torch.randn((num_tokens, NUM_KV_HEADS, HEAD_DIM), generator=generator).to(cuda, torch.bfloat16)
    query = torch.randn((1, NUM_Q_HEADS, HEAD_DIM), generator=generator).to(cuda, torch.bfloat16)

    block_table = torch.tensor([table_ids], dtype=torch.int32, device=cuda)
    prefill_starts = torch.tensor([0, num_tokens], dtype=torch.int32, device=cuda)
    positions = torch.arange(num_tokens, dtype=torch.int64, device=cuda)
    slots = slot_mapping(block_table, prefill_starts, positions, BLOCK_SIZE)
    expected_slots = [table_ids[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(num_tokens)]
    assert slots.tolist() == expected_slots
    store_kv(key, value, cache, slots)
    for position in (0, 17, num_tokens - 1):
        block, offset = table_ids[position // BLOCK_SIZE], position % BLOCK_SIZE
        assert torch.equal(cache[block, 0, offset], key[position])
        assert torch.equal(cache[block, 1, offset], value[position])
    assert not cache[NUM_BLOCKS - 1, :, num_tokens % BLOCK_SIZE :].any()  # the last block's unwritten tail

    decode_starts = torch.tensor([0, 1], dtype=torch.int32, device=cuda)
    seq_lens = torch.tensor([num_tokens], dtype=torch.int32, device=cuda)
    out = paged_attention(query, cache, block_table, decode_starts, seq_lens, HEAD_DIM**-0.5)
    compact = cache[table_ids].clone()  # the same blocks as 0, 1, 2 of a small cache
    compact_table = torch.arange(3, dtype=torch.int32, device=cuda)[None, :]
    expected = paged_attention_reference(query, compact, compact_table, decode_starts, seq_lens, HEAD_DIM**-0.5)
    torch.testing.assert_close(out.float(), expected.float(), atol=2e-2, rtol=2e-2)
