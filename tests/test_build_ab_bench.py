"""bench/build_ab_bench.py end to end, with this tree as its own baseline: both servers real, the client
processes of its process throughput series real, settings tiny (figures are not checked, only reported)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "build_ab_bench.py"
BUILDS = ("baseline", "this tree")


def run_script(*args: str, timeout: float) -> subprocess.CompletedProcess:
    argv = [sys.executable, str(SCRIPT), *args]
    return subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def test_a_tiny_run_reports_both_throughput_series_for_both_builds() -> None:
    done = run_script(
        "--baseline", str(ROOT), "--rounds", "1", "--steps", "3", "--warmup", "1",
        "--throughput-steps", "3", "--client-processes", "2", "--throughput-clients", "1",
        timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    for label in ("1 client threads", "2 client processes"):
        for build in BUILDS:
            cells = r"([\d,]+) \| ([\d,]+)-([\d,]+) \| ([\d.,]+) \| ([\d.,]+)"
            row = re.search(rf"^\| {label} \| {build} \| {cells} \|$", out, re.M)
            assert row, f"no {label} row for {build} in:\n{out}"
            rate = float(row[1].replace(",", ""))
            client_cpu_ms = float(row[5].replace(",", ""))
            assert rate > 0 and client_cpu_ms > 0, row[0]
        ratio_line = rf"^ratio this tree / baseline, throughput, {label}, median of per-round ratios: ([\d.]+) "
        ratio = re.search(ratio_line, out, re.M)
        assert ratio and float(ratio[1]) > 0, out
    progress = r"^round 1/1: baseline [\d.]+ ms, this tree [\d.]+ ms; processes baseline [\d,]+/s, this tree [\d,]+/s$"
    assert re.search(progress, done.stderr, re.M), done.stderr


def test_a_negative_count_of_client_processes_is_refused_with_the_flag_and_its_value() -> None:
    done = run_script("--baseline", str(ROOT), "--client-processes", "-1", timeout=60)
    assert done.returncode == 2
    assert "--client-processes -1: must be >= 0" in done.stderr
