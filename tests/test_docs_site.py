"""The documentation: the README is a front page that leads into docs/, and the site builds strictly, offline.

`mkdocs build --strict` (what `make docs` runs) fails on any warning: a
link or an anchor that leads nowhere (tools/mkdocs_hooks.py also checks the
links that leave docs/ for the repository), a page of docs/ left out of the
nav. The built pages must load nothing from the network.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from processes import ROOT

README = ROOT / "README.md"
MAX_README_LINES = 250
BUILD_TIMEOUT_S = 300  # a hang guard, not an expectation
# A resource the browser fetches by itself: a script, a stylesheet or an image from another host.
REMOTE_RESOURCE = re.compile(r"<(?:script|img|iframe)[^>]*\ssrc=\"(?:https?:)?//|<link[^>]*\shref=\"(?:https?:)?//")


def test_the_readme_fits_on_a_page():
    num_lines = len(README.read_text(encoding="utf-8").splitlines())
    assert num_lines <= MAX_README_LINES, f"README.md has {num_lines} lines; move sections into docs/ (limit {MAX_README_LINES})"


def test_the_readme_links_every_page_of_docs():
    linked = set(re.findall(r"\]\((docs/[^)#\s]+\.md)", README.read_text(encoding="utf-8")))
    pages = {str(path.relative_to(ROOT)) for path in (ROOT / "docs").rglob("*.md")}
    assert pages - linked == set(), f"pages of docs/ the README does not link: {sorted(pages - linked)}"
    assert linked - pages == set(), f"the README links pages that do not exist: {sorted(linked - pages)}"


def test_the_site_builds_strictly_and_loads_nothing_from_the_network(tmp_path):
    pytest.importorskip("mkdocs", reason="mkdocs is not installed: `make setup` installs it (the docs extra)")
    site = tmp_path / "site"
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=ROOT, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S, check=False,
    )  # fmt: skip
    assert done.returncode == 0, f"mkdocs build --strict failed:\n{done.stdout}\n{done.stderr}"
    pages = sorted(site.rglob("*.html"))
    assert (site / "index.html").exists() and (site / "contract" / "index.html").exists(), pages
    remote = [str(page.relative_to(site)) for page in pages if REMOTE_RESOURCE.search(page.read_text(encoding="utf-8"))]
    assert not remote, f"pages that load a resource from the network: {remote}"


def test_make_docs_builds_with_the_pinned_mkdocs():
    """`make docs` installs MkDocs as `make setup` installs the rest: the docs extra, pinned by the constraints."""
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    assert re.search(r"^docs: setup\n\t\$\(BIN\)/mkdocs build --strict", makefile, re.MULTILINE), makefile
    assert "docs]'" in makefile and ",docs" in makefile
    for constraints in ("cpu.txt", "cuda.txt"):
        pins = Path(ROOT / "constraints" / constraints).read_text(encoding="utf-8")
        assert re.search(r"^mkdocs==\d", pins, re.MULTILINE), constraints
