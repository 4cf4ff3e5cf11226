"""store_kv: the Triton kernel and the torch reference write the same bits, and only at the given slots."""

from __future__ import annotations

import pytest
import torch
from devices import DEVICE  # "cuda" when torch has a GPU, else "cpu" (kernels in the interpreter)
from sm90_support import compile_for_sm90

from kernels.store_kv import _store_kv_kernel, store_kv, store_kv_reference

# Kernels run on DEVICE; bad-argument tests stay on the CPU: they raise before any launch.

IMPLS = [store_kv, store_kv_reference]
DTYPES = [torch.float16, torch.bfloat16, torch.float32]
HEAD_SHAPES = [(1, 16), (2, 40), (4, 8)]  # (num_kv_heads, head_dim); 40 is not a power of two
BLOCK_SIZES = [1, 8, 16]
NUM_TOKENS = 20
SKIPPED_TOKENS = (0, 3, 7, NUM_TOKENS - 1)


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits of t, so that comparisons see NaN payloads and -0.0."""
    return t.view({1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def make_tokens(
    num_tokens: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    key = torch.randn(num_tokens, num_kv_heads, head_dim, generator=g).to(dtype)
    value = torch.randn(num_tokens, num_kv_heads, head_dim, generator=g).to(dtype)
    # Values that a conversion would disturb must arrive as they are.
    key[1, 0, 0] = float("nan")
    key[2, 0, -1] = -0.0
    value[1, -1, -1] = float("-inf")
    return key, value


def make_slots(num_blocks: int, block_size: int, num_tokens: int, seed: int) -> torch.Tensor:
    """Distinct slots scattered over the whole cache, -1 (padding) at SKIPPED_TOKENS."""
    g = torch.Generator().manual_seed(seed)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:num_tokens]
    slots[list(SKIPPED_TOKENS)] = -1
    return slots


def loop_store(key, value, kv_cache, slot_mapping) -> torch.Tensor:
    """An independent store_kv: one token at a time, in plain Python."""
    out = kv_cache.clone()
    block_size = kv_cache.shape[2]
    for t, slot in enumerate(slot_mapping.tolist()):
        if slot >= 0:
            out[slot // block_size, 0, slot % block_size] = key[t]
            out[slot // block_size, 1, slot % block_size] = value[t]
    return out


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("num_kv_heads,head_dim", HEAD_SHAPES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_kernel_and_reference_write_the_same_bits(dtype, num_kv_heads, head_dim, block_size) -> None:
    num_blocks = 2 * NUM_TOKENS // block_size + 2  # about half the slots stay empty
    key, value = make_tokens(NUM_TOKENS, num_kv_heads, head_dim, dtype, seed=block_size)
    slot_mapping = make_slots(num_blocks, block_size, NUM_TOKENS, seed=head_dim)
    cache = torch.full((num_blocks, 2, block_size, num_kv_heads, head_dim), float("nan"), dtype=dtype)
    expected = loop_store(key, value, cache, slot_mapping)

    args = (key.to(DEVICE), value.to(DEVICE))
    by_reference = cache.to(DEVICE)
    store_kv_reference(*args, by_reference, slot_mapping.to(DEVICE))
    by_reference = by_reference.cpu()
    assert torch.equal(bits(by_reference), bits(expected))

    by_kernel = cache.to(DEVICE)
    store_kv(*args, by_kernel, slot_mapping.to(DEVICE))
    by_kernel = by_kernel.cpu()
    assert torch.equal(bits(by_kernel), bits(expected))

    # Every (block, offset) not named by a slot keeps its NaN sentinel bits.
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool)
    untouched[slot_mapping[slot_mapping >= 0]] = False
    untouched = untouched.view(num_blocks, block_size)
    assert untouched.sum() == num_blocks * block_size - (NUM_TOKENS - len(SKIPPED_TOKENS))
    for out in (by_kernel, by_reference):
        assert torch.equal(bits(out.transpose(1, 2)[untouched]), bits(cache.transpose(1, 2)[untouched]))


@pytest.mark.parametrize("impl", IMPLS)
def test_strided_inputs_and_cache(impl) -> None:
    """K and V sliced out of a fused QKV tensor; a cache with padded heads."""
    num_tokens, num_q_heads, num_kv_heads, head_dim, block_size, num_blocks = 9, 4, 2, 24, 4, 6
    g = torch.Generator().manual_seed(7)
    qkv = torch.randn(num_tokens, num_q_heads + 2 * num_kv_heads, head_dim, generator=g).to(torch.bfloat16)
    qkv = qkv.to(DEVICE)
    key = qkv[:, num_q_heads : num_q_heads + num_kv_heads]
    value = qkv[:, num_q_heads + num_kv_heads :]
    storage = torch.full(
        (num_blocks, 2, block_size, num_kv_heads, head_dim + 8), -7.0, dtype=torch.bfloat16, device=DEVICE
    )
    cache = storage[..., :head_dim]
    slot_mapping = torch.tensor([5, -1, 0, 23, 11, 12, -1, 1, 17], device=DEVICE)
    expected = loop_store(key.cpu(), value.cpu(), cache.cpu(), slot_mapping.cpu())

    impl(key, value, cache, slot_mapping)
    storage = storage.cpu()
    assert torch.equal(bits(storage[..., :head_dim]), bits(expected))
    assert bool((storage[..., head_dim:] == -7.0).all())  # the padding around each head is untouched


@pytest.mark.parametrize("impl", IMPLS)
def test_all_padding_or_no_tokens_writes_nothing(impl) -> None:
    cache = torch.full((3, 2, 8, 2, 16), float("nan"), dtype=torch.float16, device=DEVICE)
    before = cache.clone()
    key, value = (t.to(DEVICE) for t in make_tokens(5, 2, 16, torch.float16, seed=1))
    impl(key, value, cache, torch.full((5,), -1, dtype=torch.int64, device=DEVICE))
    impl(key[:0], value[:0], cache, torch.empty(0, dtype=torch.int64, device=DEVICE))
    assert torch.equal(bits(cache), bits(before))


# (argument the error names, what is wrong, call arguments built from a good call's)
BAD_CALLS = [
    ("kv_cache", "no K/V dim", lambda k, v, c, s: (k, v, c[:, 0], s)),
    ("kv_cache", "K only", lambda k, v, c, s: (k, v, c[:, :1], s)),
    ("key", "kv heads", lambda k, v, c, s: (k[:, :1], v, c, s)),
    ("value", "tokens", lambda k, v, c, s: (k, v[:3], c, s)),
    ("key", "dtype", lambda k, v, c, s: (k.float(), v, c, s)),
    ("value", "dtype", lambda k, v, c, s: (k, v.bfloat16(), c, s)),
    ("slot_mapping", "int32", lambda k, v, c, s: (k, v, c, s.int())),
    ("slot_mapping", "length", lambda k, v, c, s: (k, v, c, s[:3])),
    ("slot_mapping", "below -1", lambda k, v, c, s: (k, v, c, torch.tensor([0, 5, -2, 11]))),
    ("slot_mapping", "past the cache", lambda k, v, c, s: (k, v, c, torch.tensor([0, 5, -1, 12]))),
    ("slot_mapping", "repeated slot", lambda k, v, c, s: (k, v, c, torch.tensor([0, 5, -1, 5]))),
]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("name,problem,make_args", BAD_CALLS, ids=[f"{n}-{p}" for n, p, _ in BAD_CALLS])
def test_bad_arguments_raise_value_error_naming_the_argument(impl, name, problem, make_args) -> None:
    key, value = make_tokens(4, 2, 8, torch.float16, seed=0)
    cache = torch.zeros(3, 2, 4, 2, 8, dtype=torch.float16)
    args = make_args(key, value, cache, torch.tensor([0, 5, -1, 11]))
    with pytest.raises(ValueError, match=name):
        impl(*args)
    assert not cache.any()


def test_kernel_compiles_for_sm90(tmp_path) -> None:
    """The interpreter accepts what a GPU compiler refuses."""
    signature = {name: "i32" for name in _store_kv_kernel.arg_names}
    signature.update(key_ptr="*i16", value_ptr="*i16", cache_ptr="*i16", slot_mapping_ptr="*i64")
    ones = {"block_size": 1, "num_kv_heads": 1, "key_stride_dim": 1, "value_stride_dim": 1, "cache_stride_dim": 1}
    variants = [{"NUM_KV_HEADS_P2": 8, "HEAD_DIM_P2": 128}, {"NUM_KV_HEADS_P2": 1, "HEAD_DIM_P2": 64, **ones}]
    compile_for_sm90(_store_kv_kernel, signature, variants, tmp_path)
