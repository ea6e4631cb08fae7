"""Sequential stopping without a server (evaldag.decisions.decide): the decision order, the prefix the parent reads, the
stop a shard obeys, the rows a later full evaluation reuses, and the reduce of a stopped evaluation. The real run
through the stack is tests/test_decide_e2e.py."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import numpy as np
from scipy import stats
import polars as pl
import pytest

from evaldag.decisions import best as best_of_job, decide, pacing, sequential, verdicts
from evaldag.pipeline import generate
from evaldag.storage import store
from evaldag.decisions.decide import Decider, Decision, decision_order, round_ends, stop_path, stop_requested
from evaldag.errors import ConfigError
from evaldag.request.plan import EvalRequest, resolve
from evaldag.storage.schema import GENERATION_SCHEMA, write_table
from evaldag.decisions.sequential import sequential_verdict
from evaldag.pipeline.generate import generate_shard
from evaldag.pipeline.grade import grade_rows
from evaldag.pipeline.reduce import reduce_results
import test_stages
from test_stages import StreamingEngine

setup, streaming = test_stages.setup, test_stages.streaming      # the stand-in engines' fixtures


def test_decision_order_is_a_seeded_permutation_that_every_subset_agrees_with():
    ids = [f"p{i}" for i in range(50)]
    order = decision_order(ids, seed=0)
    assert sorted(order) == sorted(ids) and order != ids
    assert decision_order(list(reversed(ids)), seed=0) == order          # the input order does not matter
    assert decision_order(ids, seed=1) != order
    subset = ids[::3]                    # a shard's problems: the same relative order as in the whole
    assert decision_order(subset, seed=0) == [sid for sid in order if sid in set(subset)]


def test_round_ends_are_equal_steps_ending_with_every_problem():
    assert round_ends(40, 10) == [4, 8, 12, 16, 20, 24, 28, 32, 36, 40]
    assert round_ends(7, 3) == [3, 5, 7]
    assert round_ends(3, 10) == [1, 2, 3]
    assert round_ends(5, 1) == [5]


def _decide_plan(ckpt, results, limit=8, **options):
    return resolve(EvalRequest(benchmark="aime24", checkpoint=str(ckpt), limit=limit, num_shards=1,
                               decide="vs_best", **options), results)


def test_decide_changes_the_eval_key_not_the_generations(setup):
    """On vLLM (seeded and scheduled per request) a decided evaluation generates what a full one does, so their rows
    are shared; a static-batch engine cuts its batches along the decision order instead, which is another
    generation."""
    ckpt, _, results = setup
    full = resolve(EvalRequest(benchmark="aime24", checkpoint=str(ckpt), limit=8, num_shards=1, engine="vllm"),
                   results)
    decided = _decide_plan(ckpt, results, engine="vllm")
    other_margin = _decide_plan(ckpt, results, decide_margin=0.1, engine="vllm")
    assert decided.generation_key == full.generation_key == other_margin.generation_key
    assert len({full.eval_key, decided.eval_key, other_margin.eval_key}) == 3
    full_hf = resolve(EvalRequest(benchmark="aime24", checkpoint=str(ckpt), limit=8, num_shards=1, engine="hf"),
                      results)
    assert _decide_plan(ckpt, results, engine="hf").generation_key != full_hf.generation_key
    assert decided.decide_settings == (0.05, 0.02, 10) and full.decide_settings is None
    with pytest.raises(ConfigError, match="decide .* reference"):
        _decide_plan(ckpt, results, reference=str(ckpt))
    with pytest.raises(ConfigError, match="decide"):
        EvalRequest.parse(benchmark="aime24", decide="vs_worst")


def test_in_flight_is_the_batch_size_unless_set(setup, monkeypatch):
    ckpt, _, results = setup
    plan = _decide_plan(ckpt, results)
    full = resolve(EvalRequest(benchmark="aime24", checkpoint=str(ckpt), limit=8, num_shards=1), results)
    assert decide.in_flight(full, {}) is None
    assert decide.in_flight(plan, {}) == plan.model.batch_size
    assert decide.in_flight(plan, {"EVALDAG_DECIDE_IN_FLIGHT": "3"}) == 3
    for bad in ("0", "many"):
        with pytest.raises(ValueError, match="EVALDAG_DECIDE_IN_FLIGHT"):
            decide.in_flight(plan, {"EVALDAG_DECIDE_IN_FLIGHT": bad})


def test_a_stopped_shard_finishes_the_decided_prefix_and_a_full_evaluation_generates_only_the_rest(streaming,
                                                                                                      monkeypatch):
    """The parent's stop (a file naming the decided prefix) makes the shard withdraw every request outside the
    prefix and finish the prefix's own: every sample of the prefix is written, of the others only what finished
    before the stop, nothing is merged; the full evaluation of the same checkpoint (same generation key) then
    generates only the samples the stopped one did not, and its rows for the others are the stopped run's."""
    ckpt, _, results = streaming
    monkeypatch.setenv("EVALDAG_DECIDE_IN_FLIGHT", "2")
    monkeypatch.setattr(generate, "workload", lambda shard: None)   # sizing vLLM reads a real tokenizer
    plan = _decide_plan(ckpt, results, sampling={"n": 2, "temperature": 0.7}, engine="vllm")
    order = decision_order(plan.sample_ids(), plan.sampling.seed)
    finished = []

    def on_finish(request):
        finished.append(request.key)
        if len(finished) == 3:
            store.write_text(stop_path(plan), json.dumps({"problems": 3}))

    StreamingEngine.on_finish, StreamingEngine.delay, StreamingEngine.in_flight = on_finish, 0.6, []
    StreamingEngine.generated = []
    assert generate_shard(plan, 0) is None
    assert StreamingEngine.in_flight == [2] and stop_requested(plan)
    assert len(StreamingEngine.submitted[-1]) == 16                     # a request per sample
    assert not plan.generations_path(0).exists()
    chunks = store.chunks_dir(plan.generations_path(0))
    kept = pl.concat([pl.read_parquet(p) for p in store.chunk_files(chunks)])
    assert kept.select("sample_id", "sample_index").is_unique().all()
    prefix = set(order[:3])
    assert kept.filter(pl.col("sample_id").is_in(prefix)).height == 6    # the prefix whole
    others = kept.filter(~pl.col("sample_id").is_in(prefix)).height
    assert 0 < others < 10 and kept.height == len(StreamingEngine.generated)   # withdrawn ones were not generated

    full = resolve(EvalRequest(benchmark="aime24", checkpoint=str(ckpt), limit=8, num_shards=1,
                               sampling={"n": 2, "temperature": 0.7}, engine="vllm"), results)
    StreamingEngine.on_finish, StreamingEngine.delay, StreamingEngine.generated = None, 0.0, []
    rows = pl.read_parquet(generate_shard(full, 0))
    # nothing computed twice: the full evaluation generates the 16 samples less those kept
    assert len(StreamingEngine.generated) == 16 - kept.height
    assert rows.height == 16 and rows.select("sample_id", "sample_index").is_unique().all()
    cols = ["sample_id", "sample_index", "completion"]
    kept_keys = kept.select("sample_id", "sample_index")
    assert (rows.join(kept_keys, on=["sample_id", "sample_index"]).select(cols).sort(cols)
            .equals(kept.select(cols).sort(cols)))


def test_a_shard_relaunched_after_the_stop_generates_only_the_prefix_it_lacks(streaming, monkeypatch):
    """A shard started when the stop file is already there (its node was lost after the decision) generates only
    the decided prefix's missing samples."""
    ckpt, _, results = streaming
    monkeypatch.setattr(generate, "workload", lambda shard: None)
    plan = _decide_plan(ckpt, results, sampling={"n": 2, "temperature": 0.7}, engine="vllm")
    order = decision_order(plan.sample_ids(), plan.sampling.seed)
    store.write_text(stop_path(plan), json.dumps({"problems": 2}))
    StreamingEngine.on_finish, StreamingEngine.delay, StreamingEngine.generated = None, 0.0, []
    assert generate_shard(plan, 0) is None
    kept = pl.concat([pl.read_parquet(p) for p in store.chunk_files(store.chunks_dir(plan.generations_path(0)))])
    assert sorted(kept["sample_id"].unique()) == sorted(order[:2]) and kept.height == 4


def _rows(plan, sample_ids, text):
    inputs = plan.inputs().filter(pl.col("sample_id").is_in(sample_ids))
    return pl.DataFrame([{**r, "sample_index": k, "shard_index": 0, "completion": text(r), "completion_ids": [1],
                          "prompt_tokens": 5, "completion_tokens": 10, "finish_reason": "stop", "latency_s": 0.1,
                          "batch_size": 1} for r in inputs.to_dicts() for k in range(plan.sampling.n)],
                        schema=GENERATION_SCHEMA)


def test_the_parent_decides_without_waiting_for_the_longest_answers_and_reduces_the_complete_prefix(setup):
    """A round decides while one of its problems is still generating (its samples bounded by their extremes), but
    not where that problem could still change the verdict; the stop file names the round's prefix; the decision
    is final, and its figures exact, once that problem is in; the stopped evaluation's metrics are exactly those
    of the prefix."""
    ckpt, _, results = setup
    plan = _decide_plan(ckpt, results, limit=30, decide_rounds=15)       # a verdict every 2 problems
    n = plan.sampling.n
    order = decision_order(plan.sample_ids(), plan.sampling.seed)
    incumbent = pl.DataFrame({"sample_id": order, "n": [n] * 30, "score": [1.0] * 30})   # solved every problem
    chunks = store.chunks_dir(plan.generations_path(0))
    wrong = lambda r: "The answer is \\boxed{-12345}."                  # noqa: E731 - never an AIME answer
    graded_calls = []

    def grade(rows):
        graded_calls.append(rows["sample_id"].to_list())
        return grade_rows(plan, rows)

    # the premises, from the round ends' intervals on complete data: all wrong, undecided on 4 problems, decided on
    # 6; and decided on 8 even if problem 3 were right every time, not on 6
    looks = tuple(range(2, 31, 2))
    first_decided = next(t for t in looks if sequential_verdict(-np.ones(t), looks, 0.05, 0.02).verdict != "undecided")
    assert first_decided == 6
    best_case = lambda t: np.where(np.arange(t) == 3, 0.0, -1.0)          # noqa: E731
    assert sequential_verdict(best_case(6), looks, 0.05, 0.02).verdict == "undecided"
    assert sequential_verdict(best_case(8), looks, 0.05, 0.02).verdict == "worse"

    decider = Decider(plan, incumbent, "job@1", grade)
    assert decider.looks == looks
    write_table(_rows(plan, order[:3] + order[4:6], wrong), chunks / "requests-000001.parquet", GENERATION_SCHEMA)
    assert decider.poll() is None and decider.stopped_at is None and not stop_requested(plan)
    # everything up to 10 but problem 3, whose answers still run: the round ending at 8 decides anyway
    write_table(_rows(plan, order[6:10], wrong), chunks / "requests-000002.parquet", GENERATION_SCHEMA)
    assert decider.poll() is None
    assert decider.stopped_at == 8 and json.loads(stop_path(plan).read_text())["problems"] == 8
    assert Decision.load(plan) is None                          # not final before problem 3 is in
    write_table(_rows(plan, order[3:4], wrong), chunks / "requests-000003.parquet", GENERATION_SCHEMA)
    decision = decider.poll()
    assert decision is not None and decision.stopped and decision.verdict == "worse"
    assert decision.problems == 8 and decision.prefix == order[:8] and decision.pairs == 8
    assert decision.diff == -1.0 and decision.ci_high < 0
    assert sorted(sum(graded_calls, [])) == sorted(order[:10] * n)       # each sample graded once
    assert decision.tokens_generated == 10 * n * 10 and decision.tokens_full_est == 30 * n * 10
    assert Decision.load(plan) == decision
    metrics = reduce_results(plan, [str(decide.graded_prefix_path(plan))], decision.prefix)
    assert metrics["n_samples"] == 8 * n and metrics["accuracy"] == 0.0
    assert json.loads(plan.path("metrics.json").read_text())["n_samples"] == 8 * n
    assert decision.metrics()["decide.tokens_saved_est"] == 20 * n * 10
    assert "worse after 8 of 30 problems" in decision.describe()

    # a decider of a retry, when these rows exist: it keeps the stop's prefix and reuses the rows
    reused = Decider(plan, incumbent, "job@1", grade)
    assert reused.stopped_at == 8
    again = reused.poll()
    assert (again.problems, again.tokens_generated, again.tokens_reused) == (8, 0, 10 * n * 10)


def test_decider_against_every_candidate_for_the_best(setup):
    """Given k candidates for the job's best, the Decider's looks are over the problems all of them have and its
    upper bounds use alpha / k (issue 54): two candidates, one missing a problem."""
    ckpt, _, results = setup
    plan = _decide_plan(ckpt, results, limit=30, decide_rounds=15)
    n = plan.sampling.n
    order = decision_order(plan.sample_ids(), plan.sampling.seed)
    one = pl.DataFrame({"sample_id": order, "n": [n] * 30, "score": [1.0] * 30})
    two = one.filter(pl.col("sample_id") != order[0])
    decider = Decider(plan, [one, two], "job@1", lambda rows: grade_rows(plan, rows))
    assert decider.paired == order[1:] and decider.looks == tuple(range(1, 30, 2))
    assert decider.z == sequential.pocock_boundary(decider.looks, 0.05)
    assert decider.z_k == sequential.pocock_boundary(decider.looks, 0.05 / 2) > decider.z


def test_best_so_far_returns_every_full_earlier_evaluation(setup, tmp_path, monkeypatch):
    """decide's incumbent is every candidate for the job's best (the earlier full evaluations on the same comparison
    key), read from a real MLflow store; one stopped early is none, nor is a later step (issue 54)."""
    import mlflow

    from evaldag.decisions.series import comparison_key
    from evaldag.tracking.incumbent import best_so_far
    from evaldag.tracking.names import COMPARISON_TAG, DECIDE_STATUS_TAG, experiment_name

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    ckpt, _, results = setup
    plan = _decide_plan(ckpt, results, train_run="job", step=400)
    client = mlflow.MlflowClient()
    experiment = client.create_experiment(experiment_name(plan.benchmark.name),
                                          artifact_location=(tmp_path / "artifacts").as_uri())
    ids = plan.sample_ids()
    for step, accuracy, stopped in ((100, 0.5, False), (200, 0.75, False), (300, 0.9, True), (500, 1.0, False)):
        run = client.create_run(experiment, tags={"train_run": "job", "step": str(step), "kind": "ckpt_eval",
                                                  COMPARISON_TAG: comparison_key(plan),
                                                  **({DECIDE_STATUS_TAG: "stopped"} if stopped else {})})
        client.log_metric(run.info.run_id, "accuracy", accuracy)
        samples = tmp_path / f"samples-{step}" / "samples.parquet"
        samples.parent.mkdir()
        right = round(accuracy * len(ids))
        pl.DataFrame({"sample_id": ids, "correct": [k < right for k in range(len(ids))]}).write_parquet(samples)
        client.log_artifact(run.info.run_id, str(samples), "samples")
        client.set_terminated(run.info.run_id)
    scores, label = best_so_far(plan)
    assert label == "job@200"
    assert sorted(float(f["score"].mean()) for f in scores) == [0.5, 0.75]


class _State:
    """A vLLM request state as evaldag.engines.vllm reads it (vLLM itself needs a GPU or its CPU build)."""

    def __init__(self, rid: str, tokens: int) -> None:
        self.request_id, self.is_prefilling = rid, False
        self.detokenizer = type("Detokenizer", (), {"num_output_tokens": lambda _self: tokens})()


class _Engine:
    def __init__(self) -> None:
        self.output_processor = type("Processor", (), {"request_states": {}})()
        self.aborted: list[str] = []

    def abort_request(self, ids) -> None:
        self.aborted += list(ids)
        for rid in ids:
            self.output_processor.request_states.pop(rid, None)


def test_tokens_of_withdrawn_requests_are_counted_as_generated(setup):
    """Requests withdrawn at the stop had generated tokens that no row holds: the engine counts them at the abort
    (vllm._Feed), the shard records them (decide.record_withdrawn), and the decision's `decide.tokens_generated`
    includes them, so its `decide.tokens_saved_est` does not (issue 54)."""
    from evaldag.engines.base import Request
    from evaldag.engines.vllm import _Feed

    engine = _Engine()
    requests = [Request(k, "p", k) for k in range(3)]
    added: list[str] = []

    def add(i: int) -> str:
        rid = f"r{i}"
        engine.output_processor.request_states[rid] = _State(rid, 100 * (i + 1))
        added.append(rid)
        return rid

    gone: frozenset = frozenset()
    feed = _Feed(engine, requests, add, 2, None, lambda: gone)
    feed.top_up()
    assert added == ["r0", "r1"] and feed.withdrawn_tokens == 0
    gone = frozenset({1, 2})                  # r1 runs (200 tokens so far), request 2 never started
    feed.top_up()
    assert engine.aborted == ["r1"] and feed.withdrawn_tokens == 200 and added == ["r0", "r1"]

    ckpt, _, results = setup
    plan = _decide_plan(ckpt, results, limit=30)
    decision = Decision("stopped", "worse", "job@1", 8, 30, 8, -1.0, -1.0, -0.5, tokens_generated=100,
                        tokens_full_est=3000, prefix=[])
    decision.save(plan)
    decide.record_withdrawn(plan, 0, "a1", 200)
    decide.record_withdrawn(plan, 1, "b2", 50)
    loaded = Decision.load(plan)
    assert loaded.tokens_withdrawn == 250 and loaded.tokens_spent == 350
    assert loaded.metrics()["decide.tokens_generated"] == 350
    assert loaded.metrics()["decide.tokens_saved_est"] == 3000 - 350


def test_an_undecided_evaluation_runs_to_the_end(setup):
    """A checkpoint as good as the incumbent on too few problems to be called equivalent: no round decides, the
    parent never stops it, and the final decision covers every problem."""
    ckpt, _, results = setup
    plan = _decide_plan(ckpt, results, limit=6, decide_rounds=3)
    order = decision_order(plan.sample_ids(), plan.sampling.seed)
    golds = dict(plan.inputs().select("sample_id", "gold").iter_rows())
    incumbent = pl.DataFrame({"sample_id": order, "n": [1] * 6, "score": [1.0] * 6})
    decider = Decider(plan, incumbent, "job@1", lambda rows: grade_rows(plan, rows))
    chunks = store.chunks_dir(plan.generations_path(0))
    right = _rows(plan, order, lambda r: f"The answer is \\boxed{{{golds[r['sample_id']]}}}.")
    write_table(right, chunks / "requests-000001.parquet", GENERATION_SCHEMA)
    assert decider.poll() is None
    graded = grade_rows(plan, right)
    final = decider.final(graded)
    assert final.status == "completed" and not final.stopped and final.problems == 6
    assert final.verdict == "undecided" and final.diff == 0.0
    assert "decide.tokens_saved_est" not in final.metrics()


# ---- asked for by the trainer: CheckpointNotifier(decide=...) -> the event -> the evaluation's parameters -------

def test_check_decide_normalises_and_names_what_is_wrong():
    from evaldag.request.rules import check_decide, decide_overrides

    assert check_decide(None) is None
    full = check_decide("vs_best")
    assert full == {"against": "vs_best", "alpha": None, "margin": None, "rounds": None}
    assert decide_overrides(full) == {"decide": "vs_best"}
    spec = check_decide({"margin": 0.05, "rounds": 20})
    assert decide_overrides(spec) == {"decide": "vs_best", "decide_margin": 0.05, "decide_rounds": 20}
    for bad, words in ((42, "decide must be"), ("vs_worst", "decide.against"), ({"alpha": 1.0}, "decide.alpha"),
                       ({"margin": -0.1}, "decide.margin"), ({"rounds": 2.5}, "decide.rounds"),
                       ({"rounds": True}, "decide.rounds"), ({"stop": 1}, "unknown keys")):
        with pytest.raises(ValueError, match=words):
            check_decide(bad)


def test_the_trainers_decide_travels_with_the_event_and_is_checked_on_arrival(tmp_path, monkeypatch):
    from conftest import complete_checkpoint
    from evaldag.events.checkpoint_event import validate_checkpoint_event
    from evaldag.errors import CheckpointError
    from evaldag.client import CheckpointNotifier

    ckpt = complete_checkpoint(tmp_path / "run" / "checkpoint-100")
    notifier = CheckpointNotifier("run", api_url="http://127.0.0.1:9", spool_dir=tmp_path / "spool",
                                  decide={"margin": 0.05})
    payload = notifier._build_event(ckpt, 100, None, {})["payload"]
    assert payload["decide"] == {"against": "vs_best", "alpha": None, "margin": 0.05, "rounds": None}
    event = validate_checkpoint_event(payload, [tmp_path])
    assert event.decide == payload["decide"]
    assert "decide" not in CheckpointNotifier("run", api_url="http://127.0.0.1:9",
                                              spool_dir=tmp_path / "s2")._build_event(ckpt, 100, None, {})["payload"]
    with pytest.raises(CheckpointError, match="decide.margin"):
        validate_checkpoint_event({**payload, "decide": {"margin": 2}}, [tmp_path])
    with pytest.raises(ValueError, match="decide.against"):
        CheckpointNotifier("run", api_url="http://127.0.0.1:9", decide="vs_everyone")


def test_evaldag_run_prints_the_decision_from_the_runs_tags():
    from evaldag.decisions.verdicts import logged_verdict_lines

    stopped = Decision("stopped", "worse", "job@3", 40, 500, 40, -0.3, -0.5, -0.1, 0.05, 0.02, 9000, 0, 100000)
    lines = logged_verdict_lines(stopped.tags(), stopped.metrics())
    assert lines[0] == "decide vs best (job@3): worse after 40 of 500 problems, stopped early (about 91000 tokens saved)"
    completed = Decision("completed", "undecided", "job@3", 500, 500, 500, 0.0, -0.05, 0.05)
    assert logged_verdict_lines(completed.tags(), completed.metrics()) == [
        "decide vs best (job@3): undecided after 500 of 500 problems"]
    none = Decision("no_incumbent")
    assert "nothing earlier" in logged_verdict_lines(none.tags(), none.metrics())[0]


def test_evaldag_run_decide_options_become_the_flows_parameters(monkeypatch):
    from typer.testing import CliRunner

    from evaldag.cli import app
    from evaldag.runtime import runner
    from evaldag.runtime import stack as stack_module

    sent = []
    monkeypatch.setattr(stack_module, "Stack", lambda *a, **k: None)
    monkeypatch.setattr(runner, "run_and_report", lambda stack, benchmark, params: sent.append((benchmark, params)))
    result = CliRunner().invoke(app, ["run", "gsm8k", "--limit", "20", "--decide", "--decide-margin", "0.05"])
    assert result.exit_code == 0, result.output
    assert sent == [("gsm8k", {"limit": 20, "decide": "vs_best", "decide_margin": 0.05})]
    result = CliRunner().invoke(app, ["run", "gsm8k", "--decide-margin", "0.05"])    # a setting of nothing
    assert result.exit_code == 2 and "add --decide" in result.output and len(sent) == 1


# ---- found by review: partial evaluations as references, static batches, shards' reused rows ------------------

def _run(run_id, step, accuracy, start, **tags):
    return SimpleNamespace(info=SimpleNamespace(run_id=run_id, start_time=start),
                           data=SimpleNamespace(tags={"step": str(step), **tags}, metrics={"accuracy": accuracy}))


class _Runs:
    """What earlier_evaluations reads of MLflow: search_runs, newest first."""

    def __init__(self, runs):
        self.runs = runs

    def search_runs(self, *a, **k):
        return sorted(self.runs, key=lambda r: -r.info.start_time)


def _references(runs, step=300):
    return best_of_job.references(verdicts.earlier_evaluations(_Runs(runs), "1", "job", "key", step))


def test_an_evaluation_stopped_early_is_never_the_best_so_far():
    """Step 200 stopped after a prefix that scored 0.60 (the full step 100: 0.50): the best stays step 100 whatever
    its verdict (a prefix's accuracy is too noisy to rank against full evaluations; evaldag.decisions.best); it is
    the previous checkpoint all the same."""
    full = _run("full100", 100, 0.50, 1)
    for verdict, best in (("worse", "full100"), ("equivalent", "full100"), ("better", "full100")):
        refs = _references([full, _run("stopped200", 200, 0.60, 2, **{"decide.status": "stopped",
                                                                       "decide.verdict": verdict})])
        assert (refs["best"]["run_id"], refs["previous"]["run_id"]) == (best, "stopped200"), verdict
    # a decided evaluation that ran to the end is a full one
    refs = _references([full, _run("done200", 200, 0.60, 2, **{"decide.status": "completed",
                                                                 "decide.verdict": "undecided"})])
    assert refs["best"]["run_id"] == "done200"


def test_a_full_evaluation_supersedes_a_stopped_one_of_the_same_step_whatever_their_order():
    for full_start, stopped_start in ((1, 2), (2, 1)):
        runs = [_run("full200", 200, 0.55, full_start), _run("stopped200", 200, 0.40, stopped_start,
                                                               **{"decide.status": "stopped"})]
        (only,) = verdicts.earlier_evaluations(_Runs(runs), "1", "job", "key", 300)
        assert only["run_id"] == "full200"
    # two full runs: the latest supersedes, as before
    (only,) = verdicts.earlier_evaluations(_Runs([_run("a", 200, 0.5, 1), _run("b", 200, 0.6, 2)]), "1", "job",
                                           "key", 300)
    assert only["run_id"] == "b"


def test_a_static_batch_engine_cuts_its_batches_along_the_decision_order(setup):
    """Batches by length hold a few problems of every round, so the first round would be complete only when nearly
    every batch is: with decide, the stand-in's batches of 2 are consecutive problems of the decision order, the
    first batch the order's first two."""
    ckpt, _, results = setup
    plan = _decide_plan(ckpt, results, limit=8, engine="hf")
    generations = pl.read_parquet(generate_shard(plan, 0))
    order = decision_order(plan.sample_ids(), plan.sampling.seed)
    # the stand-in's answer is "<prompt length>-<seed + batch index>-<k>": the middle part names the batch
    batch = {sid: int(text.split("-")[1]) for sid, text in generations.select("sample_id", "completion").iter_rows()}
    assert [batch[sid] for sid in order] == sorted(batch[sid] for sid in order)
    assert [len({batch[s] for s in order[lo:lo + 2]}) for lo in range(0, 8, 2)] == [1, 1, 1, 1]
    assert len(set(batch.values())) == 4


def test_a_decision_that_ran_to_the_end_counts_every_shards_reused_rows_as_reused(setup):
    ckpt, _, results = setup
    plan = resolve(EvalRequest(benchmark="aime24", checkpoint=str(ckpt), limit=8, num_shards=2, decide="vs_best",
                               engine="vllm"), results)
    for s in range(2):
        rows = pl.DataFrame([{**r, "sample_index": 0, "shard_index": s, "completion": "\\boxed{1}",
                              "completion_ids": [1], "prompt_tokens": 5, "completion_tokens": 10,
                              "finish_reason": "stop", "latency_s": 0.1, "batch_size": 1}
                             for r in plan.shard_inputs(s).to_dicts()], schema=GENERATION_SCHEMA)
        write_table(rows, store.chunks_dir(plan.generations_path(s)) / "requests-000001.parquet", GENERATION_SCHEMA)
    incumbent = pl.DataFrame({"sample_id": plan.sample_ids(), "n": [1] * 8, "score": [0.0] * 8})
    decider = Decider(plan, incumbent, "job@1", lambda rows: grade_rows(plan, rows))   # every row is there
    rows = pl.concat([pl.read_parquet(p) for s in range(2)
                      for p in store.chunk_files(store.chunks_dir(plan.generations_path(s)))])
    final = decider.final(grade_rows(plan, rows))
    assert (final.tokens_generated, final.tokens_reused) == (0, 80)


def test_the_parent_waits_for_its_shards_without_an_alarm_signal(monkeypatch):
    """The parent flow waits for its shards in short polls. Prefect's wait(timeout=...) bounds each with SIGALRM in
    a flow's main thread, whose handler raised into the thread at the wait's own timeout, and once it landed inside
    threading.Condition.wait and failed the evaluation ("RuntimeError: release unlocked lock", seen in CI). The
    wait arms no timer, and still says which shards run."""
    import concurrent.futures
    import signal
    import threading
    import uuid

    from prefect.futures import PrefectConcurrentFuture

    from tasks.decide import still_running

    assert threading.current_thread() is threading.main_thread()
    armed = []
    real = signal.setitimer
    monkeypatch.setattr(signal, "setitimer", lambda which, *a: (armed.append((which, a)), real(which, *a))[1])
    quick, slow = concurrent.futures.Future(), concurrent.futures.Future()
    futures = [PrefectConcurrentFuture(uuid.uuid4(), quick), PrefectConcurrentFuture(uuid.uuid4(), slow)]
    threading.Timer(0.05, quick.set_result, [1]).start()
    assert still_running(futures, timeout=0.3) == [futures[1]]
    slow.set_result(2)
    assert still_running(futures, timeout=0.3) == []
    assert armed == [], f"the wait armed a timer: {armed}"


def test_the_round_gate_holds_work_past_the_next_round_until_the_open_one_is_nearly_done():
    """Requests of rounds 0, 1, 2 (4 each): round 2 waits while round 0 has over 5 % of its requests unfinished,
    not once it is done; past the gated half of the rounds nothing waits; lifted, nothing waits."""
    gate = pacing.RoundGate([0] * 4 + [1] * 4 + [2] * 4, rounds=6)
    assert not gate.hold(4) and gate.hold(8)
    for k in range(3):
        gate.finished(k)
    assert gate.hold(8)                    # 1 of 4 left: 25 % > 5 %
    gate.finished(3)
    assert not gate.hold(8)
    late = pacing.RoundGate([0] * 4 + [5] * 4, rounds=6)    # round 5 is past the gated half (rounds 0-2)
    assert late.hold(4)                    # the open round 0 is gated: everything past round 1 waits
    late.lift()
    assert not late.hold(4)


def test_the_gate_is_dropped_only_when_no_verdict_is_in_sight():
    """The chance that the last gated look (250 problems) decides, predicted from 100 problems, by hand: a clear
    difference keeps the gate, none at all drops it; nothing read yet keeps it."""
    z = 2.5552                                      # Pocock's boundary for 10 looks
    rng = np.random.default_rng(1)
    clear = np.clip(rng.normal(-0.08, 0.25, 100).round(2), -1, 1)
    none = np.tile([0.5, -0.5, 0.25, -0.25, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0], 10)    # mean 0, sd 0.3
    for d, kept in ((clear, True), (none, False)):
        s = math.sqrt((((d - d.mean()) ** 2).sum() + 1) / 100)
        half = stats.t.isf(stats.norm.sf(z), 249) * s / math.sqrt(250)
        spread = s * math.sqrt(1 / 100 - 1 / 250)
        chance = stats.norm.sf((half - d.mean()) / spread) + stats.norm.cdf((-half - d.mean()) / spread)
        assert (chance >= pacing.GATE_CHANCE) == kept, (chance, kept)
        assert pacing.worth_gating(d, 250, 0.05, 0.03, z) == kept
    assert pacing.worth_gating(np.array([]), 250, 0.05, 0.03, z)


def test_the_gate_counts_an_equivalence_in_sight_and_the_problems_left_to_come():
    """Two parts of the predicted chance, each by hand: a difference of about 0 read tightly is decided at the last
    gated look as equivalent (within the margin), so the gate stays; and the mean at 250 problems, predicted from
    200, can move only by what the 50 still to come add (the finite-population factor 1/t - 1/target): read as if
    from an endless pool (1/t), a difference short of a verdict looked likely to reach one."""
    z = 2.5552

    def chance(d, target, margin):
        t = d.size
        s = math.sqrt((((d - d.mean()) ** 2).sum() + 1) / t)
        half = stats.t.isf(stats.norm.sf(z), target - 1) * s / math.sqrt(target)
        spread = s * math.sqrt(1 / t - 1 / target)
        m = d.mean()
        better_or_worse = stats.norm.sf((half - m) / spread) + stats.norm.cdf((-half - m) / spread)
        equivalent = (stats.norm.cdf((margin - half - m) / spread) - stats.norm.cdf((half - margin - m) / spread)
                      if half < margin else 0.0)
        return better_or_worse, equivalent

    tight = np.tile([0.02, -0.02, 0.0, 0.0], 25)                     # 100 problems, mean 0, sd 0.014
    better_or_worse, equivalent = chance(tight, 250, 0.03)
    assert better_or_worse < 0.05 and equivalent > 0.9
    assert pacing.worth_gating(tight, 250, 0.05, 0.03, z)
    short = np.tile([0.5, -0.5, 0.25, -0.25, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0], 20) + 0.035   # 200 problems
    better_or_worse, equivalent = chance(short, 250, 0.03)
    assert equivalent == 0.0 and 0.1 < better_or_worse < pacing.GATE_CHANCE
    assert not pacing.worth_gating(short, 250, 0.05, 0.03, z)


def test_the_pace_is_read_on_a_prefix_with_unfinished_samples_counted_wrong():
    """worth_gating reads the longest look's prefix at most 5 % unknown (not the problems that happen to be
    complete), each unfinished sample counted wrong."""
    low = np.array([0.0, -0.25, 0.5, -0.5, 0.0, 0.0, -0.25, 0.0])
    high = low + np.array([0, 0, 0, 0.25, 0, 0, 0.5, 0.5])      # 0.25 unknown by 4 problems, 1.25 by 8
    assert pacing.pace_sample(low, high, [2, 4, 8]).tolist() == [0.0, -0.25]
    assert pacing.pace_sample(low, high + [0, 0, 0, 0, 0, 0, -0.5, -0.5], [2, 4, 8]).tolist() == low.tolist()
    late = low + np.array([0, 0, 0, 0, 0, 0, 0, 0.5])          # nothing unknown by 4, 0.5 > 0.4 by 8
    assert pacing.pace_sample(low, late, [2, 4, 8]).tolist() == low[:4].tolist()
    assert pacing.pace_sample(low, high, [4, 8]).size == 0