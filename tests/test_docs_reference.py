"""The generated reference pages hold all of the code they describe: the site is built once into a temporary folder
and its HTML is read back. Every command, argument and option of the `evaldag` CLI is in its section of the CLI
reference, every field of the configuration models (with its description) in its model's section of the
configuration reference, and every public name of `evaldag.client` in the Python API page.

The lists checked are read from the code here, not from the hook that renders the pages (docs/hooks/reference.py),
so a command, option, field or model the hook skips fails this test. Fast (no stack, no model): one build, a few
seconds."""

from __future__ import annotations

import html
import os
import re
import subprocess
from pathlib import Path

import pytest
import typer.main
from pydantic import BaseModel

from test_docs import _mkdocs

ROOT = Path(__file__).resolve().parent.parent
# A heading with an id opens a section that runs to the next heading of any level.
_HEADING = re.compile(r"<h([1-6])[^>]*\bid=\"([^\"]+)\"[^>]*>")


def configuration_models() -> dict[str, type[BaseModel]]:
    """The models the configuration reference must show, by the anchor of their section."""
    from evaldag.decisions.adaptive import AdaptiveSettings
    from evaldag.events.checkpoint_event import CheckpointEvent
    from evaldag.request.config import (BenchmarkConfig, DatasetSource, EngineSettings, FieldMap, ModelConfig,
                                        SamplingConfig, SamplingOverrides)
    from evaldag.request.plan import EvalRequest
    from evaldag.scoring.rewards import RewardSpec

    return {"benchmark-config": BenchmarkConfig, "dataset": DatasetSource, "fields": FieldMap,
            "sampling": SamplingConfig, "rewards": RewardSpec, "model-config": ModelConfig,
            "evaluation-request": EvalRequest, "engine-settings": EngineSettings,
            "sampling-overrides": SamplingOverrides, "adaptive": AdaptiveSettings, "checkpoint-event": CheckpointEvent}


def cli_commands() -> dict[str, list[str]]:
    """Every visible command path of the CLI (`evaldag benchmarks check`) and its parameters' names: an option's
    spellings (`--decide`, `--no-decide`, `-n`), an argument's name."""
    root = typer.main.get_command(__import__("evaldag.cli", fromlist=["app"]).app)
    found: dict[str, list[str]] = {}

    def walk(cmd: object, ctx: object) -> None:
        for name in getattr(cmd, "list_commands", lambda _: [])(ctx):
            sub = cmd.get_command(ctx, name)
            if sub.hidden:
                continue
            sub_ctx = sub.context_class(sub, info_name=name, parent=ctx)
            found[sub_ctx.command_path] = [n for p in sub.params if not p.hidden and p.name != "help"
                                           for n in ([*p.opts, *p.secondary_opts] if p.param_type_name == "option"
                                                     else [p.name])]
            walk(sub, sub_ctx)

    walk(root, root.context_class(root, info_name="evaldag"))
    return found


def sections(page: str) -> dict[str, str]:
    """A page's HTML cut at each heading with an id: {id: its title and the HTML up to the next heading}."""
    marks = list(_HEADING.finditer(page))
    return {m.group(2): page[m.end():nxt.start() if nxt else len(page)]
            for m, nxt in zip(marks, [*marks[1:], None])}


def plain(fragment: str) -> str:
    """The text of an HTML fragment: a cell, paragraph or heading boundary a space, other tags dropped (`<code>`
    keeps its text in its sentence), entities read, white space single."""
    spaced = re.sub(r"</?(?:td|th|tr|p|li|h[1-6]|br)\b[^>]*>", " ", fragment)
    return " ".join(html.unescape(re.sub(r"<[^>]+>", "", spaced)).split())


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """The site, built once with the repository's mkdocs.yml (strictness is test_docs.py's business: here, the
    content of the reference pages)."""
    out = tmp_path_factory.mktemp("site")
    proc = subprocess.run([*_mkdocs(), "build", "--no-strict", "--config-file", str(ROOT / "mkdocs.yml"),
                           "--site-dir", str(out)], cwd=ROOT, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"mkdocs build failed:\n{proc.stdout}{proc.stderr}"
    return out


def page(site: Path, name: str) -> str:
    path = site / "reference" / name / "index.html"
    assert path.is_file(), f"the site has no reference/{name}/ page: is docs/reference/{name}.md in mkdocs.yml's nav?"
    text = path.read_text()
    assert "<!-- reference:" not in text, f"reference/{name}: a marker was left unrendered (docs/hooks/reference.py)"
    return text


def test_the_cli_reference_has_every_command_and_option(site):
    found = sections(page(site, "cli"))
    missing = []
    for path, params in cli_commands().items():
        anchor = path.replace(" ", "-")
        if anchor not in found:
            missing.append(f"command `{path}` (no heading #{anchor})")
            continue
        text = plain(found[anchor])
        missing += [f"`{path}`: {name}" for name in params if not re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])",
                                                                          text)]
    assert not missing, "docs/reference/cli.md's generated page lacks:\n" + "\n".join(missing)


def test_the_configuration_reference_has_every_field_with_its_description(site):
    found = sections(page(site, "configuration"))
    missing = []
    for anchor, model in configuration_models().items():
        if anchor not in found:
            missing.append(f"{model.__name__} (no section #{anchor})")
            continue
        rows = {plain(m.group(1)): plain(m.group(2))
                for m in re.finditer(r"<tr><td[^>]*><code>(.*?)</code></td>(.*?)</tr>", found[anchor], re.S)}
        for name, field in model.model_fields.items():
            if name not in rows:
                missing.append(f"{model.__name__}.{name}")
            elif not field.description or " ".join(field.description.replace("`", "").split()) not in rows[name]:
                missing.append(f"{model.__name__}.{name}'s description (give it Field(description=...))")
    assert not missing, "docs/reference/configuration.md's generated page lacks:\n" + "\n".join(missing)


def test_the_python_api_reference_has_every_public_name_of_the_client(site):
    import evaldag.client

    text = page(site, "python-api")
    missing = [name for name in evaldag.client.__all__ if f'id="evaldag.client.{name}"' not in text]
    assert not missing, f"docs/reference/python-api.md lacks evaldag.client's {missing} (add a `::: ` line each)"


def test_sections_cut_a_page_at_its_headings():
    text = '<h2 id="a">A</h2><p>one</p><h3 id="a-b">B</h3><p>two</p>'
    assert sections(text) == {"a": "A</h2><p>one</p>", "a-b": "B</h3><p>two</p>"}
    assert plain("<td>(<code>--n</code>)</td><td>&lt;x&gt;</td>") == "(--n) <x>"
