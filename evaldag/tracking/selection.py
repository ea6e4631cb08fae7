"""A selection in MLflow (`evaldag select`, the eval-select flow): which checkpoints a job has, and the result
written where users look, the job's parent run: tags per benchmark (status, chosen step, the set, alpha, margin), a
table of each checkpoint's elimination round and interval, and the rows each was decided on."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from evaldag.errors import ConfigError
from evaldag.tracking import client as tracking_client
from evaldag.tracking.names import EXPERIMENT_PREFIX, JOBS_EXPERIMENT

log = logging.getLogger("evaldag")
TAG_PREFIX = "evaldag.select"
# the latest selection's whole result on the parent run, whatever its benchmark (what `evaldag select` reads back)
LATEST = "select/latest.json"


def parse_steps(text: str | None) -> tuple[int | None, int | None]:
    """`A:B` (either end may be left out: `:B`, `A:`) as inclusive step bounds; None: every step."""
    if not text:
        return None, None
    lo, sep, hi = text.partition(":")
    try:
        bounds = (int(lo) if lo.strip() else None, int(hi) if hi.strip() else None)
    except ValueError:
        bounds = None
    if not sep or bounds is None or (None not in bounds and bounds[0] > bounds[1]):
        raise ConfigError(f"steps {text!r}: give a range A:B of training steps (A <= B; `:B` or `A:` leave an end "
                          "open), e.g. 1000:5000")
    return bounds


def job_checkpoints(train_run: str, roots: list[Path] | None = None) -> dict[int, str]:
    """Every checkpoint the job is known by, step -> checkpoint: those its evaluations in MLflow name (any
    benchmark; the latest run per step), and those on disk in `<root>/<train_run>` under the allowed roots (a
    checkpoint there wins: it is what the trainer wrote)."""
    from evaldag.events.checkpoint_event import allowed_roots_from_env, discover_checkpoints

    client = tracking_client.mlflow_client()
    experiments = [e.experiment_id for e in client.search_experiments(
        filter_string=f"name LIKE '{EXPERIMENT_PREFIX}-%'") if e.name != JOBS_EXPERIMENT]
    found: dict[int, str] = {}
    runs = tracking_client.all_runs(client, experiments, filter_string=f"tags.train_run = '{train_run}' and "
                                    "tags.kind = 'ckpt_eval'", order_by=["attributes.start_time ASC"]) \
        if experiments else []
    for run in runs:
        tags = run.data.tags
        if tags.get("checkpoint") and tags.get("step", "").isdigit():
            found[int(tags["step"])] = tags["checkpoint"]
    for root in roots if roots is not None else allowed_roots_from_env():
        folder = root / train_run
        if folder.is_dir():
            found.update({step: str(path.resolve()) for step, path in discover_checkpoints(folder)})
    return dict(sorted(found.items()))


def choose_checkpoints(train_run: str, checkpoints: list[str] | None, steps: str | None) -> dict[int, str]:
    """The checkpoints a selection compares, step -> checkpoint: `checkpoints` as given (each folder's step read
    from its name), else the job's known ones (`job_checkpoints`) within `steps`."""
    from evaldag.events.checkpoint_event import parse_step

    if checkpoints:
        chosen: dict[int, str] = {}
        for path in checkpoints:
            step = parse_step(Path(path).name)
            if step is None:
                raise ConfigError(f"checkpoint {path}: no training step in its folder name (checkpoint-1200, "
                                  "global_step_1200, step_1200, ...); rename it or select the job's checkpoints "
                                  "by --steps")
            if step in chosen:
                raise ConfigError(f"checkpoints {chosen[step]} and {path} are both step {step}; give one per step")
            chosen[step] = path
    else:
        chosen = job_checkpoints(train_run)
    lo, hi = parse_steps(steps)
    chosen = {s: c for s, c in chosen.items() if (lo is None or s >= lo) and (hi is None or s <= hi)}
    if len(chosen) < 2:
        raise ConfigError(f"job {train_run!r} has {len(chosen)} checkpoint(s) to select from"
                          f"{' in steps ' + steps if steps else ''}: it needs two or more. Checkpoints are those "
                          "its evaluations in MLflow name and those in <root>/<job> under EVALDAG_CHECKPOINT_ROOTS; "
                          "or name them with --checkpoint (repeat it)")
    return dict(sorted(chosen.items()))


def table(summary: dict) -> dict[str, list]:
    """Each checkpoint's line of the selection, as columns (MLflow's table artifact, the Prefect table)."""
    cols = ["step", "in_set", "problems", "mean", "dropped_round", "dropped_at", "vs", "diff", "ci_low", "ci_high",
            "checkpoint"]
    return {c: [row[c] for row in summary["checkpoints"]] for c in cols}


def describe(summary: dict) -> str:
    """The selection's outcome in one line (the flow's log, the Prefect artifact, the command's output)."""
    steps = ", ".join(str(s) for s in summary["set"])
    what = {"best": f"step {summary['best_step']} is best",
            "equivalent": f"steps {steps} are within {summary['margin']:g} of each other (any of them)",
            "undecided": f"the best is one of steps {steps} ("
                         f"{summary.get('reason') or 'not told apart by the last look'})"}[summary["status"]]
    t = summary["tokens"]
    spent = (f"{t['generated']} tokens generated ({summary['tokens_ratio']:.2f} of the {t['full_est']} of all in "
             f"full)" if summary["tokens_ratio"] is not None else f"{t['generated']} tokens generated")
    return (f"{summary['train_run']} on {summary['benchmark']}: {summary['status']}: {what}; alpha "
            f"{summary['alpha']:g}, margin {summary['margin']:g}, {summary['look']} of {summary['n_problems']} "
            f"problems read; {spent}" + (f", {t['reused']} found already" if t["reused"] else ""))


def markdown(summary: dict) -> str:
    """The selection as a markdown table (the Prefect artifact)."""
    def pct(x: float | None) -> str:
        return "-" if x is None else f"{x * 100:+.1f}"

    lines = [f"**{describe(summary)}**", "", "| step | in set | problems read | accuracy | dropped at round (problems) "
             "| vs | difference, points [interval] |", "|---|---|---|---|---|---|---|"]
    for c in summary["checkpoints"]:
        dropped = ("-" if c.get("settled_at") is None else f"settled after {c['settled_at']}") \
            if c["dropped_round"] is None else f"{c['dropped_round']} ({c['dropped_at']})"
        mean = "-" if c["mean"] is None else f"{c['mean']:.3f}"
        lines.append(f"| {c['step']} | {'yes' if c['in_set'] else 'no'} | {c['problems']} | {mean} | {dropped} | "
                     f"{c['vs'] or '-'} | {pct(c['diff'])} [{pct(c['ci_low'])}, {pct(c['ci_high'])}] |")
    return "\n".join(lines)


def log_selection(summary: dict) -> str:
    """Write the selection to the job's parent run (get-or-create): tags `evaldag.select.<benchmark>.*`, the table
    `select/<benchmark>.json` and the rows it read `select/<benchmark>-rows.json`; returns the run id."""
    from evaldag.tracking.parent_runs import job_parent_run

    client = tracking_client.mlflow_client()
    run_id = job_parent_run(client, summary["train_run"]).run_id
    bench = summary["benchmark"]
    prefix = f"{TAG_PREFIX}.{bench}"
    tags = {"status": summary["status"], "chosen_step": "" if summary["best_step"] is None else
            str(summary["best_step"]), "set": ",".join(str(s) for s in summary["set"]),
            "alpha": f"{summary['alpha']:g}", "margin": f"{summary['margin']:g}",
            "tokens_generated": str(summary["tokens"]["generated"]),
            "tokens_full_est": str(summary["tokens"]["full_est"])}
    for key, value in tags.items():
        client.set_tag(run_id, f"{prefix}.{key}", value)
    client.log_table(run_id, data=table(summary), artifact_file=f"select/{bench}.json")
    text = json.dumps(summary, indent=1)
    client.log_text(run_id, text, f"select/{bench}-rows.json")
    client.log_text(run_id, text, LATEST)
    log.info("selection of %s on %s logged to the job's parent run %s", summary["train_run"], bench, run_id)
    return run_id


__all__ = ["LATEST", "TAG_PREFIX", "choose_checkpoints", "describe", "job_checkpoints", "log_selection", "markdown",
           "parse_steps", "table"]
