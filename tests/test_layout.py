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
    """evaldag.runtime (Prefect, processes, servers) composes the core; only it and the CLI may import it."""
    offenders = {m: sorted(d for d in deps if d.startswith("evaldag.runtime"))
                 for m, deps in _graph().items()
                 if not m.startswith("evaldag.runtime") and m != "evaldag.cli"}
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
    assert flat == ["__init__", "cli", "errors", "paths"], (
        f"modules left flat in evaldag/ (put each in the package of its concept): {flat}")


@pytest.mark.parametrize("package", ["request", "events", "client", "pipeline", "storage", "scoring", "decisions",
                                     "tracking", "engines", "runtime"])
def test_each_package_says_what_it_holds(package):
    doc = ast.get_docstring(ast.parse((PACKAGE / package / "__init__.py").read_text()))
    assert doc and len(doc) > 40, f"evaldag/{package}/__init__.py needs a docstring saying what the package holds"
