"""KL(policy || reference) estimated from the log-probabilities of completions sampled from the policy.

Input: a table with list[f64] columns `logp` (each generated token under the evaluated policy) and `ref_logp` (the
same tokens under the reference model), one row per sample. With r = ref_logp - logp per token (Schulman,
"Approximating KL Divergence", 2020), for tokens drawn from the policy:

- k1 = -r = logp - ref_logp: unbiased, but high variance and negative for many tokens;
- k2 = r^2 / 2: biased, low variance, always >= 0;
- k3 = (exp(r) - 1) - r: unbiased and always >= 0 (exp(r) >= 1 + r), usually the one to report.

Per sample we give the sum over its tokens (an estimate of the sequence-level KL) and the mean per token; the
dataset metrics are the token-weighted mean per token and the mean per-sample sum.
"""

from __future__ import annotations

import numpy as np
import polars as pl

ESTIMATORS = ("k1", "k2", "k3")


def _check_lengths(df: pl.DataFrame, logp_col: str, ref_col: str) -> None:
    for col in (logp_col, ref_col):
        if col not in df.columns:
            raise ValueError(f"KL needs list column {col!r}; the table has {df.columns}")
    bad = (df.with_row_index("_row")
           .filter(pl.col(logp_col).list.len().fill_null(-1) != pl.col(ref_col).list.len().fill_null(-1)))
    if bad.height:
        ids = [c for c in ("sample_id", "sample_index") if c in bad.columns] or ["_row"]
        row = bad.row(0, named=True)
        where = ", ".join(f"{c}={row[c]!r}" for c in ids)
        raise ValueError(f"sample {where}: {logp_col} has {_len(row[logp_col])} tokens but {ref_col} has "
                         f"{_len(row[ref_col])} ({bad.height} samples mismatch); both must score the same tokens")


def _len(values: list | None) -> str:
    return "null" if values is None else str(len(values))


def token_kl_terms(logp: pl.Expr, ref_logp: pl.Expr) -> dict[str, pl.Expr]:
    """Per-token k1, k2, k3 as expressions over two float columns (one row per token)."""
    r = ref_logp - logp
    return {
        "k1": -r,
        "k2": 0.5 * r * r,
        # expm1 keeps exp(r) - 1 exact for small r; the clip removes a last-ulp negative where r is ~1e-17.
        "k3": (r.map_batches(np.expm1, return_dtype=pl.Float64) - r).clip(lower_bound=0.0),
    }


def per_sample_kl(df: pl.DataFrame, logp_col: str = "logp", ref_col: str = "ref_logp") -> pl.DataFrame:
    """`df` with n_tokens and, per estimator, kl_<k>_sum (over the sample's tokens) and kl_<k>_mean (per token).

    A sample with no tokens gets n_tokens 0, sums 0.0 and null means (a mean over nothing is undefined).
    Raises ValueError naming the first sample whose two lists differ in length.
    """
    _check_lengths(df, logp_col, ref_col)
    tokens = (df.select(pl.int_range(pl.len(), dtype=pl.UInt32).alias("_row"), logp_col, ref_col)
              .explode([logp_col, ref_col]))          # one row per token
    terms = token_kl_terms(pl.col(logp_col), pl.col(ref_col))
    per = (tokens.with_columns(**{f"_{k}": e for k, e in terms.items()})
           .group_by("_row")
           .agg(n_tokens=pl.col(f"_{ESTIMATORS[0]}").count(),
                **{f"kl_{k}_sum": pl.col(f"_{k}").sum() for k in ESTIMATORS}))
    # An empty list explodes to a null row or to none (depending on the polars version); either way a sample
    # with no tokens has a KL sum of exactly 0.
    out = (df.with_row_index("_row").join(per, on="_row", how="left", maintain_order="left").drop("_row")
           .with_columns(pl.col("n_tokens").fill_null(0),
                         *[pl.col(f"kl_{k}_sum").fill_null(0.0) for k in ESTIMATORS]))
    return out.with_columns(**{f"kl_{k}_mean": pl.when(pl.col("n_tokens") > 0)
                              .then(pl.col(f"kl_{k}_sum") / pl.col("n_tokens")) for k in ESTIMATORS})


def kl_metrics(df: pl.DataFrame, logp_col: str = "logp", ref_col: str = "ref_logp") -> dict[str, float]:
    """Dataset KL estimates: kl/<k>/token_mean (all tokens pooled) and kl/<k>/sample_sum_mean (mean sequence KL)."""
    per = per_sample_kl(df, logp_col, ref_col)
    total_tokens = int(per["n_tokens"].sum())
    if total_tokens == 0:
        raise ValueError("no tokens to estimate KL from")
    row = per.select(**{f"kl/{k}/sample_sum_mean": pl.col(f"kl_{k}_sum").mean() for k in ESTIMATORS},
                     **{f"kl/{k}/token_mean": pl.col(f"kl_{k}_sum").sum() / total_tokens for k in ESTIMATORS},
                     ).row(0, named=True)
    return {k: float(v) for k, v in row.items()}
