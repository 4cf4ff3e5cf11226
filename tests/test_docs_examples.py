"""Every code block of the README and of docs/ is run, checked, or marked as not meant to run.

What a fenced block is, by its language and the HTML comment on the line
right above it (its marker):

- no language, or `text`: a figure or literal output, never run;
- `<!-- not run: WHY -->` above any block: not run, and WHY says why;
- `python`: run in a fresh interpreter, against the manager and the worker
  that the README's server block starts, and must exit 0;
- `bash`: each line is a command (`# ...` comments aside), run by bash from
  the repository root, and must exit 0;
- `<!-- run: servers -->` above the README's one `bash` block of servers:
  each line starts a server (`kv-manager serve`, `gpu-worker`), which must
  print its ready line; the python blocks run against them;
- `<!-- check: pool config -->` above a `yaml` block: `kv-manager serve
  --config` starts with it; `<!-- check: token file -->`: the manager's
  token-file reader loads it, with every tenant it names.

Any other block fails `test_every_block_is_run_checked_or_marked`. The
documented ports, 50051 (the manager) and 50061 (the worker), are replaced
by free ones, and `.venv/bin/` by the folder of the interpreter that runs
the tests. Code blocks of other Markdown files are not checked here.
"""

from __future__ import annotations

import os
import re
import shlex
import stat
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from processes import ROOT, free_port, launch, stop_all

from kv_manager_service.client import KVManagerClient
from kv_manager_service.shared.ready_line import MANAGER_READY_PREFIX, WORKER_READY_PREFIX
from kv_manager_service.shared.security import load_token_file
from reference_scheduler import WorkerClient

DOCUMENTS = (ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")))
BIN = Path(sys.executable).parent
DOCUMENTED_PORTS = ("50051", "50061")  # the manager's, the worker's
RUN_TIMEOUT_S = 180  # a hang guard, not an expectation
FENCE = re.compile(r"^(?P<indent>\s*)(?P<fence>```|~~~)\s*(?P<language>[\w+-]*)\s*$")
MARKER = re.compile(r"^\s*<!--\s*(?P<marker>.*?)\s*-->\s*$")
NOT_RUN = re.compile(r"^not run:\s*(?P<why>.*)$")
READY_PREFIXES = {"kv-manager": MANAGER_READY_PREFIX, "gpu-worker": WORKER_READY_PREFIX}


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # of the opening fence, from 1
    language: str
    marker: str | None
    text: str

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"

    @property
    def kind(self) -> str:
        """How the test treats it: figure, not run, python, bash, servers, pool config, token file, or unmarked."""
        if self.marker is not None:
            not_run = NOT_RUN.match(self.marker)
            if not_run:
                return "not run" if not_run.group("why") else "unmarked"
            known = {("bash", "run: servers"): "servers", ("yaml", "check: pool config"): "pool config",
                     ("yaml", "check: token file"): "token file"}  # fmt: skip
            kind = known.get((self.language, self.marker), "unmarked")
            return "unmarked" if kind == "servers" and self.path.name != "README.md" else kind
        if self.language in ("", "text"):
            return "figure"
        if self.language in ("python", "bash"):
            return self.language
        return "unmarked"

    def commands(self) -> list[str]:
        """The block's command lines, comments and blank lines left out."""
        lines = [line.strip() for line in self.text.splitlines()]
        return [line for line in lines if line and not line.startswith("#")]


def blocks_of(path: Path) -> list[Block]:
    lines = path.read_text(encoding="utf-8").splitlines()
    found = []
    index = 0
    while index < len(lines):
        opening = FENCE.match(lines[index])
        if not opening:
            index += 1
            continue
        end = index + 1
        while end < len(lines) and lines[end].strip() != opening.group("fence"):
            end += 1
        assert end < len(lines), f"{path.relative_to(ROOT)}:{index + 1}: a code block that never closes"
        indent = len(opening.group("indent"))
        body = "\n".join(line[indent:] for line in lines[index + 1 : end])
        marker = MARKER.match(lines[index - 1]) if index else None
        found.append(Block(path, index + 1, opening.group("language"), marker and marker.group("marker"), body))
        index = end + 1
    return found


BLOCKS = [block for path in DOCUMENTS for block in blocks_of(path)]


def blocks(kind: str) -> list:
    return [pytest.param(block, id=block.where) for block in BLOCKS if block.kind == kind]


def substituted(text: str, ports: dict[str, int]) -> str:
    """`text` with the documented ports replaced by `ports`, and `.venv/bin/` by the running interpreter's folder."""
    for documented, port in ports.items():
        text = re.sub(rf"\b{documented}\b", str(port), text)
    return text.replace(".venv/bin/", f"{BIN}/")


def environment() -> dict[str, str]:
    return {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}


def start_servers(block: Block, ports: dict[str, int], directory: Path) -> list:
    """Each command line of a `run: servers` block, started in order; each must print its ready line."""
    processes = []
    try:
        for number, line in enumerate(block.commands()):
            argv = shlex.split(substituted(line, ports), comments=True)
            program = Path(argv[0]).name
            assert program in READY_PREFIXES, f"{block.where}: {program!r} is no server this test knows"
            processes.append(launch(argv, READY_PREFIXES[program], directory / f"{number}-{program}.log"))
    except BaseException:
        stop_all(processes)
        raise
    return processes


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """The manager and the worker of the README's server block, on free ports: the documented port -> the real one."""
    (block,) = [b for b in BLOCKS if b.kind == "servers" and b.path.name == "README.md"]
    ports = {documented: free_port() for documented in DOCUMENTED_PORTS}
    processes = start_servers(block, ports, tmp_path_factory.mktemp("readme-servers"))
    yield ports
    failures = stop_all(processes)
    assert not failures, "\n\n".join(failures)


def run_python(code: str, directory: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code], cwd=directory, env=environment(), capture_output=True, text=True,
        timeout=RUN_TIMEOUT_S, check=False,
    )  # fmt: skip


def test_every_block_is_run_checked_or_marked():
    unmarked = [f"{b.where} ({b.language or 'no language'}, marker {b.marker!r})" for b in BLOCKS if b.kind == "unmarked"]
    assert not unmarked, (
        "code blocks that are neither run nor marked (see this test's docstring for the markers; "
        "'<!-- not run: why -->' needs its why):\n" + "\n".join(unmarked)
    )


def test_the_readme_has_a_program_that_runs_and_the_servers_it_needs():
    readme = [b.kind for b in BLOCKS if b.path.name == "README.md"]
    assert readme.count("servers") == 1 and "python" in readme, readme


def test_the_readmes_servers_answer(servers):
    with KVManagerClient(f"127.0.0.1:{servers['50051']}") as manager, WorkerClient(f"127.0.0.1:{servers['50061']}") as worker:
        assert manager.get_config().num_blocks > 1
        assert worker.info().num_blocks == manager.get_config().num_blocks


@pytest.mark.parametrize("block", blocks("python"))
def test_python_block_runs(block, servers, tmp_path):
    done = run_python(substituted(block.text, servers), tmp_path)
    assert done.returncode == 0, f"{block.where} exited {done.returncode}:\n{done.stdout}\n{done.stderr}"


def test_the_readmes_loop_hits_the_cache_when_run_again(servers, tmp_path):
    """The README says so: the second run finds 32 of the 40 prompt tokens cached and generates the same tokens."""
    (loop,) = [b for b in BLOCKS if b.path.name == "README.md" and b.kind == "python"]
    outputs = []
    for _ in range(2):
        done = run_python(substituted(loop.text, servers), tmp_path)
        assert done.returncode == 0, done.stderr
        outputs.append(done.stdout.strip())
    cached, generated = zip(*(re.fullmatch(r"(\d+) prompt tokens were cached; generated (\[.*\])", o).groups() for o in outputs))
    assert cached[1] == "32" and generated[0] == generated[1], outputs


@pytest.mark.parametrize("block", blocks("bash"))
def test_shell_block_runs(block):
    for command in block.commands():
        done = subprocess.run(
            ["bash", "-c", substituted(command, {})], cwd=ROOT, env=environment(), capture_output=True, text=True,
            timeout=RUN_TIMEOUT_S, check=False,
        )  # fmt: skip
        assert done.returncode == 0, f"{block.where}: {command!r} exited {done.returncode}:\n{done.stdout}\n{done.stderr}"


@pytest.mark.parametrize("block", blocks("pool config"))
def test_pool_config_block_serves(block, tmp_path):
    config = tmp_path / "pool.yaml"
    config.write_text(block.text, encoding="utf-8")
    manager = launch([str(BIN / "kv-manager"), "serve", "--port", "0", "--config", str(config)],
                     MANAGER_READY_PREFIX, tmp_path / "manager.log")  # fmt: skip
    try:
        with KVManagerClient(manager.address) as client:
            assert client.get_config().num_blocks == yaml.safe_load(block.text)["num_blocks"]
    finally:
        failures = stop_all([manager])
        assert not failures, "\n\n".join(failures)


@pytest.mark.parametrize("block", blocks("token file"))
def test_token_file_block_loads(block, tmp_path):
    path = tmp_path / "tokens.yaml"
    path.write_text(block.text, encoding="utf-8")
    path.chmod(stat.S_IRUSR | stat.S_IWUSR)
    table = load_token_file(path)
    assert {principal.tenant for principal in table.principals} == set(yaml.safe_load(block.text))
