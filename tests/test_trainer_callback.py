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
