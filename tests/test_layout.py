"""The layout docs/layout.md describes holds: packages by concept, no import cycles, the core free of the runtime.

Imports are read from the source (ast), lazy ones inside functions included: a cycle hidden in a function body still
means two modules that cannot be understood apart."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "evaldag"


def _module_name(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in PACKAGE.rglob("*.py")}


def _imports(path: Path, known: set[str]) -> set[str]:
    """The evaldag modules `path` imports (`from evaldag.a import b` counts as evaldag.a.b when that is a module)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "evaldag":
            names = [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names if a.name.split(".")[0] == "evaldag"]
        else:
            continue
        for name in names:
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name:
                out.add(name)
    return out


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    graph = {}
    for name, path in mods.items():
        # a package's __init__ may re-export its own modules; that is not a dependency between concepts
        graph[name] = {m for m in _imports(path, set(mods)) if m != name and not m.startswith(name + ".")}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), i.e. the import cycles."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_module_of_evaldag_imports_one_that_imports_it_back():
    cycles = _cycles(_graph())
    assert not cycles, f"import cycles (each a group of modules that import each other): {cycles}"


def test_the_core_never_imports_the_runtime():
    """evaldag.runtime (Prefect, processes, servers) composes the core; only it and the CLI (evaldag.cli) may
    import it."""
    offenders = {m: sorted(d for d in deps if d.startswith("evaldag.runtime"))
                 for m, deps in _graph().items()
                 if not m.startswith("evaldag.runtime") and m != "evaldag.cli" and not m.startswith("evaldag.cli.")}
    assert not {m: d for m, d in offenders.items() if d}


def test_the_client_needs_nothing_but_the_input_rules():
    """Training scripts import evaldag.client: it may lean on evaldag.request.rules (standard library) and no more."""
    graph = _graph()
    deps = {d for m, ds in graph.items() if m.startswith("evaldag.client") for d in ds
            if not d.startswith("evaldag.client")}
    assert deps <= {"evaldag.request.rules", "evaldag.errors"}, deps


def test_the_layout_page_names_every_package_and_no_flat_core_module_is_left():
    layout = (ROOT / "docs" / "layout.md").read_text()
    packages = sorted(p.parent.name for p in PACKAGE.glob("*/__init__.py"))
    missing = [p for p in packages if f"| `evaldag/{p}/` |" not in layout]
    assert not missing, f"docs/layout.md has no line for: {missing}"
    flat = sorted(p.stem for p in PACKAGE.glob("*.py"))
    assert flat == ["__init__", "errors", "paths"], (
        f"modules left flat in evaldag/ (put each in the package of its concept): {flat}")


@pytest.mark.parametrize("package", ["request", "events", "client", "pipeline", "storage", "scoring", "decisions",
                                     "tracking", "engines", "runtime"])
def test_each_package_says_what_it_holds(package):
    doc = ast.get_docstring(ast.parse((PACKAGE / package / "__init__.py").read_text()))
    assert doc and len(doc) > 40, f"evaldag/{package}/__init__.py needs a docstring saying what the package holds"


# Size bounds a newcomer can read (issue 42): a module of evaldag/, flows/ or tasks/ at most MAX_MODULE_LINES lines,
# a function (from its `def` line to its last, docstring included, decorators not) at most MAX_FUNCTION_LINES.
MAX_MODULE_LINES, MAX_FUNCTION_LINES = 450, 60
# Known exceptions, each with its reason. An entry that no longer exceeds the bound fails the test, so the list
# stays true; remove it once the module or function is split.
LONG_MODULES: dict[str, str] = {}
LONG_FUNCTIONS: dict[str, str] = {
    "evaldag/cli/__init__.py:run": "one typer option per parameter, declared in the signature (typer's way)",
    "evaldag/cli/worker.py:worker": "one typer option per parameter, declared in the signature (typer's way)",
    "flows/eval_flow.py:eval_flow": "one flat parameter each, so `-p key=value` works from Prefect's CLI and UI",
}


def _sizes() -> tuple[dict[str, int], dict[str, int]]:
    """(lines of each module, lines of each function as 'path:Qualified.name'), over evaldag/, flows/ and tasks/."""
    modules, functions = {}, {}
    for folder in ("evaldag", "flows", "tasks"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            text = path.read_text()
            modules[rel] = len(text.splitlines())

            def visit(node: ast.AST, prefix: str) -> None:
                for child in ast.iter_child_nodes(node):
                    if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                        name = f"{prefix}{child.name}"
                        if not isinstance(child, ast.ClassDef):
                            functions[f"{rel}:{name}"] = child.end_lineno - child.lineno + 1
                        visit(child, name + ".")

            visit(ast.parse(text), "")
    return modules, functions


def test_modules_and_functions_stay_short():
    modules, functions = _sizes()
    long_modules = {m: n for m, n in modules.items() if n > MAX_MODULE_LINES and m not in LONG_MODULES}
    long_functions = {f: n for f, n in functions.items() if n > MAX_FUNCTION_LINES and f not in LONG_FUNCTIONS}
    assert not long_modules, (f"modules over {MAX_MODULE_LINES} lines (split them by job, or list one in "
                              f"LONG_MODULES with the reason): {long_modules}")
    assert not long_functions, (f"functions over {MAX_FUNCTION_LINES} lines (split them, or list one in "
                                f"LONG_FUNCTIONS with the reason): {long_functions}")
    stale = ([m for m in LONG_MODULES if modules.get(m, 0) <= MAX_MODULE_LINES]
             + [f for f in LONG_FUNCTIONS if functions.get(f, 0) <= MAX_FUNCTION_LINES])
    assert not stale, f"listed as too long but no longer are (remove them from the exceptions): {stale}"
