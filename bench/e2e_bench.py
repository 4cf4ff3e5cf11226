"""End to end on a CPU: a manager process, a worker process and the reference scheduler.

Replays the first requests of the Mooncake trace (token ids expanded as in
`kv_tooling.workload`, lengths scaled to fit a CPU) in waves of
`--batch` concurrent requests of `--output-len` tokens each: each wave is admitted in one step, then
decoded until every request of the wave has its output. Reports generated
and prefill tokens per second, the manager's Step and the worker's Execute
round trips (p50, p99) with the model time inside Execute, and the
prefix-cache hit rate.

    python bench/e2e_bench.py                        # torch backend, model "small"
    python bench/e2e_bench.py --backend triton --model tiny --requests 8
    python bench/e2e_bench.py --device cuda --backend triton --model llama-3.2-1b --dtype bfloat16 \
        --warmup-requests 32 --worker-arg=--cuda-graphs
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_stats import fmt, percentile  # noqa: E402

from gpu_worker.model_config import BUILTIN_MODELS  # noqa: E402
from kv_tooling.workload import DEFAULT_TRACE  # noqa: E402
from kv_manager_service.client import KVManagerClient  # noqa: E402
from kv_tooling.launch import launch  # noqa: E402
from kv_manager_service.shared.ready_line import MANAGER_READY_PREFIX, WORKER_READY_PREFIX  # noqa: E402
from kv_tooling.workload import TokenExpander, load_trace  # noqa: E402
from reference_scheduler import ReferenceScheduler, WorkerClient  # noqa: E402


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", choices=["torch", "triton"], default="torch", help="(default %(default)s)")
    parser.add_argument("--model", default="small", choices=list(BUILTIN_MODELS), help="(default %(default)s)")
    parser.add_argument("--requests", type=int, default=32, help="trace requests to replay (default %(default)s)")
    parser.add_argument("--batch", type=int, default=8, help="concurrent requests per wave (default %(default)s)")
    parser.add_argument("--scale", type=float, default=1 / 32, help="trace length scale (default 1/32: 16 tokens per trace block)")
    parser.add_argument("--output-len", type=int, default=32, help="tokens generated per request (default %(default)s)")
    parser.add_argument("--num-blocks", type=int, default=4096, help="manager pool size (default %(default)s)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="the worker's (default %(default)s)")
    parser.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], help="the worker's (default: its own)")
    parser.add_argument(
        "--warmup-requests", type=int, default=0,
        help="trace requests run first, untimed, in one wave (other prompts: no cache hits) (default %(default)s)",
    )  # fmt: skip
    parser.add_argument("--worker-arg", action="append", default=[], help="one more gpu-worker flag (repeatable)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = make_parser().parse_args(argv)
    vocab_size = BUILTIN_MODELS[args.model].vocab_size
    expander = TokenExpander(vocab_size=vocab_size, scale=args.scale)
    records = load_trace(DEFAULT_TRACE, limit=args.requests + args.warmup_requests)
    workload = [(expander.prompt_token_ids(r), args.output_len) for r in records]
    workload, warmup = workload[: args.requests], workload[args.requests :]
    python = sys.executable
    with tempfile.TemporaryDirectory(prefix="e2e-bench-") as tmp:
        directory = Path(tmp)
        manager = launch(
            [python, "-m", "kv_manager_service.cli", "serve", "--port", "0", "--num-blocks", str(args.num_blocks)],
            MANAGER_READY_PREFIX, directory / "manager.log",
        )  # fmt: skip
        processes = [manager]
        try:
            dtype = ["--dtype", args.dtype] if args.dtype else []
            worker = launch(
                [python, "-m", "gpu_worker.cli", "--manager", manager.address, "--backend", args.backend, "--model", args.model,
                 "--device", args.device, *dtype, *args.worker_arg],
                WORKER_READY_PREFIX, directory / "worker.log", timeout_s=300,
            )  # fmt: skip
            processes.append(worker)
            with KVManagerClient(manager.address) as manager_client, WorkerClient(worker.address) as worker_client:
                if warmup:
                    run(manager_client, worker_client, warmup, len(warmup))
                report(run(manager_client, worker_client, workload, args.batch), manager_client, args)
        finally:
            for process in reversed(processes):
                process.stop()
    return 0


def run(manager: KVManagerClient, worker: WorkerClient, workload: list, batch: int) -> dict:
    timings = []
    generated = prefill = 0
    started = time.perf_counter()
    for wave_start in range(0, len(workload), batch):
        scheduler = ReferenceScheduler(manager, worker)
        wave = workload[wave_start : wave_start + batch]
        for index, (prompt, output_len) in enumerate(wave):
            scheduler.add(f"req-{wave_start + index}", prompt, output_len)
        scheduler.run()
        generated += sum(len(r.output) for r in scheduler.sequences.values())
        prefill += sum(len(r.prompt) - r.num_cached_prompt_tokens for r in scheduler.sequences.values())
        timings += scheduler.timings
        print(f"  wave {wave_start // batch + 1}: {len(wave)} requests, {len(scheduler.timings)} steps", file=sys.stderr)
    return {"elapsed_s": time.perf_counter() - started, "generated": generated, "prefill": prefill, "timings": timings}


def report(result: dict, manager: KVManagerClient, args: argparse.Namespace) -> None:
    timings = result["timings"]
    decode = [t for t in timings if t.num_tokens == t.num_requests]  # steps with one token per request
    stats = manager.stats()

    def p(values: list[float]) -> str:
        return f"{fmt(statistics.median(values))} / {fmt(percentile(values, 99))}" if values else "-"

    overhead = [t.execute_ms - t.forward_ms for t in timings]
    rows = [
        ("backend / model", f"{args.backend} / {args.model}"),
        ("requests, waves of", f"{args.requests}, {args.batch}"),
        ("wall time (s)", fmt(result["elapsed_s"])),
        ("generated tokens/s", fmt(result["generated"] / result["elapsed_s"])),
        ("prefill tokens computed", fmt(result["prefill"])),
        ("prefix-cache hit rate (tokens)", f"{stats.prefix_cache_hits / max(1, stats.prefix_cache_queries):.1%}"),
        ("Step round trip p50 / p99 (ms)", p([t.step_ms for t in timings])),
        ("Execute round trip p50 / p99 (ms), all steps", p([t.execute_ms for t in timings])),
        ("Execute p50 / p99 (ms), decode steps", p([t.execute_ms for t in decode])),
        ("  of which model time p50 (ms), decode", fmt(statistics.median([t.forward_ms for t in decode])) if decode else "-"),
        ("Execute minus model time p50 (ms)", fmt(statistics.median(overhead))),
        ("Step share of a decode iteration (p50)", f"{statistics.median([t.step_ms / (t.step_ms + t.execute_ms) for t in decode]):.1%}" if decode else "-"),
    ]
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value}")


if __name__ == "__main__":
    sys.exit(main())
