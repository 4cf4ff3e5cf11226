"""Compile a kernel for sm_90 (H100/H200) on a CPU: the interpreter accepts what a GPU compiler refuses."""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
import textwrap
from pathlib import Path


def compile_for_sm90(kernel, signature: dict[str, str], variants: list[dict[str, int]], tmp_path: Path) -> None:
    """Compile kernel for an H100/H200 (sm_90) without a GPU; fail with the compiler's message.

    Each variant names the constexpr arguments and the arguments a launch
    specializes (an int equal to 1 becomes a constant). The interpreter
    patches triton.language in this process, so the compile runs in a fresh
    one, from the kernel's source alone (no torch import).
    """
    (tmp_path / "kernel_source.py").write_text(
        "import triton\nimport triton.language as tl\n\n\n" + textwrap.dedent(inspect.getsource(kernel.fn))
    )
    script = textwrap.dedent(
        f"""
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
        from kernel_source import {kernel.fn.__name__} as kernel

        for constexprs in {variants!r}:
            signature = {{**{signature!r}, **{{name: "constexpr" for name in constexprs}}}}
            source = ASTSource(kernel, signature, constexprs)
            assert triton.compile(source, target=GPUTarget("cuda", 90, 32)).asm["cubin"]
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=str(tmp_path / "cache"), TRITON_DEFAULT_FP_FUSION="1")
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert result.returncode == 0, result.stderr[-4000:]
