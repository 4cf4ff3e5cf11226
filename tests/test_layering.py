"""The import layering, checked on the source.

Every `.py` file of `kv_manager_service/`, `gpu_worker/`, `kernels/`,
`reference_scheduler/` and `bench/` is parsed with `ast`. Each `import` and
`from ... import` is an edge `module -> imported module`, wherever it sits (at
module level, inside a function, under `if TYPE_CHECKING:`); relative imports
are resolved against the importing module's package, and `from package import
name` points at `package.name` when that is a module of the project. Two more
ways of reaching a module count as imports: `importlib.import_module("...")`
with a literal name, and a `sys.path` insertion of the `tests/` folder, which
is an edge to `tests`.

The layers, lowest first (a layer imports only those below it, and itself):

- the shared layer, `kvcache` (the generated contract) and
  `kv_manager_service.shared`: what every process may import. It imports
  nothing of the manager nor of its users. Its value modules (`ops`,
  `events`, `config`, `hash_types`, `errors`) are pure: only each other and
  the standard library;
- `kv_manager_service.core` (pure, no I/O): the core, the shared value
  modules, the standard library and `xxhash` (the xxh3_128 block hash);
- `kv_manager_service.broadcast_log`: the standard library only;
- `kv_manager_service.wire` (messages <-> values): the shared layer only,
  called by the client, the servicer and the journal's codecs alone;
- the manager's edges: `kv_manager_service.client` (the shared layer and
  `wire`), `.server` and `.mirror` (the mirror imports nothing of the
  server), and `.cli`, the `kv-manager` command, whose only way into the
  tooling is handing its `replay` and `demo` subcommands to
  `kv_tooling.commands`;
- `gpu_worker`, `reference_scheduler`: the shared layer and the client only,
  so they never reach the core (checked on the whole import graph too);
  `kernels` is a leaf of the worker; the scheduler imports no worker;
- `kv_tooling` (the demo, replay, soak, workload and launcher) and `bench`
  may import anything but tests; no product module imports them;
- nothing outside `tests/` imports from `tests/`.
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Callable, Iterator, NamedTuple

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCANNED_FOLDERS = ("kv_manager_service", "gpu_worker", "kernels", "reference_scheduler", "kv_tooling", "bench")
# Top-level names that are the project's own (kvcache: the generated contract).
PROJECT_PACKAGES = frozenset(SCANNED_FOLDERS) | {"kvcache", "tests"}
CORE_FORBIDDEN_THIRD_PARTY = ("grpc", "redis", "torch", "triton", "prometheus_client", "kvcache")
# Beside the standard library the core uses one package, pure computation: the xxh3_128 block hash.
CORE_THIRD_PARTY_ALLOWED = ("xxhash",)

KVM = "kv_manager_service"
CORE = f"{KVM}.core"
SHARED = f"{KVM}.shared"
SHARED_VALUES = tuple(f"{SHARED}.{name}" for name in ("ops", "events", "config", "hash_types", "errors"))
WIRE = f"{KVM}.wire"
WIRE_CALLERS = (f"{KVM}.client", f"{KVM}.server.servicer", f"{KVM}.server.journal_records", f"{KVM}.server.snapshot")
SERVER = f"{KVM}.server"
MIRROR = f"{KVM}.mirror"
CLIENT = f"{KVM}.client"
CLI = f"{KVM}.cli"
BROADCAST_LOG = f"{KVM}.broadcast_log"
TOOLING = "kv_tooling"
# The one door from the product into the tooling: the command line hands it `replay` and `demo`.
TOOL_COMMANDS = (f"{CLI}.main", f"{TOOLING}.commands")
MANAGER = (CORE, WIRE, CLIENT, SERVER, MIRROR, CLI, BROADCAST_LOG)
PRODUCT = (KVM, "gpu_worker", "kernels", "reference_scheduler")
SHARED_LAYER = (SHARED, "kvcache")


class Edge(NamedTuple):
    """`importer` imports `imported` (both dotted module names)."""

    importer: str
    imported: str

    def __str__(self) -> str:
        return f"{self.importer} -> {self.imported}"


@dataclass(frozen=True)
class SourceModule:
    """One `.py` file of the project, named as Python imports it."""

    name: str
    is_package: bool  # an `__init__.py`: relative imports resolve against the module itself
    path: Path


def in_package(module: str, package: str) -> bool:
    """True when `module` is `package` or one of its submodules."""
    return module == package or module.startswith(package + ".")


def in_any(module: str, packages: tuple[str, ...]) -> bool:
    return any(in_package(module, package) for package in packages)


def is_project(module: str) -> bool:
    return module.split(".", 1)[0] in PROJECT_PACKAGES


def is_standard_library(module: str) -> bool:
    return module.split(".", 1)[0] in sys.stdlib_module_names


def module_name(path: Path) -> tuple[str, bool]:
    """The dotted name of the file at `path` (relative to the repository root), and whether it is a package."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    is_package = parts[-1] == "__init__"
    if is_package:
        parts.pop()
    return ".".join(parts), is_package


def project_modules() -> list[SourceModule]:
    """Every `.py` file under the scanned folders, sorted by module name."""
    modules = []
    for folder in SCANNED_FOLDERS:
        for path in (ROOT / folder).rglob("*.py"):
            name, is_package = module_name(path)
            modules.append(SourceModule(name, is_package, path))
    return sorted(modules, key=lambda module: module.name)


def helper_modules_of_tests() -> dict[str, str]:
    """Top-level name -> dotted name of each module under `tests/` that a script could import by its bare name.

    pytest puts each test folder on `sys.path`, so `tests/processes.py` is importable as `processes` by anyone
    who adds `tests/` to the path.
    """
    helpers = {}
    for path in sorted((ROOT / "tests").rglob("*.py")):
        name = path.stem
        if name not in ("conftest", "__init__") and not name.startswith("test_") and not is_standard_library(name):
            helpers[name] = module_name(path)[0]
    return helpers


def resolve_relative(importer: str, importer_is_package: bool, level: int, module: str | None) -> str:
    """The absolute name of `from <level dots><module> import ...` written in `importer`."""
    package = importer.split(".") if importer_is_package else importer.split(".")[:-1]
    if level > len(package):
        raise ValueError(f"{importer}: relative import beyond the top-level package")
    base = package[: len(package) - (level - 1)]
    return ".".join(base + ([module] if module else []))


def mentions_tests_folder(node: ast.AST) -> bool:
    """True when a string literal under `node` names the `tests` folder (`"tests"`, `"tests/data"`, ...)."""
    return any(
        isinstance(child, ast.Constant)
        and isinstance(child.value, str)
        and "tests" in PurePosixPath(child.value.replace("\\", "/")).parts
        for child in ast.walk(node)
    )


def is_sys_path(node: ast.AST) -> bool:
    return (
        isinstance(node, ast.Attribute)
        and node.attr == "path"
        and isinstance(node.value, ast.Name)
        and node.value.id == "sys"
    )


def adds_tests_to_sys_path(node: ast.AST) -> bool:
    """`sys.path.insert/append/extend(<tests folder>)` or `sys.path += [<tests folder>]`."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        return is_sys_path(node.func.value) and node.func.attr in ("insert", "append", "extend") and any(
            mentions_tests_folder(argument) for argument in node.args
        )
    if isinstance(node, ast.AugAssign):
        return is_sys_path(node.target) and mentions_tests_folder(node.value)
    return False


def literal_import_module(node: ast.AST) -> str | None:
    """The name in `importlib.import_module("name")` / `import_module("name")` / `__import__("name")`, if literal."""
    if not isinstance(node, ast.Call) or not node.args:
        return None
    func = node.func
    called = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
    first = node.args[0]
    if called in ("import_module", "__import__") and isinstance(first, ast.Constant) and isinstance(first.value, str):
        return first.value
    return None


def imported_modules(
    importer: str,
    importer_is_package: bool,
    source: str,
    known_modules: frozenset[str],
    tests_helpers: dict[str, str],
    sibling_names: frozenset[str] = frozenset(),
) -> set[str]:
    """Every module `source` (the text of module `importer`) imports, as dotted names.

    `known_modules`: the project's module names, to tell `from package import submodule` from
    `from package import name`. `tests_helpers`: bare names that resolve into `tests/` (see
    `helper_modules_of_tests`). `sibling_names`: modules in the importer's own folder, importable by their
    bare name (a bench script's `bench_stats`), which win over a `tests/` helper of the same name.
    """
    imported: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            imported.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = (
                resolve_relative(importer, importer_is_package, node.level, node.module)
                if node.level
                else node.module or ""
            )
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                imported.add(submodule if submodule in known_modules else base)
        elif adds_tests_to_sys_path(node):
            imported.add("tests")
        elif (name := literal_import_module(node)) is not None:
            imported.add(name)
    return {
        tests_helpers[name] if name in tests_helpers and name not in sibling_names and not is_project(name) else name
        for name in imported
    }


# A rule: (importer, imported) -> the reason the edge is forbidden, or None when it is allowed.
Rule = Callable[[str, str], str | None]


def shared_rule(importer: str, imported: str) -> str | None:
    if not in_package(importer, SHARED):
        return None
    if in_any(imported, MANAGER + ("gpu_worker", "reference_scheduler", "kernels", TOOLING)):
        return "the shared layer imports nothing of the manager nor of its users"
    if in_any(importer, SHARED_VALUES) and not (in_any(imported, SHARED_VALUES) or is_standard_library(imported)):
        return "the shared value modules import only each other and the standard library"
    return None


def core_rule(importer: str, imported: str) -> str | None:
    if not in_package(importer, CORE):
        return None
    if in_any(imported, CORE_FORBIDDEN_THIRD_PARTY):
        return "the core does no I/O: no grpc, redis, torch, triton, prometheus_client or kvcache"
    allowed = in_any(imported, (CORE,) + SHARED_VALUES) or is_standard_library(imported)
    if allowed or in_any(imported, CORE_THIRD_PARTY_ALLOWED):
        return None
    return "the core imports only the core, the shared value modules, the standard library and xxhash"


def wire_rule(importer: str, imported: str) -> str | None:
    if importer == WIRE and is_project(imported) and not in_any(imported, SHARED_LAYER):
        return "wire imports only the shared layer"
    if imported == WIRE and in_any(importer, PRODUCT + (TOOLING,)) and importer not in WIRE_CALLERS:
        return "only the client, the servicer and the journal's codecs call wire"
    return None


def client_rule(importer: str, imported: str) -> str | None:
    if in_package(importer, CLIENT) and is_project(imported) and not in_any(imported, SHARED_LAYER + (WIRE,)):
        return "the client imports only the shared layer and wire"
    return None


def mirror_rule(importer: str, imported: str) -> str | None:
    if not in_package(importer, MIRROR):
        return None
    if in_any(imported, (CLIENT, CLI)):
        return "the mirror imports no client or cli"
    if in_package(imported, SERVER):
        return "the mirror imports nothing of the server (the broadcast log both follow sits below them)"
    return None


def server_rule(importer: str, imported: str) -> str | None:
    if in_package(importer, SERVER) and in_any(imported, (CLIENT, CLI, "gpu_worker", "reference_scheduler", "kernels")):
        return "the server imports no client, cli, gpu_worker, reference_scheduler or kernels"
    return None


def broadcast_log_rule(importer: str, imported: str) -> str | None:
    if importer == BROADCAST_LOG and is_project(imported):
        return "the broadcast log imports nothing of the project"
    return None


def worker_and_scheduler_rule(importer: str, imported: str) -> str | None:
    if not in_any(importer, ("gpu_worker", "reference_scheduler")):
        return None
    if in_package(imported, KVM) and not in_any(imported, (SHARED, CLIENT)):
        return "the worker and the scheduler reach the manager through the client and the shared layer only"
    if in_package(importer, "reference_scheduler") and in_any(imported, ("gpu_worker", "kernels")):
        return "the reference scheduler imports no gpu_worker or kernels"
    return None


def kernels_rule(importer: str, imported: str) -> str | None:
    if in_package(importer, "kernels") and is_project(imported) and not in_package(imported, "kernels"):
        return "kernels import only kernels"
    return None


def tooling_rule(importer: str, imported: str) -> str | None:
    if in_any(importer, PRODUCT) and in_any(imported, (TOOLING, "bench")) and (importer, imported) != TOOL_COMMANDS:
        return "no product module imports tooling (but the command line's hand-off to kv_tooling.commands)"
    return None


def outside_tests_rule(importer: str, imported: str) -> str | None:
    if not in_package(importer, "tests") and in_package(imported, "tests"):
        return "nothing outside tests/ imports from tests/"
    return None


RULES: tuple[Rule, ...] = (
    shared_rule,
    core_rule,
    wire_rule,
    client_rule,
    mirror_rule,
    server_rule,
    broadcast_log_rule,
    worker_and_scheduler_rule,
    kernels_rule,
    tooling_rule,
    outside_tests_rule,
)


def broken_rules(edge: Edge) -> list[str]:
    """The reasons `edge` is forbidden; empty when it is allowed."""
    return [reason for rule in RULES if (reason := rule(edge.importer, edge.imported)) is not None]


def project_edges(modules: list[SourceModule]) -> Iterator[Edge]:
    """Every import edge of `modules`, in module order."""
    known = frozenset(module.name for module in modules)
    tests_helpers = helper_modules_of_tests()
    for module in modules:
        siblings = frozenset(path.stem for path in module.path.parent.glob("*.py"))
        source = module.path.read_text(encoding="utf-8")
        imported = imported_modules(module.name, module.is_package, source, known, tests_helpers, siblings)
        yield from (Edge(module.name, name) for name in sorted(imported))


def forbidden_edges_in(
    importer: str,
    source: str,
    known_modules: frozenset[str],
    tests_helpers: dict[str, str],
    is_package: bool = False,
) -> list[str]:
    """The forbidden edges of one module given as text, formatted as the layering test reports them."""
    imported = imported_modules(importer, is_package, source, known_modules, tests_helpers)
    return sorted(str(edge) for edge in (Edge(importer, name) for name in imported) if broken_rules(edge))


def test_the_project_keeps_its_layers() -> None:
    modules = project_modules()
    assert {module.name.split(".", 1)[0] for module in modules} == set(SCANNED_FOLDERS)
    forbidden = [
        f"{edge}  ({'; '.join(reasons)})" for edge in project_edges(modules) if (reasons := broken_rules(edge))
    ]
    assert not forbidden, "forbidden imports:\n" + "\n".join(forbidden)


# The self-check's own view of the project, independent of the tree as it is today.
PLANTED_KNOWN_MODULES = frozenset(
    {
        "kv_manager_service.core.hashing",
        "kv_manager_service.shared.errors",
        "kv_manager_service.shared.ops",
        "kv_manager_service.shared.status",
        "kv_manager_service.wire",
        "kv_manager_service.server.replica",
        "kv_manager_service.server.servicer",
    }
)
PLANTED_TESTS_HELPERS = {"load_generator": "tests.load_generator"}


@pytest.mark.parametrize(
    ("importer", "source", "expected"),
    [
        # Third-party packages in the core, at module level and inside a function; xxhash is the exception.
        (
            "kv_manager_service.core.block_pool",
            "import grpc, xxhash\ndef f():\n    import torch.nn\n    import numpy\n",
            [
                "kv_manager_service.core.block_pool -> grpc",
                "kv_manager_service.core.block_pool -> numpy",
                "kv_manager_service.core.block_pool -> torch.nn",
            ],
        ),
        # A relative import resolves against the importer's package; shared values are allowed, status is not.
        (
            "kv_manager_service.core.manager",
            "from ..shared import errors, ops, status\nfrom . import hashing\n",
            ["kv_manager_service.core.manager -> kv_manager_service.shared.status"],
        ),
        # `if TYPE_CHECKING:` imports count.
        (
            "kv_manager_service.shared.rpc_metrics",
            "from typing import TYPE_CHECKING\n"
            "if TYPE_CHECKING:\n"
            "    from kv_manager_service.server.servicer import X\n",
            ["kv_manager_service.shared.rpc_metrics -> kv_manager_service.server.servicer"],
        ),
        # The shared layer reaches nothing of the manager; a package `__init__` resolves `.` to itself.
        (
            "kv_manager_service.shared",
            "from .errors import x\nfrom kv_manager_service.core import KVCacheManager\n",
            ["kv_manager_service.shared -> kv_manager_service.core"],
        ),
        # A shared value module stays pure.
        (
            "kv_manager_service.shared.ops",
            "import enum\nfrom kv_manager_service.shared import status\n",
            ["kv_manager_service.shared.ops -> kv_manager_service.shared.status"],
        ),
        # wire speaks the shared layer only, and only its three callers call it.
        (
            "kv_manager_service.wire",
            "from kv_manager_service.shared.ops import Op\nfrom kv_manager_service.core import KVCacheManager\n",
            ["kv_manager_service.wire -> kv_manager_service.core"],
        ),
        ("kv_manager_service.server.servicer", "from kv_manager_service import wire\n", []),
        (
            "kv_manager_service.server.replica",
            "from kv_manager_service import wire\n",
            ["kv_manager_service.server.replica -> kv_manager_service.wire"],
        ),
        # The client returns shared values, never the core's.
        (
            "kv_manager_service.client",
            "from kv_manager_service.shared.ops import Op\nfrom kv_manager_service.core.hashing import BlockHasher\n",
            ["kv_manager_service.client -> kv_manager_service.core.hashing"],
        ),
        # The mirror reads nothing of the server; the broadcast log sits below both.
        (
            "kv_manager_service.mirror.writer",
            "from kv_manager_service.server import replica\nfrom kv_manager_service import broadcast_log\n",
            ["kv_manager_service.mirror.writer -> kv_manager_service.server.replica"],
        ),
        ("kv_manager_service.broadcast_log", "import threading\n", []),
        (
            "kv_manager_service.broadcast_log",
            "import kv_manager_service.shared.events\n",
            ["kv_manager_service.broadcast_log -> kv_manager_service.shared.events"],
        ),
        # The worker goes through the client and the shared layer, never the core; the scheduler never
        # reaches the worker.
        (
            "gpu_worker.runner",
            "from kv_manager_service.client import AllocateOp\nfrom kv_manager_service.shared.ops import FreeOp\n"
            "from kv_manager_service.core.ops import ForkOp\n",
            ["gpu_worker.runner -> kv_manager_service.core.ops"],
        ),
        (
            "reference_scheduler.scheduler",
            "import importlib\nkernels = importlib.import_module('kernels.store_kv')\n",
            ["reference_scheduler.scheduler -> kernels.store_kv"],
        ),
        # No product module imports tooling, but the command line's hand-off.
        (
            "kv_manager_service.server.process",
            "from kv_tooling.launch import launch\n",
            ["kv_manager_service.server.process -> kv_tooling.launch"],
        ),
        ("kv_manager_service.cli.main", "from kv_tooling.commands import add_tool_commands\n", []),
        (
            "kv_manager_service.cli.main",
            "from kv_tooling.demo import run_demo\n",
            ["kv_manager_service.cli.main -> kv_tooling.demo"],
        ),
        # A bench script may put the repository root on sys.path, never tests/, nor import a tests/ helper.
        (
            "bench.some_bench",
            "import sys\n"
            "sys.path.insert(0, str(ROOT))\n"
            "sys.path.insert(0, str(ROOT / 'tests'))\n"
            "from load_generator import run\n",
            ["bench.some_bench -> tests", "bench.some_bench -> tests.load_generator"],
        ),
    ],
)
def test_the_layering_check_finds_planted_imports(importer: str, source: str, expected: list[str]) -> None:
    is_package = importer == "kv_manager_service.shared"
    assert forbidden_edges_in(importer, source, PLANTED_KNOWN_MODULES, PLANTED_TESTS_HELPERS, is_package) == expected


def reachable(start: str, edges: dict[str, set[str]]) -> set[str]:
    """Every project module `start` imports, directly or through others."""
    seen: set[str] = set()
    todo = [start]
    while todo:
        for imported in edges.get(todo.pop(), ()):
            if imported not in seen:
                seen.add(imported)
                todo.append(imported)
    return seen


def test_the_worker_and_the_scheduler_never_reach_the_core() -> None:
    """On the whole import graph: no chain of imports leads from the worker or the scheduler to the core."""
    modules = project_modules()
    edges: dict[str, set[str]] = {}
    for edge in project_edges(modules):
        edges.setdefault(edge.importer, set()).add(edge.imported)
    for module in modules:
        if in_any(module.name, ("gpu_worker", "reference_scheduler")):
            into_core = sorted(m for m in reachable(module.name, edges) if in_package(m, CORE))
            assert not into_core, f"{module.name} reaches the core: {into_core}"
