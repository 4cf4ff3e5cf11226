"""`kv-manager demo` as a user runs it: local services, or running replicas routed by cached prefix."""

from __future__ import annotations

import json
import subprocess
import sys

from e2e_support import start_stack, stop_stack
from processes import ROOT

REPORT_FIELDS = {
    "num_requests", "num_completed", "prefix_hit_rate", "mean_usage", "peak_usage", "requests_per_s",
    "step_ms_p50", "step_ms_p99", "num_preemptions", "paged_real_token_share", "own_max_real_token_share",
    "contiguous_real_token_share", "requests_per_replica",
}  # fmt: skip


def run_demo(tmp_path, *args: str) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path / "out"
    done = subprocess.run(
        [sys.executable, "-m", "kv_manager_service.cli", "demo", "--output-dir", str(out), "--no-progress", *args],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert (out / "demo.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    return done, json.loads((out / "report.json").read_text())


def test_the_local_demo_reports_on_paging(tmp_path):
    done, report = run_demo(tmp_path, "--requests", "12", "--model", "tiny", "--num-blocks", "96", "--max-running", "8")
    assert REPORT_FIELDS <= set(report)
    assert report["num_requests"] == report["num_completed"] == 12
    assert "Demo report" in done.stdout and "requests completed" in done.stdout
    assert "12/12 requests" in done.stderr  # the progress line
    # Paging wastes at most a block's tail per request; a 2048-token contiguous reservation wastes most of it.
    assert report["paged_real_token_share"] > 0.8 > report["contiguous_real_token_share"]
    assert 0 < report["peak_usage"] <= 1 and report["step_ms_p50"] > 0


def test_the_demo_routes_over_running_replicas(tmp_path):
    pool = {"num_blocks": 128, "groups": [{"kind": "full_attention", "block_size": 16}]}
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
    stacks = [start_stack(tmp_path / name, "tiny", "torch", pool) for name in ("a", "b")]
    try:
        pairs = [f"{s.manager.address}={s.worker.address}" for s, _ in stacks]
        done, report = run_demo(tmp_path, "--requests", "16", "--replica", pairs[0], "--replica", pairs[1])
        assert report["num_completed"] == 16
        assert "on 2 replicas (replica-a, replica-b);" in done.stderr, done.stderr
        assert sum(report["requests_per_replica"].values()) == 16 and len(report["requests_per_replica"]) == 2
        for stack, _ in stacks:
            assert stack.manager_client.stats().num_requests == 0  # every request was freed
        done, report = run_demo(tmp_path, "--requests", "2", "--replica", pairs[0])
        assert report["num_completed"] == 2
        assert "on 1 replica (replica-a);" in done.stderr, done.stderr
    finally:
        failures = [f for stack, processes in stacks for f in stop_stack(stack, processes)]
        assert not failures, "\n\n".join(failures)


def test_bad_flags_are_refused_naming_them(tmp_path):
    for args, message in (
        (["--replica", "nonsense"], "expected MANAGER_HOST:PORT=WORKER_HOST:PORT"),
        (["--scale", "2"], "must be in (0, 1]"),
        (["--trace", str(tmp_path / "missing.jsonl")], "not found"),
    ):
        done = subprocess.run(
            [sys.executable, "-m", "kv_manager_service.cli", "demo", "--output-dir", str(tmp_path), *args],
            cwd=ROOT, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert done.returncode == 2 and message in done.stderr, (args, done.stderr)
