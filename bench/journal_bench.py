"""What the journal costs: Step round trips with no journal, fsync=never and fsync=always; and restore time.

Each configuration is a real `kv-manager serve` process; one client admits
256 requests, then sends 256-request decode `Step`s (the columnar batch).
Rounds alternate between the configurations so machine noise hits them
alike; figures are medians of per-round p50/p99. Then the manager with the
longest journal is restarted and its restore time read from its log.

    python bench/journal_bench.py [--rounds 5] [--steps 300]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_stats import fmt, percentile  # noqa: E402

from kv_manager_service.client import KVManagerClient  # noqa: E402
from kv_manager_service.rpc.launch import launch  # noqa: E402
from kv_manager_service.rpc.ready_line import MANAGER_READY_PREFIX  # noqa: E402

BATCH = 256
CONFIGS = {"no journal": [], "journal, fsync=never": ["never"], "journal, fsync=always": ["always"]}


def start(directory: Path, name: str, fsync: list[str], index: int):
    argv = [sys.executable, "-m", "kv_manager_service.cli", "serve", "--port", "0", "--num-blocks", "120000",
            "--replica-id", f"bench-{index}"]  # fmt: skip
    if fsync:
        argv += ["--journal", str(directory / f"{index}.journal"), "--journal-fsync", fsync[0]]
    return launch(argv, MANAGER_READY_PREFIX, directory / f"{index}.log"), argv


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=300, help="timed decode Steps per configuration and round")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="journal-bench-") as tmp:
        directory = Path(tmp)
        servers = {name: start(directory, name, fsync, i) for i, (name, fsync) in enumerate(CONFIGS.items())}
        clients = {name: KVManagerClient(process.address) for name, (process, _) in servers.items()}
        try:
            ids = [f"r{i}" for i in range(BATCH)]
            for client in clients.values():
                for request_id in ids:
                    client.allocate(request_id, list(range(i := hash(request_id) % 1000, i + 100)), 100)
            p50: dict[str, list[float]] = {name: [] for name in CONFIGS}
            p99: dict[str, list[float]] = {name: [] for name in CONFIGS}
            token = 0
            for _ in range(args.rounds):
                for name, client in clients.items():
                    samples = []
                    for _ in range(args.steps):
                        token = (token + 1) % 30000
                        started = time.perf_counter_ns()
                        client.decode(ids, [token] * BATCH)
                        samples.append((time.perf_counter_ns() - started) / 1e6)
                    p50[name].append(statistics.median(samples))
                    p99[name].append(percentile(samples, 99))
            base50, base99 = statistics.median(p50["no journal"]), statistics.median(p99["no journal"])
            print(f"256-request decode Step round trip, {args.rounds} rounds x {args.steps} steps")
            print(f"{'configuration':<24} {'p50 ms':>8} {'ratio':>6} {'p99 ms':>8} {'ratio':>6}")
            for name in CONFIGS:
                m50, m99 = statistics.median(p50[name]), statistics.median(p99[name])
                print(f"{name:<24} {fmt(m50):>8} {m50 / base50:>6.2f} {fmt(m99):>8} {m99 / base99:>6.2f}")
        finally:
            for client in clients.values():
                client.close()
            for process, _ in servers.values():
                process.stop()
        # Restore: restart the fsync=never manager from its journal.
        process, argv_ = servers["journal, fsync=never"]
        journal = Path(argv_[argv_.index("--journal") + 1])
        restarted = launch(argv_, MANAGER_READY_PREFIX, directory / "restart.log", timeout_s=600)
        restarted.stop()
        for line in restarted.log().splitlines():
            record = json.loads(line)
            if record.get("msg", "").startswith("journal "):
                print(f"restore: {record['msg']} ({journal.stat().st_size / 2**20:.1f} MiB journal)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
