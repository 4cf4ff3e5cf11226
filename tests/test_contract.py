"""The wire contract follows buf's STANDARD lint rules and never breaks by accident.

`buf` comes from the npm package `@bufbuild/buf`, pinned in tools/buf; on a
fresh clone it is installed with `npm ci` first. The baseline,
tools/buf/contract-baseline.binpb, is the contract as released: a change that
`buf breaking` (FILE rules) refuses would break clients generated from it.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TOOLS = ROOT / "tools" / "buf"
BASELINE = TOOLS / "contract-baseline.binpb"


@pytest.fixture(scope="module")
def buf() -> Path:
    binary = TOOLS / "node_modules" / ".bin" / "buf"
    if not binary.is_file():
        npm = shutil.which("npm")
        assert npm is not None, "npm is not installed: cannot install buf (tools/buf); install Node.js and npm"
        done = subprocess.run(
            [npm, "ci", "--no-audit", "--no-fund"], cwd=TOOLS, capture_output=True, text=True, timeout=600
        )
        assert done.returncode == 0, f"npm ci failed in {TOOLS}:\n{done.stdout}\n{done.stderr}"
    return binary


def run_buf(buf: Path, workspace: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(buf), *args], cwd=workspace, capture_output=True, text=True, timeout=120)


def copy_of_contract(tmp_path: Path) -> Path:
    """A workspace holding buf.yaml and proto/, to change without touching the repository."""
    shutil.copytree(ROOT / "proto", tmp_path / "proto")
    shutil.copy(ROOT / "buf.yaml", tmp_path / "buf.yaml")
    return tmp_path


def test_the_contract_passes_standard_lint(buf):
    done = run_buf(buf, ROOT, "lint")
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_contract_is_compatible_with_the_released_one(buf):
    done = run_buf(buf, ROOT, "breaking", "--against", str(BASELINE))
    assert done.returncode == 0, done.stdout + done.stderr


def test_a_renumbered_field_is_refused_as_breaking(buf, tmp_path):
    workspace = copy_of_contract(tmp_path)
    proto = workspace / "proto" / "kvcache" / "v1" / "kv_manager.proto"
    text = proto.read_text()
    field = "  uint64 acked_step_id = 2;"
    assert field in text
    proto.write_text(text.replace(field, "  uint64 acked_step_id = 9;"))
    done = run_buf(buf, workspace, "breaking", "--against", str(BASELINE))
    assert done.returncode != 0
    assert "WorkerStatus" in done.stdout and "acked_step_id" in done.stdout, done.stdout


def test_only_the_documented_exceptions_keep_lint_quiet(buf, tmp_path):
    """Without its per-line exceptions, lint names the two streams' response types, and nothing else."""
    workspace = copy_of_contract(tmp_path)
    proto = workspace / "proto" / "kvcache" / "v1" / "kv_manager.proto"
    text = proto.read_text()
    assert text.count("// buf:lint:ignore RPC_RESPONSE_STANDARD_NAME\n") == 2
    proto.write_text(text.replace("// buf:lint:ignore RPC_RESPONSE_STANDARD_NAME\n", "\n"))
    done = run_buf(buf, workspace, "lint")
    assert done.returncode != 0
    problems = done.stdout.strip().splitlines()
    assert len(problems) == 2, done.stdout
    assert '"StepDelta" should be named "WatchStepsResponse"' in problems[0]
    assert '"KVEvent" should be named "WatchEventsResponse"' in problems[1]
