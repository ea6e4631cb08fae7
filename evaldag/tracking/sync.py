"""`evaldag sync`: log to MLflow the finished evaluations of the result store that it lacks (the tracking server was
down longer than the track task's retries), through the track stage's own write path."""

from __future__ import annotations

import json
import logging
from os import PathLike

from evaldag.storage import store
from evaldag.tracking.run_claims import TrackingBusy
from evaldag.tracking.write import TrackedRun, track

log = logging.getLogger("evaldag")


def sync(results_root: str | PathLike | None = None,
         failed: list[tuple[str, str]] | None = None) -> list[TrackedRun]:
    """Log every finished evaluation in the result store that MLflow does not have yet (e.g. the tracking server
    was down longer than the track task's retries); returns the runs it created. One evaluation that cannot be
    logged (a damaged plan.json, a refused write) does not stop the others: it is appended to `failed` as
    (plan file, why) and logged."""
    from evaldag.request.plan import load_plan

    root = store.as_path(results_root) if results_root is not None else store.root()
    created = []
    for metrics_file in sorted(root.glob("*/*/metrics.json"), key=str):
        plan_file = metrics_file.with_name("plan.json")
        if not plan_file.is_file():
            continue
        try:
            run = track(load_plan(plan_file), json.loads(metrics_file.read_text()))
        except TrackingBusy as e:         # being logged right now by its own evaluation
            log.warning("skipping %s: %s", plan_file, e)
            continue
        except Exception as e:  # noqa: BLE001 - one bad evaluation must not keep the rest out of MLflow
            log.error("could not log %s: %s: %s", plan_file, type(e).__name__, e)
            if failed is not None:
                failed.append((str(plan_file), f"{type(e).__name__}: {e}"))
            continue
        if run.created:
            created.append(run)
    return created


__all__ = ["sync"]
