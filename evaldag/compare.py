"""Compare checkpoints across benchmarks from MLflow: one row per (training job, step), one column per benchmark,
accuracy with its interval and deltas to the job's previous and best checkpoint."""

from __future__ import annotations

import polars as pl

from evaldag.tracking import EXPERIMENT_PREFIX


def collect(benchmarks: list[str] | None = None, train_run: str | None = None) -> pl.DataFrame:
    """Finished evaluation runs as a table: train_run, step, benchmark, accuracy, interval, deltas."""
    from mlflow import MlflowClient

    client = MlflowClient()
    exps = [e for e in client.search_experiments() if e.name.startswith(f"{EXPERIMENT_PREFIX}-")]
    if benchmarks:
        exps = [e for e in exps if e.name.removeprefix(f"{EXPERIMENT_PREFIX}-") in benchmarks]
    filt = "tags.kind = 'ckpt_eval' and attributes.status = 'FINISHED'"
    if train_run:
        filt += f" and tags.train_run = '{train_run}'"
    rows = []
    if exps:
        for r in client.search_runs([e.experiment_id for e in exps], filter_string=filt, max_results=50000,
                                    order_by=["attributes.start_time DESC"]):
            m, t = r.data.metrics, r.data.tags
            if "accuracy" not in m:
                continue
            rows.append({"train_run": t.get("train_run", t.get("model", "?")), "step": int(m.get("step", 0)),
                         "benchmark": t.get("benchmark", "?"), "accuracy": m["accuracy"],
                         "ci_low": m.get("accuracy_ci_low"), "ci_high": m.get("accuracy_ci_high"),
                         "start": r.info.start_time})
    schema = {"train_run": pl.Utf8, "step": pl.Int64, "benchmark": pl.Utf8, "accuracy": pl.Float64,
              "ci_low": pl.Float64, "ci_high": pl.Float64, "start": pl.Int64}
    df = pl.DataFrame(rows, schema=schema)
    # the latest run per (job, step, benchmark): a re-evaluation supersedes an older one
    df = df.sort("start", descending=True).unique(["train_run", "step", "benchmark"], keep="first")
    return (df.sort("train_run", "benchmark", "step")
            .with_columns(
                delta_prev=pl.col("accuracy") - pl.col("accuracy").shift(1).over("train_run", "benchmark"),
                delta_best=pl.col("accuracy") - pl.col("accuracy").max().over("train_run", "benchmark"))
            .drop("start"))


def render(df: pl.DataFrame):
    """A rich table: rows = (job, step), columns = benchmarks."""
    from rich.table import Table

    table = Table(title="checkpoints x benchmarks: accuracy [95% interval] (delta to previous / to best)")
    table.add_column("train run")
    table.add_column("step", justify="right")
    benches = sorted(df["benchmark"].unique().to_list())
    for b in benches:
        table.add_column(b, justify="right")
    for (run, step), group in df.group_by(["train_run", "step"], maintain_order=True):
        cells = {r["benchmark"]: r for r in group.iter_rows(named=True)}
        row = [run, str(step)]
        for b in benches:
            r = cells.get(b)
            if r is None:
                row.append("-")
                continue
            text = f"{r['accuracy']:.1%}"
            if r["ci_low"] is not None:
                text += f" [{r['ci_low']:.1%}, {r['ci_high']:.1%}]"
            prev = "" if r["delta_prev"] is None else f"{r['delta_prev'] * 100:+.1f}"
            best = f"{r['delta_best'] * 100:+.1f}"
            colour = "green" if (r["delta_prev"] or 0) > 0 else "red" if (r["delta_prev"] or 0) < 0 else "white"
            text += f"\n[{colour}]{prev or '  '}[/] / {best}"
            row.append(text)
        table.add_row(*row)
    return table
