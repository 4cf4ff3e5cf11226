"""`kv-manager demo` as a user runs it: local services, or running replicas routed by cached prefix."""

from __future__ import annotations

import argparse
import dataclasses
import json
import signal
import subprocess
import sys
import time
import types
from pathlib import Path

import matplotlib.pyplot
import pytest
from e2e_support import start_stack, stop_stack
from processes import ROOT, free_port, launch

from kv_manager_service.cli.main import make_parser
from kv_tooling.replay import ReplayConfig, replay
from kv_manager_service.core import KVCacheManager
from kv_manager_service.shared.config import KVCacheConfig
from kv_tooling.workload import TokenExpander, load_trace
from kvcache.v1 import kv_manager_pb2 as pb
from kvcache.v1 import worker_pb2
from kv_tooling.workload import DEFAULT_TRACE
from kv_tooling.demo import _banner, tier_block_bytes, trace_start
from kv_manager_service.shared.ready_line import MANAGER_READY_PREFIX
from kv_tooling.demo_report import REPORT_UNITS, TIER_UNITS, Report, Sample, TierReport, build_figure

REPORT_FIELDS = {
    "trace_file", "trace_start_index", "num_requests", "num_completed", "prefix_hit_rate", "num_prefix_hit_tokens",
    "prefill_tokens_computed", "prefill_tokens_per_s", "est_prefill_time_saved_s", "mean_usage", "peak_usage",
    "requests_per_s", "step_ms_p50", "step_ms_p99", "num_preemptions", "num_kv_lost", "paged_real_token_share",
    "own_max_real_token_share", "contiguous_real_token_share", "requests_per_replica",
}  # fmt: skip


def default_demo_flags(*argv: str) -> argparse.Namespace:
    return make_parser().parse_args(["demo", *argv])


def run_demo(tmp_path, *args: str) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path / "out"
    done = subprocess.run(
        [sys.executable, "-m", "kv_manager_service.cli", "demo", "--output-dir", str(out), "--no-progress", *args],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert (out / "demo.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    return done, json.loads((out / "report.json").read_text())


def test_the_default_window_hits_the_prefix_cache():
    """The default workload, replayed through the core with the demo's pool and scheduler limits (no model)."""
    args = default_demo_flags()
    start = trace_start(args)
    window = load_trace(DEFAULT_TRACE, limit=start + args.requests)[start:]
    assert len(window) == args.requests

    def hit_rate(records) -> float:
        manager = KVCacheManager(KVCacheConfig(num_blocks=args.num_blocks))
        limits = ReplayConfig(args.token_budget, args.max_running)
        result = replay(manager, records, TokenExpander(scale=args.scale), limits)
        assert result.num_completed == len(records)
        return result.prefix_hit_rate

    # The trace's opening requests share little; the default window is where its conversations continue.
    assert hit_rate(window) > 0.2 > hit_rate(load_trace(DEFAULT_TRACE, limit=args.requests))


def test_the_window_starts_where_asked_or_at_the_default():
    assert trace_start(default_demo_flags()) == 3840
    assert trace_start(default_demo_flags("--start", "7")) == 7
    assert trace_start(default_demo_flags("--trace", "other.jsonl")) == 0  # the default window is the project trace's


def test_the_local_demo_reports_on_paging(tmp_path):
    done, report = run_demo(
        tmp_path, "--start", "0", "--requests", "12", "--model", "tiny", "--num-blocks", "96", "--max-running", "8"
    )
    assert REPORT_FIELDS <= set(report)
    assert set(report["units"]) == set(report) - {"units"}  # every field says its unit
    assert report["trace_start_index"] == 0 and report["trace_file"] == DEFAULT_TRACE.name
    assert report["num_requests"] == report["num_completed"] == 12
    # The manager's hit rate and the scheduler's token counts agree: hits over the tokens looked up.
    looked_up = report["num_prefix_hit_tokens"] + report["prefill_tokens_computed"]
    assert looked_up >= report["num_prompt_tokens"]  # re-admissions after preemption look up again
    assert report["num_prefix_hit_tokens"] == pytest.approx(report["prefix_hit_rate"] * looked_up)
    assert report["prefill_tokens_per_s"] > 0
    assert report["est_prefill_time_saved_s"] == pytest.approx(
        report["num_prefix_hit_tokens"] / report["prefill_tokens_per_s"]
    )
    assert "Replaying the first 12 requests of mooncake_synthetic_trace.jsonl" in done.stderr
    assert "0..11 of mooncake_synthetic_trace.jsonl" in done.stdout
    assert "prefill time the hits saved" in done.stdout
    assert "Demo report" in done.stdout and "requests completed" in done.stdout
    assert "12/12 requests" in done.stderr  # the progress line
    # Paging wastes at most a block's tail per request; a 2048-token contiguous reservation wastes most of it.
    assert report["paged_real_token_share"] > 0.8 > report["contiguous_real_token_share"]
    assert 0 < report["peak_usage"] <= 1 and report["step_ms_p50"] > 0
    assert report["host_tier"] is None and "host tier" not in done.stdout  # no tier: the report is unchanged


def test_the_local_demo_with_a_host_tier_reports_hits_by_tier_and_the_copy_volume(tmp_path):
    # A device pool too small for the window's shared prefixes: they are evicted to the host and come back from it.
    done, report = run_demo(
        tmp_path, "--requests", "24", "--model", "tiny", "--num-blocks", "160", "--max-running", "8",
        "--num-host-blocks", "512",
    )  # fmt: skip
    assert report["num_completed"] == 24
    tier = report["host_tier"]
    assert set(tier) == set(report["units"]["host_tier"]) == set(TIER_UNITS)
    assert tier["num_host_blocks"] == 512
    assert tier["device_hit_rate"] + tier["host_hit_rate"] == pytest.approx(report["prefix_hit_rate"])
    assert tier["host_hit_rate"] > 0 and tier["num_offloaded_blocks"] > 0 and tier["num_onloaded_blocks"] > 0
    # Every host-hit block is one onload, 16 tokens each.
    looked_up = report["num_prefix_hit_tokens"] + report["prefill_tokens_computed"]
    assert tier["num_onloaded_blocks"] * 16 == pytest.approx(tier["host_hit_rate"] * looked_up)
    # tiny, float32 on the CPU: 2 layers x (K, V) x 16 tokens x 2 kv heads x 16 dims x 4 bytes per block.
    block_bytes = 2 * 2 * 16 * 2 * 16 * 4
    assert tier["offloaded_bytes"] == tier["num_offloaded_blocks"] * block_bytes
    assert tier["onloaded_bytes"] == tier["num_onloaded_blocks"] * block_bytes
    assert "host tier of 512 blocks" in done.stderr, done.stderr
    for row in ("of which on the device", "of which in the host tier (512 blocks)",
                "host tier: offloaded (device -> host)", "host tier: onloaded (host -> device)"):  # fmt: skip
        assert row in done.stdout, done.stdout
    assert f"{tier['num_onloaded_blocks']:,} blocks ({tier['onloaded_bytes'] / 2**20:,.1f} MiB)" in done.stdout


def test_a_tier_copy_moves_every_layer_of_a_block_when_the_pool_is_all_full_attention():
    full = pb.GroupConfig(group_id=0, kind=pb.GROUP_KIND_FULL_ATTENTION, block_size=16)
    sliding = pb.GroupConfig(group_id=1, kind=pb.GROUP_KIND_SLIDING_WINDOW, block_size=16, sliding_window=64)
    info = worker_pb2.GetWorkerInfoResponse(num_blocks=100, kv_cache_bytes=100 * 8192)
    assert tier_block_bytes(pb.GetConfigResponse(num_host_blocks=10, groups=[full]), info) == 8192
    # Sliding-window layers stay off the tier, and the worker's cache size does not tell them apart.
    assert tier_block_bytes(pb.GetConfigResponse(num_host_blocks=10, groups=[full, sliding]), info) is None
    assert tier_block_bytes(pb.GetConfigResponse(num_host_blocks=0, groups=[full]), info) is None


def test_the_demo_routes_over_running_replicas(tmp_path):
    pool = {"num_blocks": 128, "groups": [{"kind": "full_attention", "block_size": 16}]}
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
    stacks = [start_stack(tmp_path / name, "tiny", "torch", pool) for name in ("a", "b")]
    try:
        pairs = [f"{s.manager.address}={s.worker.address}" for s, _ in stacks]
        done, report = run_demo(tmp_path, "--requests", "16", "--replica", pairs[0], "--replica", pairs[1])
        assert report["num_completed"] == 16 and report["trace_start_index"] == 3840
        assert "Replaying requests 3840..3855 of mooncake_synthetic_trace.jsonl" in done.stderr, done.stderr
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
        (["--start", "-1"], "must be >= 0"),
        (["--start", "5000"], "--start 5000 is past the end of"),
        (["--num-host-blocks", "-1"], "must be >= 0"),
    ):
        done = subprocess.run(
            [sys.executable, "-m", "kv_manager_service.cli", "demo", "--output-dir", str(tmp_path), *args],
            cwd=ROOT, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert done.returncode == 2 and message in done.stderr, (args, done.stderr)


def test_a_replica_that_does_not_answer_is_named_by_its_side(tmp_path):
    """`--replica M=W` with one side not listening says which side, and at which address."""
    manager = launch(
        [sys.executable, "-m", "kv_manager_service.cli", "serve", "--port", "0", "--num-blocks", "64"],
        MANAGER_READY_PREFIX, tmp_path / "manager.log",
    )  # fmt: skip
    dead = f"127.0.0.1:{free_port()}"
    try:
        cases = {"gpu-worker": f"{manager.address}={dead}", "kv-manager": f"{dead}=127.0.0.1:{free_port()}"}
        runs = {
            side: subprocess.Popen(
                [sys.executable, "-m", "kv_manager_service.cli", "demo", "--output-dir", str(tmp_path / side),
                 "--requests", "1", "--replica", pair],
                cwd=ROOT, stderr=subprocess.PIPE, text=True,
            )  # fmt: skip
            for side, pair in cases.items()
        }
        for side, run in runs.items():
            _, stderr = run.communicate(timeout=120)
            assert run.returncode == 2, stderr
            assert f"the {side} at {dead} did not answer within" in stderr, stderr
    finally:
        manager.stop()


def test_the_banner_counts_replicas_in_the_singular_and_plural():
    args = default_demo_flags("--replica", "a:1=b:2")
    one = [types.SimpleNamespace(replica_id="replica-a")]
    two = [*one, types.SimpleNamespace(replica_id="replica-b")]
    assert "on 1 replica (replica-a);" in _banner(args, one, "trace.jsonl", 0, 2)
    assert "on 2 replicas (replica-a, replica-b);" in _banner(args, two, "trace.jsonl", 0, 2)
    assert "Replaying the first 2 requests of trace.jsonl" in _banner(args, one, "trace.jsonl", 0, 2)


def test_the_report_gives_every_field_a_unit():
    assert set(REPORT_UNITS) == {field.name for field in dataclasses.fields(Report)}
    assert REPORT_UNITS["host_tier"] == TIER_UNITS
    assert set(TIER_UNITS) == {field.name for field in dataclasses.fields(TierReport)}


def test_the_figure_legends_sit_outside_the_plotted_data():
    samples = [
        Sample(t_s=t, usage=t / 10, hit_rate=0.5, num_running=4, num_waiting=10 - t, num_completed=t,
               num_preemptions=t // 3, real_tokens=100, paged_slots=112, own_max_slots=150, contiguous_slots=2048,
               num_prefix_hit_tokens=500 * t, prefill_tokens_computed=400 * t)
        for t in range(10)
    ]  # fmt: skip
    figure = build_figure(samples, "title")
    renderer = figure.canvas.get_renderer()
    figure.canvas.draw()
    for axes in figure.axes:
        legend = axes.get_legend()
        assert legend is not None and legend.get_texts(), axes.get_ylabel()
        assert not legend.get_window_extent(renderer).overlaps(axes.get_window_extent(renderer)), axes.get_ylabel()
    matplotlib.pyplot.close(figure)


def _children(pid: int) -> list[int]:
    """The live child processes of `pid` (Linux /proc)."""
    text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    return [int(child) for child in text.split()]


def _alive(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return "\nState:\tZ" not in status


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT], ids=lambda s: s.name)
def test_a_signalled_demo_stops_its_manager_and_worker_and_says_so_in_one_line(tmp_path, signum):
    out = tmp_path / "out"
    demo = subprocess.Popen(
        [sys.executable, "-m", "kv_manager_service.cli", "demo", "--output-dir", str(out), "--no-progress",
         "--requests", "400", "--model", "tiny", "--num-blocks", "1024", "--max-running", "8"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while len(_children(demo.pid)) < 2:  # its manager and its worker
            assert demo.poll() is None and time.monotonic() < deadline, demo.communicate()
            time.sleep(0.05)
        children = _children(demo.pid)
        demo.send_signal(signum)
        _, stderr = demo.communicate(timeout=60)
    finally:
        if demo.poll() is None:
            demo.kill()
    assert demo.returncode == 128 + signum, stderr
    assert not [child for child in children if _alive(child)], "a child outlived the demo"
    last = stderr.strip().splitlines()[-1]
    assert last == f"kv-manager demo: {signum.name}: stopped, with the manager and worker it started", stderr
    assert "Traceback" not in stderr
