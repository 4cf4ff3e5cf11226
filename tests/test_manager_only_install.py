"""What a manager-only install (`pip install kv-manager-service`, no extras, no torch) gets: the wheel built
from this checkout carries the trace as package data, so `replay` runs from any directory, and the commands
that need the worker extra say so in one line."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.thorough  # building the wheel takes 15-30 s

ROOT = Path(__file__).resolve().parents[1]
TRACE = "kv_tooling/data/mooncake_synthetic_trace.jsonl"
EXTRAS = ("torch", "triton", "matplotlib", "redis")  # the extras' packages
# `kv-manager ARGS` with some packages unimportable, as in an install without them.
WITHOUT = "import sys; sys.modules.update(dict.fromkeys({!r})); from kv_manager_service.cli.main import main; sys.exit(main({!r}))"


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel's files, unpacked as pip would install them."""
    wheels = tmp_path_factory.mktemp("wheel")
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--wheel-dir", str(wheels), str(ROOT)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert built.returncode == 0, built.stderr[-3000:]
    (wheel,) = wheels.glob("*.whl")
    site = tmp_path_factory.mktemp("site")
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(site)
    return site


def _kv_manager(
    site: Path, args: list[str], cwd: Path, without: tuple[str, ...] = EXTRAS
) -> subprocess.CompletedProcess[str]:
    """`kv-manager ARGS` from the installed files alone (not this checkout), without the packages `without`."""
    return subprocess.run(
        [sys.executable, "-c", WITHOUT.format(list(without), args)], capture_output=True, text=True, timeout=300, cwd=cwd,
        env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"},
    )  # fmt: skip


def test_the_wheel_carries_the_trace(installed: Path) -> None:
    assert (installed / TRACE).read_bytes() == (ROOT / TRACE).read_bytes()


def test_replay_finds_its_trace_outside_a_checkout(installed: Path, tmp_path: Path) -> None:
    done = _kv_manager(installed, ["replay", "--requests", "4"], tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Replaying 4 requests of mooncake_synthetic_trace.jsonl" in done.stderr, done.stderr
    assert "requests completed        4 / 4" in done.stdout, done.stdout


@pytest.mark.parametrize(
    "args, without, extra",
    [
        (["demo", "--requests", "4"], EXTRAS, "[demo]"),
        (["demo", "--requests", "4"], ("torch",), "[worker]"),
        (["serve", "--port", "0", "--redis-url", "redis://127.0.0.1:1/0"], EXTRAS, "[redis]"),
        (["serve", "--port", "0", "--replica-id", "r", "--ha-url", "redis://127.0.0.1:1/0"], EXTRAS, "[redis]"),
    ],
)
def test_a_command_needing_an_extra_names_it_in_one_line(
    installed: Path, tmp_path: Path, args: list[str], without: tuple[str, ...], extra: str
) -> None:
    done = _kv_manager(installed, args, tmp_path, without)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and extra in lines[-1], done.stderr
