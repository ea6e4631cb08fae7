"""Compare checkpoints across benchmarks from MLflow: one row per (training job, step), one column per benchmark,
accuracy with its interval and deltas to the job's previous and best checkpoint; each job's forecast at its planned
final step and whether it falls behind another job at the same step (evaldag.decisions.forecast)."""

from __future__ import annotations

from pathlib import Path

import polars as pl

from evaldag.decisions import best
from evaldag.scoring.diagnostics import Diagnostic
from evaldag.tracking.client import all_runs
from evaldag.tracking.names import COMPARISON_TAG, EXPERIMENT_PREFIX, FINAL_STEP_TAG, stopped_early


def collect(benchmarks: list[str] | None = None, train_run: str | list[str] | None = None) -> pl.DataFrame:
    """Finished evaluation runs as a table: train_run, step, benchmark, accuracy, interval, reward, comparison_key,
    stopped (an evaluation stopped early), deltas to the previous and the best checkpoint of its series.

    One row per (job, step, benchmark, comparison key): a slice or another sampling setting is another series
    (evaldag.decisions.series), never a point of this one, and at a step a full evaluation wins over one that stopped
    early, else the latest. The previous and best are evaldag.decisions.best's, within the series.
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
        for r in all_runs(client, [e.experiment_id for e in exps], filter_string=filt,
                          order_by=["attributes.start_time DESC"]):
            m, t = r.data.metrics, r.data.tags
            if "accuracy" not in m or (jobs and t.get("train_run") not in jobs):
                continue
            final = t.get(FINAL_STEP_TAG, "")
            rows.append({"train_run": t.get("train_run", t.get("model", "?")), "step": int(m.get("step", 0)),
                         "benchmark": t.get("benchmark", "?"), "accuracy": m["accuracy"],
                         "ci_low": m.get("accuracy_ci_low"), "ci_high": m.get("accuracy_ci_high"),
                         "reward": m.get("reward/mean"), "n_samples": m.get("n_samples"),
                         "comparison_key": t.get(COMPARISON_TAG), "final_step": int(final) if final.isdigit() else None,
                         "stopped": stopped_early(t), "start": r.info.start_time})
    schema = {"train_run": pl.Utf8, "step": pl.Int64, "benchmark": pl.Utf8, "accuracy": pl.Float64,
              "ci_low": pl.Float64, "ci_high": pl.Float64, "reward": pl.Float64, "n_samples": pl.Float64,
              "comparison_key": pl.Utf8, "final_step": pl.Int64, "stopped": pl.Boolean, "start": pl.Int64}
    df = (pl.DataFrame(rows, schema=schema).sort(["stopped", "start"], descending=[False, True])
          .unique(["train_run", "step", "benchmark", "comparison_key"], keep="first")
          .sort("train_run", "benchmark", "comparison_key", "step"))
    return _with_deltas(df).drop("start")


def _with_deltas(df: pl.DataFrame) -> pl.DataFrame:
    """delta_prev and delta_best: each row's accuracy less that of its series' previous and best evaluation at the
    steps before (evaldag.decisions.best.references); null where there is none."""
    prev, top = [], []
    for _, series in df.group_by("train_run", "benchmark", "comparison_key", maintain_order=True):
        earlier: list[dict] = []
        for row in series.iter_rows(named=True):
            refs = best.references(earlier)
            prev.append(row["accuracy"] - refs["previous"]["accuracy"] if "previous" in refs else None)
            top.append(row["accuracy"] - refs["best"]["accuracy"] if "best" in refs else None)
            earlier.append(row)
    # group_by(maintain_order) visits the sorted frame's rows in order, so the lists line up with its rows
    return df.with_columns(delta_prev=pl.Series(prev, dtype=pl.Float64), delta_best=pl.Series(top, dtype=pl.Float64))


def _main_keys(df: pl.DataFrame) -> pl.DataFrame:
    """Per (job, benchmark), the comparison key of its main series: the one with the most full evaluations, the
    latest step breaking a tie (so a quick slice after six full evaluations does not take the job's curve over)."""
    return (df.group_by("train_run", "benchmark", "comparison_key")
            .agg(full=(~pl.col("stopped")).sum(), last=pl.col("step").max())
            .sort("full", "last", descending=True)
            .unique(["train_run", "benchmark"], keep="first")
            .select("train_run", "benchmark", key="comparison_key"))


def _main_series(df: pl.DataFrame) -> pl.DataFrame:
    """The rows of each (job, benchmark)'s main series (`_main_keys`): what its curve is drawn from."""
    keys = _main_keys(df)
    return (df.join(keys, on=["train_run", "benchmark"])
            .filter(pl.col("comparison_key").eq_missing(pl.col("key")))
            .drop("key").sort("train_run", "benchmark", "step"))


def _series(df: pl.DataFrame) -> pl.DataFrame:
    """The rows a job's forecast is made of: its main series (a quick slice or another sampling setting is another
    series, evaldag.decisions.series), where they have sample counts."""
    return _main_series(df).filter(pl.col("n_samples").is_not_null())


def forecasts(df: pl.DataFrame, final_step: int | None = None) -> pl.DataFrame:
    """Each (job, benchmark)'s forecast at its final step: `final_step` when given, else the one its evaluations
    were tagged with (the trainer's or the request's); jobs with neither are left out. Columns: train_run,
    benchmark, final_step, made, value, low, high, reason, text (Forecast.describe), A, R0, s_mid, B (the fitted
    curve, for the plot)."""
    from evaldag.decisions.forecast import forecast

    rows = []
    for (job, bench), g in _series(df).group_by("train_run", "benchmark", maintain_order=True):
        final = final_step or g["final_step"].max()
        if final is None:
            continue
        fc = forecast(g, int(final))
        rows.append({"train_run": job, "benchmark": bench, "final_step": fc.final_step, "made": fc.made,
                     "value": fc.value, "low": fc.low, "high": fc.high, "reason": fc.reason, "text": fc.describe(),
                     **{k: fc.params.get(k) for k in ("A", "R0", "s_mid", "B")}})
    schema = {"train_run": pl.Utf8, "benchmark": pl.Utf8, "final_step": pl.Int64, "made": pl.Boolean,
              "value": pl.Float64, "low": pl.Float64, "high": pl.Float64, "reason": pl.Utf8, "text": pl.Utf8,
              **{k: pl.Float64 for k in ("A", "R0", "s_mid", "B")}}
    return pl.DataFrame(rows, schema=schema)


def falling_behind(df: pl.DataFrame, alpha: float = 0.05) -> list[tuple[str, Diagnostic]]:
    """(benchmark, diagnostic) for every job of `df` checked against the other jobs measured alike (same benchmark
    and comparison key) at its latest step (evaldag.forecast.falling_behind)."""
    from evaldag.decisions.forecast import falling_behind as check

    out = []
    for (bench, _), g in _series(df).group_by("benchmark", "comparison_key", maintain_order=True):
        jobs = {job: h for (job,), h in g.group_by("train_run", maintain_order=True)}
        if len(jobs) < 2:
            continue
        out += [(bench, check(job, h, {o: oh for o, oh in jobs.items() if o != job}, alpha))
                for job, h in jobs.items()]
    return out


def render(df: pl.DataFrame):
    """A rich table: rows = (job, step), columns = benchmarks."""
    from rich.table import Table

    table = Table(title="checkpoints x benchmarks: accuracy [95% interval] (delta to previous / to best so far); "
                        "a series other than a job's main one (another comparison key) in a column of its own")
    table.add_column("train run")
    table.add_column("step", justify="right")
    main = _main_keys(df).rename({"key": "main"})
    df = df.join(main, on=["train_run", "benchmark"]).with_columns(
        column=pl.when(pl.col("comparison_key").eq_missing(pl.col("main"))).then(pl.col("benchmark"))
        .otherwise(pl.format("{} [{}]", "benchmark", pl.col("comparison_key").fill_null("no key").str.slice(0, 8))))
    columns = sorted(df["column"].unique().to_list())
    for c in columns:
        table.add_column(c, justify="right")
    for (run, step), group in df.sort("train_run", "step").group_by(["train_run", "step"], maintain_order=True):
        cells = {r["column"]: r for r in group.iter_rows(named=True)}
        table.add_row(run, str(step), *(_cell(cells.get(c)) for c in columns))
    return table


def _cell(r: dict | None) -> str:
    """One evaluation's cell of `render`: accuracy, interval, deltas to the previous and the best so far."""
    if r is None:
        return "-"
    text = f"{r['accuracy']:.1%}"
    if r["ci_low"] is not None:
        text += f" [{r['ci_low']:.1%}, {r['ci_high']:.1%}]"
    if r["stopped"]:
        text += " (stopped early)"
    prev = "" if r["delta_prev"] is None else f"{r['delta_prev'] * 100:+.1f}"
    top = "" if r["delta_best"] is None else f"{r['delta_best'] * 100:+.1f}"
    colour = "green" if (r["delta_prev"] or 0) > 0 else "red" if (r["delta_prev"] or 0) < 0 else "white"
    return text + f"\n[{colour}]{prev or '  '}[/] / {top or '  '}"


def figure(df: pl.DataFrame, predicted: pl.DataFrame | None = None):
    """Accuracy (with its interval as a band) and mean reward against step, one line per training job; one column
    of the two panels per benchmark. With `predicted` (`forecasts(df)`), each job's fitted curve is drawn dashed
    out to its final step, with the forecast's band there as an error bar. Returns the matplotlib Figure (Agg
    backend: no display needed)."""
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
        for (job,), g in _main_series(df).filter(pl.col("benchmark") == bench).group_by(["train_run"],
                                                                                         maintain_order=True):
            steps = g["step"].to_list()
            line, = acc_ax.plot(steps, g["accuracy"].to_list(), "o-", label=job)
            if g["ci_low"].null_count() == 0:
                acc_ax.fill_between(steps, g["ci_low"].to_list(), g["ci_high"].to_list(), alpha=0.2,
                                    color=line.get_color())
            if g["reward"].null_count() < g.height:
                r = g.filter(pl.col("reward").is_not_null())
                rew_ax.plot(r["step"].to_list(), r["reward"].to_list(), "s--", label=job, color=line.get_color())
            if predicted is not None:
                _draw_forecast(acc_ax, predicted.filter((pl.col("train_run") == job) & (pl.col("benchmark") == bench)
                                                        & pl.col("made")), steps, line.get_color(), job)
        acc_ax.set_title(f"{bench}: accuracy (95% interval; forecast: 80% band)" if predicted is not None
                         and predicted.height else f"{bench}: accuracy (95% interval)")
        acc_ax.set_ylabel("accuracy")
        rew_ax.set_title(f"{bench}: mean reward")
        rew_ax.set_ylabel("mean reward")
        rew_ax.set_xlabel("training step")
        for ax in (acc_ax, rew_ax):
            ax.grid(alpha=0.3)
            ax.legend(title="training job", fontsize="small")
    fig.tight_layout()
    return fig


def _draw_forecast(ax, fc: pl.DataFrame, steps: list[int], colour: str, job: str) -> None:
    """The fitted curve from the job's first evaluated step to its final step, and the band at the final step."""
    import numpy as np

    from evaldag.decisions.forecast import sigmoid

    if fc.is_empty():
        return
    f = fc.row(0, named=True)
    xs = np.linspace(min(steps), max(f["final_step"], max(steps)), 100)
    ax.plot(xs, sigmoid(xs, f["A"], f["R0"], f["s_mid"], f["B"]), ":", color=colour, label=f"{job} forecast")
    ax.errorbar([f["final_step"]], [f["value"]], yerr=[[f["value"] - f["low"]], [f["high"] - f["value"]]],
                fmt="D", color=colour, capsize=4)


def plot(df: pl.DataFrame, out: str | Path, predicted: pl.DataFrame | None = None) -> Path:
    """Write `figure(df, predicted)` to `out` (PNG, or any format matplotlib knows by the suffix)."""
    import matplotlib.pyplot as plt

    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig = figure(df, predicted)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
