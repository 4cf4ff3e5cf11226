"""The `kv-manager` command as a user runs it: a real subprocess, real files."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kv_manager_service.cli import build_config, make_parser
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


def test_serve_refuses_a_host_tier_it_cannot_serve_yet(tmp_path):
    """The tier's copies have no way to the workers yet: a server with one would lose them silently."""
    config = tmp_path / "pool.json"
    config.write_text('{"num_blocks": 64, "num_host_blocks": 128}')
    done = run_cli("serve", "--port", "0", "--config", str(config))
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1] == (
        "kv-manager: error: config num_host_blocks = 128: the host-memory tier runs in the core and in "
        "`kv-manager replay` only; the server does not yet send its copies to workers, so it refuses it"
    )
