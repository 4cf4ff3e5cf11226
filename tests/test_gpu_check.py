"""bench/gpu_check.py without a GPU: its dry run end to end, its budget, its version paths, how it reads reports."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from types import ModuleType
from typing import Iterator

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "gpu_check.py"

JUNIT = """\
<?xml version="1.0" encoding="utf-8"?>
<testsuites name="pytest tests"><testsuite name="pytest" errors="1" failures="2" skipped="3" tests="20" time="1.0">
<testcase classname="t" name="a"><skipped type="pytest.skip" message="needs a CUDA device">x</skipped></testcase>
<testcase classname="t" name="b"><skipped type="pytest.skip" message="this process has GPU kernels"/></testcase>
<testcase classname="t" name="c"><skipped type="pytest.skip" message="needs a CUDA device: too slow"/></testcase>
</testsuite></testsuites>
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


@pytest.mark.thorough  # about 45 s
def test_the_dry_run_takes_every_step_on_the_cpu_and_writes_every_figure(tmp_path) -> None:
    out = tmp_path / "check"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    started = time.monotonic()
    done = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--budget-s", "300", "--out", str(out)],
                          capture_output=True, text=True, env=env, timeout=400, check=False)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert time.monotonic() - started < 300
    summary = json.loads((out / "summary.json").read_text())
    steps = summary["steps"]
    assert [step["name"] for step in steps] == ["setup", "e2e", "kernels", "bandwidth", "tier", "worker", "calibration"]
    assert all(step["ok"] for step in steps), steps
    for step in steps:
        for name in step["files"]:
            assert (out / name).is_file(), name
    results = {step["name"]: step["result"] for step in steps}
    assert results["setup"] == "dry run: this environment's packages; stubs generated"
    assert (out / "stubs" / "kvcache" / "v1" / "kv_manager_pb2_grpc.py").is_file()
    for name in ("e2e", "kernels"):  # only the gpu tests, which skip on a CPU by design
        assert results[name].startswith("0 passed, 0 failed, 0 errors, ") and "for want of CUDA" in results[name]
    assert "head_dim 128: " in results["bandwidth"] and "head_dim 64: " in results["bandwidth"]
    assert "offload" in results["tier"] and "overlap with a matmul" in results["tier"]
    assert results["worker"].startswith("eager ") and "tokens/s" in results["worker"]
    assert results["calibration"].startswith("kv-manager replay --prefill-us-per-token ")
    assert "not the 8B model" in results["calibration"]
    assert "path taken: " in (out / "summary.md").read_text()
    assert done.stderr.startswith("gpu_check: device: CPU")


def test_steps_run_in_their_fixed_order_and_unknown_ones_are_refused(gpu_check, capsys) -> None:
    parse = gpu_check.make_parser().parse_args
    assert parse([]).steps == ("e2e", "kernels", "bandwidth", "tier", "worker", "calibration")
    assert parse(["--steps", "worker, e2e,tier"]).steps == ("e2e", "tier", "worker")
    for bad in (["--steps", "e2e,bench"], ["--steps", ","], ["--budget-s", "0"]):
        with pytest.raises(SystemExit) as exited:
            parse(bad)
        assert exited.value.code == 2, bad
    assert "steps are among e2e, kernels, bandwidth, tier, worker, calibration" in capsys.readouterr().err


def test_each_step_gets_its_share_and_what_earlier_steps_leave(gpu_check) -> None:
    plan = gpu_check.deadlines(1000.0, 300.0, gpu_check.STEPS)
    usable = 300.0 - gpu_check.SUMMARY_RESERVE_S
    assert plan["setup"] == pytest.approx(1000.0 + usable * gpu_check.SHARES["setup"])
    assert list(plan.values()) == sorted(plan.values())
    assert plan["calibration"] == pytest.approx(1000.0 + usable)
    fewer = gpu_check.deadlines(1000.0, 300.0, ("e2e", "bandwidth"))
    assert list(fewer) == ["setup", "e2e", "bandwidth"] and fewer["bandwidth"] == pytest.approx(1000.0 + usable)
    assert fewer["e2e"] > plan["e2e"]  # the shares of the steps left out go to those that run


def test_the_paths_taken_name_old_versions_and_missing_plugins(gpu_check) -> None:
    every_module = lambda name: True  # noqa: E731
    assert gpu_check.toolchain_notes({"torch": "2.13.0+cu130", "triton": "3.7.1"}, every_module) == []
    old = gpu_check.toolchain_notes({"torch": "2.11.0+cu130", "triton": "3.6.0"}, every_module)
    assert [note.split(" ")[:2] for note in old] == [["torch", "2.11.0+cu130"], ["triton", "3.6.0"]]
    missing = gpu_check.toolchain_notes({"torch": "2.13.0", "triton": "3.7.1"}, lambda name: name != "pytest_timeout")
    assert missing == ["pytest-timeout is missing: no per-test timeout, only each step's deadline"]


def test_test_counts_come_from_the_junit_report_with_the_skips_for_want_of_cuda(gpu_check, tmp_path) -> None:
    (tmp_path / "report.xml").write_text(JUNIT)
    counts = gpu_check.junit_counts(tmp_path / "report.xml")
    assert counts == {"tests": 20, "failures": 2, "errors": 1, "skipped": 3, "no_cuda": 2}
    assert gpu_check.describe_counts(counts) == "14 passed, 2 failed, 1 errors, 3 skipped (2 for want of CUDA)"


def test_a_command_past_its_deadline_is_interrupted_and_may_still_write(gpu_check, tmp_path) -> None:
    script = textwrap.dedent(f"""
        import time
        try:
            time.sleep(60)
        except KeyboardInterrupt:
            open({str(tmp_path / "report")!r}, "w").write("written on the way out")
    """)  # fmt: skip
    started = time.monotonic()
    code = gpu_check.run_logged([sys.executable, "-c", script], tmp_path / "log", started + 2, dict(os.environ))
    assert code == 124 and time.monotonic() - started < 20
    assert (tmp_path / "report").read_text() == "written on the way out"
    assert "stopped at the step's deadline" in (tmp_path / "log").read_text()


def test_without_cuda_it_stops_at_once_and_writes_nothing(tmp_path) -> None:
    out = tmp_path / "check"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # no device, on a GPU machine too
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(out)], capture_output=True, text=True, env=env, timeout=120,
        check=False,
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith("gpu_check: no CUDA device: torch "), done.stderr
    assert "--dry-run" in done.stderr
    assert done.stdout == "" and not out.exists()


def test_a_used_output_folder_is_refused_before_anything_runs(gpu_check, tmp_path, capsys) -> None:
    (tmp_path / "summary.md").write_text("an earlier check\n")
    with pytest.raises(SystemExit) as exited:
        gpu_check.main(["--out", str(tmp_path)])
    assert exited.value.code == 2
    assert f"--out {tmp_path} is not empty" in capsys.readouterr().err
