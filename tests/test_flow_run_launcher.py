"""evaldag.runtime.flow_run_launcher, the command the local pools start flow runs with: a session of the run's own, stop
signals reaching the run and its children, the run's exit status passed on, the run dying with its launcher."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

# The child writes its own pid once its interpreter has started: a SIGINT that lands while Python is still starting
# up can be swallowed ("Exception ignored in ... KeyboardInterrupt", seen in CI), so the test signals only a child
# that is running its program, as every signal a real run gets does after its first seconds.
CHILD = ("import os, sys, time\n"
         "with open(sys.argv[1] + '.tmp', 'w') as f:\n"
         "    f.write(str(os.getpid()))\n"
         "os.replace(sys.argv[1] + '.tmp', sys.argv[1])\n"
         "time.sleep(600)\n")

# The flow run's stand-in: starts a child of its own (as vLLM's workers on a GPU host), which writes its pid; waits.
RUN = textwrap.dedent(f"""
    import subprocess, sys, time
    child = subprocess.Popen([sys.executable, "-c", {CHILD!r}, sys.argv[1]])
    time.sleep(600)
""")


def _launcher(*command: str) -> list[str]:
    return [sys.executable, "-c", "import sys; from evaldag.runtime.flow_run_launcher import launch; "
            f"sys.exit(launch({[sys.executable, *command]!r}))"]


@contextlib.contextmanager
def _launched(tmp_path: Path):
    """The launcher running RUN, and RUN's two processes (the run, its child); all killed afterwards."""
    pids = tmp_path / "pids"
    launcher = subprocess.Popen(_launcher("-c", RUN, str(pids)))
    procs: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + 60
        while not (pids.is_file() and pids.read_text()):
            assert time.monotonic() < deadline and launcher.poll() is None, "the run did not start"
            time.sleep(0.05)
        procs = [psutil.Process(launcher.pid).children()[0], psutil.Process(int(pids.read_text()))]
        yield launcher, procs
    finally:
        for p in procs:
            with contextlib.suppress(psutil.Error):
                p.kill()
        with contextlib.suppress(ProcessLookupError):
            launcher.kill()
        launcher.wait(10)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_stop_signal_reaches_the_run_and_its_children(tmp_path, sig):
    with _launched(tmp_path) as (launcher, procs):
        assert {os.getpgid(p.pid) for p in procs} == {launcher.pid} != {os.getpgid(0)}  # a process group of its own
        # but the caller's session: a flow run in a session of its own competes as an equal with a nice 19 process
        # elsewhere (autogroup scheduling, docs/performance.md)
        assert {os.getsid(p.pid) for p in procs} == {os.getsid(0)}
        launcher.send_signal(sig)
        _, alive = psutil.wait_procs(procs, timeout=20)
        assert not alive
        assert launcher.wait(20) == -sig                   # the run ended killed by `sig`, and so does the launcher


def test_the_exit_code_is_passed_on():
    assert subprocess.run(_launcher("-c", "import sys; sys.exit(3)"), timeout=60).returncode == 3


def test_the_run_dies_with_a_killed_launcher(tmp_path):
    """A worker's hard kill (SIGKILL) reaches the launcher alone; the run must not outlive it."""
    with _launched(tmp_path) as (launcher, procs):
        launcher.kill()
        launcher.wait(20)
        _, alive = psutil.wait_procs(procs[:1], timeout=20)
        assert not alive


# Run as the program by module_command: counts its own executions, then starts a grading-style worker process.
PROBE = textwrap.dedent("""
    import multiprocessing, sys
    from pathlib import Path
    log = Path(sys.argv[1])
    with log.open("a") as f:
        f.write(f"{__name__}\\n")

    if __name__ == "__main__":
        p = multiprocessing.get_context("forkserver").Process(target=print)
        p.start(); p.join()
        assert p.exitcode == 0, p.exitcode
""")


def test_worker_processes_do_not_import_the_engine_again(tmp_path):
    """A module run by `module_command` (as Prefect's engine is) is not imported again by each "forkserver" child:
    under `python -m` every grading-pool worker re-imports the main module (for the engine: all of Prefect)."""
    from evaldag.runtime.flow_run_launcher import module_command

    (tmp_path / "probe_main.py").write_text(PROBE)
    log = tmp_path / "log"
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    subprocess.run(module_command("probe_main", [str(log)]), env=env, check=True, timeout=60)
    assert log.read_text().splitlines() == ["__main__"]                   # argv reached it; run once, as main
    log.unlink()
    subprocess.run([sys.executable, "-m", "probe_main", str(log)], env=env, check=True, timeout=60)
    assert log.read_text().splitlines() == ["__main__", "__mp_main__"]   # what `-m` costs: a second execution
