"""rotary: the Triton kernel rotates queries and keys as the torch reference does, over odd head shapes."""

from __future__ import annotations

import pytest
import torch
from devices import DEVICE  # "cuda" when torch has a GPU, else "cpu" (kernels in the interpreter)
from sm90_support import compile_for_sm90

from kernels.rotary import _rotary_kernel, rotary, rotary_reference

# (atol, rtol) per dtype: fp32 math in both; a GPU may fuse a multiply and an add, one rounding fewer.
TOLERANCES = {torch.float32: (2e-6, 2e-6), torch.float16: (1e-3, 1e-3), torch.bfloat16: (8e-3, 8e-3)}
DTYPES = list(TOLERANCES)
# (num_tokens, q heads, kv heads, head_dim): GQA, MHA, heads and halves that are not powers of two.
SHAPES = [(5, 4, 2, 16), (3, 6, 6, 40), (1, 32, 8, 64), (9, 5, 1, 6), (0, 4, 2, 16)]


def make(num_tokens: int, num_q_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype):
    g = torch.Generator().manual_seed(head_dim + num_tokens)
    query = torch.randn(num_tokens, num_q_heads, head_dim, generator=g).to(dtype).to(DEVICE)
    key = torch.randn(num_tokens, num_kv_heads, head_dim, generator=g).to(dtype).to(DEVICE)
    angles = torch.arange(num_tokens)[:, None] * torch.rand(head_dim // 2, generator=g)[None, :] * 50
    return query, key, angles.cos().to(DEVICE), angles.sin().to(DEVICE)


@pytest.mark.parametrize("shape", SHAPES, ids=[str(s) for s in SHAPES])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_kernel_matches_the_reference(dtype, shape) -> None:
    query, key, cos, sin = make(*shape, dtype)
    before = query.clone(), key.clone()
    rotated = rotary(query, key, cos, sin)
    for actual, expected in zip(rotated, rotary_reference(query, key, cos, sin)):
        atol, rtol = TOLERANCES[dtype]
        assert actual.dtype == expected.dtype and actual.shape == expected.shape
        torch.testing.assert_close(actual.float().cpu(), expected.float().cpu(), atol=atol, rtol=rtol)
    assert torch.equal(query, before[0]) and torch.equal(key, before[1])


def test_a_token_at_angle_zero_is_unchanged_and_norms_are_kept() -> None:
    query, key, cos, sin = make(4, 4, 2, 16, torch.float32)
    rotated_query, rotated_key = rotary(query, key, cos, sin)
    assert torch.equal(rotated_query[0], query[0]) and torch.equal(rotated_key[0], key[0])  # position 0
    torch.testing.assert_close(rotated_query.norm(dim=-1), query.norm(dim=-1))


def test_strided_inputs_are_read_where_they_are() -> None:
    """Query and key as views of one packed qkv projection, as a fused projection would give them."""
    query, key, cos, sin = make(5, 4, 2, 16, torch.float32)
    packed = torch.cat((query.flatten(1), key.flatten(1), key.flatten(1)), dim=1)
    query_view, key_view = packed[:, :64].view(5, 4, 16), packed[:, 64:96].view(5, 2, 16)
    for actual, expected in zip(rotary(query_view, key_view, cos, sin), rotary_reference(query, key, cos, sin)):
        torch.testing.assert_close(actual, expected, atol=2e-6, rtol=2e-6)


@pytest.mark.parametrize(
    "name,args",
    [
        ("head_dim", lambda q, k, c, s: (q, k[..., :8], c, s)),
        ("cos", lambda q, k, c, s: (q, k, c.double(), s)),
        ("sin", lambda q, k, c, s: (q, k, c, s[:2])),
        ("even", lambda q, k, c, s: (q[..., :15], k[..., :15], c, s)),
    ],
)
def test_bad_arguments_raise_value_error_naming_the_argument(name, args) -> None:
    query, key, cos, sin = make(4, 4, 2, 16, torch.float32)
    with pytest.raises(ValueError, match=name):
        rotary(*args(query.cpu(), key.cpu(), cos.cpu(), sin.cpu()))


def test_kernel_compiles_for_sm90(tmp_path) -> None:
    signature = {name: "i32" for name in _rotary_kernel.arg_names}
    signature.update(query_ptr="*bf16", key_ptr="*bf16", query_out_ptr="*bf16", key_out_ptr="*bf16",
                     cos_ptr="*fp32", sin_ptr="*fp32")  # fmt: skip
    variants = [{"HALF": 32, "HALF_P2": 32, "HEADS_P2": 32}, {"HALF": 20, "HALF_P2": 32, "HEADS_P2": 8}]
    compile_for_sm90(_rotary_kernel, signature, variants, tmp_path)
