"""MkDocs hooks (mkdocs.yml): the README is the site's home page, and links leave the site only where they must.

The pages are written to be read in the repository too, so their links are
paths in the repository: the README links `docs/contract.md`, a page of
docs/ links `../BENCHMARKS.md` or `../proto/kvcache/v1/kv_manager.proto`.
This hook makes them work in the site as well:

- the README becomes the site's `index.md`, and the root's CHANGELOG.md and
  CONTRIBUTING.md become pages beside it;
- every relative link is resolved from where its page lies in the
  repository. One to a page of the site is rewritten relative to where the
  page lies in the site, and MkDocs then checks it and its anchor as usual.
  One to any other file of the repository must name a file that exists (a
  warning otherwise, which `mkdocs build --strict` turns into a failure),
  and becomes a link under `repo_url` when mkdocs.yml sets one, else the
  file's path in code font: the site carries no copy of the sources.
"""

from __future__ import annotations

import logging
import posixpath
import re
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

log = logging.getLogger("mkdocs.hooks.repository_links")

ROOT = Path(__file__).resolve().parents[1]
# Repository files outside docs/ that are pages of the site: repository path -> path in the site.
ROOT_PAGES = {"README.md": "index.md", "CHANGELOG.md": "CHANGELOG.md", "CONTRIBUTING.md": "CONTRIBUTING.md"}
# [text](target) and [text](target "title"); an image's ![...] is the same to us.
LINK = re.compile(r"\[(?P<text>[^\]\n]*)\]\((?P<target>[^)\s]+)(?P<title>\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^(```|~~~)")


def on_files(files: Files, config: Any) -> Files:
    for repository_path, site_path in ROOT_PAGES.items():
        if files.get_file_from_path(site_path) is None:
            files.append(File.generated(config, site_path, abs_src_path=str(ROOT / repository_path)))
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Files) -> str:
    source = _repository_path(page.file.src_uri)
    lines = []
    in_fence = False
    for line in markdown.split("\n"):
        if FENCE.match(line.lstrip()):
            in_fence = not in_fence
        if not in_fence:
            line = LINK.sub(lambda match: _rewrite(match, source, page.file.src_uri, config), line)
        lines.append(line)
    return "\n".join(lines)


def _repository_path(site_path: str) -> str:
    """Where a page of the site lies in the repository."""
    for repository_path, page_path in ROOT_PAGES.items():
        if page_path == site_path:
            return repository_path
    return f"docs/{site_path}"


def _site_path(repository_path: str) -> str | None:
    """Where a repository file lies in the site, if it is a page or asset of it."""
    if repository_path in ROOT_PAGES:
        return ROOT_PAGES[repository_path]
    if repository_path.startswith("docs/"):
        return repository_path[len("docs/"):]
    return None


def _rewrite(match: re.Match, source: str, page_site_path: str, config: Any) -> str:
    text, target, title = match.group("text"), match.group("target"), match.group("title") or ""
    if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith(("#", "/")):
        return match.group(0)  # a URL, an anchor of this page, or an absolute path: MkDocs judges those
    path, _, anchor = target.partition("#")
    repository_path = posixpath.normpath(posixpath.join(posixpath.dirname(source), path))
    if repository_path.startswith("../") or not (ROOT / repository_path).exists():
        log.warning("%s links %r, which is no file of the repository", source, target)
        return match.group(0)
    site_path = _site_path(repository_path)
    if site_path is not None:
        relative = posixpath.relpath(site_path, posixpath.dirname(page_site_path) or ".")
        return f"[{text}]({relative}{'#' + anchor if anchor else ''}{title})"
    repo_url = config.get("repo_url")
    if repo_url:
        kind = "tree" if (ROOT / repository_path).is_dir() else "blob"
        return f"[{text}]({repo_url.rstrip('/')}/{kind}/main/{repository_path}{title})"
    name = repository_path.rstrip("/")
    return text if name in text else f"{text} (`{name}`)"
