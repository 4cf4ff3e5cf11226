"""constraints/cpu.txt takes torch's CPU build and refuses the CUDA one, checked with pip's own resolver, offline.

Plain PyPI serves `torch==2.13.0` as a CUDA build that pulls about 16 NVIDIA
packages (several GB); the PyTorch CPU index serves `2.13.0+cpu`. Two
stand-in wheels of those names (metadata only) in a local folder let pip
resolve as it would against the two indexes: `pip install --dry-run
--report` under an empty pip configuration, with no index but that folder.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONSTRAINTS = ROOT / "constraints" / "cpu.txt"


def write_wheel(folder: Path, version: str, requires: tuple[str, ...] = ()) -> None:
    """A wheel of `torch` at `version` holding only its metadata."""
    info = f"torch-{version}.dist-info"
    files = {
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: torch\nVersion: {version}\n"
        + "".join(f"Requires-Dist: {requirement}\n" for requirement in requires),
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    files[f"{info}/RECORD"] = "".join(f"{path},,\n" for path in [*files, f"{info}/RECORD"])
    with zipfile.ZipFile(folder / f"torch-{version}-py3-none-any.whl", "w") as wheel:
        for path, text in files.items():
            wheel.writestr(path, text)


def resolve_torch(wheels: Path, report: Path) -> subprocess.CompletedProcess:
    """pip's resolution of `torch` under constraints/cpu.txt, from `wheels` only, with no pip configuration."""
    env = {name: value for name, value in os.environ.items() if not name.startswith("PIP_")}
    env["PIP_CONFIG_FILE"] = os.devnull  # no configuration file at all: no mirror, no extra index, no constraint
    return subprocess.run(
        [sys.executable, "-m", "pip", "install", "--dry-run", "--quiet", "--ignore-installed", "--no-index",
         "--find-links", str(wheels), "--report", str(report), "-c", str(CONSTRAINTS), "torch"],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def test_the_cpu_build_is_chosen_when_both_builds_are_offered(tmp_path):
    write_wheel(tmp_path, "2.13.0+cpu")
    write_wheel(tmp_path, "2.13.0", ("nvidia-cublas==13.1.1.3",))
    done = resolve_torch(tmp_path, tmp_path / "report.json")
    assert done.returncode == 0, done.stderr
    installed = json.loads((tmp_path / "report.json").read_text())["install"]
    assert [(item["metadata"]["name"], item["metadata"]["version"]) for item in installed] == [("torch", "2.13.0+cpu")]


def test_the_cuda_build_alone_is_refused_not_installed(tmp_path):
    """A machine that reaches plain PyPI only gets pip's error, never the CUDA download."""
    write_wheel(tmp_path, "2.13.0", ("nvidia-cublas==13.1.1.3",))
    done = resolve_torch(tmp_path, tmp_path / "report.json")
    assert done.returncode != 0
    assert "Cannot install torch" in done.stderr, done.stderr
    assert not (tmp_path / "report.json").exists()
