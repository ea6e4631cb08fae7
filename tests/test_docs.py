"""The documentation holds together: the MkDocs site builds with --strict and no warning (no broken link, anchor or
page left out of the nav), the README stays a few screens long, every README link into docs/ lands on a file, and
no user page keeps a diary (issue numbers, dates, "this box": history goes to CHANGELOG.md and the Development
pages, which the nav's Development section lists).

Fast (no stack, no model): the build takes a few seconds."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
README_MAX_LINES = 200

DEVELOPMENT_SECTION = "Development"

# Diary in a user page: a reference to an issue ("issue 37", "issues 23", "#37", an anchor "...-issue-23-item-1"),
# a date (2026-12-08, "8 December 2026", "Dec 8, 2026"), the machine the writer sat at ("this box") and history
# ("as before", "earlier versions"). Markdown anchors (#verdicts), shebangs and #SBATCH lines are not matched.
_MONTH = r"(?:Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Oct|Nov|Dec)[a-z]*\.?"
_DIARY = re.compile("|".join((
    r"\bissues?[\s-]+#?\d+",
    r"(?<![\w/&.#-])#\d+\b",
    r"\b20\d\d-\d\d-\d\d\b",
    rf"\b\d{{1,2}}\s+{_MONTH}\s+20\d\d\b",
    rf"\b{_MONTH}\s+\d{{1,2}},?\s+20\d\d\b",
    r"\b(?:this|the CPU) box\b",
    r"\bas before\b",
    r"\b(?:earlier|older) versions?\b",
)), re.I)

# Markdown links and images: [text](target) with the target up to a space or the closing parenthesis.
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)[^)]*\)")


def _mkdocs() -> list[str]:
    """The mkdocs command of this interpreter's environment (the `test` extra installs it)."""
    exe = Path(sys.executable).with_name("mkdocs")
    if exe.exists():
        return [str(exe)]
    if shutil.which("mkdocs"):
        return ["mkdocs"]
    pytest.fail("mkdocs is not installed: pip install -e '.[test]' (it pins mkdocs and mkdocs-material)")


def readme_doc_links(text: str) -> list[str]:
    """The README's links into docs/, without their #anchor."""
    targets = [m.group(1) for m in _LINK.finditer(text)]
    return [t.split("#", 1)[0] for t in targets if t.startswith(("docs/", "./docs/"))]


def test_the_docs_site_builds_strict_without_warnings(tmp_path):
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    proc = subprocess.run([*_mkdocs(), "build", "--strict", "--config-file", str(ROOT / "mkdocs.yml"),
                           "--site-dir", str(tmp_path / "site")], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    out = proc.stdout + proc.stderr
    warnings = [line for line in out.splitlines() if line.startswith(("WARNING", "ERROR"))]
    assert proc.returncode == 0 and not warnings, f"mkdocs build --strict failed:\n{out}"
    assert (tmp_path / "site" / "index.html").exists()


def test_the_readme_fits_on_a_few_screens():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, (
        f"README.md has {len(lines)} lines (at most {README_MAX_LINES}): move the detail to a page under docs/")


def test_every_readme_link_into_docs_resolves():
    links = readme_doc_links((ROOT / "README.md").read_text())
    assert links, "README.md links to no page under docs/"
    missing = sorted({t for t in links if not (ROOT / t).is_file()})
    assert not missing, f"README.md links to files that do not exist: {missing}"


def test_readme_doc_links_finds_links_and_drops_anchors():
    text = "see [a](docs/a.md#x), ![i](docs/i.png) and [b](https://x.org/docs/b.md), [c](docs/c.md \"t\")"
    assert readme_doc_links(text) == ["docs/a.md", "docs/i.png", "docs/c.md"]


class _NavLoader(yaml.SafeLoader):
    """mkdocs.yml may hold !!python/name tags (plugins' settings): read them as plain values, only the nav matters."""


_NavLoader.add_multi_constructor("", lambda loader, suffix, node: None)


def nav_pages(node: object) -> list[str]:
    """Every page file a nav (sub)tree names, in order."""
    if isinstance(node, str):
        return [node] if node.endswith(".md") else []
    if isinstance(node, list):
        return [page for item in node for page in nav_pages(item)]
    if isinstance(node, dict):
        return [page for value in node.values() for page in nav_pages(value)]
    return []


def development_pages() -> set[str]:
    """The pages under the nav's Development section (relative to docs/): the contributors' pages, where dated
    measurements and history belong."""
    nav = yaml.load((ROOT / "mkdocs.yml").read_text(), Loader=_NavLoader)["nav"]
    sections = [item[DEVELOPMENT_SECTION] for item in nav if isinstance(item, dict) and DEVELOPMENT_SECTION in item]
    assert sections, f"mkdocs.yml's nav has no {DEVELOPMENT_SECTION!r} section"
    return set(nav_pages(sections))


def diary_lines(text: str) -> list[tuple[int, str]]:
    """(line number, what matched) for each diary mark in a page's text."""
    return [(n, m.group(0)) for n, line in enumerate(text.splitlines(), start=1) for m in _DIARY.finditer(line)]


def test_user_pages_keep_no_diary():
    dev = development_pages()
    pages = [ROOT / "README.md", *(p for p in sorted((ROOT / "docs").rglob("*.md"))
                                   if str(p.relative_to(ROOT / "docs")) not in dev)]
    found = [f"{p.relative_to(ROOT)}:{n}: {hit!r}" for p in pages for n, hit in diary_lines(p.read_text())]
    assert not found, ("user pages hold history (issue numbers, dates, 'this box', 'as before'): state what is true "
                       "now, cite the one figure the reader needs, and move the history to CHANGELOG.md or a page of "
                       "the nav's Development section:\n" + "\n".join(found))


@pytest.mark.parametrize("text", ["Before issue 37, ...", "(issues 23 and 24)", "fixed in #37.",
                                  "[t](performance.md#progress-issue-23-item-1)", "measured 2026-12-08",
                                  "on 8 December 2026", "on Dec 8, 2026", "on this box", "open, as before",
                                  "the option of earlier versions"])
def test_diary_lines_catch_history(text):
    assert diary_lines(text), text


@pytest.mark.parametrize("text", ["[v](metrics.md#verdicts)", "#SBATCH --time=04:00:00", "#!/bin/bash",
                                  "# 1 GPU", "step 1200 of 2026 steps", "an issue with the disk", "x#1"])
def test_diary_lines_leave_the_rest(text):
    assert not diary_lines(text), text
