"""Download the wheels the GPU check needs on a machine with no package index (`make gpu-wheels`).

The GPU machine the check is sized for runs Python 3.12 on Linux x86-64 with torch, Triton,
transformers, safetensors, pytest, pytest-xdist, pytest-timeout, hypothesis, numpy, pyyaml,
xxhash, prometheus-client, typing-extensions and setuptools already installed (IMAGE_PACKAGES),
and reaches no package index. What the manager, the worker and the tests need beside those is
the gRPC stack, pinned here to the versions the CPU suite runs with: WHEELS.

`pip download --no-deps` fetches each for CPython 3.12 / manylinux x86-64 into the git-ignored
folder `.gpu-wheels/` (reused when already there); the check then checks that every wheel's
requirements are in the set or on the image, and that the whole set is under the 64 MiB a
device call may carry. `bench/gpu_check.py` installs them with `pip install --no-index
--no-deps --target` (see docs/gpu-check.md).

    python tools/gpu_wheels.py                 # into .gpu-wheels/, prints the set and its size
    python tools/gpu_wheels.py --dest DIR
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_DEST = ROOT / ".gpu-wheels"
MAX_BYTES = 64 << 20  # what one device call may carry, the working tree included
# grpcio-tools at the build's pin (pyproject.toml) generates the stubs there; the rest match the CPU suite.
WHEELS = (
    "grpcio==1.85.3",
    "grpcio-tools==1.85.1",
    "grpcio-health-checking==1.85.1",
    "grpcio-reflection==1.85.1",
    "grpcio-status==1.85.3",
    "protobuf==7.36.2",
    "googleapis-common-protos==1.76.0",
)
# Distributions the GPU machine's image already holds (the ones the project may ask for).
IMAGE_PACKAGES = frozenset({
    "torch", "triton", "transformers", "safetensors", "numpy", "pytest", "pytest-xdist", "pytest-timeout",
    "hypothesis", "pyyaml", "xxhash", "prometheus-client", "typing-extensions", "setuptools", "packaging",
})  # fmt: skip
PLATFORMS = ("manylinux2014_x86_64", "manylinux_2_17_x86_64", "manylinux_2_27_x86_64", "manylinux_2_28_x86_64")


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def download(dest: Path) -> list[Path]:
    """Fetch WHEELS into `dest` (pip reuses what is there); the wheel files of the set, sorted."""
    dest.mkdir(parents=True, exist_ok=True)
    command = [
        sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
        "--python-version", "3.12", "--implementation", "cp", *(f"--platform={p}" for p in PLATFORMS),
        "--dest", str(dest), *WHEELS,
    ]  # fmt: skip
    subprocess.run(command, check=True)
    return wheel_set(dest)


def wheel_set(dest: Path) -> list[Path]:
    """The wheel in `dest` of each pinned requirement; RuntimeError naming a missing or doubled one."""
    files = sorted(dest.glob("*.whl"))
    chosen = []
    for requirement in WHEELS:
        name, version = requirement.split("==")
        matches = [f for f in files if f.name.split("-")[:2] == [canonical(name).replace("-", "_"), version]]
        if len(matches) != 1:
            raise RuntimeError(f"{dest} holds {len(matches)} wheels of {requirement}, not one: run make gpu-wheels")
        chosen.append(matches[0])
    return chosen


def requirements(wheel: Path) -> list[str]:
    """The distribution names a wheel requires (not under an extra), from its METADATA."""
    with zipfile.ZipFile(wheel) as archive:
        metadata = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        lines = archive.read(metadata).decode().splitlines()
    needed = []
    for line in lines:
        if line.startswith("Requires-Dist:") and "extra ==" not in line:
            needed.append(canonical(re.split(r"[\s<>=!~;\[(]", line.split(":", 1)[1].strip())[0]))
    return needed


def unmet_requirements(wheels: list[Path]) -> dict[str, list[str]]:
    """Per wheel file name, what it requires that neither the set nor the image provides."""
    provided = {canonical(w.name.split("-")[0]) for w in wheels} | set(IMAGE_PACKAGES)
    unmet = {w.name: [name for name in requirements(w) if name not in provided] for w in wheels}
    return {name: missing for name, missing in unmet.items() if missing}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dest", type=Path, default=DEFAULT_DEST, help="(default .gpu-wheels/ in the repository)")
    args = parser.parse_args(argv)
    wheels = download(args.dest)
    total = sum(w.stat().st_size for w in wheels)
    for wheel in wheels:
        print(f"{wheel.stat().st_size / 2**20:6.2f} MiB  {wheel.name}")
    print(f"{total / 2**20:6.2f} MiB in {len(wheels)} wheels in {args.dest} (the limit is {MAX_BYTES >> 20} MiB)")
    unmet = unmet_requirements(wheels)
    for name, missing in unmet.items():
        print(f"{name} needs {', '.join(missing)}, which neither the set nor the image has", file=sys.stderr)
    return 1 if unmet or total > MAX_BYTES else 0


if __name__ == "__main__":
    sys.exit(main())
