"""Evaluation loss (evaldag.scoring.eval_loss) and its smoothness diagnostic (diagnostics.eval_loss_jump), checked
against independent computations: numpy means and scipy's paired t-test."""

from __future__ import annotations

import math

import numpy as np
import polars as pl
import pytest
from scipy.stats import ttest_rel

from evaldag.scoring.diagnostics import eval_loss_jump
from evaldag.scoring.eval_loss import (eval_loss_metrics, per_problem_losses, reference_text, score_solutions,
                                       solutions_digest)


def test_metrics_are_the_mean_of_per_problem_token_means():
    logprobs = [[-1.0, -2.0, -3.0], [-0.5], [-4.0, 0.0], []]          # the last: no token, left out
    losses = per_problem_losses(["a", "b", "c", "d"], logprobs)
    assert losses["eval_loss_nll"].to_list() == [6.0, 0.5, 4.0, 0.0]
    m = eval_loss_metrics(losses)
    per = np.array([2.0, 0.5, 2.0])
    assert m["eval_loss"] == pytest.approx(per.mean())
    assert m["eval_loss_se"] == pytest.approx(per.std(ddof=1) / math.sqrt(3))
    assert m["eval_loss/token_weighted"] == pytest.approx(10.5 / 6)
    assert (m["eval_loss_problems"], m["eval_loss_tokens"]) == (3.0, 6.0)


def test_metrics_refuse_nothing_scored_and_duplicates():
    with pytest.raises(ValueError, match="no problem"):
        eval_loss_metrics(per_problem_losses(["a"], [[]]))
    with pytest.raises(ValueError, match="more than once"):
        eval_loss_metrics(per_problem_losses(["a", "a"], [[-1.0], [-2.0]]))
    with pytest.raises(ValueError, match="2 problems but 1"):
        per_problem_losses(["a", "b"], [[-1.0]])


def test_reference_text_drops_gsm8k_calculator_annotations_only():
    raw = "Janet sells 16 - 3 - 4 = <<16-3-4=9>>9 duck eggs.\n#### 18"
    assert reference_text(raw, "gsm8k") == "Janet sells 16 - 3 - 4 = 9 duck eggs.\n#### 18"
    assert reference_text(" $x<<y$ \n", "latex") == "$x<<y$"
    # another format's text with both << and >> is the dataset's own (much less / greater than): scored whole
    solution = "For $0 < x<<1$ and $y>>1$, $xy \\approx 0$."
    assert reference_text(solution, "latex") == reference_text(solution, "number") == solution


def test_digest_follows_the_texts():
    base = solutions_digest(["a", "b"], ["x", "y"])
    assert base == solutions_digest(["a", "b"], ["x", "y"])
    assert base != solutions_digest(["a", "b"], ["x", "y "]) != solutions_digest(["b", "a"], ["x", "y"])
    # where an id ends and its text begins, and where one problem ends and the next begins, is part of the digest
    assert solutions_digest(["ab"], ["c"]) != solutions_digest(["a"], ["bc"])
    assert solutions_digest(["a:b"], ["c"]) != solutions_digest(["a"], ["b:c"])
    assert solutions_digest(["a", "b"], ["xb", "y"]) != solutions_digest(["a", "bb"], ["x", "y"])
    assert base != solutions_digest(["a"], ["x1:by"])                  # a text that reads as the next problem
    assert base != solutions_digest(["a1:xb"], ["y"])                  # an id that reads as the problem before


class _Tokenizer:
    def __call__(self, texts, add_special_tokens=True):
        assert add_special_tokens is False      # the chat template holds the special tokens
        return {"input_ids": [[ord(c) for c in t] for t in texts]}


class _Engine:
    tokenizer = _Tokenizer()

    def score(self, prompts, ids):
        return [[-0.1 * t for t in c] for c in ids]


def test_score_solutions_scores_the_tokenized_text_after_the_prompt():
    assert score_solutions(_Engine(), ["p1", "p2"], ["ab", ""]) == [[-9.700000000000001, -9.8], []]
    with pytest.raises(ValueError, match="cannot score"):
        score_solutions(object(), ["p"], ["a"])


# ---- eval_loss_jump ----------------------------------------------------------------------------------------------

def _table(steps_losses: dict[int, np.ndarray]) -> pl.DataFrame:
    return pl.concat([pl.DataFrame({"step": [s] * len(v), "sample_id": [f"p{i}" for i in range(len(v))],
                                    "loss": v.astype(float)}) for s, v in steps_losses.items()])


def test_jump_is_scipys_paired_t_test():
    rng = np.random.default_rng(0)
    hard = rng.normal(1.0, 0.4, size=40)                         # problems differ a lot in difficulty
    a, b = hard + rng.normal(0, 0.02, 40), hard + 0.03 + rng.normal(0, 0.02, 40)
    d = eval_loss_jump(_table({100: a, 200: b}))
    j = d.details["jumps"][0]
    ref = ttest_rel(b, a)
    assert j["p"] == pytest.approx(ref.pvalue, rel=1e-9) and j["t"] == pytest.approx(abs(ref.statistic))
    assert j["delta"] == pytest.approx((b - a).mean()) and j["m"] == 40
    assert d.fired and "step 100 -> 200" in d.explanation and d.action != "None."
    # unpaired, the same move is far inside the two checkpoints' own errors: the pairing is what sees it
    se_unpaired = math.sqrt(a.var(ddof=1) / 40 + b.var(ddof=1) / 40)
    assert abs(b.mean() - a.mean()) < 1.0 * se_unpaired


def test_jump_pairs_only_common_problems_and_bonferroni_over_jumps():
    rng = np.random.default_rng(1)
    hard = rng.normal(1.0, 0.4, size=30)
    t = _table({1: hard, 2: hard + rng.normal(0, 0.05, 30), 3: (hard + rng.normal(0, 0.05, 30))[:20]})
    d = eval_loss_jump(t, alpha=0.05)
    assert [j["m"] for j in d.details["jumps"]] == [30, 20]
    assert d.details["level"] == pytest.approx(0.025)
    assert eval_loss_jump(t, alpha=0.05, bonferroni=False).details["level"] == 0.05


def test_jump_quiet_on_noise_at_about_alpha():
    fired = []
    for seed in range(200):
        rng = np.random.default_rng(seed)
        hard = rng.normal(1.0, 0.4, size=50)
        fired.append(eval_loss_jump(_table({s: hard + rng.normal(0, 0.05, 50) for s in (1, 2, 3, 4)}),
                                    alpha=0.05).fired)
    assert np.mean(fired) <= 0.09          # Bonferroni over 3 jumps: about 0.05 or less


def test_jump_edge_cases():
    same = np.array([1.0, 2.0, 3.0])
    assert not eval_loss_jump(_table({1: same, 2: same})).fired                 # no change at all
    shifted = eval_loss_jump(_table({1: same, 2: same + 0.5}))                  # every problem moved alike
    assert shifted.fired and shifted.details["jumps"][0]["p"] == 0.0
    with pytest.raises(ValueError, match="at least 2 checkpoints"):
        eval_loss_jump(_table({1: same}))
    with pytest.raises(ValueError, match="more than once"):
        eval_loss_jump(pl.concat([_table({1: same, 2: same}), _table({2: same})]))


@pytest.mark.model
def test_loss_of_a_reference_solution_is_the_forward_pass_nll_on_the_default_model():
    """score_solutions on the transformers engine (batched, right-padded) gives, per problem, the mean nll per token
    of the solution after the chat-templated prompt, as one forward pass over that sequence alone computes it."""
    import json

    import torch

    from evaldag import paths
    from evaldag.engines import load_engine
    from evaldag.request.checkpoint import resolve_model

    rows = [json.loads(line) for line in
            (paths.data_dir() / "math500" / "test.jsonl").read_text().splitlines()[:3]]
    prompts = [f"{r['problem']}\nPlease reason step by step, and put your final answer within \\boxed{{}}."
               for r in rows]
    solutions = [r["solution"] for r in rows]
    engine = load_engine("hf", resolve_model("smollm2-135m-instruct").path, "float32", batch_size=2)
    try:
        losses = per_problem_losses([r["unique_id"] for r in rows], score_solutions(engine, prompts, solutions))
        tok, model = engine.tokenizer, engine.model
        for k, (prompt, solution) in enumerate(zip(prompts, solutions)):
            p_ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                            tokenize=True, return_dict=True)["input_ids"]
            s_ids = tok(solution, add_special_tokens=False)["input_ids"]
            with torch.inference_mode():
                logits = model(input_ids=torch.tensor([list(p_ids) + s_ids])).logits[0].float()
            logp = torch.log_softmax(logits[len(p_ids) - 1:-1], -1).gather(1, torch.tensor(s_ids)[:, None])
            assert losses["eval_loss_tokens"][k] == len(s_ids)
            assert losses["eval_loss_nll"][k] / len(s_ids) == pytest.approx(-logp.mean().item(), rel=1e-4)
    finally:
        engine.close()


# ---- at track time: this evaluation against the job's previous checkpoint (evaldag.tracking.history) -------------

class _ArtifactClient:
    """What eval_loss_diagnostics asks of an MlflowClient: another run's samples/samples.parquet."""

    def __init__(self, tables: dict[str, pl.DataFrame]):
        self.tables = tables

    def download_artifacts(self, run_id, path, dst):
        out = f"{dst}/samples.parquet"
        self.tables[run_id].write_parquet(out)
        return out


def _samples(losses: np.ndarray | None, n: int = 2) -> pl.DataFrame:
    """A samples.parquet table: n rows per problem, each with its problem's eval_loss (when given)."""
    ids = [f"p{i}" for i in range(40) for _ in range(n)]
    df = pl.DataFrame({"sample_id": ids, "correct": [True] * len(ids)})
    return df if losses is None else df.with_columns(eval_loss=pl.Series(np.repeat(losses, n)))


def test_track_time_diagnostic_pairs_this_run_with_the_previous_checkpoint(tmp_path, monkeypatch):
    from evaldag.decisions import verdicts
    from evaldag.tracking.history import eval_loss_diagnostics

    rng = np.random.default_rng(3)
    hard = rng.normal(1.0, 0.4, size=40)
    before = hard + rng.normal(0, 0.02, 40)
    monkeypatch.setattr(verdicts, "earlier_evaluations", lambda *a, **k: [{"run_id": "old", "step": 50},
                                                                           {"run_id": "prev", "step": 100}])
    mine = tmp_path / "samples.parquet"

    def diagnose(now: np.ndarray | None, previous: pl.DataFrame):
        (_samples(now)).write_parquet(mine)
        return eval_loss_diagnostics(_ArtifactClient({"prev": previous}), "1", "job", "key", 200, mine)

    [jump] = diagnose(before + 0.05, _samples(before))
    assert jump.name == "eval_loss_jump" and jump.fired and "step 100 -> 200" in jump.explanation
    assert jump.details["jumps"][0]["m"] == 40
    assert jump.details["jumps"][0]["delta"] == pytest.approx(0.05)
    [calm] = diagnose(before + rng.normal(0, 0.02, 40), _samples(before))
    assert not calm.fired
    [untested] = diagnose(before, _samples(None))
    assert not untested.fired and "step 100" in untested.explanation and "no eval_loss" in untested.explanation
    assert diagnose(None, _samples(before)) == []          # this evaluation has no eval_loss: nothing to say
