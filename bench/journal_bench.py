"""What the journal costs: Step round trips with no journal, fsync=never and fsync=always; and restore time.

Each configuration is a real `kv-manager serve` process; one client admits
256 requests, then sends 256-request decode `Step`s (the columnar batch).
Rounds alternate between the configurations so machine noise hits them
alike; figures are medians of per-round p50/p99. Then the manager with the
longest journal is restarted and its restore time read from its log.

    python bench/journal_bench.py [--rounds 5] [--steps 300]

With `--history 1000,10000,50000`, it measures instead the restart time
against the journal's history, with and without compaction: a replica (in
this process, as the server builds it) runs a 256-request decode workload
whose requests finish after `--request-steps` steps and are replaced, so
the live state stays the same size while the history grows; at each
history length the journal is copied and a replica is built from the copy
(`build_replica`: open, read, replay or restore; imports excluded). The
compaction pauses are the longest steps that compacted.

    python bench/journal_bench.py --history 1000,10000,50000
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_stats import Series, fmt, med  # noqa: E402

from kv_manager_service.client import KVManagerClient  # noqa: E402
from kv_manager_service.core import KVCacheConfig  # noqa: E402
from kv_manager_service import wire  # noqa: E402
from kv_manager_service.server.journal import DEFAULT_COMPACT_BYTES  # noqa: E402
from kv_manager_service.server.process import ServerOptions, build_replica  # noqa: E402
from kv_manager_service.server.snapshot import take_snapshot  # noqa: E402
from kvcache.v1 import kv_manager_pb2 as pb  # noqa: E402
from kv_tooling.launch import launch  # noqa: E402
from kv_manager_service.shared.ready_line import MANAGER_READY_PREFIX  # noqa: E402

BATCH = 256
CONFIGS = {"no journal": [], "journal, fsync=never": ["never"], "journal, fsync=always": ["always"]}


def start(directory: Path, name: str, fsync: list[str], index: int):
    argv = [sys.executable, "-m", "kv_manager_service.cli", "serve", "--port", "0", "--num-blocks", "120000",
            "--replica-id", f"bench-{index}"]  # fmt: skip
    if fsync:
        argv += ["--journal", str(directory / f"{index}.journal"), "--journal-fsync", fsync[0]]
    return launch(argv, MANAGER_READY_PREFIX, directory / f"{index}.log"), argv


def decode_workload(num_steps: int, request_steps: int) -> Iterator[pb.StepRequest]:
    """256 live requests; each step decodes one token of every one. Request i finishes after
    `request_steps` steps (staggered) and a new one with a 100-token prompt takes its place."""
    live = [f"r{i}" for i in range(BATCH)]
    yield pb.StepRequest(ops=[_admit(request_id, i) for i, request_id in enumerate(live)])
    next_id = BATCH
    for step in range(1, num_steps):
        ops = []
        slot = step % request_steps
        for i in range(slot, BATCH, request_steps):  # about BATCH / request_steps requests a step
            ops += [pb.StepOp(free=pb.FreeRequest(request_ids=[live[i]])), _admit(f"r{next_id}", next_id)]
            live[i] = f"r{next_id}"
            next_id += 1
        replaced = {op.allocate.request_id for op in ops if op.WhichOneof("op") == "allocate"}
        decode = [r for r in live if r not in replaced]
        request = pb.StepRequest(ops=ops)
        request.decode.request_ids.extend(decode)
        request.decode.token_ids.extend([step % 30000] * len(decode))
        yield request


def _admit(request_id: str, n: int) -> pb.StepOp:
    start = (n * 7919) % 20000
    allocate = pb.AllocateRequest(request_id=request_id, token_ids=range(start, start + 100), num_new_tokens=100)
    return pb.StepOp(allocate=allocate)


def restart_bench(directory: Path, histories: list[int], request_steps: int, num_blocks: int) -> None:
    config = KVCacheConfig(num_blocks=num_blocks)
    print(f"restart time against history: 256-request decode Steps, requests replaced every {request_steps} steps, "
          f"{num_blocks} blocks; fsync=never while running")  # fmt: skip
    print(f"{'compaction':<22} {'steps':>7} {'journal MiB':>11} {'restart s':>9} {'records replayed':>16}")
    for label, compact_bytes in (("off", 0), (f"{DEFAULT_COMPACT_BYTES >> 20} MiB (default)", DEFAULT_COMPACT_BYTES)):
        path = directory / f"compact-{compact_bytes}.journal"
        options = ServerOptions(
            replica_id="bench", journal_path=path, journal_fsync="never", journal_compact_bytes=compact_bytes
        )
        replica = build_replica(config, options)
        journal = replica.journal
        pauses: list[tuple[float, int]] = []
        checkpoints = iter(histories)
        checkpoint = next(checkpoints)
        for step, request in enumerate(decode_workload(histories[-1], request_steps), 1):
            ops, decode = wire.step_ops(request)
            snapshot_end = journal.snapshot_end
            started = time.perf_counter()
            replica.step(ops, decode, request)
            if journal.snapshot_end != snapshot_end:
                pauses.append((time.perf_counter() - started, journal.snapshot_end))
            if step == checkpoint:
                copy = directory / f"copy-{compact_bytes}-{step}.journal"
                shutil.copyfile(path, copy)
                started = time.perf_counter()
                restored = build_replica(config, dataclasses.replace(options, journal_path=copy))
                elapsed = time.perf_counter() - started
                assert restored.stats() == replica.stats(), "the restored replica differs"
                print(f"{label:<22} {step:>7} {copy.stat().st_size / 2**20:>11.1f} {elapsed:>9.2f} "
                      f"{len(restored.journal.records):>16}")  # fmt: skip
                restored.journal.close()
                copy.unlink()
                checkpoint = next(checkpoints, None)
        if compact_bytes:  # the bound: a restart right after a compaction restores the snapshot alone
            journal.compact(take_snapshot(replica))
            started = time.perf_counter()
            restored = build_replica(config, options)
            elapsed = time.perf_counter() - started
            assert restored.stats() == replica.stats() and not restored.journal.records[1:]
            print(f"{'  snapshot alone':<22} {histories[-1]:>7} {path.stat().st_size / 2**20:>11.1f} "
                  f"{elapsed:>9.2f} {0:>16}")  # fmt: skip
            restored.journal.close()
        journal.close()
        if pauses:
            longest = max(pauses)
            print(f"  {len(pauses)} compactions; pause (the compacting step) median "
                  f"{statistics.median(p for p, _ in pauses) * 1e3:.0f} ms, max {longest[0] * 1e3:.0f} ms; "
                  f"snapshot {longest[1] / 2**20:.1f} MiB")  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=300, help="timed decode Steps per configuration and round")
    parser.add_argument("--history", help="comma-separated step counts: measure restart time against history instead")
    parser.add_argument("--request-steps", type=int, default=1000, help="with --history: decode steps per request")
    parser.add_argument("--num-blocks", type=int, default=120_000, help="with --history: the pool's blocks")
    args = parser.parse_args(argv)
    if args.history:
        with tempfile.TemporaryDirectory(prefix="journal-bench-") as tmp:
            histories = sorted(int(n) for n in args.history.split(","))
            restart_bench(Path(tmp), histories, args.request_steps, args.num_blocks)
        return 0
    with tempfile.TemporaryDirectory(prefix="journal-bench-") as tmp:
        directory = Path(tmp)
        servers = {name: start(directory, name, fsync, i) for i, (name, fsync) in enumerate(CONFIGS.items())}
        clients = {name: KVManagerClient(process.address) for name, (process, _) in servers.items()}
        try:
            ids = [f"r{i}" for i in range(BATCH)]
            for client in clients.values():
                for request_id in ids:
                    client.allocate(request_id, list(range(i := hash(request_id) % 1000, i + 100)), 100)
            series = {name: Series() for name in CONFIGS}  # round trips in ms
            token = 0
            for _ in range(args.rounds):
                for name, client in clients.items():
                    samples = []
                    for _ in range(args.steps):
                        token = (token + 1) % 30000
                        started = time.perf_counter_ns()
                        client.decode(ids, [token] * BATCH)
                        samples.append((time.perf_counter_ns() - started) / 1e6)
                    series[name].add_samples(samples, scale=1)
            base50, base99 = med(series["no journal"]), med(series["no journal"], "p99")
            print(f"256-request decode Step round trip, {args.rounds} rounds x {args.steps} steps")
            print(f"{'configuration':<24} {'p50 ms':>8} {'ratio':>6} {'p99 ms':>8} {'ratio':>6}")
            for name in CONFIGS:
                m50, m99 = med(series[name]), med(series[name], "p99")
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
