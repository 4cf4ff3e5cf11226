"""The manager's memory estimate: its figures per block hold for a real pool, and a start that cannot fit
is refused with the figures."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kv_manager_service.server.memory_budget import (
    EXPECTED_BYTES_PER_BLOCK,
    FREQUENCY_BYTES_PER_BLOCK,
    MIRROR_HOST_BYTES_PER_BLOCK,
    MIRROR_HOST_TRANSIENT_BYTES_PER_BLOCK,
    available_memory,
    check_fits,
    estimate_memory,
)

ROOT = Path(__file__).resolve().parents[2]


def test_the_figures_per_block_hold_for_a_full_pool():
    """bench/manager_memory_bench.py: every block of both tiers cached, then a compaction's snapshot."""
    done = subprocess.run(
        [sys.executable, "bench/manager_memory_bench.py", "--pools", "40000:40000", "--json"],
        capture_output=True, text=True, timeout=300, check=True, cwd=ROOT,
    )  # fmt: skip
    figures = json.loads(done.stdout)
    num = figures["num_blocks"] + figures["num_host_blocks"]
    estimate = estimate_memory(figures["num_blocks"], figures["num_host_blocks"], 0)
    # Free, and every one cached (the null block is never free).
    assert figures["cached_device_blocks"] == 40_000 - 1 and figures["free_host_blocks"] == 40_000
    assert figures["full"] <= estimate.blocks, f"{figures['full'] / num:.0f} bytes per block"
    assert figures["transient"] <= estimate.transient, f"{figures['transient'] / num:.0f} bytes per block"


def test_a_pool_that_cannot_fit_is_refused_with_the_figures():
    estimate = estimate_memory(10**9, 10**9, 0)
    with pytest.raises(ValueError, match=r"would need up to \d+\.\d\d GiB .* but 1\.00 GiB is available \(test\)"):
        check_fits(estimate, (2**30, "test"))
    check_fits(estimate_memory(1000, 0, 0), (2**30, "test"))
    check_fits(estimate, None)  # nothing to compare with: not refused


def test_the_available_memory_is_the_lower_of_meminfo_and_the_cgroup(tmp_path: Path):
    proc, cgroup = tmp_path / "proc", tmp_path / "cgroup"
    proc.mkdir()
    cgroup.mkdir()
    (proc / "meminfo").write_text("MemTotal: 8000000 kB\nMemAvailable: 4000000 kB\n")
    assert available_memory(proc, cgroup) == (4_096_000_000, "MemAvailable in /proc/meminfo")
    (cgroup / "memory.max").write_text("max\n")
    assert available_memory(proc, cgroup)[0] == 4_096_000_000
    (cgroup / "memory.max").write_text(f"{2 * 2**30}\n")
    (cgroup / "memory.current").write_text(f"{2**30}\n")
    assert available_memory(proc, cgroup)[0] == 2**30
    assert available_memory(tmp_path / "none", tmp_path / "none") is None


def test_the_frequency_policy_adds_its_history_to_the_estimate():
    lru, frequency = estimate_memory(100_000, 0, 0), estimate_memory(100_000, 0, 0, by_frequency=True)
    assert frequency.blocks - lru.blocks == 100_000 * FREQUENCY_BYTES_PER_BLOCK
    assert frequency.transient > lru.transient


def test_expected_prompts_add_their_room_to_the_estimate():
    none, room = estimate_memory(100_000, 0, 0), estimate_memory(100_000, 0, 0, num_expected_blocks=400_000)
    assert room.blocks - none.blocks == 400_000 * EXPECTED_BYTES_PER_BLOCK
    assert room.transient > none.transient


def test_a_mirror_adds_its_host_key_set_to_the_estimate():
    alone, mirrored = estimate_memory(1000, 700_000, 0), estimate_memory(1000, 700_000, 0, mirrored=True)
    assert mirrored.blocks - alone.blocks == 700_000 * MIRROR_HOST_BYTES_PER_BLOCK
    assert mirrored.transient - alone.transient == 700_000 * MIRROR_HOST_TRANSIENT_BYTES_PER_BLOCK
