"""Paged attention compiles for sm_90 (H100/H200) in its production configurations, without spills.

No GPU needed: `triton.compile` with a CUDA `GPUTarget` runs on a CPU, and ptxas reports each
kernel's registers and spills. The launches compiled are the launcher's own
(`paged_attention_config` + `paged_attention_launches`, bound to arguments the way Triton
binds them at launch), so what passes here is what runs on the GPU.

The compile runs in a child process (this file run as a script): `TRITON_INTERPRET=1`, set
for the tests, makes `@triton.jit` produce interpreter wrappers, Triton's own library
functions included, and those cannot be compiled.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NUM_SMS = 132  # H100 SXM and H200

# name -> (num_tokens, num_reqs, num_q_heads, num_kv_heads, sliding_window, dtype): Llama-style
# head_dim 128, block size 16, 4096-token context, bf16 (plus the float32 debug dtype, whose
# exact dots need their own tiles). Decode splits the KV range (main kernel writing partials +
# merge kernel); prefill does not.
CASES = {
    "decode-gqa4": (64, 64, 32, 8, 0, "bfloat16"),
    "decode-gqa8": (64, 64, 32, 4, 0, "bfloat16"),
    "prefill-gqa4": (4096, 2, 32, 8, 0, "bfloat16"),
    "prefill-gqa8": (4096, 2, 32, 4, 0, "bfloat16"),
    "prefill-gqa4-window": (4096, 2, 32, 8, 1024, "bfloat16"),
    "prefill-gqa4-float32": (4096, 2, 32, 8, 0, "float32"),
}
HEAD_DIM, BLOCK_SIZE, CONTEXT = 128, 16, 4096
SPILLS = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")
REGISTERS = re.compile(r"Used (\d+) registers")


def compile_cases() -> None:
    """Child process: compile every case, one JSON line per kernel on stdout."""
    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import get_ptxas
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    from kernels.paged_attention import paged_attention_config, paged_attention_launches

    target = GPUTarget("cuda", 90, 32)
    backend = make_backend(target)
    # The ptxas Triton itself runs for this target (the older bundled one rejects its PTX).
    ptxas = get_ptxas(target.arch).path
    for name, (num_tokens, num_reqs, num_q_heads, num_kv_heads, window, dtype_name) in CASES.items():
        dtype = getattr(torch, dtype_name)
        query = torch.empty((num_tokens, num_q_heads, HEAD_DIM), dtype=dtype)
        kv_cache = torch.empty((4, 2, BLOCK_SIZE, num_kv_heads, HEAD_DIM), dtype=dtype)
        block_table = torch.zeros((num_reqs, CONTEXT // BLOCK_SIZE), dtype=torch.int32)
        query_start_loc = torch.zeros(num_reqs + 1, dtype=torch.int32)
        seq_lens = torch.zeros(num_reqs, dtype=torch.int32)
        config = paged_attention_config(num_tokens, num_reqs, num_q_heads, num_kv_heads, HEAD_DIM,
                                        max_kv_len=CONTEXT, num_sms=NUM_SMS, dtype=dtype)
        launches = paged_attention_launches(torch.empty_like(query), query, kv_cache, block_table, query_start_loc,
                                            seq_lens, HEAD_DIM**-0.5, window, config, upcast=False)
        for launch in launches:
            fn = launch.kernel
            # What JITFunction.run does before compiling: specialize the arguments, then pack.
            binder = create_function_from_signature(fn.signature, fn.params, backend)
            bound, specialization, options = binder(*launch.args, **launch.kwargs)
            options, signature, constexprs, attrs = fn._pack_args(backend, launch.kwargs, bound, specialization,
                                                                  options)
            compiled = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=target,
                                      options=options.__dict__)
            ptx_path = Path(os.environ["PTX_DIR"]) / f"{name}-{fn.__name__}.ptx"
            ptx_path.write_text(compiled.asm["ptx"])
            report = subprocess.run(
                [ptxas, "-v", "--regAllocOptLevel=2", f"--gpu-name=sm_{target.arch}a", str(ptx_path),
                 "-o", str(ptx_path.with_suffix(".cubin"))],
                capture_output=True, text=True, check=False,
            )
            print(json.dumps(dict(case=name, kernel=fn.__name__, config=config._asdict(), returncode=report.returncode,
                                  ptxas=report.stdout + report.stderr)), flush=True)


@pytest.fixture(scope="module")
def reports(tmp_path_factory) -> dict[tuple[str, str], dict]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PTX_DIR"] = str(tmp_path_factory.mktemp("ptx"))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    child = subprocess.run([sys.executable, __file__], cwd=ROOT, env=env, capture_output=True, text=True,
                           timeout=600, check=False)
    assert child.returncode == 0, child.stderr[-5000:]
    lines = [json.loads(line) for line in child.stdout.splitlines() if line.startswith("{")]
    return {(r["case"], r["kernel"]): r for r in lines}


@pytest.mark.parametrize("case", list(CASES))
def test_compiles_for_sm90_without_spills(reports, case):
    kernels = {kernel: r for (name, kernel), r in reports.items() if name == case}
    decode = case.startswith("decode")
    expected = {"_paged_attention_kernel", "_merge_kv_splits_kernel"} if decode else {"_paged_attention_kernel"}
    assert set(kernels) == expected, f"{case}: compiled {sorted(kernels)}"
    for kernel, r in kernels.items():
        config = r["config"]
        assert (config["num_kv_splits"] > 1) == decode, config
        assert r["returncode"] == 0, f"{case} {kernel}: ptxas failed\n{r['ptxas']}"
        spills = SPILLS.findall(r["ptxas"])
        registers = REGISTERS.findall(r["ptxas"])
        assert spills and registers, f"{case} {kernel}: no ptxas report\n{r['ptxas']}"
        assert all(int(n) == 0 for pair in spills for n in pair), f"{case} {kernel} spills registers:\n{r['ptxas']}"
        print(f"{case} {kernel}: {registers[0]} registers, no spills, {config}")


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    compile_cases()
