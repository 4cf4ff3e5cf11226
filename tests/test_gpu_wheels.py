"""tools/gpu_wheels.py: the cp312 manylinux wheel set downloads, is complete beside the GPU image, and fits 64 MiB.

Needs PyPI (or pip's configured index); the wheels are kept in the git-ignored .gpu-wheels/, so
a second run downloads nothing.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("gpu_wheels", ROOT / "tools" / "gpu_wheels.py")
gpu_wheels = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = gpu_wheels
spec.loader.exec_module(gpu_wheels)


def test_the_wheel_set_downloads_for_cp312_and_fits_under_64_mib():
    wheels = gpu_wheels.download(gpu_wheels.DEFAULT_DEST)
    assert len(wheels) == len(gpu_wheels.WHEELS)
    for wheel in wheels:  # built for CPython 3.12 on Linux x86-64, or pure Python
        tags = wheel.name.removesuffix(".whl").split("-")[-3:]
        assert tags[0] in ("cp312", "cp310", "py3") and (tags[2] == "any" or "x86_64" in tags[2]), wheel.name
    assert sum(wheel.stat().st_size for wheel in wheels) < gpu_wheels.MAX_BYTES
    assert gpu_wheels.unmet_requirements(wheels) == {}


def test_an_unmet_requirement_is_named(tmp_path):
    import zipfile

    wheel = tmp_path / "example-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        metadata = "Name: example\nRequires-Dist: grpcio>=1.80\nRequires-Dist: Left_Out (>=2)\n"
        metadata += "Requires-Dist: pytest; extra == 'test'\n"
        archive.writestr("example-1.0.dist-info/METADATA", metadata)
    assert gpu_wheels.requirements(wheel) == ["grpcio", "left-out"]
    assert gpu_wheels.unmet_requirements([wheel]) == {wheel.name: ["grpcio", "left-out"]}
