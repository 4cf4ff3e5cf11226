"""bench/ha_bench.py end to end in its smoke run: a lone manager, a real Redis and a group of two real managers;
figures are not checked, only that every row is there."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_a_quick_run_prints_its_table_and_every_standby_gets_in_sync() -> None:
    argv = [sys.executable, str(ROOT / "bench" / "ha_bench.py"), "--quick", "--rounds", "1", "--catch-up-steps", "50"]
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = done.stdout
    assert "Command: `python bench/ha_bench.py --quick --rounds 1 --catch-up-steps 50`" in out
    number = r"[\d.,]+"
    rows = (
        rf"1 \| 256-request decode Step round trip, p50 \| {number} \| {number} \| {number} \({number}-{number}\)",
        rf"2 \| \*\*throughput, back-to-back 256-request Steps, 1 client\*\* \| {number} \| {number} \| {number} \(",
        rf"2 \| the standby's CPU per Step \| +\| {number} \|",
        rf"3 \| a standby paused during 50 decode Steps, resumed: the tail \| 50 \| +\| {number} s \|",
        rf"3 \| a fresh standby: the snapshot, then \d+ records \| {number} \| {number} MB \| {number} s",
    )
    for row in rows:
        assert re.search(rf"^\| {row}", out, re.M), f"no row {row!r} in:\n{out}"
    assert "FAILED" not in out
