"""KL(policy || reference) along the evaluated completions: exact per position, and the sampling estimators.

Two kinds of figures, named apart so that nobody mistakes one for the other:

- `kl/exact/*` (column `kl_exact`): at each generated position, the exact KL between the two models' next-token
  distributions over the whole vocabulary (temperature 1, from both models' logits; see HFEngine.
  score_with_reference). It assumes nothing about how the completion was decoded: under greedy decoding it is the
  models' divergence at the positions the evaluation visited. `token_mean` averages it over positions,
  `sample_sum_mean` is the mean over samples of its sum along the completion (the sequence KL when the completions
  are samples from the policy at temperature 1).
- `kl/k1|k2|k3/*`: Monte-Carlo estimators from the sampled tokens' log-probabilities only. They estimate the KL only
  when the tokens were drawn from the policy itself: temperature 1 and top_p 1. Under greedy (every benchmark's
  default), tempered or nucleus decoding they measure something else (pi = (.6, .4), ref = (.4, .6), greedy:
  k1 = 0.405 against a true KL of 0.081), so they are reported only for such sampling, and without an exact
  column the KL of other decoding is refused.

Input: a table with list[f64] columns `logp` (each generated token under the evaluated policy) and `ref_logp` (the
same tokens under the reference model), and optionally `kl_exact`, one row per sample. With r = ref_logp - logp per
token (Schulman, "Approximating KL Divergence", 2020), for tokens drawn from the policy:

- k1 = -r = logp - ref_logp: unbiased, but high variance and negative for many tokens;
- k2 = r^2 / 2: biased, low variance, always >= 0;
- k3 = (exp(r) - 1) - r: unbiased and always >= 0 (exp(r) >= 1 + r), usually the one to report.

Per sample we give the sum over its tokens (an estimate of the sequence-level KL) and the mean per token; the
dataset metrics are the token-weighted mean per token and the mean per-sample sum.
"""

from __future__ import annotations

import numpy as np
import polars as pl

from evaldag.request.config import SamplingConfig

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


def samples_the_policy(sampling: SamplingConfig | None) -> bool:
    """Whether completions drawn with `sampling` are samples of the policy's own distribution (temperature 1, no
    nucleus cut): the condition of the k1/k2/k3 estimators. None stands for tokens known to be drawn so."""
    return sampling is None or (sampling.temperature == 1.0 and sampling.top_p == 1.0)


def kl_metrics(df: pl.DataFrame, logp_col: str = "logp", ref_col: str = "ref_logp",
               sampling: SamplingConfig | None = None, exact_col: str = "kl_exact") -> dict[str, float]:
    """Dataset KL figures (see the module docstring): kl/exact/token_mean and kl/exact/sample_sum_mean when the table
    has the exact per-position KL; kl/<k>/token_mean (all tokens pooled) and kl/<k>/sample_sum_mean (mean sequence
    estimate) when `sampling` draws from the policy (`samples_the_policy`).

    Raises ValueError when neither applies: completions not sampled from the policy and no exact KL.
    """
    per = per_sample_kl(df, logp_col, ref_col)
    total_tokens = int(per["n_tokens"].sum())
    if total_tokens == 0:
        raise ValueError("no tokens to estimate KL from")
    out: dict[str, float] = {}
    if exact_col in df.columns and df[exact_col].null_count() == 0:
        exact = df.select(n=pl.col(exact_col).list.len(), total=pl.col(exact_col).list.sum())
        if not exact["n"].equals(per["n_tokens"].cast(exact["n"].dtype)):
            raise ValueError(f"{exact_col} has a different number of positions than {logp_col} for some sample")
        out["kl/exact/token_mean"] = float(exact["total"].sum() / total_tokens)
        out["kl/exact/sample_sum_mean"] = float(exact["total"].mean())
    if samples_the_policy(sampling):
        row = per.select(**{f"kl/{k}/sample_sum_mean": pl.col(f"kl_{k}_sum").mean() for k in ESTIMATORS},
                         **{f"kl/{k}/token_mean": pl.col(f"kl_{k}_sum").sum() / total_tokens for k in ESTIMATORS},
                         ).row(0, named=True)
        out.update({k: float(v) for k, v in row.items()})
    elif not out:
        raise ValueError(f"KL from sampled tokens needs completions drawn from the policy (temperature 1, top_p 1), "
                         f"not temperature {sampling.temperature}, top_p {sampling.top_p}; and no exact per-position "
                         f"KL was computed (it needs both models on the hf engine)")
    return out
