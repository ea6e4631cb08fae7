"""constraints.txt holds the exact versions of the server side (pyproject.toml has ranges): `make setup` installs
with it, so the environment the tests run in holds exactly what it pins, and every pin is within pyproject's range."""

from __future__ import annotations

import importlib.metadata
import re
import sys
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parent.parent
WORKERS = Path(sys.prefix) / "opt" / "prefect-workers"   # prefect-kubernetes and prefect-docker (see the Makefile)


def _pins() -> dict[str, str]:
    pins = {}
    for line in (REPO / "constraints.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, version = re.fullmatch(r"([A-Za-z0-9_.\-]+)==(\S+)", line).groups()
            pins[canonicalize_name(name)] = version
    return pins


def _installed(name: str) -> str | None:
    for path in (None, [str(WORKERS)]):
        try:
            return importlib.metadata.distribution(name).version if path is None else next(
                importlib.metadata.distributions(name=name, path=path)).version
        except (importlib.metadata.PackageNotFoundError, StopIteration):
            continue
    return None


def test_environment_holds_what_constraints_pin():
    wrong = {name: (version, _installed(name)) for name, version in _pins().items() if _installed(name) != version}
    assert not wrong, f"pinned, installed: {wrong}; run `make setup` (or fix constraints.txt)"


def test_pyproject_has_ranges_that_admit_the_pins():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    reqs = [Requirement(r) for r in project["dependencies"] + project["optional-dependencies"]["test"]]
    exact = [str(r) for r in reqs if any(s.operator == "==" for s in r.specifier)]
    assert not exact, f"exact pins belong in constraints.txt, not the package's metadata: {exact}"
    pins = _pins()
    for r in reqs:
        name = canonicalize_name(r.name)
        if name in pins:
            assert r.specifier.contains(pins[name]), f"constraints.txt pins {name}=={pins[name]} outside {r}"
    assert {"prefect", "mlflow"} <= pins.keys()
