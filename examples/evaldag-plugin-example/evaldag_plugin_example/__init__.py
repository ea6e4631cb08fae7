"""Example evaldag plug-ins: what a team writes to add a reward and a statistic without editing evaldag.

A benchmark config then names them (configs/benchmarks/<name>.yaml):

    rewards:
      - {name: correctness, weight: 1.0}
      - {name: brevity, weight: 0.1, params: {target_tokens: 256}}
    metrics: [boxed_share]

or, without installing the package's entry points, by `evaldag_plugin_example:brevity` where it is importable.
"""

from __future__ import annotations

import polars as pl


def brevity(target_tokens: int = 256) -> pl.Expr:
    """A reward: 1.0 for a completion of at most `target_tokens` tokens, falling linearly to 0.0 at twice that.

    A reward plug-in returns a polars expression over the graded table (one float per completion), so evaldag
    scores a million rows in one pass."""
    if target_tokens <= 0:
        raise ValueError(f"brevity needs target_tokens > 0, got {target_tokens}")
    over = (pl.col("completion_tokens").cast(pl.Float64) - target_tokens) / target_tokens
    return 1.0 - over.clip(0.0, 1.0)


def boxed_share(graded: pl.DataFrame) -> dict[str, float]:
    """A statistic: the share of completions that give their answer in \\boxed{...}, overall and among wrong ones.

    A metric plug-in takes the graded table and returns {metric name: number}; names of its own (here prefixed
    with the plug-in's) so that they do not clash with evaldag's metrics. A figure with nothing to be over is
    left out, not logged as 0."""
    boxed = pl.col("completion").str.contains(r"\\boxed\s*\{").fill_null(False).cast(pl.Float64)
    out = {"boxed_share": float(graded.select(boxed.mean()).item())}
    wrong = graded.filter(pl.col("status") == "wrong")
    if wrong.height:
        out["boxed_share/wrong"] = float(wrong.select(boxed.mean()).item())
    return out
