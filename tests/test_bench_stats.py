"""The benchmarks warn, with the figures, when their rounds disagree as on a busy machine."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def load_bench_stats():
    """bench/bench_stats.py, which the bench scripts import by its bare name from their own folder."""
    spec = importlib.util.spec_from_file_location("bench_stats", ROOT / "bench" / "bench_stats.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("bench_stats", module)  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_no_warning_when_every_spread_is_narrow():
    stats = load_bench_stats()
    assert stats.busy_machine_warning([("decode", 100.0, 95.0, 110.0)], loadavg=0.1, num_cpus=2) == ""


def test_a_wide_spread_is_named_with_its_rounds_and_the_load():
    stats = load_bench_stats()
    warning = stats.busy_machine_warning(
        [("decode step", 1800.0, 1700.0, 5400.0), ("alloc", 0.17, 0.17, 0.18)], loadavg=3.5, num_cpus=2
    )
    lines = warning.splitlines()
    assert lines[0].startswith("WARNING: the machine looks busy (load average 3.50 on 2 CPUs)")
    assert len(lines) == 2
    assert "decode step: median 1,800, rounds from 1,700 to 5,400 (206%)" in lines[1]
