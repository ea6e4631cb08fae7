"""EvaldagCallback in a real transformers Trainer: a tiny model built here (no download), a few CPU steps, a
recording HTTP server standing in for Prefect's /api/events. The events it receives are what the on-checkpoint flow
validates (evaldag.events.checkpoint_event), so the tests pass them through that validator too."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import free_ports
from evaldag.client import EvaldagCallback, EvalTrigger
from evaldag.events.checkpoint_event import validate_checkpoint_event
from fake_events import FakeEventsServer

VOCAB = [f"w{i}" for i in range(60)]


@pytest.fixture(scope="module")
def tiny():
    """A 1-layer Llama with a 64-token word-level tokenizer: a complete Hugging Face model in a few kB."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(["<unk>", "<pad>", "<s>", "</s>", *VOCAB])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", pad_token="<pad>",
                                        bos_token="<s>", eos_token="</s>")
    config = LlamaConfig(vocab_size=len(vocab), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32)
    return LlamaForCausalLM(config), tokenizer


def _rows(tokenizer, n: int = 8) -> list[dict]:
    rows = []
    for i in range(n):
        ids = tokenizer(" ".join(VOCAB[(i + j) % len(VOCAB)] for j in range(8)))["input_ids"]
        rows.append({"input_ids": ids, "labels": ids})
    return rows


def _train(tiny, out: Path, callback, *, max_steps: int = 4, save_steps: int = 2, report_to=(), **args):
    from transformers import Trainer, TrainingArguments

    model, tokenizer = tiny
    targs = TrainingArguments(output_dir=str(out), max_steps=max_steps, save_steps=save_steps,
                              per_device_train_batch_size=2, learning_rate=1e-3, logging_steps=1,
                              report_to=list(report_to), use_cpu=True, save_only_model=True,
                              disable_tqdm=True, **args)
    trainer = Trainer(model=model, args=targs, train_dataset=_rows(tokenizer), processing_class=tokenizer,
                      callbacks=[callback])
    trainer.train()
    return trainer


@pytest.fixture
def events():
    server = FakeEventsServer().start()
    yield server
    server.release.set()
    server.stop()


def test_each_save_is_announced_with_its_folder_step_job_and_final_step(tiny, tmp_path, events):
    cb = EvaldagCallback(["gsm8k", "math500"], limit=8, decide="vs_best", api_url=events.url,
                         spool_dir=tmp_path / "spool")
    _train(tiny, tmp_path / "sft-tiny", cb)
    sent = events.events()
    assert [e["payload"]["step"] for e in sent] == [2, 4]
    assert [e["id"] for e in sent] == cb.announced
    for event, step in zip(sent, (2, 4)):
        p = event["payload"]
        assert p["path"] == str(tmp_path / "sft-tiny" / f"checkpoint-{step}")
        assert (p["train_run"], p["final_step"], p["benchmarks"]) == ("sft-tiny", 4, ["gsm8k", "math500"])
        assert p["extra"] == {"limit": 8} and p["decide"]["against"] == "vs_best"
        assert p["mlflow_parent_run_id"] is None          # the trainer logs to no MLflow run
        assert event["resource"]["prefect.resource.id"] == "evaldag.train-run.sft-tiny"
        # what the on-checkpoint flow does with it: a complete checkpoint, at the step its name says
        assert validate_checkpoint_event(p, [tmp_path]).step == step
    assert not list((tmp_path / "spool").glob("*.json"))


def test_run_name_names_the_job_and_every_k_th_save_or_a_trigger_picks_the_saves(tiny, tmp_path, events):
    every = EvaldagCallback(every_saves=2, api_url=events.url, spool_dir=tmp_path / "spool")
    _train(tiny, tmp_path / "out", every, max_steps=6, save_steps=1, run_name="grpo run/7")
    assert [(e["payload"]["train_run"], e["payload"]["step"]) for e in events.events()] == \
        [("grpo-run-7", 2), ("grpo-run-7", 4), ("grpo-run-7", 6)]
    events.received.clear()
    # every 3 steps, asked at saves 2, 4, 6: the first save past each due point
    trigger = EvaldagCallback(trigger=EvalTrigger(freq_steps=3), train_run="job-b", api_url=events.url,
                              spool_dir=tmp_path / "spool")
    _train(tiny, tmp_path / "out-b", trigger, max_steps=6, save_steps=2)
    assert [e["payload"]["step"] for e in events.events()] == [4, 6]


def test_the_trainers_mlflow_run_is_the_evaluations_parent(tiny, tmp_path, events, sqlite_mlflow, monkeypatch):
    import mlflow
    from mlflow import MlflowClient

    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "trainer-runs")
    cb = EvaldagCallback(["gsm8k"], api_url=events.url, spool_dir=tmp_path / "spool")
    _train(tiny, tmp_path / "logged", cb, report_to=["mlflow"])
    assert mlflow.active_run() is None                    # MLflowCallback ended its run at the end of training
    parents = {e["payload"]["mlflow_parent_run_id"] for e in events.events()}
    assert len(parents) == 1 and None not in parents
    run = MlflowClient().get_run(parents.pop())
    assert "loss" in run.data.metrics                       # the run that holds the training loss
    assert MlflowClient().get_experiment(run.info.experiment_id).name == "trainer-runs"
    events.received.clear()
    # a run id given explicitly wins over the active run
    with mlflow.start_run() as mine:
        explicit = EvaldagCallback(mlflow_parent_run_id="0123abcd", api_url=events.url, spool_dir=tmp_path / "sp")
        _train(tiny, tmp_path / "explicit", explicit, max_steps=2)
        assert mine.info.run_id != "0123abcd"
    assert [e["payload"]["mlflow_parent_run_id"] for e in events.events()] == ["0123abcd"]


def test_a_server_that_is_down_neither_blocks_nor_fails_training(tiny, tmp_path):
    [port] = free_ports(1)                                  # nothing listens there
    cb = EvaldagCallback(api_url=f"http://127.0.0.1:{port}/api", spool_dir=tmp_path / "spool", max_block_s=1.0)
    t0 = time.monotonic()
    trainer = _train(tiny, tmp_path / "offline", cb)
    assert trainer.state.global_step == 4 and time.monotonic() - t0 < 60
    spooled = sorted((tmp_path / "spool").glob("*.json"))
    assert len(spooled) == 2 and len(cb.announced) == 2     # kept for the next notify() or `evaldag flush-events`


def test_only_the_world_main_process_announces(tmp_path, events):
    from transformers import TrainerControl, TrainerState, TrainingArguments

    cb = EvaldagCallback(api_url=events.url, spool_dir=tmp_path / "spool")
    args = TrainingArguments(output_dir=str(tmp_path / "ranks"), report_to=[], use_cpu=True)
    other_rank = TrainerState(is_world_process_zero=False, global_step=2, max_steps=4)
    cb.on_train_begin(args, other_rank, TrainerControl())
    cb.on_save(args, other_rank, TrainerControl())
    assert cb.notifier is None and events.events() == [] and cb.saves == 0


@pytest.mark.parametrize("kwargs, message", [
    ({"every_saves": 0}, "every_saves must be an int >= 1"),
    ({"every_saves": 2, "trigger": EvalTrigger(freq_steps=10)}, "give every_saves or trigger, not both"),
    ({"benchmarks": ["GSM 8K"]}, "GSM 8K"),
    ({"limit": 0}, "limit must be >= 1"),
    ({"train_run": "a/b"}, "train_run must match"),
    ({"decide": "vs_worst"}, "vs_worst"),
    ({"api_url": "localhost:4200/api"}, "api_url must be an http"),      # on every rank, before training starts
    ({"max_block_s": 0}, "max_block_s must be > 0"),
])
def test_bad_options_are_refused_when_the_callback_is_built(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EvaldagCallback(**kwargs)


def test_the_client_still_imports_without_transformers():
    code = ("import sys, evaldag.client; from evaldag.client import EvaldagCallback; "
            "print(sorted(m for m in ('transformers', 'torch', 'mlflow', 'pydantic') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parent.parent)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_an_active_run_id_the_event_would_refuse_is_left_out(monkeypatch):
    """An id outside the event schema's pattern would get the whole event refused by the server; the job's own
    parent run is the better outcome. (A stand-in `mlflow` module: real MLflow ids always match.)"""
    from types import SimpleNamespace

    from evaldag.client.trainer_callback import active_mlflow_run_id

    def fake(run_id):
        return SimpleNamespace(active_run=lambda: SimpleNamespace(info=SimpleNamespace(run_id=run_id)))

    monkeypatch.setitem(sys.modules, "mlflow", fake("0123abcd" * 4))
    assert active_mlflow_run_id() == "0123abcd" * 4
    monkeypatch.setitem(sys.modules, "mlflow", fake("runs:/not an id"))
    assert active_mlflow_run_id() is None
    monkeypatch.delitem(sys.modules, "mlflow")
    assert active_mlflow_run_id() is None


def _trainer_events() -> list[str]:
    """Every event a Trainer sends its callbacks (TrainerCallback's on_* methods), by name."""
    from transformers import TrainerCallback

    return sorted(name for name in vars(TrainerCallback) if name.startswith("on_"))


# Settings found wrong only once training runs, on the world's main process alone: raised into the Trainer there,
# the other ranks would wait in their next collective until the NCCL timeout (issue 51 item 5).
BAD_SETTINGS = {
    "PREFECT_API_URL without its scheme": ({"PREFECT_API_URL": "127.0.0.1:4200/api"}, "out"),
    "an output folder the event refuses": ({}, "out\0put"),
}


@pytest.mark.parametrize("bad", BAD_SETTINGS)
def test_no_trainer_event_raises_a_bad_setting_warns_once_and_turns_the_callback_off(bad, tmp_path, monkeypatch,
                                                                                     events, caplog):
    from transformers import TrainerControl, TrainerState, TrainingArguments

    env, folder = BAD_SETTINGS[bad]
    monkeypatch.setenv("PREFECT_API_URL", events.url)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    cb = EvaldagCallback(spool_dir=tmp_path / "spool")
    args = TrainingArguments(output_dir=str(tmp_path / folder), report_to=[], use_cpu=True)
    state = TrainerState(is_world_process_zero=True, global_step=2, max_steps=4, epoch=0)
    with caplog.at_level("WARNING", logger="evaldag"):
        for name in _trainer_events():
            getattr(cb, name)(args, state, TrainerControl(), metrics={}, logs={})
        after_first = (cb.saves, cb.notifier, list(cb.announced))
        for name in _trainer_events() * 2:              # turned off: every later event is a no-op
            getattr(cb, name)(args, state, TrainerControl(), metrics={}, logs={})
    warned = [r for r in caplog.records if r.name.startswith("evaldag") and r.levelname == "WARNING"]
    assert len(warned) == 1, [r.getMessage() for r in warned]
    assert "turned off" in warned[0].getMessage()
    assert (cb.saves, cb.notifier, cb.announced) == after_first and cb.announced == []
    assert events.events() == [] and not list((tmp_path / "spool").glob("*.json"))


def test_training_runs_to_its_end_with_a_malformed_prefect_api_url(tiny, tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("PREFECT_API_URL", "localhost:4200/api")
    cb = EvaldagCallback(spool_dir=tmp_path / "spool")
    with caplog.at_level("WARNING", logger="evaldag"):
        trainer = _train(tiny, tmp_path / "bad-url", cb)
    assert trainer.state.global_step == 4 and cb.announced == []
    warned = [r.getMessage() for r in caplog.records if r.name.startswith("evaldag") and r.levelname == "WARNING"]
    assert len(warned) == 1 and "localhost:4200/api" in warned[0], warned


def test_a_run_name_that_is_the_output_folder_names_the_job_after_the_folder(tmp_path):
    """Older transformers default `run_name` to `output_dir`: a path, which would name the job after the whole path
    ("tmp-...-sft-7")."""
    from transformers import TrainingArguments

    out = tmp_path / "sft-7"
    args = TrainingArguments(output_dir=str(out), run_name=str(out), report_to=[], use_cpu=True)
    assert EvaldagCallback().job_name(args) == "sft-7"
    args = TrainingArguments(output_dir=str(out), run_name="grpo 7", report_to=[], use_cpu=True)
    assert EvaldagCallback().job_name(args) == "grpo-7"
