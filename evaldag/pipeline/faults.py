"""Fault injection, for the fault tests and for drills: make named points of the pipeline fail transiently.

Off unless `$EVALDAG_FAULTS_FILE` names a JSON file such as `{"generate": 1, "grade": 1, "track": 2}`. A point
whose count is positive takes one off (under a file lock, so the budget holds across worker processes) and raises
`InjectedFault`, a `ConnectionError`: the retry logic sees exactly what a flaky node or server would produce. A
missing file, or a count of 0, costs one `os.environ` lookup.

Points: `generate` (between two batches, after the first batch's chunk is written), `grade` (before grading a
shard), `track` (after the MLflow run is created and its metrics logged, before its artifacts).
"""

from __future__ import annotations

import json
import os
from pathlib import Path


class InjectedFault(ConnectionError):
    """A transient failure raised on purpose by `maybe_fail`."""


def maybe_fail(point: str) -> None:
    """Raise InjectedFault if the fault plan still holds failures for `point`."""
    plan = os.environ.get("EVALDAG_FAULTS_FILE")
    if not plan or not Path(plan).is_file():
        return
    from filelock import FileLock

    with FileLock(plan + ".lock"):
        path = Path(plan)
        if not path.is_file():
            return
        budget = json.loads(path.read_text() or "{}")
        left = int(budget.get(point, 0))
        if left <= 0:
            return
        budget[point] = left - 1
        budget.setdefault("_fired", []).append(point)
        path.write_text(json.dumps(budget))
    raise InjectedFault(f"injected transient fault at {point!r} ({left - 1} more planned in {plan})")


__all__ = ["InjectedFault", "maybe_fail"]
