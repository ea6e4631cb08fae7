"""The documentation holds together: the MkDocs site builds with --strict and no warning (no broken link, anchor or
page left out of the nav), the README stays a few screens long, and every README link into docs/ lands on a file.

Fast (no stack, no model): the build takes a few seconds."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README_MAX_LINES = 200

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
