"""copy_blocks: the Triton kernel and the torch reference copy the same bits, and only onto destinations."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from devices import DEVICE  # "cuda" when torch has a GPU, else "cpu" (kernels in the interpreter)
from sm90_support import compile_for_sm90

from kernels.copy_blocks import _MAX_CHUNK, _copy_blocks_kernel, _layer_table, copy_blocks, copy_blocks_reference

# Kernels run on DEVICE; bad-argument tests stay on the CPU: they raise before any launch.

IMPLS = [copy_blocks, copy_blocks_reference]
DTYPES = [torch.float16, torch.bfloat16, torch.float32]
# (block_size, num_kv_heads, head_dim); the last block (5,120 elements) takes
# the kernel more than one chunk, the last one partial.
LAYOUTS = [(1, 1, 16), (8, 2, 40), (16, 4, 40)]
NUM_LAYERS = 3
NUM_BLOCKS = 10
# Block 1 is copied twice; block 0 (the null block) is a destination like any other.
COPIES = [(1, 5), (2, 7), (1, 8), (9, 0)]


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits of t, so that comparisons see NaN payloads and -0.0."""
    return t.view({1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def random_bits(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random bit patterns of dtype: NaNs with payloads, infinities, subnormals, -0.0 and all."""
    int_dtype = bits(torch.empty(0, dtype=dtype)).dtype
    info = torch.iinfo(int_dtype)
    g = torch.Generator().manual_seed(seed)
    return torch.randint(info.min, info.max, shape, dtype=int_dtype, generator=g).view(dtype)


def loop_copy(kv_caches, copies) -> list[torch.Tensor]:
    """An independent copy_blocks: one block of one layer at a time, in plain Python."""
    out = [layer.clone() for layer in kv_caches]
    for layer, original in zip(out, kv_caches):
        for src, dst in copies.tolist():
            layer[dst] = original[src]
    return out


@pytest.mark.parametrize("block_size,num_kv_heads,head_dim", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_kernel_and_reference_copy_the_same_bits(dtype, block_size, num_kv_heads, head_dim) -> None:
    shape = (NUM_BLOCKS, 2, block_size, num_kv_heads, head_dim)
    layers = [random_bits(shape, dtype, seed=layer) for layer in range(NUM_LAYERS)]
    copies = torch.tensor(COPIES)
    expected = loop_copy(layers, copies)
    destinations = {dst for _, dst in COPIES}

    for impl in IMPLS:
        out = [layer.to(DEVICE) for layer in layers]
        impl(out, copies)
        for layer, want, before in zip((layer.cpu() for layer in out), expected, layers):
            assert torch.equal(bits(layer), bits(want))
            for block_id in range(NUM_BLOCKS):
                if block_id not in destinations:
                    assert torch.equal(bits(layer[block_id]), bits(before[block_id]))


@pytest.mark.parametrize("impl", IMPLS)
def test_layers_with_a_gap_between_blocks(impl) -> None:
    """Each layer a view with padding between blocks; the padding stays as it was."""
    before = random_bits((NUM_LAYERS, NUM_BLOCKS, 3, 8, 2, 24), torch.bfloat16, seed=11)
    copies = torch.tensor(COPIES)
    expected = loop_copy([before[layer, :, :2] for layer in range(NUM_LAYERS)], copies)

    storage = before.to(DEVICE, copy=True)
    impl([storage[layer, :, :2] for layer in range(NUM_LAYERS)], copies.to(DEVICE))
    storage = storage.cpu()
    for layer, want in enumerate(expected):
        assert torch.equal(bits(storage[layer, :, :2]), bits(want))
    assert torch.equal(bits(storage[:, :, 2]), bits(before[:, :, 2]))


@pytest.mark.parametrize("impl", IMPLS)
def test_no_copies_change_nothing(impl) -> None:
    layers = [random_bits((4, 2, 8, 2, 16), torch.float16, seed=layer).to(DEVICE) for layer in range(2)]
    before = [layer.clone() for layer in layers]
    impl(layers, torch.empty(0, 2, dtype=torch.int64, device=DEVICE))
    for layer, original in zip(layers, before):
        assert torch.equal(bits(layer), bits(original))


# (argument the error names, what is wrong, call arguments built from a good call's)
BAD_CALLS = [
    ("kv_caches", "no layers", lambda c, cp: ([], cp)),
    ("kv_caches", "no K/V dim", lambda c, cp: ([layer[:, 0] for layer in c], cp)),
    ("kv_caches", "non-contiguous block", lambda c, cp: ([layer.transpose(3, 4) for layer in c], cp)),
    ("kv_caches", "layer shape", lambda c, cp: ([c[0], c[1][:, :, :4]], cp)),
    ("kv_caches", "layer dtype", lambda c, cp: ([c[0], c[1].view(torch.int16)], cp)),
    ("kv_caches", "layer off a 16-byte boundary",
     lambda c, cp: ([c[0], torch.zeros(c[1].numel() + 1, dtype=c[1].dtype)[1:].view(c[1].shape)], cp)),
    ("copies", "int32", lambda c, cp: (c, cp.int())),
    ("copies", "1-D", lambda c, cp: (c, cp[0])),
    ("copies", "three columns", lambda c, cp: (c, torch.cat([cp, cp[:, :1]], dim=1))),
    ("copies", "past num_blocks", lambda c, cp: (c, torch.tensor([[1, 3], [2, 6]]))),
    ("copies", "negative id", lambda c, cp: (c, torch.tensor([[1, 3], [-1, 4]]))),
    ("copies", "repeated destination", lambda c, cp: (c, torch.tensor([[1, 3], [2, 3]]))),
    ("copies", "destination also a source", lambda c, cp: (c, torch.tensor([[1, 3], [3, 4]]))),
]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("name,problem,make_args", BAD_CALLS, ids=[f"{n}-{p}" for n, p, _ in BAD_CALLS])
def test_bad_arguments_raise_value_error_naming_the_argument(impl, name, problem, make_args) -> None:
    layers = [torch.zeros(6, 2, 8, 2, 16, dtype=torch.float16) for _ in range(2)]
    with pytest.raises(ValueError, match=name):
        impl(*make_args(layers, torch.tensor([[1, 3], [2, 4]])))
    assert not any(layer.any() for layer in layers)


def test_the_layer_table_is_built_once_per_set_of_caches() -> None:
    """A call copies nothing from the host: the table of layer addresses is kept on the device."""
    layers = [random_bits((4, 2, 8, 2, 16), torch.float16, seed=layer).to(DEVICE) for layer in range(2)]
    before = _layer_table.cache_info().misses
    for copies in ([[1, 2]], [[3, 0]], [[0, 1], [2, 3]]):
        copy_blocks(layers, torch.tensor(copies, device=DEVICE))
    assert _layer_table.cache_info().misses == before + 1
    table = _layer_table(layers[0].device, tuple(layer.data_ptr() for layer in layers))
    assert table.device == layers[0].device and table.tolist() == [layer.data_ptr() for layer in layers]


def test_kernel_compiles_for_sm90(tmp_path) -> None:
    """The interpreter accepts what a GPU compiler refuses."""
    signature = {"layer_ptrs_ptr": "*i64", "first_layer_ptr": "*i16", "copies_ptr": "*i64"}
    signature.update(block_stride="i64", block_numel="i32")
    variants = [{"CHUNK": _MAX_CHUNK}, {"CHUNK": 16, "block_numel": 1}]
    compile_for_sm90(_copy_blocks_kernel, signature, variants, tmp_path)


LOAD_WIDTHS = """
import re
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.runtime.jit import create_function_from_signature
from kernels import copy_blocks as module

kernel, target = module._copy_blocks_kernel, GPUTarget("cuda", 90, 32)
backend = make_backend(target)

def compile_instead(*args, grid, warmup, **kwargs):  # what JITFunction.run compiles; nothing runs
    bound, specialization, options = create_function_from_signature(kernel.signature, kernel.params, backend)(
        *args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound, specialization, options)
    ptx = triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=target, options=options.__dict__)
    print(sorted(set(re.findall(r"(?:ld|st)[.]global[.][.\\w]*", ptx.asm["ptx"]))))

kernel.run = compile_instead
module.copy_blocks([torch.zeros((4, 2, 16, 8, 128), dtype=torch.bfloat16)] * 2, torch.tensor([[0, 1]]))
"""


def test_blocks_move_in_16_byte_loads_on_sm90(tmp_path) -> None:
    """The layer pointer comes from memory: without the launcher's alignment promise the loads are 2 bytes wide."""
    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=str(tmp_path / "cache"), PYTHONPATH=str(root))
    result = subprocess.run([sys.executable, "-c", LOAD_WIDTHS], cwd=root, env=env, capture_output=True, text=True,
                            timeout=300, check=False)  # fmt: skip
    assert result.returncode == 0, result.stderr[-4000:]
    widths = result.stdout.splitlines()[-1]
    # bf16 blocks: the cache reads and writes are 128-bit vectors (the 8-byte loads read the table and the ids).
    assert "'ld.global.v4.b32'" in widths and "'st.global.v4.b32'" in widths, widths
    assert "b16" not in widths, widths
