"""The manager's memory estimate: its figures per block hold for a real pool, and a start that cannot fit
is refused with the figures."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kv_manager_service.server.memory_budget import (
    BYTES_PER_BLOCK,
    TRANSIENT_BYTES_PER_BLOCK,
    available_memory,
    check_fits,
    estimate_memory,
)

# A pool whose every block is cached, in both tiers, then a compaction's snapshot of it; RSS before and after each.
MEASURE = """
import gc, sys
from kv_manager_service.core import AllocateOp, FreeOp, KVCacheConfig, KVCacheManager
from kv_manager_service.server.snapshot import core_to_proto

def rss():
    return int(open("/proc/self/statm").read().split()[1]) * 4096

num_blocks, num_host_blocks, block_size, per_request = int(sys.argv[1]), int(sys.argv[2]), 16, 256
gc.collect()
before = rss()
manager = KVCacheManager(KVCacheConfig.from_dict(
    {"num_blocks": num_blocks, "num_host_blocks": num_host_blocks, "enable_events": True}
))
tokens_per_request = per_request * block_size
for i in range((num_blocks + num_host_blocks) // per_request + 2):
    manager.step([AllocateOp(f"r{i}", range(i * tokens_per_request, (i + 1) * tokens_per_request), tokens_per_request)])
    manager.step([FreeOp([f"r{i}"])])
    manager.take_events()
    manager.ack(manager.last_step_id)
gc.collect()
full = rss()
snapshot = core_to_proto(manager.export_state()).SerializeToString()
print(full - before, rss() - full, manager.stats().num_free_blocks, manager.host_tier_stats().num_free_host_blocks)
"""


def test_the_figures_per_block_hold_for_a_full_pool():
    num_blocks = num_host_blocks = 40_000
    done = subprocess.run(
        [sys.executable, "-c", MEASURE, str(num_blocks), str(num_host_blocks)],
        capture_output=True, text=True, timeout=300, check=True,
    )  # fmt: skip
    full, transient, num_free, num_free_host = map(int, done.stdout.split())
    num = num_blocks + num_host_blocks
    assert num_free == num_blocks - 1 and num_free_host == num_host_blocks  # free, and every one cached
    assert full <= num * BYTES_PER_BLOCK, f"{full / num:.0f} bytes per block"
    assert transient <= num * TRANSIENT_BYTES_PER_BLOCK, f"{transient / num:.0f} bytes per block"


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
