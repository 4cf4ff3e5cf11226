"""Figures shared by the benchmark scripts: percentiles, per-round series, number formatting."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Sequence


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
