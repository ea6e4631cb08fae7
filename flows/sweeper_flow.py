"""eval-sweeper and eval-latest: scheduled flows that find checkpoints on disk and start missing evaluations.

The sweeper catches what events missed (a trainer without a notifier, a lost event, a crashed evaluation);
eval-latest evaluates the newest checkpoint of one run (the nightly example in deployments/prefect.yaml).
"""

from __future__ import annotations

import os
from pathlib import Path

from prefect import flow, get_run_logger

from evaldag.events.checkpoint_event import allowed_roots_from_env, discover_checkpoints
from evaldag.runtime.deployments import LATEST_FLOW, SWEEPER_FLOW
from evaldag.errors import ConfigError
from evaldag.events.identity import evaluated_key, requested_benchmarks, train_run_of
from tasks.start_evaluation import start_evaluation
from tasks.lookup import evaluated_checkpoints


def _roots(roots: list[str] | None) -> list[Path]:
    """The folders to search: `roots` (each resolved, and under an allowed root) or the allowed roots."""
    allowed = allowed_roots_from_env()
    chosen = [Path(r).expanduser().resolve() for r in roots] if roots else allowed
    # a chosen root is resolved, so it is compared with where each allowed root leads too (/ckpts -> /mnt/ckpts)
    where = allowed + [a.resolve() for a in allowed]
    outside = [r for r in chosen if not any(r.is_relative_to(a) for a in where)]
    if outside:
        raise ConfigError(f"roots {[str(r) for r in outside]} are not under EVALDAG_CHECKPOINT_ROOTS "
                          f"({[str(a) for a in allowed]})")
    return chosen


@flow(name=SWEEPER_FLOW, log_prints=True)
def eval_sweeper(roots: list[str] | None = None, benchmarks: list[str] = ["math500"],  # noqa: B006
                 eval_overrides: dict | None = None, include_cancelled: bool = False,
                 full_after_decide: bool = False) -> dict:
    """Start an evaluation for every complete checkpoint under `roots` (default: EVALDAG_CHECKPOINT_ROOTS) that
    has no finished MLflow run with these settings (`eval_overrides`) yet. An evaluation that asked for a
    sequential verdict (decide; it may have stopped early) counts as one with the same settings otherwise, so the
    sweep does not undo its saving; `full_after_decide` evaluates such checkpoints in full all the same. An evaluation that failed or crashed is
    started again, once: nothing while a retry of it is still queued or running, and nothing after a run a person
    cancelled unless `include_cancelled` (evaldag.runtime.relaunch). A checkpoint a trainer announced under a job
    name of its own is evaluated under that name, so an evaluation under way is joined, not repeated."""
    marker = os.environ.get("EVALDAG_CHECKPOINT_MARKER") or None
    benches = requested_benchmarks(None, benchmarks)
    found = [(step, ckpt, root) for root in _roots(roots) if root.is_dir()
             for step, ckpt in discover_checkpoints(root, marker)]
    have = {bench: evaluated_checkpoints(bench, decided_counts=not full_after_decide) for bench in benches}
    started, done = [], 0
    for step, ckpt, root in found:
        missing = [bench for bench in benches   # not yet evaluated with these settings
                   if evaluated_key(ckpt.resolve(), step, bench, eval_overrides) not in have[bench]]
        done += len(benches) - len(missing)
        if missing:   # one evaluation for the checkpoint's missing benchmarks: one engine load per slot
            started.append(start_evaluation(missing, str(ckpt.resolve()), step, train_run_of(ckpt, root),
                                            eval_overrides, relaunch_failed=True,
                                            include_cancelled=include_cancelled, adopt_train_run=True))
    cancelled = sum(1 for s in started if s.get("relaunch") == "cancelled")
    get_run_logger().info("%d checkpoints x %d benchmarks: %d already evaluated, %d evaluations started or in "
                          "progress, %d left cancelled (include_cancelled=true starts them again)",
                          len(found), len(benches), done, len(started) - cancelled, cancelled)
    return {"checkpoints": len(found), "already_evaluated": done, "started": started}


@flow(name=LATEST_FLOW, log_prints=True)
def eval_latest(root: str, benchmark: str = "math500", eval_overrides: dict | None = None,
                include_cancelled: bool = False) -> dict:
    """Evaluate the newest complete checkpoint under `root` (a run folder such as /ckpts/run-42); a failed
    evaluation of it is retried as by the sweeper (`include_cancelled` likewise)."""
    run_root = _roots([root])[0]
    found = discover_checkpoints(run_root, os.environ.get("EVALDAG_CHECKPOINT_MARKER") or None)
    if not found:
        raise ConfigError(f"no complete checkpoint under {run_root}")
    step, ckpt = found[-1]
    return start_evaluation(requested_benchmarks(None, [benchmark])[0], str(ckpt.resolve()), step,
                            train_run_of(ckpt, run_root), eval_overrides, relaunch_failed=True,
                            include_cancelled=include_cancelled, adopt_train_run=True)
