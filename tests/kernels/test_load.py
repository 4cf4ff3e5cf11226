"""`kernels.load`: interpreter kernels never reach CUDA, and the bf16 upcast is fixed when the kernels are built."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import kernels
from kernels.paged_attention import paged_attention_reference

ROOT = Path(__file__).resolve().parents[2]

# The child asks for the Triton kernels on CUDA with TRITON_INTERPRET inherited; torch.cuda's
# lazy initialisation is replaced first, so any driver call before the refusal fails differently.
REFUSAL_SCRIPT = textwrap.dedent(
    """
    import torch

    def no_driver(*args, **kwargs):
        raise AssertionError("a CUDA driver was touched")

    torch.cuda._lazy_init = no_driver
    torch.cuda.init = no_driver
    import kernels

    try:
        kernels.load("triton", "cuda")
    except RuntimeError as error:
        print("REFUSED", error)
    else:
        print("LOADED")
    assert not torch.cuda.is_initialized()
    """
)


def test_triton_on_cuda_refuses_an_inherited_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    child = subprocess.run([sys.executable, "-c", REFUSAL_SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True,
                           timeout=120, check=False)
    assert child.returncode == 0, child.stderr[-3000:]
    assert child.stdout.startswith("REFUSED"), child.stdout
    assert "TRITON_INTERPRET" in child.stdout and "interpreter" in child.stdout


@pytest.mark.skipif(not kernels.interpreting(), reason="this process has GPU kernels: nothing to refuse")
def test_triton_on_cuda_refuses_interpreter_kernels_even_once_the_variable_is_gone(monkeypatch):
    """Triton read the variable when the kernels were imported: unsetting it later changes nothing."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        kernels.load("triton", "cuda")


@pytest.mark.skipif(not kernels.interpreting(), reason="the kernels of this process run on a GPU: no upcast")
@pytest.mark.parametrize("environment", [None, "0"], ids=["unset", "0"])
def test_the_upcast_follows_the_kernels_not_the_environment(monkeypatch, environment):
    """bf16 in the interpreter needs fp32 tiles (it computes bf16 arithmetic wrongly): the launcher
    keeps upcasting after TRITON_INTERPRET changes, because its kernels are still interpreter kernels."""
    from test_paged_attention import MIXED, Batch, assert_close

    if environment is None:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    else:
        monkeypatch.setenv("TRITON_INTERPRET", environment)
    kernel_set = kernels.load("triton", "cpu")
    assert kernels.interpreting()
    batch = Batch(MIXED[:5], 8, 2, 16, torch.bfloat16)
    assert_close(kernel_set.paged_attention(*batch.args()), paged_attention_reference(*batch.args()))


def test_the_torch_backend_loads_anywhere():
    assert kernels.load("torch", "cuda").paged_attention is paged_attention_reference
    with pytest.raises(ValueError, match="backend"):
        kernels.load("cutlass", "cpu")
