"""Compare checkpoints across benchmarks from MLflow: one row per (training job, step), one column per benchmark,
accuracy with its interval and deltas to the job's previous and best checkpoint."""

from __future__ import annotations

from pathlib import Path

import polars as pl

from evaldag.tracking.names import EXPERIMENT_PREFIX


def collect(benchmarks: list[str] | None = None, train_run: str | list[str] | None = None) -> pl.DataFrame:
    """Finished evaluation runs as a table: train_run, step, benchmark, accuracy, interval, reward, deltas.

    `train_run` keeps only that training job (or those jobs, given a list)."""
    from mlflow import MlflowClient

    client = MlflowClient()
    exps = [e for e in client.search_experiments() if e.name.startswith(f"{EXPERIMENT_PREFIX}-")]
    if benchmarks:
        exps = [e for e in exps if e.name.removeprefix(f"{EXPERIMENT_PREFIX}-") in benchmarks]
    filt = "tags.kind = 'ckpt_eval' and attributes.status = 'FINISHED'"
    jobs = [train_run] if isinstance(train_run, str) else list(train_run or [])
    if len(jobs) == 1:
        filt += f" and tags.train_run = '{jobs[0]}'"
    # (MLflow's search has no IN for tags: several jobs are kept below)
    rows = []
    if exps:
        for r in client.search_runs([e.experiment_id for e in exps], filter_string=filt, max_results=50000,
                                    order_by=["attributes.start_time DESC"]):
            m, t = r.data.metrics, r.data.tags
            if "accuracy" not in m or (jobs and t.get("train_run") not in jobs):
                continue
            rows.append({"train_run": t.get("train_run", t.get("model", "?")), "step": int(m.get("step", 0)),
                         "benchmark": t.get("benchmark", "?"), "accuracy": m["accuracy"],
                         "ci_low": m.get("accuracy_ci_low"), "ci_high": m.get("accuracy_ci_high"),
                         "reward": m.get("reward/mean"), "start": r.info.start_time})
    schema = {"train_run": pl.Utf8, "step": pl.Int64, "benchmark": pl.Utf8, "accuracy": pl.Float64,
              "ci_low": pl.Float64, "ci_high": pl.Float64, "reward": pl.Float64, "start": pl.Int64}
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


def figure(df: pl.DataFrame):
    """Accuracy (with its interval as a band) and mean reward against step, one line per training job; one column
    of the two panels per benchmark. Returns the matplotlib Figure (Agg backend: no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if df.is_empty():
        raise ValueError("nothing to plot: no finished evaluations match; run one with "
                         "`evaldag run math500 --limit 20 --train-run JOB --step N`")
    benches = sorted(df["benchmark"].unique().to_list())
    fig, axes = plt.subplots(2, len(benches), figsize=(6 * len(benches), 7), sharex="col", squeeze=False)
    for col, bench in enumerate(benches):
        acc_ax, rew_ax = axes[0][col], axes[1][col]
        for (job,), g in df.filter(pl.col("benchmark") == bench).sort("step").group_by(["train_run"],
                                                                                        maintain_order=True):
            steps = g["step"].to_list()
            line, = acc_ax.plot(steps, g["accuracy"].to_list(), "o-", label=job)
            if g["ci_low"].null_count() == 0:
                acc_ax.fill_between(steps, g["ci_low"].to_list(), g["ci_high"].to_list(), alpha=0.2,
                                    color=line.get_color())
            if g["reward"].null_count() < g.height:
                r = g.filter(pl.col("reward").is_not_null())
                rew_ax.plot(r["step"].to_list(), r["reward"].to_list(), "s--", label=job, color=line.get_color())
        acc_ax.set_title(f"{bench}: accuracy (95% interval)")
        acc_ax.set_ylabel("accuracy")
        rew_ax.set_title(f"{bench}: mean reward")
        rew_ax.set_ylabel("mean reward")
        rew_ax.set_xlabel("training step")
        for ax in (acc_ax, rew_ax):
            ax.grid(alpha=0.3)
            ax.legend(title="training job", fontsize="small")
    fig.tight_layout()
    return fig


def plot(df: pl.DataFrame, out: str | Path) -> Path:
    """Write `figure(df)` to `out` (PNG, or any format matplotlib knows by the suffix)."""
    import matplotlib.pyplot as plt

    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig = figure(df)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
