"""The trainers' client as a distribution of its own (client/pyproject.toml, `pip install <checkout>/client`): built
from the same source files as the full package, it holds evaldag.client and the standard-library rules it imports,
nothing of the server side, and installs into a fresh environment without adding anything but itself.

Offline: the wheel is built with this environment's setuptools (--no-build-isolation), and installed with this
environment's pip into a bare venv (`pip --python`), so the venv holds exactly what the install added."""

from __future__ import annotations

import importlib.metadata
import shutil
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# what evaldag.client imports beyond itself: the event's input rules, shared with the server (standard library)
SHARED = {"evaldag/__init__.py", "evaldag/request/__init__.py", "evaldag/request/rules.py",
          "evaldag/request/layouts.py"}
HEAVY = ("transformers", "torch", "pydantic", "prefect", "mlflow", "fsspec", "polars", "httpx")


def _pip(python: Path, *args: str) -> str:
    done = subprocess.run([sys.executable, "-m", "pip", "--disable-pip-version-check", "--python", str(python),
                           *args], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_client_installs_alone_from_the_same_source(tmp_path):
    # client/ beside the real package (a link), so the build's scratch folders stay out of the checkout
    shutil.copytree(REPO / "client", tmp_path / "client", ignore=shutil.ignore_patterns("build", "*.egg-info"))
    (tmp_path / "evaldag").symlink_to(REPO / "evaldag")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "--no-index",
                    "-w", str(tmp_path / "dist"), str(tmp_path / "client")], check=True)
    [wheel] = (tmp_path / "dist").glob("evaldag_client-*.whl")
    modules = {n for n in zipfile.ZipFile(wheel).namelist() if n.endswith(".py")}
    client = {f"evaldag/client/{p.name}" for p in (REPO / "evaldag" / "client").glob("*.py")}
    assert modules == client | SHARED, sorted(modules ^ (client | SHARED))
    assert wheel.name.split("-")[1] == importlib.metadata.version("evaldag")      # one version for both

    venv.create(tmp_path / "venv", with_pip=False)
    python = tmp_path / "venv" / "bin" / "python"
    before = set(_pip(python, "list", "--format=freeze").split())
    _pip(python, "install", "--no-index", str(wheel))
    added = set(_pip(python, "list", "--format=freeze").split()) - before
    assert added == {f"evaldag-client=={importlib.metadata.version('evaldag')}"}, added
    assert "No broken requirements" in _pip(python, "check")

    probe = f"""
import sys
from evaldag.client import CheckpointNotifier, EvaldagCallback, EvalTrigger
heavy = sorted(m for m in sys.modules if m.split(".")[0] in {HEAVY!r})
assert not heavy, heavy
try:
    EvaldagCallback(benchmarks=["gsm8k"])
except ImportError as e:
    assert "pip install transformers" in str(e), e
else:
    raise AssertionError("an EvaldagCallback without transformers")
print("ok")
"""
    done = subprocess.run([str(python), "-c", probe], capture_output=True, text=True, cwd=tmp_path)
    assert done.stdout.strip() == "ok", done.stdout + done.stderr
