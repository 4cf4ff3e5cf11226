"""What the benchmark scripts share: percentiles, per-round series, the order of alternating rounds and their
ratios, progress lines, number formatting, report rows, and the run's command line and load."""

from __future__ import annotations

import math
import os
import shlex
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Sequence, TypeVar

if TYPE_CHECKING:
    from kv_manager_service.core import KVCacheManager
    from kv_tooling.replay import ReplayProgress

T = TypeVar("T")


def percentile(samples: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in (0, 100])."""
    ordered = sorted(samples)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


@dataclass
class Series:
    """Per-round figures of one metric: p50 and p99 of that round's samples (or one value)."""

    p50: list[float] = field(default_factory=list)
    p99: list[float] = field(default_factory=list)

    def add_samples(self, samples: Sequence[float], scale: float = 1e6) -> None:
        if not samples:
            return
        self.p50.append(statistics.median(samples) / scale)
        self.p99.append(percentile(samples, 99) / scale)

    def add_value(self, value: float) -> None:
        self.p50.append(value)


def fmt(value: float) -> str:
    """A figure with as many digits as it deserves."""
    if isinstance(value, int):
        return f"{value:,}"
    if abs(value) >= 100:
        return f"{value:,.0f}"
    if abs(value) >= 10:
        return f"{value:.1f}"
    if abs(value) >= 1:
        return f"{value:.2f}"
    return f"{value:.3f}"


def med(series: Series, which: str = "p50") -> float:
    """The median over rounds of a series' per-round p50 (or `which`)."""
    return statistics.median(getattr(series, which))


def spread(values: Sequence[float], separator: str = " - ") -> str:
    """The lowest and highest of per-round figures."""
    return f"{fmt(min(values))}{separator}{fmt(max(values))}"


def row(number: str, metric: str, series: Series, unit: str, target: str = "", note: str = "",
        met: bool | None = None) -> str:
    """A report row: the medians over rounds of p50 and p99, the spread of the round p50s, the target and whether
    it was met."""
    p50 = fmt(med(series)) if series.p50 else "n/a"
    p99 = fmt(med(series, "p99")) if series.p99 else ""
    round_spread = spread(series.p50) if len(series.p50) > 1 else ""
    if met is not None:
        target = f"{target} ({'met' if met else 'MISSED'})"
    return f"| {number} | {metric} | {p50} | {p99} | {unit} | {round_spread} | {target} | {note} |"


# -- alternating rounds ------------------------------------------------------------


def alternating(names: Sequence[T], round_index: int) -> list[T]:
    """The order in which round `round_index` runs the series `names`: as given in even rounds, reversed in odd
    ones, so that neither always runs first."""
    return list(names) if round_index % 2 == 0 else list(reversed(names))


def per_round_ratios(values: Sequence[float], base: Sequence[float]) -> list[float]:
    """Round by round `values / base`, of the rounds whose base is not 0 (a CPU time shorter than one clock tick
    of /proc reads as 0)."""
    return [value / base_value for value, base_value in zip(values, base) if base_value]


def ratio_summary(ratios: Sequence[float]) -> str:
    """The median of per-round ratios and their range."""
    return f"{statistics.median(ratios):.3f} (rounds {min(ratios):.3f}-{max(ratios):.3f})"


def print_round(index: int, rounds: int, figures: str = "") -> None:
    """The progress line of round `index` (from 0) of `rounds`, with that round's figures, on stderr."""
    print(f"round {index + 1}/{rounds}" + (f": {figures}" if figures else ""), file=sys.stderr, flush=True)


def replay_progress_printer(label: str, num_requests: int, manager: KVCacheManager,
                            every_steps: int = 1) -> Callable[[ReplayProgress], None]:
    """A trace replay's progress callback: every `every_steps` steps, a line on stderr with the requests done,
    running and waiting, the pool's usage, the hit rate so far and the time since this call."""
    started = time.perf_counter()

    def show(progress: ReplayProgress) -> None:
        if progress.num_steps % every_steps:
            return
        stats = manager.stats()
        hit_rate = stats.prefix_cache_hits / stats.prefix_cache_queries if stats.prefix_cache_queries else 0.0
        print(f"  [{label}] step {progress.num_steps:>6}: {progress.num_completed:>5}/{num_requests} done, "
              f"{progress.num_running:>3} running, {progress.num_waiting:>5} waiting, usage {progress.usage:6.1%}, "
              f"hits {hit_rate:6.1%}, {time.perf_counter() - started:6.1f} s", file=sys.stderr, flush=True)  # fmt: skip

    return show


# -- the run's circumstances -------------------------------------------------------


def command_line(script: str, argv: Sequence[str] | None) -> str:
    """How the script at `script` (its `__file__`) was run, as `python bench/NAME ARGS`."""
    return shlex.join(["python", f"bench/{Path(script).name}", *(argv if argv is not None else sys.argv[1:])])


def load_averages() -> str:
    """The machine's 1-, 5- and 15-minute load averages."""
    return ", ".join(f"{x:.2f}" for x in os.getloadavg())


# A spread (highest round median minus lowest) past this share of the median: the rounds disagree,
# most often because something else ran on the machine.
WIDE_SPREAD = 0.25


def busy_machine_warning(spreads: Sequence[tuple[str, float, float, float]], loadavg: float, num_cpus: int) -> str:
    """A warning naming each (metric, median, lowest, highest) whose spread is wide, with the load average;
    "" when every spread is narrow."""
    wide = [(name, median, low, high) for name, median, low, high in spreads if median and (high - low) / median > WIDE_SPREAD]
    if not wide:
        return ""
    lines = [
        f"WARNING: the machine looks busy (load average {loadavg:.2f} on {num_cpus} CPUs): these figures varied "
        f"by more than {WIDE_SPREAD:.0%} between rounds, so their medians are not to be trusted; rerun on an idle machine."
    ]
    for name, median, low, high in wide:
        lines.append(f"  {name}: median {fmt(median)}, rounds from {fmt(low)} to {fmt(high)} ({(high - low) / median:.0%})")
    return "\n".join(lines)
