"""Fault injection, for the fault tests and for drills: make named points of the pipeline fail transiently.

Off unless `$EVALDAG_FAULTS_FILE` names a JSON file such as `{"generate": 1, "grade": 1, "track": 2}`. A point
whose count is positive takes one off (under a file lock, so the budget holds across worker processes) and raises
`InjectedFault`, a `ConnectionError`: the retry logic sees exactly what a flaky node or server would produce. A
missing file, or a count of 0, costs one `os.environ` lookup.

Points: `generate` (between two batches, after the first batch's chunk is written), `grade` (before grading a
shard), `shard_done` (in the parent, once a shard's run completed), `reduce` (before a reduce), `track` (after the
MLflow run is created and its metrics logged, before its artifacts).

A hold instead parks the first process that reaches a point until a test lets it go, to act in that window (a
cancel during track): `{"hold": {"track": "/tmp/go"}}` makes that process create `/tmp/go.reached`, then wait until
`/tmp/go` exists (at most HOLD_MAX_S). A hold is taken once.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

HOLD_MAX_S = 600.0


class InjectedFault(ConnectionError):
    """A transient failure raised on purpose by `maybe_fail`."""


def maybe_fail(point: str) -> None:
    """Raise InjectedFault if the fault plan still holds failures for `point`; wait at a hold for it."""
    plan = os.environ.get("EVALDAG_FAULTS_FILE")
    if not plan or not Path(plan).is_file():
        return
    from filelock import FileLock

    with FileLock(plan + ".lock"):
        path = Path(plan)
        if not path.is_file():
            return
        budget = json.loads(path.read_text() or "{}")
        release = budget.get("hold", {}).pop(point, None)
        left = int(budget.get(point, 0))
        if left > 0:
            budget[point] = left - 1
            budget.setdefault("_fired", []).append(point)
        if release is not None or left > 0:
            path.write_text(json.dumps(budget))
    if release is not None:      # outside the lock: other processes' points go on meanwhile
        _hold(Path(release))
    if left <= 0:
        return
    raise InjectedFault(f"injected transient fault at {point!r} ({left - 1} more planned in {plan})")


def _hold(release: Path) -> None:
    """Say that the point is reached, then wait for `release` (or HOLD_MAX_S: a drill nobody ends must not hang)."""
    release.with_name(release.name + ".reached").touch()
    deadline = time.monotonic() + HOLD_MAX_S
    while not release.exists() and time.monotonic() < deadline:
        time.sleep(0.1)


__all__ = ["HOLD_MAX_S", "InjectedFault", "maybe_fail"]
