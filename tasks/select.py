"""The eval-select flow's tasks, thin over evaldag.decisions.select (the elimination, pure),
evaldag.decisions.select_rows (its rows in the store) and evaldag.tracking.selection (MLflow): which checkpoints,
their plans, the rounds (each survivor's shards generate the prefix it needs; nothing generated is thrown away),
and the result written where users look."""

from __future__ import annotations

from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact, create_table_artifact

from evaldag.decisions.select import Selection, select_step
from evaldag.decisions.select_rows import CheckpointRows, ask_prefix, select_request
from evaldag.request.plan import load_plan
from tasks.launch_shard import launch_shard
from tasks.resolve import resolve_task
from tasks.retry import retry_transient


@task(name="select-checkpoints", persist_result=False,
      retries=3, retry_delay_seconds=[2, 5, 10], retry_condition_fn=retry_transient)
def choose_task(train_run: str, checkpoints: list[str] | None, steps: str | None) -> dict[int, str]:
    """step -> checkpoint of the selection (evaldag.tracking.selection.choose_checkpoints)."""
    from evaldag.tracking.selection import choose_checkpoints

    return choose_checkpoints(train_run, checkpoints, steps)


def plan_checkpoints(benchmark: str, chosen: dict[int, str], train_run: str, settings: dict, num_gpus: int
                     ) -> dict[str, CheckpointRows]:
    """Resolve each checkpoint's select plan (a resolve task each) and read the rows it has already, by label
    JOB@STEP."""
    rows = {}
    for step, checkpoint in chosen.items():
        path = resolve_task(select_request(benchmark, checkpoint, step, train_run, **settings), num_gpus)
        rows[f"{train_run}@{step}"] = CheckpointRows(f"{train_run}@{step}", load_plan(path))
    orders = {tuple(r.order) for r in rows.values()}
    if len(orders) > 1:
        raise ValueError("the checkpoints' evaluations hold different problems or seeds, so they share no problem "
                         "order; give them the same benchmark, limit and sampling seed")
    return rows


def run_rounds(rows: dict[str, CheckpointRows], looks: list[int], alpha: float, margin: float,
               parent_run_id: str) -> Selection:
    """Replay the elimination on the rows in the store; while it is pending, have each surviving checkpoint's
    shards generate the prefix it needs (all survivors at once, on the gpu pool), read the new rows and replay."""
    log = get_run_logger()
    while True:
        scores = {label: r.scores() for label, r in rows.items()}
        sel = select_step(scores, looks, alpha, margin)
        if sel.done:
            return sel
        log.info("look %d done; %s need rows: %s", sel.look, len(sel.need),
                 ", ".join(f"{label} up to {t} (has {scores[label].size})" for label, t in sel.need.items()))
        futures = []
        for label, t in sel.need.items():
            plan = rows[label].plan
            asked = ask_prefix(plan, t)
            futures += [launch_shard.submit([str(plan.path("plan.json"))], s, parent_run_id, f"select-{asked}")
                        for s in range(plan.num_shards)]
        for future in futures:
            future.result()
        for label, t in sel.need.items():
            rows[label].refresh()
            have = rows[label].scores().size
            if have < t:
                raise RuntimeError(f"{label}: its shards completed but its rows cover {have} of the {t} problems "
                                   f"asked (store: {rows[label].plan.stage_dir}); run the selection again (it "
                                   "generates only what is missing)")


@task(name="log-selection", persist_result=False,
      retries=4, retry_delay_seconds=[2, 5, 10, 20], retry_condition_fn=retry_transient)
def log_task(summary: dict) -> str:
    """The selection on the job's MLflow parent run; returns its id (evaldag.tracking.selection.log_selection)."""
    from evaldag.tracking.selection import log_selection

    return log_selection(summary)


def publish(summary: dict) -> None:
    """The selection as Prefect artifacts of the flow run: the markdown table, and a table of every figure."""
    from evaldag.tracking.selection import markdown, table

    bench = summary["benchmark"]
    create_markdown_artifact(markdown(summary), key=f"select-{bench}",
                             description=f"the best checkpoint of {summary['train_run']} on {bench}")
    columns = table(summary)
    create_table_artifact([dict(zip(columns, values)) for values in zip(*columns.values())],
                          key=f"select-{bench}-table", description="each checkpoint's elimination round and interval")


__all__ = ["choose_task", "log_task", "plan_checkpoints", "publish", "run_rounds"]
