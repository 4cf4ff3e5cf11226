"""Will the manager fit in this machine's memory? An estimate of its own memory, checked at start.

The manager's memory grows with its pool: every device block, once cached,
holds its bookkeeping (a block object, its place in a free queue, its hash
and the hash map's entry); a host block holds its share of the host tier's
flat arrays from the start (core/host_tier.py). A compaction (the journal's snapshot)
or a resync of every table (GetBlockTables) builds a copy of that state
for a moment, and the step log, the event log and the key memory keep up
to their retention in bytes. The estimate adds the four, each at its
worst, to what the process holds before its first block:

    base + num_blocks * per block + num_host_blocks * per host block
         + (num_blocks + num_host_blocks) * transient per block + retentions

The figures per block are measured (`bench/manager_memory_bench.py`: the
resident memory of a process holding a pool whose every block is cached,
in both tiers, and of a compaction's snapshot built from it, all of its
parts alive at once: 282 to 323 bytes, and 223 to 283 bytes more, for
8 * 10^4 to 2.5 * 10^5 blocks; a host block 61 to 96 bytes, and 176 to
271 more, for 4 * 10^4 to 10^6 host blocks), rounded up. The frequency eviction policy adds its history:
4 hashes per block (core/block_pool.py HISTORY_PER_BLOCK) at 105 bytes an OrderedDict entry and 65 a
hash no block holds any more (tracemalloc), and a snapshot's copy of it. Expected requests' prompts
(core/expectations.py) add up to their room's hashes, at 193 bytes each (tracemalloc). A mirror to Redis
keeps a set of the host tier's keys (mirror/key_set.py, in the writer's thread or process): 46 bytes a
host block, and a resync 42 more for a moment (tracemalloc). A start whose estimate
exceeds the memory available
to it (MemAvailable, or the cgroup's limit less its usage when lower) is
refused with the figures; `--no-memory-check` skips the check.
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

BASE_BYTES = 64 << 20  # the server process before any block: Python, grpc, protobuf (measured ~50 MiB)
BYTES_PER_BLOCK = 360  # a cached device block
HOST_BYTES_PER_BLOCK = 128  # a host block, cached or not
TRANSIENT_BYTES_PER_BLOCK = 320  # a block of either tier in a compaction's snapshot, or in a resync's tables
FREQUENCY_BYTES_PER_BLOCK = 4 * 176  # the frequency history's 4 hashes per device block
FREQUENCY_TRANSIENT_BYTES_PER_BLOCK = 4 * 128  # their copy in a compaction's snapshot
EXPECTED_BYTES_PER_BLOCK = 200  # a hash an expected prompt keeps, no other holding it (tracemalloc: 193)
EXPECTED_TRANSIENT_BYTES_PER_BLOCK = 48  # its place in a compaction's snapshot
MIRROR_HOST_BYTES_PER_BLOCK = 56  # the mirror's set of the host tier's keys (mirror/key_set.py: 50 a block)
MIRROR_HOST_TRANSIENT_BYTES_PER_BLOCK = 48  # a resync's copy of the tier's keys and its reconciliation (42)


class MemoryEstimate(NamedTuple):
    base: int
    blocks: int  # every block of both tiers, cached
    transient: int  # a compaction's snapshot, or a resync of every table, while it is built
    retention: int  # the step and event logs and the key memory, full

    @property
    def total(self) -> int:
        return self.base + self.blocks + self.transient + self.retention


def estimate_memory(
    num_blocks: int,
    num_host_blocks: int,
    retention_bytes: int,
    by_frequency: bool = False,
    num_expected_blocks: int = 0,
    mirrored: bool = False,
) -> MemoryEstimate:
    """The manager's memory at its worst for a pool of `num_blocks` device and `num_host_blocks` host blocks,
    `by_frequency` with the frequency eviction policy's history, expected prompts keeping up to
    `num_expected_blocks` hashes, and `mirrored` to Redis."""
    blocks = num_blocks * BYTES_PER_BLOCK + num_host_blocks * HOST_BYTES_PER_BLOCK
    blocks += num_expected_blocks * EXPECTED_BYTES_PER_BLOCK
    transient = (num_blocks + num_host_blocks) * TRANSIENT_BYTES_PER_BLOCK
    transient += num_expected_blocks * EXPECTED_TRANSIENT_BYTES_PER_BLOCK
    if mirrored:
        blocks += num_host_blocks * MIRROR_HOST_BYTES_PER_BLOCK
        transient += num_host_blocks * MIRROR_HOST_TRANSIENT_BYTES_PER_BLOCK
    if by_frequency:
        blocks += num_blocks * FREQUENCY_BYTES_PER_BLOCK
        transient += num_blocks * FREQUENCY_TRANSIENT_BYTES_PER_BLOCK
    return MemoryEstimate(BASE_BYTES, blocks, transient, retention_bytes)


def available_memory(proc: Path = Path("/proc"), cgroup: Path = Path("/sys/fs/cgroup")) -> tuple[int, str] | None:
    """The bytes this process may still use, and where that figure comes from; None where neither
    /proc/meminfo nor a cgroup (v2) limit can be read."""
    found: list[tuple[int, str]] = []
    try:
        for line in (proc / "meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                found.append((int(line.split()[1]) * 1024, "MemAvailable in /proc/meminfo"))
    except (OSError, ValueError, IndexError):
        pass
    try:
        limit = (cgroup / "memory.max").read_text().strip()
        if limit != "max":
            usage = int((cgroup / "memory.current").read_text())
            found.append((max(0, int(limit) - usage), f"the cgroup's memory.max ({int(limit):,} bytes) less its usage"))
    except (OSError, ValueError):
        pass
    return min(found) if found else None


def check_fits(estimate: MemoryEstimate, available: tuple[int, str] | None) -> None:
    """ValueError, with the figures, when the estimate exceeds what is available."""
    if available is None or estimate.total <= available[0]:
        return
    gib = 2**30
    raise ValueError(
        f"the manager would need up to {estimate.total / gib:.2f} GiB ({describe(estimate)}), but "
        f"{available[0] / gib:.2f} GiB is available ({available[1]}): lower --num-blocks, --num-host-blocks or "
        "the --*-retention-bytes, or pass --no-memory-check to start anyway"
    )


def describe(estimate: MemoryEstimate) -> str:
    mib = 2**20
    return (
        f"{estimate.blocks / mib:,.0f} MiB of blocks, {estimate.transient / mib:,.0f} MiB for a compaction or resync, "
        f"{estimate.retention / mib:,.0f} MiB of logs and keys, {estimate.base / mib:,.0f} MiB of process"
    )
