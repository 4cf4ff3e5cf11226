"""The first minutes on a GPU machine, in one command that fits in a budget and needs no network.

Written for the machine the project is checked on: Python 3.12 with torch and Triton
preinstalled (torch 2.11 / Triton 3.6 as found, not the pinned 2.13 / 3.7), no package index,
64 MiB of working tree, about 15 minutes in all. In order:

0. setup: prints the versions and the paths taken where they differ from the pinned ones
   (`toolchain_notes`, the one place that compares versions); installs the wheels of
   `make gpu-wheels` (.gpu-wheels/, carried with the tree) with `pip install --no-index
   --no-deps --target`; generates the contract's protobuf stubs on the spot;
1. `e2e`: the end-to-end equality tests with the Triton backend on CUDA, fp32 (every token
   against the dense pass) and bf16 (within the stated tolerance), and against transformers
   on real checkpoints;
2. `kernels`: the kernel tests and the worker's device-path tests (decode CUDA graphs, staging,
   sampling, the host tier), without what CPU CI already covers (the sm_90 compiles);
3. `bandwidth`: decode paged attention's share of the HBM bandwidth (bench/kernels_gpu.py);
4. `tier`: the host tier's offload/onload rates against the link's pinned copy rate
   (bench/tier_copy_bench.py) and the offload's overlap with a matmul (bench/tier_overlap.py);
5. `worker`: generated tokens/s of a manager, a worker and the reference scheduler with the
   built-in llama-3.2-1b (a 1B-class config, random weights, bf16), eager and with decode CUDA
   graphs (bench/e2e_bench.py);
6. `calibration`: the replay cost model's flags measured with that worker
   (bench/cost_calibration.py).

Tests run with pytest-xdist and per-test timeouts (pytest-timeout); a skip is a skip, unless its
reason says CUDA is missing, which on a GPU machine means the check is broken. Each step has a
deadline (shares of `--budget-s`, unused time passing on); a step still running at its deadline
is interrupted, and the summary (summary.md, summary.json) is rewritten after every step, so
whatever was measured before the budget ran out is on disk. A failed step does not stop the next.

`--dry-run` runs the same steps on the CPU with tiny shapes and this environment's packages
(nothing installed; the stubs generated all the same; the tests of steps 1-2 limited to their
`gpu`-marked ones, which skip): the check's own bugs show up here, not on the GPU.

    python bench/gpu_check.py --budget-s 300 --out /tmp/gpu-check
    python bench/gpu_check.py --dry-run --budget-s 120

Exits 0 when every step passed, 1 when one failed or ran out of time, 2 at once (writing
nothing) when torch sees no CUDA device and --dry-run is not given.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.util
import json
import os
import platform
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from xml.etree import ElementTree

ROOT = Path(__file__).resolve().parents[1]
WHEELS = ROOT / ".gpu-wheels"
STEPS = ("e2e", "kernels", "bandwidth", "tier", "worker", "calibration")
# Each step's share of the budget; a step's deadline is the sum of the shares up to it, so time
# a step leaves unused passes to the next.
SHARES = {
    "setup": 0.06, "e2e": 0.26, "kernels": 0.2, "bandwidth": 0.08, "tier": 0.07, "worker": 0.2, "calibration": 0.13,
}  # fmt: skip
SUMMARY_RESERVE_S = 3.0  # kept back at the end for the summary
INTERRUPT_GRACE_S = 10.0  # a command interrupted at its deadline may write its report this long
PER_TEST_TIMEOUT_S = 240
PINNED = {"torch": (2, 13), "triton": (3, 7)}  # constraints/cuda.txt
# A skip with one of these reasons means CUDA is missing: on a GPU machine, a failure of the check.
NO_CUDA_SKIP = re.compile(r"needs a CUDA device|needs CUDA")

E2E_TESTS = ["tests/gpu_worker/test_end_to_end.py", "tests/gpu_worker/test_end_to_end_bf16.py",
             "tests/gpu_worker/test_hf_checkpoints.py", "-k", "triton"]  # fmt: skip
KERNEL_TESTS = [
    "tests/kernels", "tests/gpu_worker/test_decode_graphs.py", "tests/gpu_worker/test_runner_gpu.py",
    "tests/gpu_worker/test_sampling.py", "tests/gpu_worker/test_staging.py",
    "tests/gpu_worker/test_worker_host_tier.py",
    # sm_90 compiles run on CPU CI, with the pinned Triton.
    "--ignore", "tests/kernels/test_sm90_compile.py", "-k", "not sm90",
]  # fmt: skip


@dataclasses.dataclass(frozen=True)
class StepResult:
    name: str
    ok: bool
    result: str  # the step's figures or counts, one line
    files: tuple[str, ...]  # what it wrote, relative to the output folder


@dataclasses.dataclass(frozen=True)
class Context:
    """What every step needs: where to write, the children's environment, the clock, the mode."""

    out: Path
    env: dict[str, str]
    dry_run: bool
    workers: int
    per_test_timeout: bool  # pytest-timeout is importable
    deadlines: dict[str, float]  # time.monotonic() by which each step must be done


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--budget-s", type=_positive_float, default=300.0, help="the whole check (default %(default)s)")
    parser.add_argument("--out", type=Path, help="output folder (default out/gpu-check-<UTC time> in the repository)")
    parser.add_argument(
        "--steps", type=_steps, default=STEPS,
        help=f"comma-separated steps to run, in the fixed order {','.join(STEPS)} (default all)",
    )  # fmt: skip
    parser.add_argument("--wheels", type=Path, default=WHEELS, help="the wheels to install (default .gpu-wheels/)")
    parser.add_argument("--dry-run", action="store_true", help="the same steps on the CPU, tiny, installing nothing")
    parser.add_argument(
        "--workers", type=int, default=min(8, os.cpu_count() or 1), help="pytest processes (default %(default)s)"
    )
    return parser


def _steps(text: str) -> tuple[str, ...]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = sorted(set(names) - set(STEPS))
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"steps are among {', '.join(STEPS)}; got {text!r}")
    return tuple(name for name in STEPS if name in names)


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return value


def deadlines(started: float, budget_s: float, steps: Sequence[str]) -> dict[str, float]:
    """Each step's deadline: its share and those before it, of the steps that run; the last ends the budget."""
    names = ["setup", *steps]
    total = sum(SHARES[name] for name in names)
    end = started + budget_s - SUMMARY_RESERVE_S
    result, elapsed = {}, 0.0
    for name in names:
        elapsed += SHARES[name] / total
        result[name] = started + (budget_s - SUMMARY_RESERVE_S) * elapsed
    result[names[-1]] = end
    return result


def version_tuple(version: str) -> tuple[int, int]:
    major, minor = re.match(r"(\d+)\.(\d+)", version).groups()
    return int(major), int(minor)


def toolchain_notes(versions: dict[str, str], has_module: Callable[[str], bool]) -> list[str]:
    """The paths the check takes where this environment differs from the pinned one, one line each.

    The one place that compares versions: `versions` maps torch and triton to what is installed;
    `has_module` says whether a module can be imported.
    """
    notes = []
    for name, pinned in PINNED.items():
        found = version_tuple(versions[name])
        if found < pinned:
            notes.append(
                f"{name} {versions[name]} is older than the pinned {pinned[0]}.{pinned[1]}: the sm_90 compile tests, "
                "which check the pinned Triton, are left to CPU CI (they are excluded here in any case)"
            )
    if not has_module("xdist"):
        notes.append("pytest-xdist is missing: tests run in one process")
    if not has_module("pytest_timeout"):
        notes.append("pytest-timeout is missing: no per-test timeout, only each step's deadline")
    return notes


def run_logged(
    argv: Sequence[str], log_path: Path, deadline: float, env: dict[str, str], stdout_path: Path | None = None
) -> int:
    """Run argv in the repository root, stderr to log_path, stdout to stdout_path (default: log_path too).

    Returns its exit status; 124 when it was still running at `deadline` (time.monotonic()): then it was
    interrupted (SIGINT to its process group, so pytest writes its report) and killed INTERRUPT_GRACE_S later.
    """
    with open(log_path, "w") as log, open(stdout_path or os.devnull, "w") as separate:
        out = separate if stdout_path is not None else log
        log.write(f"$ {' '.join(argv)}\n")
        log.flush()
        process = subprocess.Popen(list(argv), cwd=ROOT, env=env, stdout=out, stderr=log, start_new_session=True)
        try:
            return process.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGINT)
            try:
                process.wait(timeout=INTERRUPT_GRACE_S)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
            log.write("\ngpu_check: stopped at the step's deadline\n")
            return 124


def junit_counts(path: Path) -> dict[str, int]:
    """tests / failures / errors / skipped of a pytest JUnit XML report, and `no_cuda`: skips for want of CUDA."""
    root = ElementTree.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    keys = ("tests", "failures", "errors", "skipped")
    counts = {key: sum(int(suite.get(key, 0)) for suite in suites) for key in keys}
    counts["no_cuda"] = sum(1 for skip in root.iter("skipped") if NO_CUDA_SKIP.search(skip.get("message", "")))
    return counts


def describe_counts(counts: dict[str, int]) -> str:
    passed = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    text = f"{passed} passed, {counts['failures']} failed, {counts['errors']} errors, {counts['skipped']} skipped"
    return text + (f" ({counts['no_cuda']} for want of CUDA)" if counts["no_cuda"] else "")


def run_pytest(context: Context, name: str, args: Sequence[str], step: str) -> StepResult:
    """One pytest run of `args` in parallel, with per-test timeouts; in a dry run only its `gpu` tests (they skip).

    Passes when nothing failed and something ran; on a GPU a skip for want of CUDA fails it too.
    """
    xml_path, log_path = context.out / f"{name}.xml", context.out / f"{name}.log"
    selection = [*args, "-m", "gpu"] if context.dry_run else list(args)
    command = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", f"--junitxml={xml_path}",
               "-n", str(context.workers), *selection]  # fmt: skip
    if context.per_test_timeout:
        command.append(f"--timeout={PER_TEST_TIMEOUT_S}")
    code = run_logged(command, log_path, context.deadlines[step], context.env)
    files = (xml_path.name, log_path.name)
    if not xml_path.exists():
        return StepResult(step, False, f"no report ({'out of time' if code == 124 else f'exit {code}'})", files)
    counts = junit_counts(xml_path)
    no_cuda = counts["no_cuda"] and not context.dry_run
    broken = counts["failures"] or counts["errors"] or not counts["tests"] or no_cuda
    late = " (stopped at its deadline)" if code == 124 else ""
    return StepResult(step, not broken and code in (0, 5) and not late, describe_counts(counts) + late, files)


def table_cells(text: str) -> list[list[str]]:
    """The cells of every markdown table row in `text`."""
    rows = [line.strip().strip("|") for line in text.splitlines() if line.startswith("|")]
    return [[cell.strip() for cell in row.split("|")] for row in rows]


def run_bandwidth(context: Context) -> StepResult:
    table_path, log_path = context.out / "kernels_gpu.md", context.out / "kernels_gpu.log"
    command = [sys.executable, "bench/kernels_gpu.py", *(["--dry-run"] if context.dry_run else [])]
    code = run_logged(command, log_path, context.deadlines["bandwidth"], context.env, stdout_path=table_path)
    rows = [c for c in table_cells(table_path.read_text()) if c[0] == "triton paged_attention" and len(c) == 7]
    figures = [f"head_dim {c[1]}: {c[4]} TB/s, {c[5]} of the datasheet peak, {c[6]} of the measured copy" for c in rows]
    ok = code == 0 and bool(rows)
    files = (table_path.name, log_path.name)
    return StepResult("bandwidth", ok, "; ".join(figures) or f"no figure (exit {code})", files)


def run_tier(context: Context) -> StepResult:
    """The tier's copy rates (the largest step's) against the link's, then the offload's overlap with a matmul."""
    if context.dry_run:
        rates_args = ["--models", "tiny", "--dtypes", "float32", "--blocks", "4", "--rounds", "1", "--repeats", "1",
                      "--device", "cpu"]  # fmt: skip
    else:
        rates_args = ["--models", "llama-3.2-1b", "--dtypes", "bfloat16", "--blocks", "64", "256", "--rounds", "3"]
    rates_path, overlap_path = context.out / "tier_copy.md", context.out / "tier_overlap.md"
    deadline = context.deadlines["tier"]
    code = run_logged([sys.executable, "bench/tier_copy_bench.py", *rates_args], context.out / "tier_copy.log",
                      deadline, context.env, stdout_path=rates_path)  # fmt: skip
    rates = {c[4]: c[5] for c in table_cells(rates_path.read_text()) if len(c) == 7 and c[4] in TIER_DIRECTIONS}
    overlap_code = run_logged(
        [sys.executable, "bench/tier_overlap.py", *(["--dry-run"] if context.dry_run else [])],
        context.out / "tier_overlap.log", deadline, context.env, stdout_path=overlap_path,
    )  # fmt: skip
    overlap = re.search(r"^overlap: ([\d.]+)$", overlap_path.read_text(), re.MULTILINE)
    parts = [f"{direction} {rate} GB/s" for direction, rate in rates.items()] or [f"no rates (exit {code})"]
    parts.append(f"overlap with a matmul {overlap.group(1)}" if overlap else f"no overlap figure (exit {overlap_code})")
    ok = code == 0 and overlap_code == 0 and {"offload", "onload"} <= rates.keys() and overlap is not None
    files = ("tier_copy.md", "tier_copy.log", "tier_overlap.md", "tier_overlap.log")
    return StepResult("tier", ok, "largest step: " + ", ".join(parts), files)


TIER_DIRECTIONS = ("offload", "onload", "contiguous copy, to host", "contiguous copy, to device")


def run_worker(context: Context) -> StepResult:
    """Generated tokens/s of manager + worker + reference scheduler, eager then with decode CUDA graphs."""
    if context.dry_run:
        common = ["--device", "cpu", "--backend", "torch", "--model", "tiny", "--requests", "4", "--batch", "2",
                  "--output-len", "4", "--scale", str(1 / 64)]  # fmt: skip
        variants = {"eager": []}
    else:
        common = ["--device", "cuda", "--backend", "triton", "--model", "llama-3.2-1b", "--dtype", "bfloat16",
                  "--requests", "64", "--batch", "32", "--output-len", "128", "--scale", "0.125",
                  "--num-blocks", "16384", "--warmup-requests", "32"]  # fmt: skip
        variants = {"eager": [], "cuda-graphs": ["--worker-arg=--cuda-graphs"]}
    figures, files, ok = [], [], True
    for name, extra in variants.items():
        report_path, log_path = context.out / f"worker-{name}.txt", context.out / f"worker-{name}.log"
        command = [sys.executable, "bench/e2e_bench.py", *common, *extra]
        code = run_logged(command, log_path, context.deadlines["worker"], context.env, stdout_path=report_path)
        files += [report_path.name, log_path.name]
        rate = re.search(r"^generated tokens/s\s+(\S+)$", report_path.read_text(), re.MULTILINE)
        ok = ok and code == 0 and rate is not None
        figures.append(f"{name} {rate.group(1)} tokens/s" if rate else f"{name}: no figure (exit {code})")
    model = "tiny, CPU" if context.dry_run else "llama-3.2-1b, bf16, batch 32"
    return StepResult("worker", ok, f"{', '.join(figures)} ({model})", tuple(files))


def run_calibration(context: Context) -> StepResult:
    report_path, log_path = context.out / "calibration.md", context.out / "calibration.log"
    command = [sys.executable, "bench/cost_calibration.py", "--dry-run" if context.dry_run else "--cuda-graphs"]
    code = run_logged(command, log_path, context.deadlines["calibration"], context.env, stdout_path=report_path)
    text = report_path.read_text()
    flags, note = (re.search(rf"^{key}: (.+)$", text, re.MULTILINE) for key in ("replay flags", "note"))
    ok = code == 0 and flags is not None
    result = f"{flags.group(1)} ({note.group(1) if note else ''})" if flags else f"no figure (exit {code})"
    return StepResult("calibration", ok, result, (report_path.name, log_path.name))


def setup(out: Path, wheels: Path, dry_run: bool, deadline: float) -> tuple[dict[str, str], StepResult]:
    """Install the wheels (not in a dry run), generate the stubs: the children's environment, and what happened."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET" or dry_run}
    env["PYTHONUNBUFFERED"] = "1"
    paths, parts, ok = [], [], True
    wheel_files = sorted(wheels.glob("*.whl")) if wheels.is_dir() else []
    site = out / "site"
    if dry_run:
        parts.append("dry run: this environment's packages")
    elif not wheel_files:
        parts.append(f"no wheels in {wheels}: the image's packages")
    else:
        command = [sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps", "--no-compile",
                   "--target", str(site), *map(str, wheel_files)]  # fmt: skip
        code = run_logged(command, out / "setup-pip.log", deadline, env)
        ok = ok and code == 0
        parts.append(f"installed {len(wheel_files)} wheels" if code == 0 else f"pip install failed (exit {code})")
        paths.append(str(site))
    stubs = out / "stubs"
    paths += [str(stubs), str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    code = run_logged([sys.executable, "-c", GENERATE_STUBS, str(ROOT / "proto"), str(stubs)], out / "setup-stubs.log",
                      deadline, env)  # fmt: skip
    ok = ok and code == 0
    parts.append("stubs generated" if code == 0 else f"stub generation failed (exit {code})")
    files = tuple(name for name in ("setup-pip.log", "setup-stubs.log") if (out / name).exists())
    return env, StepResult("setup", ok, "; ".join(parts), files)


# Run by the children's Python, with the children's packages: protoc over every .proto into a folder,
# then an __init__.py in each package folder, and an import of the contract to prove it loads (where an
# editable install maps `kvcache` to the source tree, as in a dry run, that import finds the tree's own).
GENERATE_STUBS = """
import sys
from pathlib import Path
import grpc_tools
from grpc_tools import protoc
proto, out = Path(sys.argv[1]), Path(sys.argv[2])
out.mkdir(parents=True, exist_ok=True)
include = Path(grpc_tools.__file__).parent / "_proto"
for source in sorted(proto.rglob("*.proto")):
    args = ["protoc", f"-I{proto}", f"-I{include}", f"--python_out={out}", f"--grpc_python_out={out}", str(source)]
    if protoc.main(args) != 0:
        sys.exit(f"protoc failed on {source}")
for module in (out / "kvcache").rglob("*_pb2.py"):
    for package in module.relative_to(out).parents:
        if package != Path("."):
            (out / package / "__init__.py").touch()
assert (out / "kvcache" / "v1" / "kv_manager_pb2_grpc.py").is_file(), "protoc wrote no kvcache.v1 stubs"
sys.path.insert(0, str(out))
from kvcache.v1 import kv_manager_pb2, kv_manager_pb2_grpc
print("stubs in", out, "; kvcache.v1 imports from", Path(kv_manager_pb2.__file__).parent)
"""


def environment(dry_run: bool) -> dict[str, str]:
    """What the figures were measured on: device, torch, Triton, Python, commit."""
    import torch
    import triton

    facts = {}
    if dry_run:
        facts["device"] = f"CPU ({platform.machine()}, {os.cpu_count()} CPUs): a dry run, no figure means anything"
    else:
        props = torch.cuda.get_device_properties(0)
        facts["device"] = (f"{props.name} (sm_{props.major}{props.minor}, {props.total_memory / 2**30:.1f} GiB, "
                           f"{props.multi_processor_count} SMs), {torch.cuda.device_count()} visible")  # fmt: skip
    facts["torch"] = f"{torch.__version__} (CUDA {torch.version.cuda})"
    facts["triton"] = triton.__version__
    facts["python"] = platform.python_version()
    git = subprocess.run(["git", "-C", str(ROOT), "describe", "--always", "--dirty"], capture_output=True, text=True,
                         check=False)  # fmt: skip
    facts["commit"] = git.stdout.strip() or "unknown"
    return facts


def summary_markdown(facts: dict[str, str], notes: Sequence[str], results: Sequence[StepResult], out: Path) -> str:
    lines = [f"GPU check, {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC", ""]
    lines += [f"- {key}: {value}" for key, value in facts.items()]
    lines += [f"- path taken: {note}" for note in notes] or ["- path taken: the pinned versions' (no fallback)"]
    lines += ["", "| step | status | result | files |", "|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r.name} | {'ok' if r.ok else 'FAILED'} | {r.result} | {', '.join(r.files)} |")
    lines += ["", f"Everything is under {out}."]
    return "\n".join(lines) + "\n"


def write_summary(out: Path, facts: dict[str, str], notes: Sequence[str], results: Sequence[StepResult]) -> str:
    summary = summary_markdown(facts, notes, results, out)
    (out / "summary.md").write_text(summary)
    record = {"environment": facts, "paths_taken": list(notes), "steps": [dataclasses.asdict(r) for r in results]}
    (out / "summary.json").write_text(json.dumps(record, indent=2) + "\n")
    return summary


def cuda_refusal() -> str | None:
    """Why this machine cannot run the check (no CUDA device torch can use), or None when it can."""
    import torch

    if torch.cuda.is_available():
        return None
    build = f"built for CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU build"
    return (
        f"gpu_check: no CUDA device: torch {torch.__version__} ({build}) sees none. Run it on a machine with an "
        "NVIDIA GPU (docs/gpu-check.md), or check the check on this one with --dry-run."
    )


def main(argv: Sequence[str] | None = None) -> int:
    started = time.monotonic()
    parser = make_parser()
    args = parser.parse_args(argv)
    if args.out is not None and args.out.exists() and any(args.out.iterdir()):
        parser.error(f"--out {args.out} is not empty: each check gets a folder of its own")
    refusal = None if args.dry_run else cuda_refusal()
    if refusal is not None:
        print(refusal, file=sys.stderr)
        return 2
    import torch
    import triton

    out = args.out or ROOT / "out" / f"gpu-check-{datetime.datetime.now(datetime.timezone.utc):%Y%m%d-%H%M%S}"
    out.mkdir(parents=True, exist_ok=True)
    facts = environment(args.dry_run)
    notes = toolchain_notes({"torch": torch.__version__, "triton": triton.__version__},
                            lambda name: importlib.util.find_spec(name) is not None)  # fmt: skip
    print("".join(f"gpu_check: {key}: {value}\n" for key, value in facts.items()), end="", file=sys.stderr)
    for note in notes or ["the pinned versions' (no fallback)"]:
        print(f"gpu_check: path taken: {note}", file=sys.stderr)
    plan = deadlines(started, args.budget_s, args.steps)
    env, setup_result = setup(out, args.wheels, args.dry_run, plan["setup"])
    results = [setup_result]
    write_summary(out, facts, notes, results)
    context = Context(out, env, args.dry_run, 0 if args.dry_run else args.workers,
                      importlib.util.find_spec("pytest_timeout") is not None, plan)  # fmt: skip
    runners: dict[str, Callable[[], StepResult]] = {
        "e2e": lambda: run_pytest(context, "tests-e2e", E2E_TESTS, "e2e"),
        "kernels": lambda: run_pytest(context, "tests-kernels", KERNEL_TESTS, "kernels"),
        "bandwidth": lambda: run_bandwidth(context),
        "tier": lambda: run_tier(context),
        "worker": lambda: run_worker(context),
        "calibration": lambda: run_calibration(context),
    }
    for name in args.steps:
        step_started = time.monotonic()
        if step_started >= plan[name]:
            results.append(StepResult(name, False, "not run: the budget was spent", ()))
        else:
            print(f"gpu_check: {name} (until +{plan[name] - started:.0f} s) ...", file=sys.stderr, flush=True)
            results.append(runners[name]())
            status = "ok" if results[-1].ok else "FAILED"
            print(f"gpu_check: {name} {status} in {time.monotonic() - step_started:.0f} s", file=sys.stderr, flush=True)
        write_summary(out, facts, notes, results)
    print(write_summary(out, facts, notes, results), end="")
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
