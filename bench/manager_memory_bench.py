"""The manager's own memory per block, as `kv_manager_service/server/memory_budget.py` counts it.

For each pool size, a fresh process builds a core whose every block of both tiers is cached, then a
compaction's snapshot of it (the core's export, as the journal's message, serialized), and reports
the growth of its resident memory per block: empty, full, and the snapshot's transient on top. The
start-up check refuses a pool whose estimate (`BYTES_PER_BLOCK` a device block, `HOST_BYTES_PER_BLOCK` a
host block, `TRANSIENT_BYTES_PER_BLOCK` a block of either) exceeds the memory available, so they must stay
above what this measures.

    python bench/manager_memory_bench.py                      # 10^5 device blocks; 10^5 + 10^5; 5*10^4 + 2*10^5
    python bench/manager_memory_bench.py --pools 40000:40000 --json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kv_manager_service.server.memory_budget import (  # noqa: E402
    BYTES_PER_BLOCK,
    HOST_BYTES_PER_BLOCK,
    TRANSIENT_BYTES_PER_BLOCK,
)

# Run in a process of its own, so that each pool's growth is measured from a fresh start.
MEASURE = """
import gc, json, sys
from kv_manager_service.core import AllocateOp, FreeOp, KVCacheConfig, KVCacheManager
from kv_manager_service.server.snapshot import core_to_proto

def rss():
    return int(open("/proc/self/statm").read().split()[1]) * 4096

num_blocks, num_host_blocks, block_size, per_request = int(sys.argv[1]), int(sys.argv[2]), 16, 256
gc.collect()
start = rss()
manager = KVCacheManager(KVCacheConfig.from_dict(
    {"num_blocks": num_blocks, "num_host_blocks": num_host_blocks, "enable_events": True}
))
empty = rss()
tokens = per_request * block_size
for i in range((num_blocks + num_host_blocks) // per_request + 2):
    manager.step([AllocateOp(f"r{i}", range(i * tokens, (i + 1) * tokens), tokens)])
    manager.step([FreeOp([f"r{i}"])])
    manager.take_events()
    manager.ack(manager.last_step_id)
gc.collect()
full = rss()
state = manager.export_state()  # all three alive at once: a compaction's peak, on the high side
message = core_to_proto(state)
serialized = message.SerializeToString()
host = manager.host_tier_stats()
print(json.dumps({
    "num_blocks": num_blocks, "num_host_blocks": num_host_blocks,
    "empty": empty - start, "full": full - start, "transient": rss() - full,
    "cached_device_blocks": manager.stats().num_free_blocks, "free_host_blocks": host.num_free_host_blocks if host else 0,
}))
"""


def measure(num_blocks: int, num_host_blocks: int) -> dict[str, int]:
    """One pool's figures, in bytes, from a fresh process."""
    done = subprocess.run(
        [sys.executable, "-c", MEASURE, str(num_blocks), str(num_host_blocks)],
        capture_output=True, text=True, check=True, cwd=ROOT, timeout=600,
    )  # fmt: skip
    return json.loads(done.stdout)


def pool(text: str) -> tuple[int, int]:
    device, _, host = text.partition(":")
    return int(device), int(host or 0)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--pools", type=pool, nargs="+", default=[(100_000, 0), (100_000, 100_000), (50_000, 200_000)],
        metavar="DEVICE[:HOST]", help="pools to measure, device and host blocks (default %(default)s)",
    )  # fmt: skip
    parser.add_argument("--json", action="store_true", help="one JSON object per pool instead of the table")
    args = parser.parse_args(argv)
    if not args.json:
        print(f"resident memory per block (the estimate counts {BYTES_PER_BLOCK} a device block, "
              f"{HOST_BYTES_PER_BLOCK} a host block, + {TRANSIENT_BYTES_PER_BLOCK} transient)")  # fmt: skip
        print("| device blocks | host blocks | empty (B/block) | every block cached (B/block) | + a compaction's snapshot (B/block) |")
        print("|---:|---:|---:|---:|---:|")
    for num_blocks, num_host_blocks in args.pools:
        figures = measure(num_blocks, num_host_blocks)
        if args.json:
            print(json.dumps(figures), flush=True)
            continue
        n = num_blocks + num_host_blocks
        print(f"| {num_blocks:,} | {num_host_blocks:,} | {figures['empty'] / n:.0f} | {figures['full'] / n:.0f} | "
              f"{figures['transient'] / n:.0f} |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
