"""The warm-up compiles every kernel variant serving can launch, so no step compiles one.

- Configs: `paged_attention_variants` holds the compile variant of every config
  `paged_attention_config` picks over a sweep of batch shapes, table widths and SM counts.
- Compile keys: in a child process with GPU kernels (this file run as a script; no GPU needed,
  nothing compiled or launched), every launch of the warm-up and of a sweep of serving-shaped
  batches through the four launchers is bound the way Triton binds it before looking up its
  compiled kernels; each serving launch's key (argument specialisation + options) must be one
  the warm-up made. A per-step size Triton specialised (num_reqs = 1, a table width divisible
  by 16, ...) would show up here as a key the warm-up never made.
  The sweep's small inputs are views of a `Staging` buffer laid out as the runner lays out a
  step's (token ids, then query starts and lengths; block-move ids, then the copies), so a
  pointer that staging leaves without Triton's 16-byte alignment for some counts shows up too.
- Runs: the warm-up runs end to end on the test device (in the interpreter on a CPU); on a
  GPU, serving-shaped batches after it add nothing to the kernels' compile caches.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gpu_worker.staging import Staging
from kernels import copy_blocks as copy_blocks_module
from kernels import paged_attention as paged_attention_module
from kernels import slot_mapping as slot_mapping_module
from kernels import store_kv as store_kv_module
from kernels.copy_blocks import copy_blocks
from kernels.paged_attention import (
    compile_variant,
    paged_attention,
    paged_attention_config,
    paged_attention_variants,
)
from kernels.slot_mapping import slot_mapping, slot_mapping_reference
from kernels.store_kv import store_kv
from kernels.warmup import PROGRESS_PREFIX, KernelShapes, warm_up, warmup_launches

ROOT = Path(__file__).resolve().parents[2]
KERNELS = [
    store_kv_module._store_kv_kernel,
    slot_mapping_module._slot_mapping_kernel,
    copy_blocks_module._copy_blocks_kernel,
    paged_attention_module._paged_attention_kernel,
    paged_attention_module._merge_kv_splits_kernel,
]
SHAPES = {
    "small-bf16": KernelShapes(8, 2, 32, torch.bfloat16, ((16, 0),), 2048),
    "window-gqa5-fp16": KernelShapes(5, 1, 40, torch.float16, ((16, 0), (16, 24)), 1000),
    "float32": KernelShapes(4, 2, 16, torch.float32, ((8, 0),), 512),
}
# Per-request query lengths of the serving sweep: decodes, prefill chunks, mixes; 1, 16, 17 and 32 requests.
QUERY_LENS = [[1], [1] * 16, [1] * 17, [5], [16], [17], [64], [1, 16, 1, 5], [1] * 31 + [40]]


@pytest.mark.parametrize("name", list(SHAPES))
def test_variants_cover_every_config_the_launcher_picks(name):
    shapes = SHAPES[name]
    heads = (shapes.num_q_heads, shapes.num_kv_heads, shapes.head_dim)
    for block_size, _ in shapes.groups:
        max_blocks = -(-shapes.max_model_len // block_size)
        variants = paged_attention_variants(*heads, max_blocks * block_size, shapes.dtype)
        assert len(set(variants)) == len(variants) and all(v == compile_variant(v) for v in variants)
        picked = set()
        for width in sorted({*range(1, max_blocks + 1, max(1, max_blocks // 24)), max_blocks}):
            max_kv_len = width * block_size
            avg_query_lens = [n for n in [*range(1, 40), 63, 64, 65, 128, 500, max_kv_len] if n <= max_kv_len]
            for num_reqs in (1, 2, 3, 8, 64, 256):
                for avg_query_len in avg_query_lens:
                    for num_tokens in {num_reqs * avg_query_len, num_reqs * (avg_query_len - 1) + 1}:
                        for num_sms in (1, 78, 132):
                            config = paged_attention_config(num_tokens, num_reqs, *heads, max_kv_len, num_sms,
                                                            dtype=shapes.dtype)
                            picked.add(compile_variant(config))
        assert picked <= set(variants), f"configs the warm-up misses: {sorted(picked - set(variants))}"
        assert any(v.num_kv_splits > 1 for v in picked), "the sweep never split: it checks too little"


def test_warm_up_runs_end_to_end(device):
    """A tiny model with a full and a windowed group; in the interpreter on a CPU."""
    shapes = KernelShapes(4, 2, 16, torch.bfloat16, ((16, 0), (16, 24)), 600)
    lines = []
    count = warm_up(shapes, torch.device(device), lines.append)
    launches = warmup_launches(shapes, torch.device(device))
    assert count == len(launches) == len(lines)
    assert lines == [f"{PROGRESS_PREFIX}{i}/{count} {launch.description}" for i, launch in enumerate(launches, 1)]
    variants = paged_attention_variants(4, 2, 16, 608, torch.bfloat16)
    attention_lines = [line for line in lines if " paged_attention " in line]
    assert len(attention_lines) == 2 * len(variants)  # per group
    others = {line.split()[5] for line in lines if " paged_attention " not in line}
    assert others == {"store_kv", "slot_mapping", "copy_blocks"}


def test_kernel_shapes_are_checked():
    with pytest.raises(ValueError, match="multiple"):
        KernelShapes(5, 2, 16, torch.bfloat16, ((16, 0),), 600)
    with pytest.raises(ValueError, match="groups"):
        KernelShapes(4, 2, 16, torch.bfloat16, (), 600)
    with pytest.raises(ValueError, match="max_model_len"):
        KernelShapes(4, 2, 16, torch.bfloat16, ((16, 0),), 0)


def serve(shapes: KernelShapes, device: torch.device) -> None:
    """The launches of a sweep of batches, made as the worker makes them (contiguous activations,
    block tables gathered from wider tables, one cache per layer of the pool's block shape, small
    inputs staged)."""
    for block_size, window in shapes.groups:
        max_blocks = -(-shapes.max_model_len // block_size)
        for width in sorted({1, 2, 16, 17, max(1, max_blocks // 2), max_blocks} & set(range(1, max_blocks + 1))):
            for query_lens in QUERY_LENS:
                if max(query_lens) <= width * block_size:
                    serve_batch(shapes, device, block_size, window, width, query_lens)


def serve_batch(
    shapes: KernelShapes, device: torch.device, block_size: int, window: int, width: int, query_lens: list[int]
) -> None:
    num_reqs, num_tokens = len(query_lens), sum(query_lens)
    seq_len = width * block_size
    num_blocks = num_reqs * width + 4
    wide = torch.arange(num_reqs * (width + 3), dtype=torch.int32).view(num_reqs, width + 3)
    wide = (wide - 3 * torch.arange(num_reqs, dtype=torch.int32)[:, None]).to(device)  # row r: r * width + b
    table = wide[:, :width].index_select(0, torch.arange(num_reqs, device=device))
    step = Staging()  # the runner's order: token ids, query starts, lengths
    step.add([0] * num_tokens, torch.int64)
    staged_starts = step.add([0, *torch.tensor(query_lens).cumsum(0).tolist()], torch.int32)
    staged_lengths = step.add([seq_len] * num_reqs, torch.int32)
    step.to(device)
    starts, seq_lens = staged_starts.tensor, staged_lengths.tensor
    positions = torch.cat([torch.arange(seq_len - q, seq_len) for q in query_lens]).to(device)
    slot_mapping(table, starts, positions, block_size)
    slots = slot_mapping_reference(table, starts, positions, block_size)  # a capturing child computes nothing
    cache_shape = (num_blocks, 2, block_size, shapes.num_kv_heads, shapes.head_dim)
    caches = [torch.zeros(cache_shape, dtype=shapes.dtype, device=device) for _ in range(2)]
    key = torch.zeros((num_tokens, shapes.num_kv_heads * shapes.head_dim), dtype=shapes.dtype, device=device)
    key = key.view(num_tokens, shapes.num_kv_heads, shapes.head_dim)
    store_kv(key, torch.zeros_like(key), caches[0], slots)
    query = torch.zeros((num_tokens, shapes.num_q_heads, shapes.head_dim), dtype=shapes.dtype, device=device)
    paged_attention(query, caches[0], table, starts, seq_lens, shapes.head_dim**-0.5, window)
    moves = Staging()  # the runner's order: offloaded and onloaded device ids (one or two each), then the copies
    num_copies = 1 + num_tokens % 2
    moves.add([1] * num_copies, torch.int64)
    moves.add([2] * num_reqs, torch.int64)
    copies = [block_id for i in range(num_copies) for block_id in (i, num_blocks - 1 - i)]
    staged_copies = moves.add(copies, torch.int64, (num_copies, 2))
    moves.to(device)
    copy_blocks(caches, staged_copies.tensor)


def compiled_kernels() -> int:
    """How many compiled variants the kernels of this process hold (Triton's in-memory caches)."""
    return sum(len(caches[0]) for kernel in KERNELS for caches in kernel.device_caches.values())


@pytest.mark.gpu
def test_serving_compiles_nothing_after_warm_up(device):
    if device != "cuda":
        pytest.skip("needs a CUDA device: only GPU kernels are compiled")
    cuda = torch.device("cuda")
    for shapes in SHAPES.values():
        warm_up(shapes, cuda, lambda line: None)
        before = compiled_kernels()
        serve(shapes, cuda)
        torch.cuda.synchronize()
        assert compiled_kernels() == before, f"{shapes}: serving compiled {compiled_kernels() - before} variants"


def capture_compile_keys() -> None:
    """Child process: the compile keys of the warm-up's and the serving sweep's launches, as JSON."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    assert not paged_attention_module.INTERPRETED, "the child must build GPU kernels"
    backend = make_backend(GPUTarget("cuda", 90, 32))
    keys: dict[str, set[str]] = {"warm-up": set(), "serving": set()}
    phase = ["warm-up"]

    def capture(kernel) -> None:
        # What JITFunction.run computes before looking a launch up in its cache; nothing runs.
        binder = create_function_from_signature(kernel.signature, kernel.params, backend)

        def run(*args, grid, warmup, **kwargs):
            _, specialization, options = binder(*args, **kwargs)
            keys[phase[0]].add(json.dumps([kernel.fn.__name__, repr(specialization), repr(sorted(options.items()))]))

        kernel.run = run

    for kernel in KERNELS:
        capture(kernel)
    paged_attention_module._num_sms = lambda device: 132  # an H200's SMs: decode batches split
    cpu = torch.device("cpu")
    result = {}
    for name, shapes in SHAPES.items():
        keys["warm-up"].clear()
        keys["serving"].clear()
        phase[0] = "warm-up"
        warm_up(shapes, cpu, lambda line: None)
        phase[0] = "serving"
        serve(shapes, cpu)
        result[name] = {phase: sorted(found) for phase, found in keys.items()}
    print(json.dumps(result))


@pytest.fixture(scope="module")
def compile_keys() -> dict[str, dict[str, list[str]]]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    child = subprocess.run([sys.executable, __file__], cwd=ROOT, env=env, capture_output=True, text=True,
                           timeout=600, check=False)
    assert child.returncode == 0, child.stderr[-5000:]
    return json.loads(child.stdout.splitlines()[-1])


@pytest.mark.parametrize("name", list(SHAPES))
def test_serving_launches_only_what_the_warm_up_compiled(compile_keys, name):
    warmed, served = set(compile_keys[name]["warm-up"]), set(compile_keys[name]["serving"])
    launched = {json.loads(key)[0] for key in served}
    assert launched == {kernel.fn.__name__ for kernel in KERNELS}, f"the sweep launched only {sorted(launched)}"
    missing = sorted(served - warmed)
    assert not missing, f"{len(missing)} serving launches would compile inside a step:\n" + "\n".join(missing[:5])


if __name__ == "__main__":
    capture_compile_keys()
