"""The layout table (docs/architecture.md, "Layout"; the README links it) matches the tree: every path it
lists exists, every package and top-level module of the product and the tooling is listed, and every module
it names inside a package exists."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYOUT_DOC = ROOT / "docs" / "architecture.md"
PACKAGES = ("kv_manager_service", "gpu_worker", "kernels", "reference_scheduler", "kv_tooling")


def layout_rows() -> dict[str, str]:
    """Path -> the row's description, from the table under `## Layout` of docs/architecture.md."""
    text = LAYOUT_DOC.read_text(encoding="utf-8")
    assert "\n## Layout\n" in text, f"{LAYOUT_DOC.relative_to(ROOT)} has no Layout section"
    section = text.split("\n## Layout\n", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        match = re.match(r"\| `([^`]+)` \| (.*)", line)
        if match:
            rows[match.group(1)] = match.group(2)
    assert rows, "the Layout section has no table rows"
    return rows


def test_every_listed_path_exists():
    missing = [path for path in layout_rows() if not (ROOT / path).exists()]
    assert not missing, f"the layout table lists paths that do not exist: {missing}"


def test_every_package_and_top_level_module_is_listed():
    """Each top-level package, and each subpackage and module of kv_manager_service (listed by its parts)."""
    listed = {path.rstrip("/") for path in layout_rows()}
    required = {package for package in PACKAGES if package != "kv_manager_service"}
    for child in (ROOT / "kv_manager_service").iterdir():
        if (child / "__init__.py").exists() or (child.suffix == ".py" and child.name != "__init__.py"):
            required.add(str(child.relative_to(ROOT)))
    unlisted = sorted(required - listed)
    assert not unlisted, f"the layout table does not list: {unlisted}"


def test_every_module_a_row_names_exists():
    """A row names its package's modules in backquotes (`replica`, `groups/`): each is a file or folder there."""
    missing = []
    for path, description in layout_rows().items():
        folder = ROOT / path
        if not folder.is_dir() or not (folder / "__init__.py").exists():
            continue
        what = description.split(" | ")[0]
        for name in re.findall(r"`([a-z_]+)(?:\.py|/)?`", what):
            if not ((folder / f"{name}.py").exists() or (folder / name).is_dir()):
                missing.append(f"{path}{name}")
    assert not missing, f"the layout table names modules that do not exist: {missing}"
