"""The docs cannot drift from the code: every `evaldag` command and option, `EVALDAG_*` variable, make target, Python
import path and repository path that README.md and docs/**/*.md name in code (inline spans and fenced blocks) exists.

Also: the environment table (docs/reference/environment.md) lists exactly the `EVALDAG_*` variables the code reads,
and every error message docs/troubleshooting.md quotes is still a literal in the source.

Fast (no stack, no model). Prose is not checked, only code; a name that is legitimately not in the code (a user's own
path such as /ckpts/..., a placeholder such as <name>, a URL) is skipped by the rules below, not by a list of
exceptions."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import re
from dataclasses import dataclass
from pathlib import Path

import pytest
import typer.main

ROOT = Path(__file__).resolve().parent.parent
SOURCE_DIRS = ("evaldag", "flows", "tasks")
ENV_PAGE = ROOT / "docs" / "reference" / "environment.md"
TROUBLESHOOTING = ROOT / "docs" / "troubleshooting.md"

_FENCE = re.compile(r"^\s*(```|~~~)")
_SPAN = re.compile(r"(`+)(.+?)\1", re.S)
_VAR = re.compile(r"\bEVALDAG_[A-Z0-9_]*[A-Z0-9]\b")
# Shell segments: a comment ends a line, `&&`, `||`, `;`, `|` and `$(` start a new command.
_COMMENT = re.compile(r"(?:^|\s)#.*$")
_SEPARATOR = re.compile(r"&&|\|\||;|\||\$\(|\)")
# What may come before the command word: a prompt, environment assignments, a folder (.venv/bin/evaldag).
_PREFIX = re.compile(r"^\s*(?:\$\s+)?(?:[A-Z_][A-Z0-9_]*=\S*\s+)*(?:\S*/)?")
_MODULE = re.compile(r"(?<![\w./-])evaldag(?:\.[A-Za-z_]\w*)+")
_FROM_IMPORT = re.compile(r"\bfrom\s+(evaldag(?:\.\w+)*)\s+import\s+\(?([\w\s,]+)")
# A repository path: a tracked top-level folder, a slash, then path characters (placeholders such as <x>, globs and
# ${VAR} end the match or mark it as not a literal path).
_TOP_DIRS = ("evaldag", "flows", "tasks", "tests", "deployments", "configs", "docs", "bench", "client", "examples")
_PATH = re.compile(r"(?<![\w./~:-])(?:\./)?((?:" + "|".join(_TOP_DIRS) + r")/[\w./-]*)([<*{$]?)")


@dataclass(frozen=True)
class Code:
    """One piece of code a doc shows: its text and where it starts."""
    file: str
    line: int
    text: str


def doc_files() -> list[Path]:
    """README.md, every page under docs/, and the Dockerfile (its comments' code spans read as a page's)."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")), ROOT / "deployments" / "Dockerfile"]


def code_pieces(path: Path) -> list[Code]:
    """The fenced blocks (one piece per logical line, backslash continuations joined) and inline code spans (a span
    may run over a line break inside its paragraph, as Markdown allows)."""
    rel = str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else path.name
    pieces: list[Code] = []
    in_fence, pending, pending_line = False, "", 0
    para: list[tuple[int, str]] = []

    def flush() -> None:
        text = "\n".join(line for _, line in para)
        for m in _SPAN.finditer(text):
            pieces.append(Code(rel, para[0][0] + text.count("\n", 0, m.start()), m.group(2).replace("\n", " ")))
        para.clear()

    for n, line in enumerate(path.read_text().splitlines(), start=1):
        if _FENCE.match(line):
            flush()
            in_fence = not in_fence
            continue
        if in_fence:
            if not pending:
                pending_line = n
            if line.rstrip().endswith("\\"):
                pending += line.rstrip()[:-1] + " "
                continue
            pieces.append(Code(rel, pending_line, pending + line))
            pending = ""
        elif line.strip():
            para.append((n, line))
        else:
            flush()
    flush()
    return pieces


def all_code() -> list[Code]:
    return [c for p in doc_files() for c in code_pieces(p)]


# ---- the code side ---------------------------------------------------------------------------------------------

def cli_tree() -> object:
    """The typer app's click command tree (typer vendors click, so its groups are not `click.Group`s)."""
    from evaldag.cli import app
    return typer.main.get_command(app)


def source_files() -> list[Path]:
    return [p for d in SOURCE_DIRS for p in (ROOT / d).rglob("*") if p.is_file() and p.suffix in (".py", ".sh")]


def commands(piece: str, program: str) -> list[list[str]]:
    """The argument lists of every shell command in `piece` whose program is `program` (comments dropped)."""
    found = []
    for line in piece.splitlines():
        for segment in _SEPARATOR.split(_COMMENT.sub("", line)):
            words = segment[_PREFIX.match(segment).end():].split()
            if words and words[0] == program:
                found.append(words[1:])
    return found


def code_variables() -> set[str]:
    """Every full `EVALDAG_*` name in the sources (prefixes such as `EVALDAG_DEFAULT_` excluded by the regex)."""
    return {v for p in source_files() for v in _VAR.findall(p.read_text())}


def harness_variables() -> set[str]:
    """The variables of the test and benchmark harness (tests/, bench/, the Makefile): docs for contributors name
    them, the user's environment table does not list them."""
    files = [ROOT / "Makefile", *(p for d in ("tests", "bench") for p in (ROOT / d).rglob("*.py")
                                   if p.resolve() != Path(__file__).resolve())]
    return {v for p in files for v in _VAR.findall(p.read_text())}


def make_targets() -> set[str]:
    text = (ROOT / "Makefile").read_text()
    targets = set()
    for m in re.finditer(r"^([\w.-]+(?:[ \t]+[\w.-]+)*)[ \t]*:(?!=)", text, re.M):
        targets.update(m.group(1).split())
    return targets


def source_string_literals() -> list[str]:
    """The string literals of the Python sources (f-strings contribute their literal parts)."""
    out: list[str] = []
    for p in source_files():
        if p.suffix != ".py":
            continue
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                out.append(node.value)
    return out


# ---- the checks -----------------------------------------------------------------------------------------------

def cli_mismatches(pieces: list[Code], root: object) -> list[str]:
    """Each `evaldag <command> [--option ...]` whose command or option the typer app lacks."""
    bad = []
    for c in pieces:
        for words in commands(c.text, "evaldag"):
            cmd, ctx_name = root, "evaldag"
            i = 0
            while hasattr(cmd, "commands") and i < len(words) and not words[i].startswith("-"):
                word = words[i]
                if not re.fullmatch(r"[a-z][a-z0-9-]*", word):
                    break  # a placeholder or a value: nothing more to check on this line
                sub = cmd.commands.get(word)
                if sub is None:
                    bad.append(f"{c.file}:{c.line}: `{ctx_name} {word}`: no such command "
                               f"(commands: {', '.join(sorted(cmd.commands))})")
                    cmd = None
                    break
                cmd, ctx_name, i = sub, f"{ctx_name} {word}", i + 1
            if cmd is None:
                continue
            known = {o for p in cmd.params for o in (*p.opts, *p.secondary_opts)} | {"--help"}
            for word in words[i:]:
                if not word.startswith("--") or word == "--":
                    continue
                opt = word.split("=", 1)[0].rstrip(",.:")
                if re.fullmatch(r"--[a-z0-9][a-z0-9-]*", opt) and opt not in known:
                    bad.append(f"{c.file}:{c.line}: `{ctx_name} {opt}`: no such option")
    return bad


def variable_mismatches(pieces: list[Code], known: set[str]) -> list[str]:
    return [f"{c.file}:{c.line}: `{v}` is read nowhere in {', '.join(SOURCE_DIRS)}/"
            for c in pieces for v in _VAR.findall(c.text) if v not in known]


def make_mismatches(pieces: list[Code], targets: set[str]) -> list[str]:
    bad = []
    for c in pieces:
        for words in commands(c.text, "make"):
            for word in words:
                if "=" in word or word.startswith("-"):
                    continue
                if not re.fullmatch(r"[a-z][\w-]*", word):
                    break
                if word not in targets:
                    bad.append(f"{c.file}:{c.line}: `make {word}`: the Makefile has no such target")
    return bad


def _resolves(dotted: str) -> bool:
    """A module, or a module's attribute chain (evaldag.client.Client.notify)."""
    parts = dotted.split(".")
    for k in range(len(parts), 0, -1):
        name = ".".join(parts[:k])
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            spec = None
        if spec is None:
            continue
        obj = importlib.import_module(name)
        for attr in parts[k:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def import_mismatches(pieces: list[Code]) -> list[str]:
    bad = []
    for c in pieces:
        names = set()
        for m in _FROM_IMPORT.finditer(c.text):
            imported = re.sub(r"\s+as\s+\w+", "", m.group(2))  # `import x as y` imports x
            names |= {f"{m.group(1)}.{n}" for n in re.split(r"[\s,]+", imported.strip()) if n}
        for m in _MODULE.finditer(c.text):
            end = m.end()
            if end < len(c.text) and c.text[end] in "/-":
                continue  # a file name such as evaldag.egg-info/, not a module
            first = m.group(0).split(".")[1]
            if (ROOT / "evaldag" / first).is_dir() or (ROOT / "evaldag" / f"{first}.py").is_file():
                names.add(m.group(0))  # else a tag, event or entry-point group name (evaldag.train_run)
        for name in sorted(names):
            if not _resolves(name):
                bad.append(f"{c.file}:{c.line}: `{name}` does not import")
    return bad


def path_mismatches(pieces: list[Code]) -> list[str]:
    """Each repository path that does not exist. A block's header comment (`# configs/models/mine.yaml` as the first
    line) names the file the block shows, often the reader's own: only its folder must exist."""
    bad = []
    for c in pieces:
        header = re.fullmatch(r"\s*#\s*(\S+)\s*", c.text)
        for m in _PATH.finditer(c.text):
            path, tail = m.group(1).rstrip("."), m.group(2)
            if tail:
                continue  # a placeholder or glob: not one file
            if header and header.group(1).endswith(path):
                path = str(Path(path).parent)
            if not (ROOT / path).exists():
                bad.append(f"{c.file}:{c.line}: `{path}` does not exist in the repository")
    return bad


def test_docs_name_only_commands_and_options_the_cli_has():
    bad = cli_mismatches(all_code(), cli_tree())
    assert not bad, "docs name evaldag commands or options the CLI lacks:\n" + "\n".join(bad)


def test_docs_name_only_variables_the_code_reads():
    bad = variable_mismatches(all_code(), code_variables() | harness_variables())
    assert not bad, "docs name EVALDAG_* variables the code does not read:\n" + "\n".join(bad)


def test_docs_name_only_make_targets_the_makefile_has():
    bad = make_mismatches(all_code(), make_targets())
    assert not bad, "\n".join(bad)


def test_docs_name_only_import_paths_that_import():
    bad = import_mismatches(all_code())
    assert not bad, "\n".join(bad)


def test_docs_name_only_repository_paths_that_exist():
    bad = path_mismatches(all_code())
    assert not bad, "\n".join(bad)


def environment_table() -> set[str]:
    """The variables in the first column of the tables of docs/reference/environment.md (the page is the table)."""
    return {v for row in re.findall(r"^\|([^|\n]*)\|", ENV_PAGE.read_text(), re.M) for v in _VAR.findall(row)}


def test_the_environment_table_lists_every_variable_the_code_reads():
    rows, code = environment_table(), code_variables()
    missing, stale = sorted(code - rows), sorted(rows - code)
    assert not missing and not stale, (f"docs/reference/environment.md: add rows for {missing}; "
                                       f"remove the rows of {stale} (read nowhere in {', '.join(SOURCE_DIRS)}/)")


def troubleshooting_quotes() -> list[tuple[int, str]]:
    """The messages docs/troubleshooting.md quotes: the lines of its blocks fenced as ```text."""
    quotes, in_block = [], False
    for n, line in enumerate(TROUBLESHOOTING.read_text().splitlines(), start=1):
        if line.strip().startswith("```"):
            in_block = line.strip() == "```text" and not in_block
            continue
        if in_block and line.strip():
            quotes.append((n, line.strip()))
    return quotes


def test_troubleshooting_quotes_messages_the_code_still_prints():
    quotes = troubleshooting_quotes()
    assert len(quotes) >= 10, "docs/troubleshooting.md quotes fewer than ten messages"
    literals = source_string_literals()
    gone = [f"docs/troubleshooting.md:{n}: {q!r}" for n, q in quotes if not any(q in s for s in literals)]
    assert not gone, "messages quoted in the troubleshooting page are no longer in the code:\n" + "\n".join(gone)


@pytest.mark.parametrize("planted, check", [
    ("`evaldag run --no-such-option`", "cli"), ("`evaldag frobnicate`", "cli"),
    ("`EVALDAG_WARM_START`", "var"), ("`make setup-vllm`", "make"),
    ("`from evaldag.prefect_results import x`", "import"), ("`tests/test_lost_node_e2e.py`", "path"),
])
def test_each_check_catches_a_planted_mismatch(tmp_path, planted, check):
    page = tmp_path / "page.md"
    page.write_text(f"# A page\n\nRun {planted} now.\n")
    pieces = code_pieces(page)
    found = {"cli": lambda: cli_mismatches(pieces, cli_tree()),
             "var": lambda: variable_mismatches(pieces, code_variables()),
             "make": lambda: make_mismatches(pieces, make_targets()),
             "import": lambda: import_mismatches(pieces),
             "path": lambda: path_mismatches(pieces)}[check]()
    assert found and found[0].startswith("page.md:3:"), found


def test_what_is_legitimately_not_in_the_code_is_not_flagged(tmp_path):
    """A user's own paths, placeholders, URLs, other programs' words and tag names pass every check."""
    page = tmp_path / "page.md"
    page.write_text(
        "# A page\n\n"
        "```bash\n"
        "# configs/models/my-policy.yaml\n"
        "EVALDAG_CHECKPOINT_ROOTS=/ckpts .venv/bin/evaldag run math500 --checkpoint /ckpts/run-42/checkpoint-1200 \\\n"
        "  --step 1200   # evaldag reads the folder\n"
        "kubectl -n evaldag create secret generic evaldag-results --from-literal=A=b\n"
        "pip install evaldag && make test PYTEST_ARGS=-x\n"
        "```\n\n"
        "Tags `evaldag.train_run` and `evaldag.checkpoint.saved`; a file `configs/benchmarks/<name>.yaml`; "
        "see https://github.com/o/evaldag/blob/main/tests/test_gone.py and `/opt/evaldag/tests/x.py`.\n")
    pieces = code_pieces(page)
    assert not cli_mismatches(pieces, cli_tree())
    assert not variable_mismatches(pieces, code_variables())
    assert not make_mismatches(pieces, make_targets())
    assert not import_mismatches(pieces)
    assert not path_mismatches(pieces)
