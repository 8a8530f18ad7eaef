"""The documentation holds together: the MkDocs site builds under ``--strict`` (no broken link or anchor
between pages), every page under ``docs/`` is in the nav, and the README stays a short page whose relative
links all lead to files."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
README_MAX_LINES = 200
#: ``[text](target)``; images too (``![alt](target)``)
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


def _nav_pages(nav: object) -> set[str]:
    """Every ``.md`` path named anywhere in mkdocs.yml's ``nav`` (plain entries, titled ones, sections)."""
    if isinstance(nav, str):
        return {nav} if nav.endswith(".md") else set()
    if isinstance(nav, list):
        return set().union(*(_nav_pages(item) for item in nav))
    if isinstance(nav, dict):
        return set().union(*(_nav_pages(value) for value in nav.values()))
    return set()


def test_mkdocs_builds_strict(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert (tmp_path / "site" / "index.html").is_file()


def test_readme_relative_links_point_to_files() -> None:
    readme = (ROOT / "README.md").read_text()
    targets = [t for t in LINK.findall(readme) if not re.match(r"[a-z][a-z0-9+.-]*:|#", t)]
    assert targets, "the README links to no docs page"
    broken = [t for t in targets if not (ROOT / t.split("#", 1)[0]).exists()]
    assert not broken, f"README.md links to missing files: {broken}"


def test_readme_stays_short() -> None:
    lines = len((ROOT / "README.md").read_text().splitlines())
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines: move detail to docs/ (≤ {README_MAX_LINES})"


def test_every_docs_page_is_in_the_nav() -> None:
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    docs = ROOT / config.get("docs_dir", "docs")
    pages = {p.relative_to(docs).as_posix() for p in docs.rglob("*.md")}
    in_nav = _nav_pages(config["nav"])
    assert pages - in_nav == set(), f"pages missing from mkdocs.yml's nav: {sorted(pages - in_nav)}"
    assert in_nav - pages == set(), f"nav entries with no page: {sorted(in_nav - pages)}"
