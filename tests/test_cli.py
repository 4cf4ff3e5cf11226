"""The `kv-manager` command as a user runs it: a real subprocess, real files."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kv_manager_service.cli.flags import build_config
from kv_manager_service.cli.main import make_parser
from kv_manager_service.core import GroupKind

ROOT = Path(__file__).resolve().parents[1]
EXCERPT = ROOT / "tests" / "data" / "mooncake_excerpt.jsonl"


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "kv_manager_service.cli", *args], capture_output=True, text=True, timeout=120, cwd=ROOT
    )


def test_replay_prints_a_report():
    done = run_cli("replay", "--trace", str(EXCERPT), "--requests", "12", "--scale", "0.05", "--num-blocks", "4000")
    assert done.returncode == 0, done.stderr
    assert "requests completed        12 / 12" in done.stdout
    assert "prefix-hit rate" in done.stdout
    assert "Replaying 12 requests" in done.stderr


def test_missing_trace_is_a_clear_error(tmp_path):
    done = run_cli("replay", "--trace", str(tmp_path / "nope.jsonl"))
    assert done.returncode == 2
    assert "nope.jsonl not found" in done.stderr


def test_bad_flag_values_name_the_flag():
    done = run_cli("replay", "--scale", "2")
    assert done.returncode == 2 and "--scale" in done.stderr and "(0, 1]" in done.stderr


def parse(*args: str):
    return make_parser().parse_args(["replay", *args])


def test_config_file_with_groups_and_flag_override(tmp_path):
    path = tmp_path / "pool.yaml"
    path.write_text(
        "num_blocks: 64\n"
        "groups:\n"
        "  - {kind: full_attention, block_size: 16}\n"
        "  - {kind: sliding_window, block_size: 32, sliding_window: 128}\n"
    )
    config = build_config(parse("--config", str(path), "--num-blocks", "99"))
    assert config.num_blocks == 99
    assert [g.kind for g in config.groups] == [GroupKind.FULL_ATTENTION, GroupKind.SLIDING_WINDOW]
    assert config.hash_block_size == 16 and config.lcm_block_size == 32


def test_block_size_conflicts_with_file_groups(tmp_path):
    path = tmp_path / "pool.json"
    path.write_text(json.dumps({"num_blocks": 8, "groups": [{"kind": "mamba", "block_size": 64}]}))
    with pytest.raises(ValueError, match="--block-size"):
        build_config(parse("--config", str(path), "--block-size", "32"))


@pytest.mark.parametrize(
    "content, message",
    [
        ({"num_blocks": 8, "colour": "red"}, "unknown config keys \\['colour'\\]"),
        ({"num_blocks": 1}, "num_blocks must be an integer >= 2"),
        ({"num_blocks": 8, "groups": [{"kind": "sliding_window", "block_size": 16}]}, "groups\\[0\\]: sliding_window"),
        ({"num_blocks": 8, "groups": [{"kind": "chunked_local", "block_size": 16, "chunk_size": 24}]}, "chunk_size"),
        ({"num_blocks": 8, "groups": [{"kind": "linear", "block_size": 16}]}, "groups\\[0\\]"),
        ({"num_blocks": 8, "hash_algorithm": "xxh3_128"}, "xxh3_128 needs a secret hash_seed"),
    ],
)
def test_invalid_config_files_are_refused_with_the_field(tmp_path, content, message):
    path = tmp_path / "pool.json"
    path.write_text(json.dumps(content))
    with pytest.raises(ValueError, match=message):
        build_config(parse("--config", str(path)))


def test_serve_takes_the_host_tier_from_the_flag_or_the_config_file(tmp_path):
    config = tmp_path / "pool.json"
    config.write_text('{"num_blocks": 64, "num_host_blocks": 128}')

    def num_host_blocks(*args: str) -> int:
        return build_config(make_parser().parse_args(["serve", *args])).num_host_blocks

    assert num_host_blocks() == 0
    assert num_host_blocks("--num-host-blocks", "32") == 32
    assert num_host_blocks("--config", str(config)) == 128
    assert num_host_blocks("--config", str(config), "--num-host-blocks", "0") == 0  # the flag overrides the file
    assert build_config(parse("--num-host-blocks", "16")).num_host_blocks == 16  # replay shares the flag


def test_serve_refuses_a_host_tier_the_pool_cannot_use(tmp_path):
    """The core refuses a tier with a group other than full attention: one line, exit 2."""
    config = tmp_path / "pool.json"
    config.write_text(
        json.dumps(
            {
                "num_blocks": 64,
                "groups": [
                    {"kind": "full_attention", "block_size": 16},
                    {"kind": "sliding_window", "block_size": 16, "sliding_window": 64},
                ],
            }
        )
    )
    done = run_cli("serve", "--port", "0", "--config", str(config), "--num-host-blocks", "128")
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "kv-manager: error: num_host_blocks 128 needs full_attention groups only; groups[1] (sliding_window) "
        "cannot use the host tier"
    ]


@pytest.mark.parametrize("module, name", [("kv_manager_service.cli", "kv-manager"), ("gpu_worker.cli", "gpu-worker")])
def test_both_commands_say_their_version_from_the_package_metadata(module, name):
    from importlib.metadata import version

    done = subprocess.run([sys.executable, "-m", module, "--version"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"{name} {version('kv-manager-service')}"


def test_the_worker_without_its_extra_exits_2_with_one_line_naming_it():
    """A manager-only install has no torch: the worker says which extra to install, in one line."""
    code = (
        "import sys; sys.modules['torch'] = None; from gpu_worker.cli import main; "
        "sys.exit(main(['--manager', '127.0.0.1:1']))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "torch not installed" in lines[0] and "kv-manager-service[worker]" in lines[0], lines


@pytest.mark.parametrize(
    "module, args, expected",
    [
        ("kv_manager_service.cli", ["serve", "--num-blocks", "abc"], "argument --num-blocks: invalid int value: 'abc'"),
        ("gpu_worker.cli", ["--manager", "127.0.0.1:1", "--port", "x"], "argument --port: invalid int value: 'x'"),
    ],
)
def test_a_mistyped_flag_is_one_line_not_the_usage(module, args, expected):
    done = subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert len(done.stderr.strip().splitlines()) == 1 and expected in done.stderr and "--help" in done.stderr, done.stderr


def test_serve_help_puts_every_flag_in_a_topic():
    help_text = make_parser()._subparsers._group_actions[0].choices["serve"].format_help()
    ungrouped = help_text.split("options:", 1)[1].split("\n\n", 1)[0]
    assert ungrouped.split() == ["-h,", "--help", "show", "this", "help", "message", "and", "exit"], ungrouped


def test_a_generated_conversation_trace_replays_on_the_trace_clock(tmp_path):
    trace, report = tmp_path / "conversations.jsonl", tmp_path / "report.json"
    done = run_cli("conversations", "--requests", "60", "--seed", "3", "--output", str(trace))
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("60 requests in "), done.stdout
    done = run_cli("replay", "--trace", str(trace), "--requests", "60", "--scale", "0.05", "--num-blocks", "4000",
                   "--arrivals", "trace", "--report-json", str(report))  # fmt: skip
    assert done.returncode == 0, done.stderr
    figures = json.loads(report.read_text())
    assert figures["num_completed"] == 60
    assert figures["prefill_tokens_computed"] >= figures["prompt_tokens"] - figures["prefix_hit_tokens"]
    assert figures["ttft_ms_p50"] > 0 and figures["makespan_s"] > 0
