"""The identity of a requested evaluation (Prefect idempotency key, the sweeper's "already evaluated"): it follows
every setting that changes the result, and nothing else."""

from __future__ import annotations

import pytest

from evaldag.request.plan import EvalRequest
from evaldag.events.identity import (IDENTITY, NOT_OUTPUT, OUTPUT_SETTINGS, evaluated_key, evaluation_id,
                              plan_settings_key, settings_key)

CKPT = "/ckpts/run-1/checkpoint-100"


def _id(overrides=None, **kw):
    args = {"step": 100, "benchmark": "math500", "checkpoint": CKPT, **kw}
    return evaluation_id(overrides=overrides, **args)


def test_a_full_evaluation_after_a_quick_slice_is_a_new_evaluation():
    assert _id({"limit": 4}) != _id()
    assert _id({"limit": 4}) != _id({"limit": 5})


@pytest.mark.parametrize("overrides", [
    {"sampling": {"n": 8, "temperature": 0.6}}, {"sampling": {"max_new_tokens": 64}}, {"pass_k": [1, 4]},
    {"reference": "smollm2-135m-instruct"}, {"engine": "vllm"}, {"num_shards": 7}])
def test_each_output_setting_is_a_new_evaluation(overrides):
    assert _id(overrides) != _id()


def test_an_identical_request_is_the_same_evaluation():
    assert _id({"limit": 4, "sampling": {"temperature": 0.6, "n": 4}}) == \
        _id({"sampling": {"n": 4, "temperature": 0.6}, "limit": 4})           # order does not matter
    assert _id({"pass_k": [4, 1, 4]}) == _id({"pass_k": [1, 4]})
    # a setting spelled out at its default value is the same request as leaving it out
    assert _id({"sampling": {"temperature": 0.0, "max_new_tokens": 512}}) == _id()
    assert _id({"limit": None, "reference": None}) == _id()
    # how the evaluation runs and where it is logged do not change what it computes
    assert _id({"dispatch": "inline", "mlflow_parent_run_id": "abc"}) == _id()


def test_identity_fields_still_separate_evaluations():
    base = _id()
    for kw in ({"step": 200}, {"benchmark": "gsm8k"}, {"checkpoint": CKPT + "0"}):
        assert _id(**kw) != base


def test_the_jobs_name_does_not_separate_evaluations(tmp_path):
    """The sweeper names a checkpoint's job after its folder, the trainer's event after its run: one checkpoint
    (the same folder and contents, the same settings) is one evaluation under either name (issue 51 item 7). A
    checkpoint rewritten in place is another one, and so is another job's copy of the same bytes."""
    import shutil

    from conftest import complete_checkpoint

    ckpt = complete_checkpoint(tmp_path / "ckpts" / "folder-run" / "checkpoint-100")
    key = evaluation_id(100, "aime24", ckpt, {"limit": 2})
    copy = shutil.copytree(ckpt, tmp_path / "ckpts" / "other-run" / "checkpoint-100")
    assert evaluation_id(100, "aime24", copy, {"limit": 2}) != key
    # what an evaluation's key is made of: the plan's request (train_run is the one field whose name is not used)
    for job in ("folder-run", "grpo-job"):
        request = EvalRequest(benchmark="aime24", checkpoint=str(ckpt), step=100, limit=2, train_run=job)
        overrides = request.model_dump(exclude={"benchmark", "checkpoint", "step"})
        assert evaluation_id(100, "aime24", ckpt, overrides) == key, job
    (ckpt / "model.safetensors").write_bytes(b"rewritten")
    assert evaluation_id(100, "aime24", ckpt, {"limit": 2}) != key


def test_eval_loss_is_another_evaluation_unless_it_repeats_the_default():
    assert _id({"eval_loss": True}) != _id()
    assert _id({"eval_loss": False}) == _id()   # math500's config leaves it off


def test_every_request_field_is_classified():
    """A new EvalRequest field must be placed: identity, output setting, or not part of the output."""
    fields = set(EvalRequest.model_fields)
    assert fields == set(IDENTITY) | set(OUTPUT_SETTINGS) | (set(NOT_OUTPUT) & fields)


def test_every_request_field_is_a_parameter_of_the_evaluation_flow():
    """A request field the flow does not take cannot be asked for by `prefect deployment run`, `evaldag run` or an
    automation: the flow run crashes on the unknown parameter (eval_loss did, before it was added)."""
    import inspect

    from flows.eval_flow import eval_flow

    parameters = set(inspect.signature(eval_flow.fn).parameters)
    assert set(EvalRequest.model_fields) <= parameters
    assert parameters - set(EvalRequest.model_fields) == {"dispatch", "benchmarks"}


@pytest.mark.parametrize("extra", [{}, {"eval_loss": True}, {"eval_loss": False}])
def test_the_tracked_run_and_the_sweeper_agree(tmp_path, extra):
    """track() tags a run with plan_settings_key(plan); the sweeper looks up evaluated_key(...) built from its
    overrides and the folder: the same settings give the same key, so the sweeper skips exactly what was
    evaluated."""
    from conftest import complete_checkpoint
    from evaldag.request.plan import resolve

    ckpt = complete_checkpoint(tmp_path / "run-1" / "checkpoint-100")
    overrides = {"limit": 2, "num_shards": 1, "sampling": {"max_new_tokens": 16}, "dispatch": "inline", **extra}
    request = EvalRequest.parse(benchmark="math500", checkpoint=str(ckpt), step=100, train_run="run-1",
                                **{k: v for k, v in overrides.items() if k != "dispatch"})
    plan = resolve(request, tmp_path / "results")
    assert plan_settings_key(plan) == settings_key("math500", ckpt, overrides)
    have = {(str(ckpt), 100, plan_settings_key(plan))}
    assert evaluated_key(ckpt, 100, "math500", overrides) in have
    assert evaluated_key(ckpt, 100, "math500", {**overrides, "limit": None}) not in have   # the full one is not


def test_the_tracked_run_and_the_sweeper_agree_on_an_adaptive_evaluation(tmp_path):
    """The request keeps adaptive settings with their defaults filled in; a sweeper's overrides name only some:
    both must give one key, or the sweeper never sees the evaluation as done."""
    from conftest import complete_checkpoint
    from evaldag.request.plan import resolve

    ckpt = complete_checkpoint(tmp_path / "run-1" / "checkpoint-100")
    overrides = {"limit": 8, "engine": "vllm", "sampling": {"temperature": 0.6}, "adaptive": {"budget": 200, "n0": 4}}
    plan = resolve(EvalRequest.parse(benchmark="math500", checkpoint=str(ckpt), step=100, train_run="run-1",
                                     **overrides), tmp_path / "results")
    assert plan_settings_key(plan) == settings_key("math500", ckpt, overrides)
    assert settings_key("math500", ckpt, {**overrides, "adaptive": {"budget": 200, "n0": 4, "floor": 4}}) == \
        settings_key("math500", ckpt, overrides)                       # a default named is the same request
    assert settings_key("math500", ckpt, {**overrides, "adaptive": {"budget": 300, "n0": 4}}) != \
        settings_key("math500", ckpt, overrides)


def test_unreadable_overrides_still_give_a_key():
    """Overrides the benchmark config rejects are the evaluation flow's to report; the key must not raise first."""
    assert _id({"sampling": {"temprature": 1}}) != _id()
    assert _id({"sampling": "nonsense"}) != _id()
