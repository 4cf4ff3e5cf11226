"""The warm-up's parallel compile fills Triton's cache with exactly what the warm-up's launches compile.

No GPU needed: in a child process with GPU kernels (this file run as a script), `precompile`
compiles the paged-attention variants for an sm_90 target in two processes into an empty
`TRITON_CACHE_DIR`; then every paged-attention launch of the warm-up itself is intercepted where
`JITFunction.run` receives it and compiled as `run` would compile it. Each of those compiles must
be a cache hit: it adds nothing to the cache directory.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

# 20-50 s of compiles on a CPU (conftest.py). Everywhere, not only without CUDA: this file also runs as a
# script and in spawned children, where importing devices.py would set Triton up the wrong way.
pytestmark = pytest.mark.thorough

ROOT = Path(__file__).resolve().parents[2]
SHAPES = dict(num_q_heads=8, num_kv_heads=2, head_dim=32, dtype="bfloat16", groups=((16, 64),),
              max_model_len=2048)  # fmt: skip


def cache_entries(cache_dir: Path) -> set[str]:
    return {str(path.relative_to(cache_dir)) for path in cache_dir.rglob("*")}


def precompile_then_launch() -> None:
    """Child process: precompile, then compile every warm-up attention launch as `JITFunction.run` would."""
    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    from kernels import paged_attention as module
    from kernels.warmup import KernelShapes, precompile, warmup_launches

    assert not module.INTERPRETED, "the child must build GPU kernels"
    shapes = KernelShapes(**{**SHAPES, "dtype": getattr(torch, SHAPES["dtype"])})
    target = GPUTarget("cuda", 90, 32)
    cache_dir = Path(os.environ["TRITON_CACHE_DIR"])
    started = time.monotonic()
    num_variants = precompile(shapes, target, num_workers=2)
    precompiled = cache_entries(cache_dir)
    precompile_s = time.monotonic() - started

    backend = make_backend(target)
    compiled = []

    def run(kernel, *args, grid, warmup, **kwargs):  # JITFunction.run's own first steps, then its compile
        kwargs["debug"] = kwargs.get("debug", kernel.debug) or knobs.runtime.debug
        kwargs["instrumentation_mode"] = knobs.compilation.instrumentation_mode
        bound, specialization, options = create_function_from_signature(kernel.signature, kernel.params, backend)(
            *args, **kwargs
        )
        options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound, specialization, options)
        triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=target, options=options.__dict__)
        compiled.append(kernel.fn.__name__)

    for kernel in (module._paged_attention_kernel, module._merge_kv_splits_kernel):
        kernel.run = lambda *args, kernel=kernel, **kwargs: run(kernel, *args, **kwargs)
    started = time.monotonic()
    for launch in warmup_launches(shapes, torch.device("cpu")):
        if launch.description.startswith("paged_attention "):
            launch.run()
    print(json.dumps(dict(num_variants=num_variants, compiled=compiled, precompile_s=precompile_s,
                          launches_s=time.monotonic() - started,
                          new_entries=sorted(cache_entries(cache_dir) - precompiled))))  # fmt: skip


def test_the_warm_up_loads_every_attention_variant_the_parallel_compile_made(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env["TRITON_CACHE_DIR"] = str(tmp_path / "cache")
    child = subprocess.run([sys.executable, __file__], cwd=ROOT, env=env, capture_output=True, text=True,
                           timeout=900, check=False)  # fmt: skip
    assert child.returncode == 0, child.stderr[-5000:]
    report = json.loads(child.stdout.splitlines()[-1])
    assert report["num_variants"] >= 4 and "_merge_kv_splits_kernel" in report["compiled"], report
    assert report["new_entries"] == [], f"the warm-up compiled what the parallel compile missed: {report}"
    print(f"{report['num_variants']} variants: parallel compile {report['precompile_s']:.1f} s, "
          f"then {len(report['compiled'])} launches from the cache {report['launches_s']:.1f} s")


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    precompile_then_launch()
