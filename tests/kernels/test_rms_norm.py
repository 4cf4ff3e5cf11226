"""rms_norm and add_rms_norm: the Triton kernel against the torch reference, over odd shapes and every dtype."""

from __future__ import annotations

import pytest
import torch
from devices import DEVICE  # "cuda" when torch has a GPU, else "cpu" (kernels in the interpreter)
from sm90_support import compile_for_sm90

from kernels.rms_norm import _rms_norm_kernel, add_rms_norm, add_rms_norm_reference, rms_norm, rms_norm_reference

# (atol, rtol) per dtype: the sum of squares may be added up in another order, which can move the
# normalised value across one rounding boundary of the dtype.
TOLERANCES = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (1.6e-2, 1.6e-2)}
DTYPES = list(TOLERANCES)
# Leading shape x row length: a hidden state, the heads of a query (qk-norm), odd and one-wide rows.
SHAPES = [((7,), 64), ((3, 4), 16), ((5,), 40), ((1,), 1), ((2,), 2048), ((0,), 32)]
EPS = 1e-5


def make(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (3 * torch.randn(shape, generator=g)).to(dtype).to(DEVICE)


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    atol, rtol = TOLERANCES[expected.dtype]
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    torch.testing.assert_close(actual.float().cpu(), expected.float().cpu(), atol=atol, rtol=rtol)


@pytest.mark.parametrize("lead,width", SHAPES, ids=[f"{lead}x{width}" for lead, width in SHAPES])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rms_norm_matches_the_reference(dtype, lead, width) -> None:
    x, weight = make((*lead, width), dtype, seed=width), make((width,), dtype, seed=1)
    before = x.clone()
    assert_close(rms_norm(x, weight, EPS), rms_norm_reference(x, weight, EPS))
    assert torch.equal(x, before)


@pytest.mark.parametrize("lead,width", SHAPES, ids=[f"{lead}x{width}" for lead, width in SHAPES])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_add_rms_norm_matches_the_reference(dtype, lead, width) -> None:
    x, residual = make((*lead, width), dtype, seed=width), make((*lead, width), dtype, seed=width + 1)
    weight = make((width,), dtype, seed=2)
    total, normed = add_rms_norm(x, residual, weight, EPS)
    expected_total, expected_normed = add_rms_norm_reference(x, residual, weight, EPS)
    if dtype == torch.bfloat16 and DEVICE == "cpu":
        # The interpreter rounds to bf16 toward zero: the sum may be one unit off, and the norm follows it.
        torch.testing.assert_close(total, expected_total, atol=0, rtol=2**-7)
        assert_close(normed, rms_norm_reference(total, weight, EPS))
    else:  # one rounding of an exact fp32 sum, as torch adds
        assert torch.equal(total, expected_total)
        assert_close(normed, expected_normed)


def test_strided_rows_are_read_where_they_are() -> None:
    """A view whose rows are not packed (every other row of a wider tensor) is normalised like its copy."""
    wide = make((6, 2, 40), torch.float32, seed=3)
    view, weight = wide[:, 1], make((40,), torch.float32, seed=4)
    assert_close(rms_norm(view, weight, EPS), rms_norm_reference(view.contiguous(), weight, EPS))


@pytest.mark.parametrize(
    "name,call",
    [
        ("weight", lambda x: rms_norm(x, torch.ones(7, device=x.device), EPS)),
        ("weight", lambda x: rms_norm(x, torch.ones(8, dtype=torch.float16, device=x.device), EPS)),
        ("residual", lambda x: add_rms_norm(x, x[:2], torch.ones(8, device=x.device), EPS)),
        ("last dimension", lambda x: rms_norm(x[:, :0], torch.ones(0, device=x.device), EPS)),
    ],
)
def test_bad_arguments_raise_value_error_naming_the_argument(name, call) -> None:
    with pytest.raises(ValueError, match=name):
        call(torch.ones(3, 8))


def test_kernel_compiles_for_sm90(tmp_path) -> None:
    signature = {name: "i32" for name in _rms_norm_kernel.arg_names}
    signature.update(x_ptr="*bf16", residual_ptr="*bf16", weight_ptr="*bf16", out_ptr="*bf16", total_ptr="*bf16",
                     eps="fp32")  # fmt: skip
    variants = [{"HAS_RESIDUAL": True, "BLOCK": 2048}, {"HAS_RESIDUAL": False, "BLOCK": 128}]
    compile_for_sm90(_rms_norm_kernel, signature, variants, tmp_path)
