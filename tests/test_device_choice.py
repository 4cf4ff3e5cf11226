"""The tests choose their device in one place: `tests/devices.py` (`DEVICE`; conftest's `device` fixture).

A test module that asked CUDA (or `nvidia-smi`) for itself could pick a
device the rest of the suite does not run on: CUDA kernels under a CPU
interpreter, or the other way round.
"""

from __future__ import annotations

import re
from pathlib import Path

TESTS = Path(__file__).resolve().parent
# A call that decides a device: `torch.cuda.is_available()`, `cuda.device_count()`, or a look for nvidia-smi.
DEVICE_PROBE = re.compile(r"cuda\.is_available\(\)|cuda\.device_count\(\)|nvidia-smi")


def device_probes(text: str) -> list[int]:
    """Line numbers of `text` that probe for a device."""
    return [number for number, line in enumerate(text.splitlines(), 1) if DEVICE_PROBE.search(line)]


def test_only_devices_py_probes_for_a_device() -> None:
    offenders = [
        f"{path.relative_to(TESTS)}:{number}"
        for path in sorted(TESTS.rglob("*.py"))
        if path.name not in ("devices.py", Path(__file__).name) or path.parent != TESTS
        for number in device_probes(path.read_text(encoding="utf-8"))
    ]
    assert not offenders, "choose the device through devices.DEVICE or the `device` fixture: " + ", ".join(offenders)


def test_devices_decides_the_device() -> None:
    devices = (TESTS / "devices.py").read_text(encoding="utf-8")
    assert re.search(r'^DEVICE = "cuda" if torch\.cuda\.is_available\(\) else "cpu"$', devices, re.MULTILINE)


def test_the_probe_pattern_finds_each_way_of_asking() -> None:
    source = 'a = torch.cuda.is_available()\nb = 1\nshutil.which("nvidia-smi")\nn = torch.cuda.device_count()\n'
    assert device_probes(source) == [1, 3, 4]
    assert device_probes("torch.cuda.is_available = lambda: True\n") == []
