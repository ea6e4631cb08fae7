"""Keys follow what decides the result (issue 22 item 8): one list of settings that do not change results
(evaldag.request.keys.NOT_RESULT_SETTINGS), each entry tested to keep every key, and each result-changing setting tested
to move them: the plan's keys, the settings key the sweeper compares, and the trigger's evaluation_id."""

from __future__ import annotations

import pytest
from test_plan import KeyWorld

from evaldag.engines.dtype import DEFAULT_DTYPE_ENV
from evaldag.request.keys import NOT_RESULT_SETTINGS
from evaldag.request.plan import EvalRequest, resolve
from evaldag.decisions.series import comparison_key
from evaldag.events.identity import (
    IDENTITY,
    evaluated_key,
    evaluation_id,
    plan_settings_key,
    settings_key,
)

# One example value per entry of NOT_RESULT_SETTINGS (what the entry is changed to in the test below).
EXAMPLES = {
    "request.mlflow_parent_run_id": "abc123",
    "request.dispatch": "inline",
    "request.baseline": "base-model@0",
    "request.final_step": 5000,
    "benchmark.description": "other words",
    "model.engine_args.gpu_memory_utilization": 0.5,
    "model.engine_args.max_num_seqs": 3,
    "model.engine_args.max_num_batched_tokens": 4096,
    "model.engine_args.kv_cache_space_gb": 1.5,
    "model.engine_args.cpu_offload_gb": 2,
    "model.engine_args.distributed_executor_backend": "ray",
    "model.engine_args.tensor_parallel_size": 2,
    "model.engine_args.pipeline_parallel_size": 2,
    "model.engine_args.concurrency": 4,
    "model.engine_args.max_retries": 1,
    "model.engine_args.timeout_s": 30,
    "model.engine_args.api_key_env": "MY_KEY",
}


def _keys(w: KeyWorld, checkpoint: str = "tiny", **changes) -> dict[str, str]:
    """Every key of one evaluation: the plan's three, the settings key track() tags it with, and the trigger side's
    settings key and evaluation_id (computed from the request as an event or the sweeper would send it)."""
    request = {**w.request, "checkpoint": checkpoint, **{k: v for k, v in changes.items() if k != "dispatch"}}
    plan = resolve(EvalRequest(**request), w.results)
    overrides = {k: v for k, v in {**request, **changes}.items() if k not in IDENTITY}
    return {"generation": plan.generation_key, "grade": plan.grade_key, "eval": plan.eval_key,
            "tracked settings": plan_settings_key(plan),
            "sweeper settings": settings_key(request["benchmark"], checkpoint, overrides),
            "evaluation_id": evaluation_id(request["step"], request["benchmark"], checkpoint, overrides)}


def test_every_entry_says_why_and_has_a_test():
    assert set(EXAMPLES) == set(NOT_RESULT_SETTINGS)
    assert all(len(why) > 20 for why in NOT_RESULT_SETTINGS.values())


@pytest.mark.parametrize("entry", sorted(NOT_RESULT_SETTINGS))
def test_a_setting_that_does_not_change_results_keeps_every_key(entry, tmp_path, monkeypatch):
    w = KeyWorld(tmp_path, monkeypatch)
    before = _keys(w)
    assert before["tracked settings"] == before["sweeper settings"]     # track() and the sweeper agree
    value, (part, name) = EXAMPLES[entry], entry.rsplit(".", 1)
    if part == "request":
        after = _keys(w, **{name: value})
    elif part == "benchmark":
        w.bench(lambda c: c.update({name: value}))
        after = _keys(w)
    else:
        w.write_alias(engine_args={name: value})
        after = _keys(w)
    assert after == before


def _set_engine_arg(w):
    w.write_alias(engine_args={"cache_implementation": "dynamic"})


def _rewrite_weights(w):
    (w.ckpt / "model.safetensors").write_bytes(b"x" * 64)


RESULT_CHANGING = [
    ("dtype", lambda w: w.write_alias(dtype="float16")),                  # float16 is never the host default
    ("EVALDAG_DEFAULT_DTYPE", lambda w: w.monkeypatch.setenv(DEFAULT_DTYPE_ENV, "float16")),
    ("engine_args that change outputs", _set_engine_arg),
    ("batch size", lambda w: w.write_alias(batch_size=8)),
    ("instruction", lambda w: w.bench(lambda c: c.update(instruction="Solve: {problem}"))),
    ("dataset revision", lambda w: w.bench(lambda c: c["dataset"].update(revision="0" * 40))),
    ("gold format", lambda w: w.bench(lambda c: c.update(gold_format="number"))),
    ("grading timeout", lambda w: w.bench(lambda c: c.update(grading_timeout_s=30))),
    ("weights rewritten in place", _rewrite_weights),
]


@pytest.mark.parametrize("change", [c[1] for c in RESULT_CHANGING], ids=[c[0] for c in RESULT_CHANGING])
def test_a_setting_that_changes_results_changes_the_trigger_keys(change, tmp_path, monkeypatch):
    """Before: the trigger keys saw only the request, so a switch to bfloat16, an edited instruction or a rewritten
    checkpoint looked evaluated already and nothing ran again."""
    w = KeyWorld(tmp_path, monkeypatch)
    before = _keys(w)
    change(w)
    after = _keys(w)
    for key in ("tracked settings", "sweeper settings", "evaluation_id"):
        assert after[key] != before[key], key
    assert after["tracked settings"] == after["sweeper settings"]


@pytest.mark.parametrize("change", [c[1] for c in RESULT_CHANGING if c[0] in
                                    ("EVALDAG_DEFAULT_DTYPE", "weights rewritten in place")],
                         ids=["EVALDAG_DEFAULT_DTYPE", "weights rewritten in place"])
def test_the_sweeper_evaluates_a_folder_again_when_its_result_would_change(change, tmp_path, monkeypatch):
    """A plain folder (what events and the sweeper send) has no config: its dtype is the resolved default, and its
    contents are its fingerprint. What track() tagged is what the sweeper finds, until one of them changes."""
    w = KeyWorld(tmp_path, monkeypatch)
    overrides = {"limit": 3, "num_shards": 1, "dispatch": "inline"}
    plan = resolve(EvalRequest(benchmark="aime24", checkpoint=str(w.ckpt), step=100, limit=3, num_shards=1),
                   w.results)
    have = {(plan.model.path, 100, plan_settings_key(plan))}
    assert evaluated_key(w.ckpt, 100, "aime24", overrides) in have
    ident = evaluation_id(100, "aime24", str(w.ckpt), overrides)
    change(w)
    assert evaluated_key(w.ckpt, 100, "aime24", overrides) not in have
    assert evaluation_id(100, "aime24", str(w.ckpt), overrides) != ident


@pytest.mark.parametrize("entry", [e for e in sorted(NOT_RESULT_SETTINGS) if e.startswith("model.engine_args.")])
def test_throughput_engine_args_keep_the_generations(entry, tmp_path, monkeypatch):
    """Before: the generation key held every engine_arg, so raising gpu_memory_utilization regenerated
    everything."""
    w = KeyWorld(tmp_path, monkeypatch)
    w.write_alias(engine="vllm")
    before = w.keys()
    w.write_alias(engine_args={entry.rsplit(".", 1)[1]: EXAMPLES[entry]})
    assert w.keys() == before


def test_float32_and_bfloat16_are_separate_curves(tmp_path, monkeypatch):
    """Before: comparison_key had no dtype, so the job history set a bfloat16 run next to float32 ones."""
    w = KeyWorld(tmp_path, monkeypatch)
    w.write_alias(dtype="float32")
    f32 = resolve(EvalRequest(**w.request), w.results)
    w.write_alias(dtype="bfloat16")
    bf16 = resolve(EvalRequest(**w.request), w.results)
    assert comparison_key(f32) != comparison_key(bf16)
    w.write_alias(dtype="float32", batch_size=8)           # execution only: still the same series
    assert comparison_key(resolve(EvalRequest(**w.request), w.results)) == comparison_key(f32)
