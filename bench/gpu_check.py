"""The first hour on a GPU machine, in one command: correctness, decode-attention bandwidth, worker tokens/s.

On a machine with a CUDA GPU and this repository installed with a CUDA build of torch
(constraints/cuda.txt), runs in order:

1. `tests`: the end-to-end equality tests with the Triton backend on CUDA (every generated
   token against the dense pass; tests/gpu_worker/test_end_to_end.py -k triton), the same
   against transformers on real checkpoints (test_hf_checkpoints.py -k triton), then the
   kernel tests (tests/kernels) and the worker's device-path tests (`-m gpu` of
   tests/gpu_worker/test_runner_gpu.py, test_sampling.py, test_staging.py) on the GPU, and the
   host tier's tests (test_worker_host_tier.py: overlapped offloads against the CPU copies,
   generation through the tier with both backends);
2. `kernels`: bench/kernels_gpu.py, decode paged attention's share of the HBM bandwidth;
3. `tier-copy`: bench/tier_copy_bench.py at the worker model's shape in bfloat16: the host
   tier's offload and onload rates per step size against the link's pinned D2H/H2D rate;
4. `worker`: generated tokens/s of a manager, a worker (`--device cuda --backend triton`,
   the built-in 1B model `llama-3.2-1b` with random weights, bfloat16) and the reference
   scheduler replaying trace requests in waves (bench/e2e_bench.py's driver), after one
   untimed wave.

Every log, report and figure goes under one folder (`--out`, default
out/gpu-check-<UTC time>); the summary is printed and written there as summary.md and
summary.json. A failed step does not stop the next one. Exits 0 when every step passed,
1 when one failed, 2 at once (writing nothing) when torch sees no CUDA device.

    python bench/gpu_check.py
    python bench/gpu_check.py --steps tests,kernels --out /tmp/gpu-check
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import io
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from xml.etree import ElementTree

ROOT = Path(__file__).resolve().parents[1]
STEPS = ("tests", "kernels", "tier-copy", "worker")
WORKER_MODEL = "llama-3.2-1b"


@dataclasses.dataclass(frozen=True)
class StepResult:
    name: str
    ok: bool
    result: str  # the step's figure or counts, one line
    files: tuple[str, ...]  # what it wrote, relative to the output folder


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="output folder (default out/gpu-check-<UTC time> in the repository)")
    parser.add_argument(
        "--steps", type=_steps, default=STEPS,
        help=f"comma-separated steps to run, in the fixed order {','.join(STEPS)} (default all)",
    )  # fmt: skip
    parser.add_argument("--step-timeout-s", type=_positive_int, default=1800, help="per command (default %(default)s)")
    worker = parser.add_argument_group("the worker step (bench/e2e_bench.py's workload)")
    worker.add_argument("--requests", type=_positive_int, default=64, help="trace requests timed (default %(default)s)")
    worker.add_argument("--batch", type=_positive_int, default=32, help="requests per wave (default %(default)s)")
    worker.add_argument("--output-len", type=_positive_int, default=128, help="tokens each (default %(default)s)")
    worker.add_argument("--scale", type=float, default=1 / 8, help="trace length scale (default 1/8)")
    worker.add_argument("--num-blocks", type=_positive_int, default=16384, help="manager pool (default %(default)s)")
    return parser


def _steps(text: str) -> tuple[str, ...]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = sorted(set(names) - set(STEPS))
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"steps are among {', '.join(STEPS)}; got {text!r}")
    return tuple(name for name in STEPS if name in names)


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def cuda_refusal() -> str | None:
    """Why this machine cannot run the check (no CUDA device torch can use), or None when it can."""
    import torch

    if torch.cuda.is_available():
        return None
    build = f"built for CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU build"
    return (
        f"gpu_check: no CUDA device: torch {torch.__version__} ({build}) sees none. Run it on a machine with an "
        "NVIDIA GPU and its driver, with torch and Triton installed from constraints/cuda.txt (docker/README.md)."
    )


def child_env() -> dict[str, str]:
    """This environment for the steps' commands, without TRITON_INTERPRET: the kernels must run on the GPU."""
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def run_logged(argv: Sequence[str], log_path: Path, timeout_s: float, stdout_path: Path | None = None) -> int:
    """Run argv in the repository root, stderr to log_path, stdout to stdout_path (default: log_path too).

    Returns its exit status; 124 when it ran past `timeout_s` and was killed.
    """
    with contextlib.ExitStack() as files:
        log = files.enter_context(open(log_path, "w"))
        out = files.enter_context(open(stdout_path, "w")) if stdout_path is not None else log
        log.write(f"$ {' '.join(argv)}\n")
        log.flush()
        try:
            done = subprocess.run(
                list(argv), cwd=ROOT, env=child_env(), stdout=out, stderr=log, timeout=timeout_s, check=False
            )
            return done.returncode
        except subprocess.TimeoutExpired:
            log.write(f"\ngpu_check: timed out after {timeout_s:g} s\n")
            return 124


def junit_counts(path: Path) -> dict[str, int]:
    """tests / failures / errors / skipped of a pytest JUnit XML report (all suites summed)."""
    root = ElementTree.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    return {key: sum(int(suite.get(key, 0)) for suite in suites) for key in ("tests", "failures", "errors", "skipped")}


def describe_counts(counts: dict[str, int]) -> str:
    passed = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    return f"{passed} passed, {counts['failures']} failed, {counts['errors']} errors, {counts['skipped']} skipped"


def run_tests(out: Path, timeout_s: float) -> StepResult:
    """The CUDA end-to-end equality tests (Triton backend), the kernel tests, the worker's device-path
    tests; a skip counts as a failure."""
    suites = {
        "e2e": ["tests/gpu_worker/test_end_to_end.py", "-k", "triton"],
        # Real checkpoints against transformers: a full-attention and a sliding-window model, Triton on CUDA.
        "checkpoints": ["tests/gpu_worker/test_hf_checkpoints.py", "-k", "triton"],
        "kernels": ["tests/kernels"],
        # The worker's device path: one staging transfer per step, sampling on the device, host-side copy checks.
        "worker": ["-m", "gpu", "tests/gpu_worker/test_runner_gpu.py", "tests/gpu_worker/test_sampling.py",
                   "tests/gpu_worker/test_staging.py"],
        # The host tier on CUDA: pinned buffer, offloads on a side stream, and generation through it.
        "host-tier": ["tests/gpu_worker/test_worker_host_tier.py"],
    }
    ok, parts, files = True, [], []
    for name, args in suites.items():
        xml_path, log_path = out / f"tests-{name}.xml", out / f"tests-{name}.log"
        code = run_logged([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", *args,
                           f"--junitxml={xml_path}"], log_path, timeout_s)  # fmt: skip
        files += [log_path.name, xml_path.name]
        if not xml_path.exists():
            ok = False
            parts.append(f"{name}: no report (exit {code})")
            continue
        counts = junit_counts(xml_path)
        ok = ok and code == 0 and counts["skipped"] == 0 and counts["tests"] > 0
        parts.append(f"{name}: {describe_counts(counts)}")
    return StepResult("tests", ok, "; ".join(parts), tuple(files))


def bandwidth_row(table: str) -> tuple[str, str] | None:
    """(TB/s, share of the peak) of the Triton row of bench/kernels_gpu.py's table, or None if it has none."""
    for line in table.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if cells[0] == "triton paged_attention" and len(cells) == 5:
            return cells[3], cells[4]
    return None


def run_kernels(out: Path, timeout_s: float) -> StepResult:
    table_path, log_path = out / "kernels_gpu.md", out / "kernels_gpu.log"
    code = run_logged([sys.executable, "bench/kernels_gpu.py"], log_path, timeout_s, stdout_path=table_path)
    row = bandwidth_row(table_path.read_text()) if table_path.exists() else None
    ok = code == 0 and row is not None
    result = f"decode attention {row[0]} TB/s, {row[1]} of the HBM peak" if row else f"no figure (exit {code})"
    return StepResult("kernels", ok, result, (table_path.name, log_path.name))


def tier_copy_rates(table: str) -> dict[str, str]:
    """direction -> GB/s of the largest step in bench/tier_copy_bench.py's table (its last rows)."""
    rates = {}
    for line in table.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) == 7 and cells[4] in ("offload", "onload", "contiguous copy, to host", "contiguous copy, to device"):
            rates[cells[4]] = cells[5]
    return rates


def run_tier_copy(out: Path, timeout_s: float) -> StepResult:
    """The host tier's copies at llama-3.2-1b's shape in bfloat16, against the link's pinned copy rate."""
    table_path, log_path = out / "tier_copy.md", out / "tier_copy.log"
    command = [sys.executable, "bench/tier_copy_bench.py", "--models", WORKER_MODEL, "--dtypes", "bfloat16"]
    code = run_logged(command, log_path, timeout_s, stdout_path=table_path)
    rates = tier_copy_rates(table_path.read_text()) if table_path.exists() else {}
    ok = code == 0 and {"offload", "onload"} <= rates.keys()
    result = ", ".join(f"{direction} {rate} GB/s" for direction, rate in rates.items()) or f"no figure (exit {code})"
    return StepResult("tier-copy", ok, f"largest step: {result}", (table_path.name, log_path.name))


def run_worker(out: Path, args: argparse.Namespace) -> StepResult:
    """Manager + CUDA worker + reference scheduler; generated tokens/s over the timed waves."""
    sys.path.insert(0, str(ROOT / "bench"))
    import e2e_bench

    from gpu_worker.model_config import BUILTIN_MODELS
    from kv_tooling.workload import DEFAULT_TRACE
    from kv_manager_service.client import KVManagerClient
    from kv_tooling.launch import launch
    from kv_manager_service.shared.ready_line import MANAGER_READY_PREFIX, WORKER_READY_PREFIX
    from kv_tooling.workload import TokenExpander, load_trace
    from reference_scheduler import WorkerClient

    folder = out / "worker"
    folder.mkdir()
    expander = TokenExpander(vocab_size=BUILTIN_MODELS[WORKER_MODEL].vocab_size, scale=args.scale)
    records = load_trace(DEFAULT_TRACE, limit=args.requests + args.batch)
    workload = [(expander.prompt_token_ids(r), args.output_len) for r in records]
    timed, warmup = workload[: args.requests], workload[args.requests :]  # distinct prompts: no cache hits
    env = child_env()
    processes = []
    report = io.StringIO()
    try:
        manager = launch(
            [sys.executable, "-m", "kv_manager_service.cli", "serve", "--port", "0",
             "--num-blocks", str(args.num_blocks)],
            MANAGER_READY_PREFIX, folder / "manager.log", cwd=ROOT, env=env,
        )  # fmt: skip
        processes.append(manager)
        worker = launch(
            [sys.executable, "-m", "gpu_worker.cli", "--manager", manager.address, "--device", "cuda",
             "--backend", "triton", "--model", WORKER_MODEL, "--dtype", "bfloat16"],
            WORKER_READY_PREFIX, folder / "worker.log", cwd=ROOT, env=env, timeout_s=args.step_timeout_s,
        )  # fmt: skip
        processes.append(worker)
        with KVManagerClient(manager.address) as manager_client, WorkerClient(worker.address) as worker_client:
            with contextlib.redirect_stderr(report):
                if warmup:
                    e2e_bench.run(manager_client, worker_client, warmup[: args.batch], args.batch)
                result = e2e_bench.run(manager_client, worker_client, timed, args.batch)
            with contextlib.redirect_stdout(report):
                e2e_bench.report(result, manager_client, argparse.Namespace(
                    backend="triton", model=WORKER_MODEL, requests=args.requests, batch=args.batch))  # fmt: skip
    except Exception as error:  # the step fails; the check goes on and says why
        (folder / "report.txt").write_text(report.getvalue() + f"\nfailed: {type(error).__name__}: {error}\n")
        return StepResult("worker", False, f"failed: {type(error).__name__}: {str(error).splitlines()[0][:200]}",
                          ("worker/report.txt", "worker/manager.log", "worker/worker.log"))  # fmt: skip
    finally:
        for process in reversed(processes):
            process.stop()
    (folder / "report.txt").write_text(report.getvalue())
    tokens_per_s = result["generated"] / result["elapsed_s"]
    figure = f"{tokens_per_s:,.0f} generated tokens/s ({WORKER_MODEL}, bf16, {args.batch} per wave)"
    return StepResult("worker", True, figure, ("worker/report.txt", "worker/manager.log", "worker/worker.log"))


def environment() -> dict[str, str]:
    """What the figures were measured on: GPU, driver, torch, Triton, commit."""
    import torch
    import triton

    props = torch.cuda.get_device_properties(0)
    facts = {
        "gpu": f"{props.name} (sm_{props.major}{props.minor}, {props.total_memory / 2**30:.1f} GiB, "
        f"{props.multi_processor_count} SMs), {torch.cuda.device_count()} visible",
        "torch": f"{torch.__version__} (CUDA {torch.version.cuda})",
        "triton": triton.__version__,
        "python": platform.python_version(),
    }
    if shutil.which("nvidia-smi"):
        query = ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader", "--id=0"]
        facts["driver"] = subprocess.run(query, capture_output=True, text=True, check=False).stdout.strip() or "unknown"
    git = subprocess.run(
        ["git", "-C", str(ROOT), "describe", "--always", "--dirty"], capture_output=True, text=True, check=False
    )
    facts["commit"] = git.stdout.strip() or "unknown"
    return facts


def summary_markdown(facts: dict[str, str], results: Sequence[StepResult], out: Path) -> str:
    lines = [f"GPU check, {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC", ""]
    lines += [f"- {key}: {value}" for key, value in facts.items()]
    lines += ["", "| step | status | result | files |", "|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r.name} | {'ok' if r.ok else 'FAILED'} | {r.result} | {', '.join(r.files)} |")
    lines += ["", f"Everything is under {out}."]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = make_parser()
    args = parser.parse_args(argv)
    if args.out is not None and args.out.exists() and any(args.out.iterdir()):
        parser.error(f"--out {args.out} is not empty: each check gets a folder of its own")
    refusal = cuda_refusal()
    if refusal is not None:
        print(refusal, file=sys.stderr)
        return 2
    out = args.out or ROOT / "out" / f"gpu-check-{datetime.datetime.now(datetime.timezone.utc):%Y%m%d-%H%M%S}"
    out.mkdir(parents=True, exist_ok=True)
    facts = environment()
    (out / "environment.json").write_text(json.dumps(facts, indent=2) + "\n")
    runners: dict[str, Callable[[], StepResult]] = {
        "tests": lambda: run_tests(out, args.step_timeout_s),
        "kernels": lambda: run_kernels(out, args.step_timeout_s),
        "tier-copy": lambda: run_tier_copy(out, args.step_timeout_s),
        "worker": lambda: run_worker(out, args),
    }
    results = []
    for name in args.steps:
        started = time.monotonic()
        print(f"gpu_check: {name} ...", file=sys.stderr, flush=True)
        results.append(runners[name]())
        print(f"gpu_check: {name} {'ok' if results[-1].ok else 'FAILED'} in {time.monotonic() - started:.0f} s",
              file=sys.stderr, flush=True)  # fmt: skip
    summary = summary_markdown(facts, results, out)
    (out / "summary.md").write_text(summary)
    (out / "summary.json").write_text(json.dumps([dataclasses.asdict(r) for r in results], indent=2) + "\n")
    print(summary, end="")
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
