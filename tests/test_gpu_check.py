"""bench/gpu_check.py, what of it runs without a GPU: its flags, the no-CUDA refusal, and how it reads its steps."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Iterator

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "gpu_check.py"

# bench/kernels_gpu.py's table, as it prints it.
KERNELS_TABLE = """\
decode: batch 64, context 4096, 32 q / 8 kv heads, head_dim 128, bf16, block_size 16, shuffled block table
NVIDIA H200; torch 2.13.0+cu130; python 3.11.9

| kernel | config | median us | TB/s | of 4.3 TB/s |
|---|---|---:|---:|---:|
|   sweep | block_m 16, block_n 32, warps 4, stages 2, splits 4 | 180.2 | 2.98 | 69% |
| triton paged_attention | block_m 16, block_n 64, warps 4, stages 3, splits 4 | 152.6 | 3.52 | 82% |
| torch SDPA, contiguous K/V | no paging, enable_gqa | 140.0 | 3.83 | 89% |
"""

JUNIT = """\
<?xml version="1.0" encoding="utf-8"?>
<testsuites name="pytest tests"><testsuite name="pytest" errors="1" failures="2" skipped="3" tests="20" time="1.0">
<testcase classname="t" name="a" time="0.1"/></testsuite></testsuites>
"""


@pytest.fixture(scope="module")
def gpu_check() -> Iterator[ModuleType]:
    """The script as a module (its dataclasses need it in sys.modules while it loads)."""
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        del sys.modules[spec.name]


def test_steps_run_in_their_fixed_order_and_unknown_ones_are_refused(gpu_check, capsys) -> None:
    parse = gpu_check.make_parser().parse_args
    assert parse([]).steps == ("tests", "kernels", "tier-copy", "worker")
    assert parse(["--steps", "worker, tests,tier-copy"]).steps == ("tests", "tier-copy", "worker")
    for bad in (["--steps", "tests,bench"], ["--steps", ","], ["--batch", "0"]):
        with pytest.raises(SystemExit) as exited:
            parse(bad)
        assert exited.value.code == 2, bad
    assert "steps are among tests, kernels, tier-copy, worker" in capsys.readouterr().err


def test_the_tier_copy_step_reads_the_largest_step_of_the_bench_table(gpu_check) -> None:
    table = """| model | dtype | blocks per step | MiB per step | direction | GB/s (median) | rounds' range |
|---|---|---:|---:|---|---:|---|
| llama-3.2-1b | bfloat16 | 16 | 8.00 | offload | 20.10 | 19.00-21.00 |
| llama-3.2-1b | bfloat16 | 256 | 128.00 | offload | 48.20 | 47.00-49.00 |
| llama-3.2-1b | bfloat16 | 256 | 128.00 | onload | 45.70 | 44.00-46.00 |
| llama-3.2-1b | bfloat16 | 256 | 128.00 | contiguous copy, to host | 52.00 | 51.00-53.00 |
"""
    assert gpu_check.tier_copy_rates(table) == {"offload": "48.20", "onload": "45.70", "contiguous copy, to host": "52.00"}


def test_without_cuda_it_stops_at_once_and_writes_nothing(tmp_path) -> None:
    out = tmp_path / "check"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # no device, on a GPU machine too
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(out)], capture_output=True, text=True, env=env, timeout=120, check=False
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith("gpu_check: no CUDA device: torch "), done.stderr
    assert "constraints/cuda.txt" in done.stderr
    assert done.stdout == "" and not out.exists()


def test_a_used_output_folder_is_refused_before_anything_runs(gpu_check, tmp_path, capsys) -> None:
    (tmp_path / "summary.md").write_text("an earlier check\n")
    with pytest.raises(SystemExit) as exited:
        gpu_check.main(["--out", str(tmp_path)])
    assert exited.value.code == 2
    assert f"--out {tmp_path} is not empty" in capsys.readouterr().err


def test_the_bandwidth_figure_is_the_triton_row_of_the_kernels_table(gpu_check) -> None:
    assert gpu_check.bandwidth_row(KERNELS_TABLE) == ("3.52", "82%")
    assert gpu_check.bandwidth_row(KERNELS_TABLE.split("| triton")[0]) is None


def test_test_counts_come_from_the_junit_report(gpu_check, tmp_path) -> None:
    (tmp_path / "report.xml").write_text(JUNIT)
    counts = gpu_check.junit_counts(tmp_path / "report.xml")
    assert counts == {"tests": 20, "failures": 2, "errors": 1, "skipped": 3}
    assert gpu_check.describe_counts(counts) == "14 passed, 2 failed, 1 errors, 3 skipped"


def test_a_step_that_fails_is_reported_with_its_files_and_the_check_goes_on(gpu_check, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # bench/kernels_gpu.py then exits 2: no CUDA device
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # and the steps' commands never see this
    assert "TRITON_INTERPRET" not in gpu_check.child_env()
    result = gpu_check.run_kernels(tmp_path, timeout_s=120)
    assert (result.ok, result.result) == (False, "no figure (exit 2)")
    assert "needs a CUDA device" in (tmp_path / "kernels_gpu.log").read_text()
    assert set(result.files) == {"kernels_gpu.md", "kernels_gpu.log"}
    summary = gpu_check.summary_markdown({"gpu": "none"}, [result], tmp_path)
    assert "| kernels | FAILED | no figure (exit 2) | kernels_gpu.md, kernels_gpu.log |" in summary
