"""`kv-manager replay` end to end on a few requests of the project's trace: the console report and the JSON."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kv_manager_service.cli.main import main
from kv_tooling.workload import DEFAULT_TRACE

# The first 6 requests of the trace, scaled to 16 tokens per 512: a second of wall time.
FEW = ["replay", "--trace", str(DEFAULT_TRACE), "--requests", "6", "--scale", "0.03125"]
FIGURES = {
    "prompt_tokens", "prefix_hit_tokens", "device_hit_tokens", "host_hit_tokens", "readmission_hit_tokens",
    "prefill_tokens_computed", "num_preemptions", "offloaded_blocks", "onloaded_blocks", "ttft_ms_p50",
    "ttft_ms_p99", "tpot_ms_p50", "makespan_s",
}  # fmt: skip


def run_replay(tmp_path: Path, capsys: pytest.CaptureFixture[str], *args: str) -> tuple[str, dict]:
    path = tmp_path / "replay.json"
    assert main([*FEW, "--report-json", str(path), *args]) == 0
    return capsys.readouterr().out, json.loads(path.read_text())


def test_the_trace_replay_writes_the_figures_and_prints_them(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out, report = run_replay(tmp_path, capsys, "--arrivals", "trace", "--num-blocks", "4000")
    assert FIGURES <= set(report)
    assert report["arrivals"] == "trace" and report["time_scale"] == 1.0 and report["num_completed"] == 6
    assert report["prefill_tokens_computed"] >= report["prompt_tokens"] - report["prefix_hit_tokens"]
    assert report["device_hit_tokens"] + report["host_hit_tokens"] == report["prefix_hit_tokens"]
    assert 0 < report["ttft_ms_p50"] <= report["ttft_ms_p99"] and report["tpot_ms_p50"] > 0
    # The sixth request arrives 0.529 s after the first, and then takes its prefill and decode time.
    assert report["makespan_s"] > 0.529
    assert report["cost_model"]["kv_bytes_per_token"] == 131_072
    for row in ("prefill tokens computed", f"{report['prefill_tokens_computed']:,}", "re-admission hits",
                "TTFT p50 / p99", "TPOT p50", "makespan", "preemptions"):  # fmt: skip
        assert row in out


def test_the_cost_model_flags_reach_the_clock(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _, default = run_replay(tmp_path, capsys, "--num-blocks", "4000")
    _, slower = run_replay(tmp_path, capsys, "--num-blocks", "4000", "--prefill-us-per-token", "400")
    assert slower["cost_model"]["prefill_us_per_token"] == 400.0
    assert slower["ttft_ms_p50"] > default["ttft_ms_p50"]
    assert slower["prefill_tokens_computed"] == default["prefill_tokens_computed"]  # the clock, not the work


def test_asap_and_the_time_scale(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _, trace = run_replay(tmp_path, capsys, "--num-blocks", "4000")
    _, sparse = run_replay(tmp_path, capsys, "--num-blocks", "4000", "--time-scale", "100")
    _, asap = run_replay(tmp_path, capsys, "--num-blocks", "4000", "--arrivals", "asap")
    assert trace["arrivals"] == "trace"  # the default
    assert sparse["makespan_s"] > trace["makespan_s"] > asap["makespan_s"]
    assert asap["prompt_tokens"] == trace["prompt_tokens"] == sparse["prompt_tokens"]


def test_a_host_tier_reports_hits_by_tier(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out, report = run_replay(tmp_path, capsys, "--num-blocks", "400", "--num-host-blocks", "4000")
    assert report["num_host_blocks"] == 4000
    assert "device hit rate (tokens)" in out and "host hit rate (tokens)" in out


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [("--arrivals", "later", "invalid choice"), ("--time-scale", "0", "must be > 0"),
     ("--link-gb-per-s", "0", "must be > 0"), ("--prefill-us-per-token", "-1", "must be >= 0")],
)  # fmt: skip
def test_bad_values_name_the_flag(capsys: pytest.CaptureFixture[str], flag: str, value: str, message: str) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main([*FEW, flag, value])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert flag in err and message in err


def test_spliced_turns_of_a_generated_conversation_trace_are_reported(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "conversations.jsonl"
    assert main(["conversations", "--requests", "60", "--seed", "0", "--output", str(trace)]) == 0
    path = tmp_path / "spliced.json"
    args = ["replay", "--trace", str(trace), "--requests", "60", "--scale", "0.03125", "--num-blocks", "4000"]
    assert main([*args, "--splice-turns", "--report-json", str(path)]) == 0
    out, report = capsys.readouterr().out, json.loads(path.read_text())
    assert report["splice_turns"] is True and report["spliced_turns"] > 0 and report["num_completed"] == 60
    assert "spliced turns" in out and "held turns" in out
