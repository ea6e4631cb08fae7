"""The command the local stack's process workers start each flow run with: `python -m evaldag.runtime.flow_run_launcher`.

Prefect's process worker, left without a command, starts a flow run through its workspace supervisor: a Python
process that imports Prefect (3-4 s of a 2-core box, measured) to run the deployment's pull step and then start
`python -m prefect.engine` in a session and process group of its own. This launcher keeps the group (the flow run
and whatever it starts, vLLM's workers on a GPU host, in one group apart from the worker's; a stop signal reaches
all of them; the run dies with its launcher) for the price of a bare interpreter start: it imports only the standard
library, and the engine runs the pull step itself when it loads the flow.

It does not start a session: with the kernel's autogroup scheduling (on in most Linux kernels) CPU time is shared
between sessions first and by nice only within one, so a flow run in a session of its own competes as an equal with
a `nice -n 19` process started anywhere else, and vLLM's threads, which wait for each other at every step, slowed
3-4x beside one (docs/performance.md, bench/bench_contention.py). In the worker's session a low-priority neighbour
of the user's stays low.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys

_FORWARDED = (signal.SIGTERM, signal.SIGINT)
_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """SIGKILL this process when its parent (thread) ends. Linux only; a no-op elsewhere (there `evaldag down`
    sweeps such leftovers)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass


def _forward(sig: int, _frame: object) -> None:
    """Pass a stop signal to the whole group (the engine and its children), as Prefect's supervisor does."""
    signal.signal(sig, signal.SIG_IGN)     # ignored: the copy the group signal sends to this process is discarded
    try:
        os.killpg(os.getpgrp(), sig)
    finally:
        signal.signal(sig, _forward)


def _own_group() -> None:
    try:
        os.setpgid(0, 0)
    except OSError:                        # a session leader leads its group already
        pass


def _end_as(code: int) -> int:
    """Return `code`; for a run killed by a signal, end by the same signal, so that the worker reports it so."""
    if code < 0:
        with contextlib.suppress(OSError):     # SIGKILL has no handler to reset
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    return code


def launch(command: list[str]) -> int:
    """Run `command` in a new process group with this process, forward stop signals to the whole group, and end as
    it ended (the same exit code, or the same signal)."""
    _own_group()
    # the engine dies with this launcher: a worker's hard kill reaches the launcher alone
    child = subprocess.Popen(command, preexec_fn=die_with_parent)
    for sig in _FORWARDED:
        signal.signal(sig, _forward)
    return _end_as(child.wait())


def module_command(module: str, argv: list[str]) -> list[str]:
    """The command that runs `module` as the program, like `python -m module argv...`, but with no named main
    module: multiprocessing's "spawn" and "forkserver" children (the grading pool's workers) import a named main
    module again, each of them, which for `prefect.engine` means importing Prefect at every worker start
    (docs/performance.md); a `-c` program has nothing for them to import."""
    return [sys.executable, "-c", f"import runpy; runpy.run_module({module!r}, run_name='__main__')", *argv]


def main(argv: list[str]) -> int:
    """Start Prefect's engine for the flow run named by PREFECT__FLOW_RUN_ID (or argv), as `launch` says."""
    return launch(module_command("prefect.engine", argv))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
