"""KL estimators: hand values, convergence to the exact KL of two categorical distributions, input checks."""

from __future__ import annotations

import math

import numpy as np
import polars as pl
import pytest

from evaldag.scoring.kl import kl_metrics, per_sample_kl, token_kl_terms


def test_hand_values():
    df = pl.DataFrame({"sample_id": ["a", "b"], "logp": [[-1.0, -2.0], [-0.5]], "ref_logp": [[-1.5, -1.0], [-0.5]]})
    per = per_sample_kl(df).sort("sample_id")
    r = [-0.5, 1.0]                                          # ref - logp for sample a
    assert per["n_tokens"].to_list() == [2, 1]
    assert per["kl_k1_sum"][0] == pytest.approx(-sum(r))
    assert per["kl_k2_sum"][0] == pytest.approx(sum(x * x / 2 for x in r))
    assert per["kl_k3_sum"][0] == pytest.approx(sum(math.exp(x) - 1 - x for x in r))
    assert per["kl_k3_mean"][0] == pytest.approx(per["kl_k3_sum"][0] / 2)
    assert per["kl_k1_sum"][1] == 0.0 and per["kl_k3_sum"][1] == 0.0
    m = kl_metrics(df)
    assert m["kl/k3/token_mean"] == pytest.approx(per["kl_k3_sum"].sum() / 3)
    assert m["kl/k3/sample_sum_mean"] == pytest.approx(per["kl_k3_sum"].mean())


def test_estimators_approach_exact_kl():
    p = np.array([0.6, 0.3, 0.1])
    q = np.array([0.3, 0.4, 0.3])
    exact = float(np.sum(p * np.log(p / q)))
    rng = np.random.default_rng(0)
    tokens = rng.choice(3, size=(2000, 100), p=p)            # 2000 samples of 100 tokens drawn from the policy
    df = pl.DataFrame({"logp": np.log(p)[tokens].tolist(), "ref_logp": np.log(q)[tokens].tolist()})
    m = kl_metrics(df)
    assert m["kl/k1/token_mean"] == pytest.approx(exact, abs=0.01)
    assert m["kl/k3/token_mean"] == pytest.approx(exact, abs=0.01)
    assert m["kl/k1/sample_sum_mean"] == pytest.approx(100 * exact, abs=1.0)
    # k3 is non-negative for every token (k1 is not)
    flat = pl.DataFrame({"logp": np.log(p)[tokens].ravel(), "ref_logp": np.log(q)[tokens].ravel()})
    terms = flat.select(**token_kl_terms(pl.col("logp"), pl.col("ref_logp")))
    assert terms["k3"].min() >= 0.0 and terms["k1"].min() < 0.0
    assert terms["k2"].min() >= 0.0


def test_k3_non_negative_for_tiny_differences():
    x = np.array([-1.0, -1.0 - 1e-17, -2.0, -3.0 + 1e-12])
    df = pl.DataFrame({"a": x, "b": np.array([-1.0 - 1e-17, -1.0, -2.0 + 1e-16, -3.0])})
    assert df.select(**token_kl_terms(pl.col("a"), pl.col("b")))["k3"].min() >= 0.0


def test_length_mismatch_names_the_sample():
    df = pl.DataFrame({"sample_id": ["a", "b"], "sample_index": [0, 3],
                       "logp": [[-1.0], [-1.0, -2.0]], "ref_logp": [[-1.0], [-1.0]]})
    with pytest.raises(ValueError, match=r"sample_id='b', sample_index=3.*2 tokens.*has 1"):
        per_sample_kl(df)
    with pytest.raises(ValueError, match="ref_logp"):
        kl_metrics(df.drop("ref_logp"))


def test_no_tokens_is_an_error():
    df = pl.DataFrame({"logp": [[]], "ref_logp": [[]]}, schema={"logp": pl.List(pl.Float64),
                                                                "ref_logp": pl.List(pl.Float64)})
    assert per_sample_kl(df)["n_tokens"].to_list() == [0]
    with pytest.raises(ValueError, match="no tokens"):
        kl_metrics(df)


# ---- what the logged KL means under the evaluation's decoding ----------------------------------------------------

def _greedy_two_token_case(tokens: int = 50) -> tuple[pl.DataFrame, float]:
    """pi = (.6, .4), ref = (.4, .6) at every position; greedy decoding always takes token 0."""
    pi, ref = np.array([0.6, 0.4]), np.array([0.4, 0.6])
    exact = float(np.sum(pi * np.log(pi / ref)))
    df = pl.DataFrame({"logp": [[math.log(0.6)] * tokens], "ref_logp": [[math.log(0.4)] * tokens],
                       "kl_exact": [[exact] * tokens]})
    return df, exact


def test_greedy_decoding_reports_the_exact_kl_not_the_sampling_estimators():
    from evaldag.request.config import SamplingConfig

    df, exact = _greedy_two_token_case()
    m = kl_metrics(df, sampling=SamplingConfig())                      # greedy: every benchmark's default
    assert exact == pytest.approx(0.0811, abs=1e-4)
    assert m["kl/exact/token_mean"] == pytest.approx(exact)
    assert m["kl/exact/sample_sum_mean"] == pytest.approx(50 * exact)
    # k1 would say 0.405 here: the estimators assume tokens drawn from the policy at temperature 1, so they are
    # not reported for greedy, tempered or nucleus decoding
    assert not any(k.startswith(("kl/k1", "kl/k2", "kl/k3")) for k in m)
    for sampling in (SamplingConfig(n=4, temperature=0.6), SamplingConfig(n=4, temperature=1.0, top_p=0.9)):
        assert not any(k.startswith("kl/k") for k in kl_metrics(df, sampling=sampling))


def test_sampling_at_temperature_one_reports_both_and_they_agree():
    from evaldag.request.config import SamplingConfig

    p, q = np.array([0.6, 0.3, 0.1]), np.array([0.3, 0.4, 0.3])
    exact = float(np.sum(p * np.log(p / q)))
    tokens = np.random.default_rng(0).choice(3, size=(2000, 50), p=p)
    df = pl.DataFrame({"logp": np.log(p)[tokens].tolist(), "ref_logp": np.log(q)[tokens].tolist(),
                       "kl_exact": np.full(tokens.shape, exact).tolist()})
    m = kl_metrics(df, sampling=SamplingConfig(n=4, temperature=1.0))
    assert m["kl/exact/token_mean"] == pytest.approx(exact)
    assert m["kl/k3/token_mean"] == pytest.approx(exact, abs=0.01)


def test_without_exact_kl_non_policy_sampling_is_refused():
    from evaldag.request.config import SamplingConfig

    df, _ = _greedy_two_token_case()
    with pytest.raises(ValueError, match="temperature 1"):
        kl_metrics(df.drop("kl_exact"), sampling=SamplingConfig())
    assert "kl/k1/token_mean" in kl_metrics(df.drop("kl_exact"), sampling=SamplingConfig(n=2, temperature=1.0))
