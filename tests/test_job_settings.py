"""Sampling and engine settings per evaluation and per job (issue 52 item 5): which of them are the evaluation's
identity, the trainer's options carried in the event to the request the server builds, and the CLI's options."""

from __future__ import annotations

import pytest
from test_keys import _keys
from test_plan import KeyWorld

from evaldag.client.notifier import CheckpointNotifier
from evaldag.errors import CheckpointError, ConfigError
from evaldag.events.checkpoint_event import job_overrides, validate_checkpoint_event
from evaldag.request.config import EngineSettings, SamplingConfig, SamplingOverrides
from evaldag.request.plan import EvalRequest, resolve
from evaldag.request.rules import ENGINE_SETTING_KEYS, SAMPLING_KEYS


def test_the_trainer_side_knows_the_servers_setting_names():
    """The client (standard library only) checks names and types; the server's models check the values."""
    assert set(SAMPLING_KEYS) == set(SamplingConfig.model_fields) == set(SamplingOverrides.model_fields)
    assert set(ENGINE_SETTING_KEYS) == set(EngineSettings.model_fields)


# --------------------------------------------------------------------------------------- identity


@pytest.mark.parametrize("settings, changes", [
    ({"dtype": "float16"}, True),                       # what the weights compute in
    ({"max_model_len": 2048}, True),                    # the window the completions must fit
    ({"tensor_parallel_size": 2}, False),               # parallelism: not the identity
    ({"gpu_memory_utilization": 0.5}, False),           # memory share: throughput
    ({"tensor_parallel_size": 2, "gpu_memory_utilization": 0.8}, False),
])
def test_engine_settings_move_the_keys_where_they_change_results(settings, changes, tmp_path, monkeypatch):
    w = KeyWorld(tmp_path, monkeypatch)
    w.write_alias(engine="vllm")
    before = _keys(w)
    after = _keys(w, engine_settings=settings)
    moved = {k for k in before if after[k] != before[k]}
    assert moved == (set(before) if changes else set()), moved
    assert after["tracked settings"] == after["sweeper settings"]      # track() and the sweeper agree
    plan = resolve(EvalRequest(**{**w.request, "engine_settings": settings}), w.results)
    assert {**plan.model.engine_args, "dtype": plan.model.dtype}.items() >= settings.items()   # and they are used


def test_an_engine_setting_the_model_has_anyway_is_the_same_evaluation(tmp_path, monkeypatch):
    w = KeyWorld(tmp_path, monkeypatch)
    w.write_alias(engine="vllm", dtype="float16", engine_args={"max_model_len": 2048})
    assert _keys(w, engine_settings={"dtype": "float16", "max_model_len": 2048}) == _keys(w)


@pytest.mark.parametrize("sampling", [{"n": 4}, {"top_p": 0.9}, {"max_new_tokens": 64}, {"seed": 3},
                                      {"temperature": 0.7}])
def test_sampling_settings_are_the_identity(sampling, tmp_path, monkeypatch):
    w = KeyWorld(tmp_path, monkeypatch)
    before = _keys(w)
    after = _keys(w, sampling={**w.request["sampling"], **sampling})
    assert all(after[k] != before[k] for k in before)


def test_engine_settings_a_model_cannot_take_are_refused(tmp_path, monkeypatch):
    w = KeyWorld(tmp_path, monkeypatch)            # the alias runs on hf (the tests' default engine)
    with pytest.raises(CheckpointError, match=r"\['max_model_len', 'tensor_parallel_size'\] are the vllm engine's, "
                                              r"and this evaluation runs on engine 'hf'"):
        resolve(EvalRequest(**{**w.request, "engine_settings": {"tensor_parallel_size": 2, "max_model_len": 99}}),
                w.results)
    plan = resolve(EvalRequest(**{**w.request, "engine_settings": {"dtype": "float16"}}), w.results)
    assert plan.model.dtype == "float16"           # dtype is every local engine's
    with pytest.raises(ConfigError, match="engine_settings.tensor_parallel_size"):
        EvalRequest.parse(benchmark="aime24", engine_settings={"tensor_parallel_size": 0})
    with pytest.raises(ConfigError, match="engine_settings.swap_space"):
        EvalRequest.parse(benchmark="aime24", engine_settings={"swap_space": 4})


def test_a_folder_checkpoint_takes_engine_settings(tmp_path, monkeypatch):
    """Before: a folder always ran with the engine's defaults; nothing could give it a window or parallelism."""
    w = KeyWorld(tmp_path, monkeypatch)
    plan = resolve(EvalRequest(**{**w.request, "checkpoint": str(w.ckpt), "engine": "vllm",
                                  "engine_settings": {"tensor_parallel_size": 2, "max_model_len": 4096}}), w.results)
    assert plan.model.engine_args == {"tensor_parallel_size": 2, "max_model_len": 4096}


# --------------------------------------------------------------------------------------- trainer -> event -> request


def test_the_trainers_settings_reach_the_request(tmp_path):
    ckpt = tmp_path / "ckpts" / "checkpoint-300"
    from conftest import complete_checkpoint

    complete_checkpoint(ckpt)
    notifier = CheckpointNotifier("grpo-42", api_url="http://127.0.0.1:9", spool_dir=tmp_path / "spool",
                                  sampling={"n": 8, "temperature": 0.6, "max_new_tokens": 32768},
                                  engine_settings={"tensor_parallel_size": 4, "max_model_len": 34816})
    payload = notifier._build_event(ckpt, 300, None, {})["payload"]
    event = validate_checkpoint_event(payload, [tmp_path])
    deployment = {"sampling": {"seed": 5, "n": 2}, "engine_settings": {"gpu_memory_utilization": 0.8}}
    overrides = {**deployment, **job_overrides(event, deployment)}
    assert overrides == {"sampling": {"seed": 5, "n": 8, "temperature": 0.6, "max_new_tokens": 32768},
                         "engine_settings": {"gpu_memory_utilization": 0.8, "tensor_parallel_size": 4,
                                             "max_model_len": 34816}}
    request = EvalRequest.parse(benchmark="math500", checkpoint=event.path, step=event.step, **overrides)
    assert request.engine_settings == EngineSettings(tensor_parallel_size=4, max_model_len=34816,
                                                     gpu_memory_utilization=0.8)
    assert request.sampling["n"] == 8


@pytest.mark.parametrize("options, message", [
    ({"sampling": {"beams": 4}}, "sampling has unknown keys ['beams']"),
    ({"sampling": {"n": True}}, "sampling.n=True must be int"),
    ({"engine_settings": {"tensor_parallel_size": "4"}}, "engine_settings.tensor_parallel_size='4' must be int"),
    ({"engine_settings": [4]}, "engine_settings must be a mapping"),
])
def test_the_client_refuses_settings_it_could_never_send(options, message, tmp_path):
    with pytest.raises(ValueError, match=r"^" + message.replace("[", r"\[").replace("]", r"\]")):
        CheckpointNotifier("grpo-42", api_url="http://127.0.0.1:9", spool_dir=tmp_path, **options)


@pytest.mark.parametrize("payload, message", [
    ({"sampling": {"n": 0}}, "invalid sampling: n: Input should be greater than or equal to 1"),
    ({"sampling": {"n": "8"}}, "invalid sampling: n: Input should be a valid integer"),
    ({"engine_settings": {"gpu_memory_utilization": 1.5}}, "invalid engine_settings: gpu_memory_utilization"),
    ({"engine_settings": {"trust_remote_code": True}}, "invalid engine_settings: trust_remote_code: Extra inputs"),
    ({"engine_settings": {"dtype": "int4"}}, "invalid engine_settings: dtype"),
])
def test_the_server_checks_an_events_settings_as_untrusted_input(payload, message, tmp_path):
    from conftest import complete_checkpoint

    ckpt = complete_checkpoint(tmp_path / "checkpoint-300")
    with pytest.raises(CheckpointError, match=message):
        validate_checkpoint_event({"path": str(ckpt), "step": 300, "train_run": "grpo-42", **payload}, [tmp_path])


def test_the_callback_takes_the_settings_and_no_model_option():
    pytest.importorskip("transformers")
    from evaldag.client.trainer_callback import EvaldagCallback

    cb = EvaldagCallback(["gsm8k"], sampling={"n": 4, "temperature": 0.6}, engine_settings={"dtype": "float16"})
    assert cb._notifier_options["sampling"] == {"n": 4, "temperature": 0.6}
    with pytest.raises(TypeError, match="model"):
        EvaldagCallback(model="smollm2")        # read by nothing before: removed, not kept as a dead option


# --------------------------------------------------------------------------------------- CLI


from test_run_options import _run, sent  # noqa: E402,F401 - the CLI runner and its fixture, shared


def test_the_cli_sets_sampling_and_engine_settings(sent):
    result = _run("math500", "--checkpoint", "Qwen/Qwen2.5-Math-1.5B-Instruct", "-n", "8", "--temperature", "0.6",
                  "--top-p", "0.95", "--max-new-tokens", "32768", "--tensor-parallel-size", "4",
                  "--max-model-len", "34816", "--gpu-memory-utilization", "0.9", "--dtype", "bfloat16")
    assert result.exit_code == 0, result.output
    assert sent == [("math500", {
        "checkpoint": "Qwen/Qwen2.5-Math-1.5B-Instruct",
        "sampling": {"n": 8, "temperature": 0.6, "top_p": 0.95, "max_new_tokens": 32768},
        "engine_settings": {"tensor_parallel_size": 4, "max_model_len": 34816, "gpu_memory_utilization": 0.9,
                            "dtype": "bfloat16"}})]


@pytest.mark.parametrize("args, message", [
    (("--dtype", "int4"), "dtype: Input should be 'bfloat16', 'float16' or 'float32'"),
    (("--gpu-memory-utilization", "0"), "gpu-memory-utilization: Input should be greater than 0"),
    (("--top-p", "1.5"), "top-p: Input should be less than or equal to 1"),
    (("--tensor-parallel-size", "0"), "--tensor-parallel-size"),
    (("-n", "0"), "'--n' / '-n'"),
])
def test_the_cli_refuses_bad_settings_before_starting_anything(sent, args, message):
    result = _run("math500", *args)
    assert result.exit_code == 2 and message in " ".join(result.output.split()), result.output
    assert sent == []
