"""MkDocs hook: the reference pages' tables, generated from the code at every build, so they cannot go stale.

A page under docs/reference/ holds its hand-written introduction and a marker line, `<!-- reference:cli -->` or
`<!-- reference:config -->`; this hook replaces the marker with the CLI reference (every command, argument and
option of the typer app, with the help text `--help` prints) or the configuration reference (every field of the
pydantic models, with its type, default, bounds and description). A model field without a description is a
warning, so `mkdocs build --strict` fails until it has one (`Field(description=...)`).

The tables are HTML built here (code spans of the help texts become <code>, the rest is escaped): help texts hold
`<name>`, `|` and `*`, which Markdown would read as markup."""

from __future__ import annotations

import html
import json
import logging
import re
import types
import typing
from typing import Any

from pydantic import BaseModel
from pydantic.fields import FieldInfo

log = logging.getLogger("mkdocs.hooks.reference")
MARKER = re.compile(r"^<!-- reference:(\w+) -->$", re.M)
CSS = "reference/tables.css"
LONG_DEFAULT = 24   # characters of a default shown in its own column; a longer one goes under the description


def on_config(config: Any) -> Any:
    """Add the tables' stylesheet (docs/reference/tables.css: names in a first column are not broken)."""
    if CSS not in config.extra_css:
        config.extra_css.append(CSS)
    return config


def on_page_markdown(markdown: str, page: Any, **_: Any) -> str:
    """Replace each reference marker of a page with its generated Markdown."""
    def render(m: re.Match) -> str:
        kind = m.group(1)
        if kind not in RENDERERS:
            log.warning("%s: unknown reference marker %r (known: %s)", page.file.src_uri, kind, ", ".join(RENDERERS))
            return m.group(0)
        return RENDERERS[kind]()
    return MARKER.sub(render, markdown)


# ---- shared ----------------------------------------------------------------------------------------------------

def inline(text: str) -> str:
    """Plain text as HTML: its `code` spans as <code>, everything else escaped."""
    parts = text.split("`")
    if len(parts) % 2 == 0:      # an unpaired backtick: no spans
        return html.escape(text)
    return "".join(f"<code>{html.escape(p)}</code>" if i % 2 else html.escape(p) for i, p in enumerate(parts))


def table(head: list[str], rows: list[list[str]], nowrap: int = 1) -> str:
    """An HTML table (cells already HTML), one block with no blank line, so Markdown passes it through. The first
    `nowrap` columns (names, types) do not wrap: an option's name broken at its hyphens reads as two."""
    def cell(i: int, c: str) -> str:
        return f'<td style="white-space: nowrap">{c}</td>' if i < nowrap else f"<td>{c}</td>"
    out = ["<table>", "<thead><tr>" + "".join(f"<th>{h}</th>" for h in head) + "</tr></thead>", "<tbody>"]
    out += ["<tr>" + "".join(cell(i, c) for i, c in enumerate(row)) + "</tr>" for row in rows]
    return "\n".join([*out, "</tbody>", "</table>"])


def paragraphs(text: str) -> str:
    """A help text or docstring as HTML paragraphs (a blank line separates them; other line breaks are spaces)."""
    paras = [" ".join(p.split()) for p in re.split(r"\n\s*\n", text.strip()) if p.strip()]
    return "\n".join(f"<p>{inline(p)}</p>" for p in paras)


# ---- the CLI ---------------------------------------------------------------------------------------------------

def cli_markdown() -> str:
    """Every command of `evaldag` (groups' subcommands included): its usage, help, arguments and options."""
    import typer.main

    from evaldag.cli import app

    root = typer.main.get_command(app)
    ctx = root.context_class(root, info_name="evaldag")
    parts = [paragraphs(root.help or ""), _params_table(root, ctx)]
    for sub, sub_ctx in _subcommands(root, ctx):
        depth = sub_ctx.command_path.count(" ")
        parts += [f"{'#' * (depth + 1)} {sub_ctx.command_path}", "```text\n" + sub.get_usage(sub_ctx) + "\n```",
                  paragraphs(sub.help or ""), _params_table(sub, sub_ctx)]
    return "\n\n".join(p for p in parts if p)


def _subcommands(cmd: Any, ctx: Any) -> list[tuple[Any, Any]]:
    """The visible subcommands under `cmd`, depth first, each with its context (for its usage and help records)."""
    found = []
    for name in getattr(cmd, "list_commands", lambda _: [])(ctx):
        sub = cmd.get_command(ctx, name)
        if sub is None or sub.hidden:
            continue
        sub_ctx = sub.context_class(sub, info_name=name, parent=ctx)
        found += [(sub, sub_ctx), *_subcommands(sub, sub_ctx)]
    return found


def _params_table(cmd: Any, ctx: Any) -> str:
    """A command's arguments and options (--help left out): name, value, description, details (default, range,
    environment variable), from the help records `--help` prints."""
    rows = []
    for param in cmd.get_params(ctx):
        record = None if param.hidden else param.get_help_record(ctx)
        if record is None or param.name == "help":
            continue
        names, text = record
        flags, _, value = names.partition(" <")       # "-n, --n <int range>", "--decide / --no-decide"
        help_text, _, extra = text.rpartition("  [") if text.endswith("]") else ("", "", "")
        if not help_text:                               # no "  [default: ...]" part
            help_text, extra = text, ""
        extra = extra.removesuffix("]")
        if param.param_type_name == "argument":
            extra = "; ".join(x for x in ("positional argument", extra) if x)
        details = f"<br><em>{inline(extra)}</em>" if extra else ""
        rows.append([f"<code>{html.escape(flags)}</code>", html.escape(value.removesuffix(">")),
                     inline(help_text) + details])
    return table(["argument or option", "value", "description"], rows, nowrap=2) if rows else ""


# ---- the configuration -----------------------------------------------------------------------------------------

def config_sections() -> list[tuple[str, str, type[BaseModel], str]]:
    """The models of the configuration reference: (heading, anchor, model, where a user writes it). The models are
    imported here, at build time, so the page shows the code being built."""
    from evaldag.decisions.adaptive import AdaptiveSettings
    from evaldag.events.checkpoint_event import CheckpointEvent
    from evaldag.request.config import (BenchmarkConfig, DatasetSource, EngineSettings, FieldMap, ModelConfig,
                                        SamplingConfig, SamplingOverrides)
    from evaldag.request.plan import EvalRequest
    from evaldag.scoring.rewards import RewardSpec

    return [
        ("Benchmark config", "benchmark-config", BenchmarkConfig,
         "`configs/benchmarks/<name>.yaml`, `$EVALDAG_CONFIGS_DIR/benchmarks/<name>.yaml`, or any file passed as "
         "`evaldag run ./mybench.yaml`"),
        ("dataset", "dataset", DatasetSource, "the benchmark config's `dataset:`"),
        ("fields", "fields", FieldMap, "the benchmark config's `fields:`"),
        ("sampling", "sampling", SamplingConfig, "the benchmark config's `sampling:`"),
        ("rewards", "rewards", RewardSpec, "each item of the benchmark config's `rewards:`"),
        ("Model config", "model-config", ModelConfig,
         "`configs/models/<alias>.yaml` or `$EVALDAG_CONFIGS_DIR/models/<alias>.yaml`"),
        ("Evaluation request", "evaluation-request", EvalRequest,
         "the parameters of the `eval/<benchmark>` and `eval/suite` deployments (`evaldag run` sets most of them from "
         "its options); the flow also takes `benchmarks` (several at once, `eval/suite`) and `dispatch`"),
        ("engine_settings", "engine-settings", EngineSettings,
         "a request's or a checkpoint event's `engine_settings`, over the model config's"),
        ("Sampling overrides", "sampling-overrides", SamplingOverrides,
         "a request's or a checkpoint event's `sampling`, over the benchmark config's"),
        ("adaptive", "adaptive", AdaptiveSettings, "a request's `adaptive`"),
        ("Checkpoint event", "checkpoint-event", CheckpointEvent,
         "the payload of an `evaldag.checkpoint.saved` event (what `CheckpointNotifier.notify` sends)"),
    ]


def config_markdown() -> str:
    """One section per model: where it is written, its docstring, and a row per field."""
    sections = config_sections()
    anchors = {model: anchor for _, anchor, model, _ in sections}
    parts = []
    for heading, anchor, model, where in sections:
        rows = []
        for name, field in model.model_fields.items():
            if not field.description:
                log.warning("%s.%s has no description: give it Field(description=...) in %s (the configuration "
                            "reference shows it)", model.__name__, name, model.__module__)
            default, limits = default_html(field), bounds(field)
            notes = [f"<em>{inline(limits)}</em>"] if limits else []
            if len(re.sub(r"<[^>]+>", "", default)) > LONG_DEFAULT:   # a narrow column: the value under the text
                notes.append(f"default: {default}")
                default = "<em>below</em>"
            rows.append([f"<code>{html.escape(name)}</code>", type_html(field.annotation, anchors), default,
                         "<br>".join([inline(field.description or ""), *notes])])
        parts += [f"## {heading} {{#{anchor}}}", f"<p>Where: {inline(where)}.</p>",
                  paragraphs(model.__doc__ or ""),
                  table(["field", "type", "default", "description (and bounds)"], rows)]
    return "\n\n".join(p for p in parts if p)


def type_html(annotation: Any, anchors: dict[type, str]) -> str:
    """A field's type as readable HTML: `int | null`, `list[str]`, `"hf" | "vllm"`, a link for a nested model."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Annotated:
        return type_html(args[0], anchors)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_html(a, anchors) for a in args)
    if origin is typing.Literal:
        return " | ".join(f"<code>{html.escape(json.dumps(a))}</code>" for a in args)
    if origin in (list, dict, tuple, set):
        inner = ", ".join(type_html(a, anchors) for a in args)
        return f"{origin.__name__}[{inner}]" if args else origin.__name__
    if annotation is type(None):
        return "null"
    if annotation is typing.Any:
        return "any"
    if isinstance(annotation, type) and annotation in anchors:
        return f'<a href="#{anchors[annotation]}">{annotation.__name__}</a>'
    return html.escape(getattr(annotation, "__name__", str(annotation)))


def default_html(field: FieldInfo) -> str:
    """The field's default as YAML would write it (`null`, `false`, a list), or `required`."""
    if field.is_required():
        return "<em>required</em>"
    value = field.get_default(call_default_factory=True)
    if isinstance(value, BaseModel):
        value = value.model_dump()
    if isinstance(value, list):
        value = [v.model_dump() if isinstance(v, BaseModel) else v for v in value]
    return f"<code>{html.escape(json.dumps(value, default=str))}</code>"


def bounds(field: FieldInfo) -> str:
    """The field's constraints (ge, le, gt, lt, lengths, pattern), its own and those of its union's members."""
    metadata = list(field.metadata)
    for arg in typing.get_args(field.annotation):
        if typing.get_origin(arg) is typing.Annotated:
            metadata += typing.get_args(arg)[1:]
    words = {"ge": ">=", "le": "<=", "gt": ">", "lt": "<", "min_length": "length >=", "max_length": "length <="}
    found = []
    for item in metadata:
        for attr, word in words.items():
            if getattr(item, attr, None) is not None:
                found.append(f"{word} {getattr(item, attr)}")
        if getattr(item, "pattern", None):
            found.append(f"pattern `{item.pattern}`")
        if getattr(item, "strict", None):
            found.append("strict type")
    return ", ".join(dict.fromkeys(found))


RENDERERS = {"cli": cli_markdown, "config": config_markdown}
