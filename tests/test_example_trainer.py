"""examples/train_sft.py: a real (tiny) fine-tuning of the default model that saves and announces checkpoints.

The model tests train 4 steps on 10 GSM8K-style rows, with a recording HTTP server standing in for Prefect's
/api/events, then resume to step 6. Each checkpoint folder holds ~1.3 GB (bf16 weights + AdamW state); the
folder is removed when the module's tests are done.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import shutil
from pathlib import Path

import pytest

from conftest import require_free_disk
from evaldag.request.checkpoint import validate_checkpoint
from fake_events import FakeEventsServer

_SCRIPT = Path(__file__).resolve().parent.parent / "examples" / "train_sft.py"
TRAIN_RUN = "sft-test"
MODEL = "smollm2-135m-instruct"


def _load_script():
    spec = importlib.util.spec_from_file_location("train_sft", _SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


train_sft = _load_script()

ROWS = [
    ("Tom has 3 apples and buys 4 more. How many apples does he have?", "3 + 4 = <<3+4=7>>7\n#### 7"),
    ("A box holds 6 pens. How many pens are in 2 boxes?", "6 * 2 = <<6*2=12>>12\n#### 12"),
    ("Sara had 10 cookies and ate 3. How many are left?", "10 - 3 = <<10-3=7>>7\n#### 7"),
    ("Each bus seats 20 kids. How many kids fit in 3 buses?", "20 * 3 = <<20*3=60>>60\n#### 60"),
    ("Ben splits 12 marbles equally between 4 friends. How many does each get?", "12 / 4 = <<12/4=3>>3\n#### 3"),
    ("A shirt costs $8 and pants cost $15. What do both cost?", "8 + 15 = <<8+15=23>>23\n#### 23"),
    ("Mia reads 5 pages a day. How many pages does she read in a week?", "5 * 7 = <<5*7=35>>35\n#### 35"),
    ("There are 9 birds and 4 fly away. How many birds remain?", "9 - 4 = <<9-4=5>>5\n#### 5"),
    ("A farmer has 2 pens with 11 sheep each. How many sheep?", "2 * 11 = <<2*11=22>>22\n#### 22"),
    ("Leo saves $5 a week for 6 weeks. How much does he save?", "5 * 6 = <<5*6=30>>30\n#### 30"),
]


@pytest.fixture(scope="module")
def events_api():
    """A stand-in for Prefect's events endpoint: records the events POSTed to /api/events, answers 204."""
    server = FakeEventsServer().start()
    yield server.url, server
    server.release.set()
    server.stop()


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    root = tmp_path_factory.mktemp("train-sft")
    require_free_disk(root, 5, "examples/train_sft.py's test (up to three checkpoints of 1.35 GB: bf16 weights, "
                               "float32 AdamW state)")
    data = root / "train.jsonl"
    data.write_text("".join(json.dumps({"question": q, "answer": a}) + "\n" for q, a in ROWS))
    yield root, data
    shutil.rmtree(root / "out", ignore_errors=True)     # ~4 GB of checkpoints: do not leave them in /tmp


def _args(data: Path, out: Path, api_url: str, *extra: str) -> list[str]:
    return ["--data", str(data), "--output-dir", str(out), "--train-run", TRAIN_RUN, "--batch-size", "2",
            "--max-length", "128", "--save-every-steps", "2", "--log-every", "1", "--api-url", api_url,
            "--seed", "0", *extra]


def _checkpoints(out: Path) -> list[str]:
    return sorted((p.name for p in out.iterdir()), key=lambda n: (len(n), n))


def _state(folder: Path) -> dict:
    return json.loads((folder / "trainer_state.json").read_text())


def _check_events(events: list[dict], out: Path, steps: list[int]) -> None:
    assert [e["payload"]["step"] for e in events] == steps                   # exactly these, in this order
    for event, step in zip(events, steps):
        payload = event["payload"]
        assert event["event"] == "evaldag.checkpoint.saved"
        assert payload["path"] == str(out / f"checkpoint-{step}")
        assert payload["train_run"] == TRAIN_RUN
        assert payload["benchmarks"] == ["gsm8k"]
        assert payload["epoch"] == step // (len(ROWS) // 2)
        assert payload["extra"] == {"model": MODEL}
        assert isinstance(payload["final_step"], int) and payload["final_step"] >= step     # --max-steps
    assert len({e["id"] for e in events}) == len(events)


@pytest.fixture(scope="module")
def first_run(workdir, events_api):
    root, data = workdir
    api_url, server = events_api
    out = root / "out"
    rc = train_sft.main(_args(data, out, api_url, "--max-steps", "4"))
    return rc, out, server.events()


@pytest.mark.model
def test_trains_saves_and_announces_checkpoints(first_run, events_api):
    rc, out, events = first_run
    assert rc == 0
    assert _checkpoints(out) == ["checkpoint-2", "checkpoint-4"]             # no leftover .tmp-checkpoint-*
    for step in (2, 4):
        folder = out / f"checkpoint-{step}"
        validate_checkpoint(folder)                                          # config, weights, tokenizer
        for name in ("config.json", "model.safetensors", "generation_config.json", "optimizer.pt"):
            assert (folder / name).is_file(), name
        assert json.loads((folder / "config.json").read_text())["dtype"] == "bfloat16"
        state = _state(folder)
        assert state["step"] == step and state["trigger"]["last_step"] == step
        assert state["base_model"] == MODEL and state["train_run"] == TRAIN_RUN
        assert state["log_history"] and all(math.isfinite(h["loss"]) and h["loss"] > 0
                                            for h in state["log_history"])
        assert math.isfinite(state["loss"])
    assert [h["step"] for h in _state(out / "checkpoint-4")["log_history"]] == [1, 2, 3, 4]
    _check_events(events, out, [2, 4])
    spool = Path(os.environ["EVALDAG_HOME"]) / "spool" / TRAIN_RUN
    assert not list(spool.glob("*.json")), "every event was delivered, none should be spooled"


@pytest.mark.model
def test_resume_continues_without_retriggering(first_run, workdir, events_api, capsys):
    _, out, _ = first_run
    _, data = workdir
    api_url, server = events_api
    before = {n: (out / n / "model.safetensors").stat().st_mtime_ns for n in _checkpoints(out)}

    rc = train_sft.main(_args(data, out, api_url, "--max-steps", "6", "--resume"))

    assert rc == 0
    assert "[resume] from" in capsys.readouterr().out
    assert _checkpoints(out) == ["checkpoint-2", "checkpoint-4", "checkpoint-6"]
    assert {n: (out / n / "model.safetensors").stat().st_mtime_ns for n in before} == before   # untouched
    validate_checkpoint(out / "checkpoint-6")
    state = _state(out / "checkpoint-6")
    assert state["step"] == 6 and state["trigger"]["num_triggers"] == 3
    assert [h["step"] for h in state["log_history"]] == [1, 2, 3, 4, 5, 6]
    _check_events(server.events(), out, [2, 4, 6])                                 # one more event, 2 and 4 not re-sent

    # Resuming once more at the end is a no-op: nothing trained, saved or sent.
    assert train_sft.main(_args(data, out, api_url, "--max-steps", "6", "--resume")) == 0
    assert _checkpoints(out) == ["checkpoint-2", "checkpoint-4", "checkpoint-6"]
    assert len(server.events()) == 3


def test_missing_data_file_is_a_clear_error(tmp_path, capsys):
    missing = tmp_path / "nope" / "train.jsonl"
    assert train_sft.main(["--data", str(missing), "--output-dir", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert str(missing) in err and "--data" in err
    assert not (tmp_path / "out").exists()


def test_malformed_rows_are_refused_with_their_line(tmp_path, capsys):
    data = tmp_path / "train.jsonl"
    data.write_text(json.dumps({"question": "q", "answer": "4"}) + "\n")
    assert train_sft.main(["--data", str(data), "--output-dir", str(tmp_path / "out")]) == 2
    assert f"{data}:1" in capsys.readouterr().err


def test_solution_format_matches_the_graded_answer():
    assert train_sft.format_solution("Half of 48 is 48/2 = <<48/2=24>>24.\n#### 24") == \
        "Half of 48 is 48/2 = 24.\n\\boxed{24}"
    assert train_sft.format_solution("#### 1,000") == "\\boxed{1000}"


def test_prompt_is_masked_and_answer_is_learnt():    # the model's tokenizer only: no `model` mark
    from transformers import AutoTokenizer

    from evaldag.request.config import load_benchmark
    from evaldag.request.checkpoint import resolve_model

    tok = AutoTokenizer.from_pretrained(resolve_model(MODEL).path)
    render = load_benchmark("gsm8k").render_prompt
    examples = train_sft.Examples([{"question": q, "answer": a} for q, a in ROWS], tok, render, batch_size=2,
                                  max_length=128, seed=0)
    ids, labels = examples.encode({"question": ROWS[0][0], "answer": ROWS[0][1]})
    assert len(ids) == len(labels)
    start = next(i for i, lab in enumerate(labels) if lab != -100)
    assert all(lab == -100 for lab in labels[:start]) and labels[start:] == ids[start:]
    prompt = tok.decode(ids[:start])
    assert prompt.endswith("<|im_start|>assistant\n")
    assert "Please reason step by step, and put your final answer within \\boxed{}." in prompt
    assert tok.decode(ids[start:]) == "3 + 4 = 7\n\\boxed{7}<|im_end|>\n"
    # Batches are a function of (seed, step): the same step gives the same batch, padded and masked.
    a, b = examples.batch(3), train_sft.Examples(examples.rows, tok, render, 2, 128, 0).batch(3)
    assert all((x == y).all() for x, y in zip(a, b))
    input_ids, mask, lab = a
    assert ((mask == 0) <= (lab == -100)).all()                              # pads carry no loss


def test_a_checkpoint_that_cannot_be_written_leaves_nothing_and_says_why(tmp_path):
    """A full disk in the middle of a save (stood in for by a save_pretrained that writes part of its file and then
    fails as a full disk does): no half-written folder stays behind, and the error names the checkpoint, the free
    space and the way on, not a write error from deep inside torch."""
    import errno

    import torch

    class _Model(torch.nn.Linear):
        def save_pretrained(self, folder, **_):
            (Path(folder) / "model.safetensors").write_bytes(b"\0" * 1024)
            raise OSError(errno.ENOSPC, "No space left on device")

    model = _Model(2, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    with pytest.raises(train_sft.CheckpointWriteError) as failed:
        train_sft.save_checkpoint(tmp_path, 2, model, tokenizer=None, optimizer=optimizer, state={})
    message = str(failed.value)
    assert str(tmp_path / "checkpoint-2") in message and "No space left" in message
    assert "GiB free" in message and "--resume" in message
    assert list(tmp_path.iterdir()) == []
