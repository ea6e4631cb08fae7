"""Trainer side: when evaluations are due, and delivering checkpoint events to a real local HTTP server.

The server is http.server in a thread on 127.0.0.1 (no Prefect): it records each POSTed body and answers with
scripted statuses, or is stopped so that connections are refused.
"""

from __future__ import annotations

import json
import logging
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from evaldag.client import CheckpointNotifier, EvalTrigger, flush_spool
from fake_events import FakeEventsServer


# ----------------------------------------------------------------------------------------------------------------
# EvalTrigger
# ----------------------------------------------------------------------------------------------------------------

class FakeClock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def fired_steps(trigger: EvalTrigger, steps, epoch=0):
    return [s for s in steps if trigger.check(epoch, s)]


def test_steps_fire_on_multiples_never_at_zero():
    t = EvalTrigger(freq_steps=100)
    assert fired_steps(t, range(0, 501)) == [100, 200, 300, 400, 500]
    assert t.num_triggers == 5 and t.last_reasons == ("steps",)


def test_steps_keep_their_grid_with_irregular_calls():
    t = EvalTrigger(freq_steps=100)
    assert fired_steps(t, [0, 30, 60, 90, 120, 150, 180, 205, 299, 300]) == [120, 205, 300]


def test_repeated_call_at_the_same_step_fires_once():
    t = EvalTrigger(freq_steps=10)
    assert [t.check(0, 10), t.check(0, 10), t.check(0, 11)] == [True, False, False]


def test_epochs():
    t = EvalTrigger(freq_epochs=2)
    seen = [(e, s) for e in range(6) for s in range(e * 10, e * 10 + 10) if t.check(e, s)]
    assert seen == [(2, 20), (4, 40)]            # first step of epochs 2 and 4: two epochs have ended


def test_seconds_with_fake_clock():
    clock = FakeClock()
    t = EvalTrigger(freq_secs=60, clock=clock)
    assert not t.check(0, 1)                      # nothing has passed since construction
    clock.t += 59.9
    assert not t.check(0, 2)
    clock.t += 0.1
    assert t.check(0, 3) and t.last_reasons == ("secs",)
    clock.t += 30
    assert not t.check(0, 4)
    clock.t += 30
    assert t.check(0, 5)


def test_combination_any_condition_fires_and_resets_the_timer():
    clock = FakeClock()
    t = EvalTrigger(freq_steps=100, freq_secs=60, clock=clock)
    clock.t += 61
    assert t.check(0, 50) and t.last_reasons == ("secs",)
    clock.t += 10
    assert not t.check(0, 99)
    assert t.check(0, 100) and t.last_reasons == ("steps",)   # the step grid is not moved by the timed trigger
    clock.t += 55                                            # 55 s after the step trigger: timer was reset
    assert not t.check(0, 101)
    clock.t += 5
    assert t.check(0, 102)
    t2 = EvalTrigger(freq_steps=10, freq_epochs=1)
    assert t2.check(1, 10) and t2.last_reasons == ("steps", "epochs")


def test_resume_neither_retriggers_nor_skips():
    clock = FakeClock()
    t = EvalTrigger(freq_steps=100, freq_epochs=1, freq_secs=600, clock=clock)
    fired_steps(t, range(0, 251))
    clock.t += 400
    state = json.loads(json.dumps(t.state_dict()))           # it goes into a checkpoint: must be JSON-clean
    assert state["last_step"] == 200 and state["secs_since_last"] == pytest.approx(400)

    clock2 = FakeClock(5.0)                                  # a new process: another monotonic origin
    resumed = EvalTrigger(freq_steps=100, freq_epochs=1, freq_secs=600, clock=clock2)
    resumed.load_state_dict(state)
    assert fired_steps(resumed, range(201, 300)) == []       # the same steps after resume: no re-trigger
    assert resumed.check(0, 300)                             # ... and the next due step still fires
    clock2.t += 599
    assert not resumed.check(0, 301)
    clock2.t += 1
    assert resumed.check(0, 302)
    assert resumed.num_triggers == t.num_triggers + 2


def test_resume_seconds_counts_elapsed_before_the_save():
    clock = FakeClock()
    t = EvalTrigger(freq_secs=100, clock=clock)
    clock.t += 70
    state = t.state_dict()
    clock2 = FakeClock(0.0)
    resumed = EvalTrigger(freq_secs=100, clock=clock2)
    resumed.load_state_dict(state)
    clock2.t += 29
    assert not resumed.check(0, 1)
    clock2.t += 1
    assert resumed.check(0, 2)                               # 70 before the save + 30 after


@pytest.mark.parametrize("kwargs, message", [
    ({}, "at least one of"),
    ({"freq_steps": 0}, "freq_steps must be > 0"),
    ({"freq_steps": -5}, "freq_steps must be > 0"),
    ({"freq_steps": 1.5}, "freq_steps must be an int"),
    ({"freq_steps": True}, "freq_steps must be an int"),
    ({"freq_epochs": 0}, "freq_epochs must be > 0"),
    ({"freq_secs": 0}, "freq_secs must be > 0"),
    ({"freq_secs": "60"}, "freq_secs must be a number"),
])
def test_trigger_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EvalTrigger(**kwargs)


def test_check_and_state_validation():
    t = EvalTrigger(freq_steps=10)
    with pytest.raises(ValueError, match="step must be >= 0"):
        t.check(0, -1)
    with pytest.raises(ValueError, match="epoch must be an int"):
        t.check(None, 1)
    with pytest.raises(ValueError, match="lacks"):
        t.load_state_dict({"last_step": 3})
    with pytest.raises(ValueError, match="secs_since_last"):
        t.load_state_dict({"last_step": 3, "last_epoch": 0, "secs_since_last": -1})


@pytest.fixture
def server():
    s = FakeEventsServer().start()
    yield s
    s.release.set()
    s.stop()


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _notifier(url, tmp_path, **kw) -> CheckpointNotifier:
    kw = {"timeout_s": 1.0, "max_block_s": 3.0, "retries": 3, "backoff_s": 0.01, **kw}
    return CheckpointNotifier("grpo-42", api_url=url, spool_dir=tmp_path / "spool", **kw)


# ----------------------------------------------------------------------------------------------------------------
# CheckpointNotifier
# ----------------------------------------------------------------------------------------------------------------

def test_delivered_event_shape(server, tmp_path):
    ckpt = tmp_path / "ckpts" / "checkpoint-1200"
    ckpt.mkdir(parents=True)
    n = _notifier(server.url, tmp_path, benchmarks=["math500", "gsm8k"], sampling={"n": 4, "temperature": 0.6},
                  engine_settings={"max_model_len": 4096}, mlflow_parent_run_id="0123456789abcdef0123456789abcdef", final_step=5000)
    event_id = n.notify(ckpt, 1200, epoch=3, lr=1e-5)
    assert len(server.received) == 1
    path, body = server.received[0]
    assert path == "/api/events" and isinstance(body, list) and len(body) == 1
    ev = body[0]
    assert ev["id"] == event_id and ev["event"] == "evaldag.checkpoint.saved"
    assert ev["occurred"].endswith("Z") and "T" in ev["occurred"]
    assert ev["resource"] == {"prefect.resource.id": "evaldag.train-run.grpo-42", "prefect.resource.name": "grpo-42"}
    assert ev["payload"] == {"path": str(ckpt), "step": 1200, "epoch": 3, "train_run": "grpo-42",
                             "benchmarks": ["math500", "gsm8k"],
                             "mlflow_parent_run_id": "0123456789abcdef0123456789abcdef", "final_step": 5000,
                             "sampling": {"n": 4, "temperature": 0.6}, "engine_settings": {"max_model_len": 4096},
                             "extra": {"lr": 1e-5}}
    assert n.pending() == []


def test_relative_path_is_sent_absolute(server, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _notifier(server.url, tmp_path).notify("ckpts/step_5", 5)
    assert server.received[0][1][0]["payload"]["path"] == str(tmp_path / "ckpts" / "step_5")


def test_retries_5xx_then_succeeds(server, tmp_path):
    server.script = [500, 503]
    n = _notifier(server.url, tmp_path)
    event_id = n.notify(tmp_path, 10)
    assert server.ids == [event_id] * 3                       # same id on every attempt
    assert n.pending() == []


def test_server_down_spools_within_budget_then_flush_delivers(tmp_path, caplog):
    port = _closed_port()
    n = _notifier(f"http://127.0.0.1:{port}/api", tmp_path, max_block_s=1.0, backoff_s=0.2)
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="evaldag.client.notifier"):
        event_id = n.notify(tmp_path, 100)
    elapsed = time.monotonic() - t0
    assert elapsed < 1.0 + 0.5, elapsed                      # slack for a busy 2-core box
    assert [p.name.endswith(f"{event_id}.json") for p in n.pending()] == [True]
    assert json.loads(n.pending()[0].read_text())["id"] == event_id
    assert "spooled" in caplog.text
    assert not list((tmp_path / "spool").glob(".tmp-*"))     # atomic write left no temp file

    server = FakeEventsServer().start(port)
    try:
        assert n.flush() == 1
        assert server.ids == [event_id]
        assert n.pending() == []
    finally:
        server.stop()


def test_slow_server_is_bounded_by_max_block_s(server, tmp_path):
    server.delay_s = 5.0                                      # answers long after the client timeout
    n = _notifier(server.url, tmp_path, timeout_s=0.3, max_block_s=0.8, backoff_s=0.05)
    t0 = time.monotonic()
    n.notify(tmp_path, 1)
    elapsed = time.monotonic() - t0
    assert elapsed < 0.8 + 0.5, elapsed
    assert len(n.pending()) == 1


def test_4xx_goes_to_rejected_and_is_not_retried(server, tmp_path, caplog):
    server.script = [400]
    n = _notifier(server.url, tmp_path)
    with caplog.at_level(logging.WARNING, logger="evaldag.client.notifier"):
        event_id = n.notify(tmp_path, 7)
    assert len(server.received) == 1                          # one attempt, no retries
    rejected = list((tmp_path / "spool" / "rejected").glob("*.json"))
    assert len(rejected) == 1 and json.loads(rejected[0].read_text())["id"] == event_id
    assert "HTTP 400" in caplog.text and "rejected" in caplog.text
    assert n.pending() == []
    second = n.notify(tmp_path, 8)                             # a later notify does not re-send the rejected one
    assert server.ids == [event_id, second]


def test_spooled_4xx_is_moved_to_rejected_on_flush(tmp_path):
    port = _closed_port()
    n = _notifier(f"http://127.0.0.1:{port}/api", tmp_path, max_block_s=0.5)
    bad, good = n.notify(tmp_path, 1), n.notify(tmp_path, 2)
    server = FakeEventsServer().start(port)
    server.script = [422]
    try:
        assert n.flush() == 1
        assert server.ids == [bad, good]
        assert [p.name.endswith(f"{bad}.json") for p in (tmp_path / "spool" / "rejected").glob("*.json")] == [True]
        assert n.pending() == []
    finally:
        server.stop()


def test_order_is_oldest_first_and_ids_are_kept(tmp_path):
    port = _closed_port()
    n = _notifier(f"http://127.0.0.1:{port}/api", tmp_path, max_block_s=0.5)
    spooled = [n.notify(tmp_path, s) for s in (100, 200, 300)]
    assert len(n.pending()) == 3
    assert [json.loads(p.read_text())["payload"]["step"] for p in n.pending()] == [100, 200, 300]
    server = FakeEventsServer().start(port)
    try:
        latest = n.notify(tmp_path, 400)                       # flushes the spool first, then sends its own
        assert server.ids == spooled + [latest]
        assert [b[0]["payload"]["step"] for _, b in server.received] == [100, 200, 300, 400]
        assert n.pending() == []
    finally:
        server.stop()


def test_while_down_each_notify_costs_one_attempt(tmp_path):
    port = _closed_port()
    n = _notifier(f"http://127.0.0.1:{port}/api", tmp_path, max_block_s=2.0, backoff_s=0.3)
    n.notify(tmp_path, 1)                                      # pays the retry cycle once
    t0 = time.monotonic()
    for s in range(2, 6):
        n.notify(tmp_path, s)
    assert (time.monotonic() - t0) / 4 < 0.2                   # then a single refused connect per notify
    assert len(n.pending()) == 5


def test_notify_never_raises_on_network_faults(tmp_path):
    # A listener that accepts and answers garbage, then closes.
    garbage = socket.socket()
    garbage.bind(("127.0.0.1", 0))
    garbage.listen()
    stop = threading.Event()

    def answer():
        garbage.settimeout(0.1)
        while not stop.is_set():
            try:
                conn, _ = garbage.accept()
            except OSError:
                continue
            with conn:
                conn.recv(65536)
                conn.sendall(b"NOT HTTP AT ALL\r\n\r\n")

    threading.Thread(target=answer, daemon=True).start()
    try:
        for url in (f"http://127.0.0.1:{garbage.getsockname()[1]}/api", f"http://127.0.0.1:{_closed_port()}/api"):
            n = _notifier(url, tmp_path / url.split(":")[-1].split("/")[0], max_block_s=0.5)
            assert isinstance(n.notify(tmp_path, 1), str)
            assert len(n.pending()) == 1
    finally:
        stop.set()
        garbage.close()


def test_unwritable_spool_does_not_raise(tmp_path, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    n = CheckpointNotifier("r", api_url=f"http://127.0.0.1:{_closed_port()}/api", spool_dir=blocker / "spool",
                           max_block_s=0.3)
    with caplog.at_level(logging.ERROR, logger="evaldag.client.notifier"):
        assert n.notify(tmp_path, 1)
    assert "could not be sent or spooled" in caplog.text


def test_no_api_url_spools_and_flush_spool_delivers(server, tmp_path, monkeypatch):
    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    n = CheckpointNotifier("r1", spool_dir=tmp_path / "spool")
    ids = [n.notify(tmp_path, 1), n.notify(tmp_path, 2)]
    assert len(n.pending()) == 2 and server.received == []
    assert flush_spool(tmp_path / "spool", server.url) == 2
    assert server.ids == ids and n.pending() == []
    with pytest.raises(ValueError, match="PREFECT_API_URL"):
        flush_spool(tmp_path / "spool")


def test_api_url_from_env(server, tmp_path, monkeypatch):
    monkeypatch.setenv("PREFECT_API_URL", server.url + "/")
    n = CheckpointNotifier("r1", spool_dir=tmp_path / "spool")
    assert n.api_url == server.url
    n.notify(tmp_path, 3)
    assert len(server.received) == 1


def test_default_spool_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("EVALDAG_HOME", raising=False)
    assert CheckpointNotifier("run-7", api_url="http://127.0.0.1:1/api").spool_dir == \
        tmp_path / ".evaldag" / "spool" / "run-7"
    monkeypatch.setenv("EVALDAG_HOME", str(tmp_path / "state"))   # the state folder of the local stack wins
    assert CheckpointNotifier("run-7", api_url="http://127.0.0.1:1/api").spool_dir == \
        tmp_path / "state" / "spool" / "run-7"


def _flush_threads(n: CheckpointNotifier) -> list[threading.Thread]:
    """Live background-flush threads of `n` (named after its training run)."""
    return [t for t in threading.enumerate() if t.name == f"evaldag-flush-{n.train_run}"]


def test_background_flush_is_opt_in_and_delivers(tmp_path):
    port = _closed_port()
    n = _notifier(f"http://127.0.0.1:{port}/api", tmp_path, max_block_s=0.5)
    event_id = n.notify(tmp_path, 1)
    server = FakeEventsServer().start(port)
    try:
        # opt-in: the server is back, but until start_background_flush() nothing sends the spooled event
        assert _flush_threads(n) == []
        time.sleep(0.5)
        assert server.received == [] and len(n.pending()) == 1
        n.start_background_flush(interval_s=0.05)
        assert len(_flush_threads(n)) == 1
        deadline = time.monotonic() + 5
        while n.pending() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert server.ids == [event_id]
    finally:
        n.close()
        server.stop()
    assert _flush_threads(n) == []                              # close() stops it


@pytest.mark.parametrize("call, message", [
    (lambda n, p: n.notify("", 1), "path must be"),
    (lambda n, p: n.notify(None, 1), "path must be"),
    (lambda n, p: n.notify(p, -1), "step must be >= 0"),
    (lambda n, p: n.notify(p, "12"), "step must be an int"),
    (lambda n, p: n.notify(p, True), "step must be an int"),
    (lambda n, p: n.notify(p, 1, epoch=-2), "epoch must be >= 0"),
    (lambda n, p: n.notify(p, 1, obj=object()), "JSON-serialisable"),
])
def test_notify_programmer_errors_raise(server, tmp_path, call, message):
    n = _notifier(server.url, tmp_path)
    with pytest.raises(ValueError, match=message):
        call(n, tmp_path)
    assert server.received == []


@pytest.mark.parametrize("kwargs, message", [
    ({"train_run": "has space"}, "train_run must match"),
    ({"train_run": "../escape"}, "train_run must match"),
    ({"api_url": "localhost:4200/api"}, "http"),
    ({"benchmarks": "math500"}, "benchmarks must be"),
    ({"benchmarks": []}, "benchmarks must be"),
    ({"timeout_s": 0}, "timeout_s must be > 0"),
    ({"max_block_s": -1}, "max_block_s must be > 0"),
    ({"retries": -1}, "retries must be >= 0"),
    ({"final_step": 0}, "final_step must be > 0"),
    ({"final_step": "5000"}, "final_step must be an int"),
    ({"final_step": 5000.0}, "final_step must be an int"),
])
def test_notifier_validation(tmp_path, kwargs, message):
    kwargs = {"train_run": "ok", "api_url": "http://127.0.0.1:1/api", **kwargs}
    with pytest.raises(ValueError, match=message):
        CheckpointNotifier(spool_dir=tmp_path, **kwargs)


def test_trainer_module_imports_no_heavy_dependencies():
    code = ("import sys, evaldag.client; "
            "print(sorted(m for m in ('prefect', 'mlflow', 'pydantic', 'polars', 'torch', 'yaml', 'httpx') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parent.parent)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


@pytest.mark.parametrize("code", [401, 403, 404])
def test_a_refused_sender_keeps_its_events_until_the_server_takes_them(server, tmp_path, caplog, monkeypatch, code):
    """An expired key (401/403) or a wrong api_url (404) is the sender's problem, not the event's: the events stay
    spooled in order, nothing goes to rejected/, and they are sent once the server takes them (the key is read at
    each send, so a rotated one is used at once)."""
    server.script = [code, code]
    n = _notifier(server.url, tmp_path)
    with caplog.at_level(logging.WARNING, logger="evaldag.client.notifier"):
        first = n.notify(tmp_path, 7)
        second = n.notify(tmp_path, 8)
    assert not list((tmp_path / "spool" / "rejected").glob("*.json"))
    assert len(n.pending()) == 2 and f"HTTP {code}" in caplog.text
    assert len(server.received) == 2                          # one try each: a retry would be refused the same way
    monkeypatch.setenv("PREFECT_API_KEY", "rotated")
    third = n.notify(tmp_path, 9)
    assert server.ids[-3:] == [first, second, third] and n.pending() == []


@pytest.mark.parametrize("code", [301, 302, 307])
def test_a_redirect_is_not_followed_and_the_event_stays_spooled(server, tmp_path, caplog, monkeypatch, code):
    """urllib would follow a redirect with the Authorization header to the host Location names, as a GET without
    the event, and count that host's 200 as a delivery. The notifier follows none: the other host sees nothing,
    the event stays spooled (one try: the same URL redirects again) and the warning names the URL to use."""
    monkeypatch.delenv("PREFECT_API_KEY", raising=False)
    monkeypatch.setenv("PREFECT_API_AUTH_STRING", "evaldag:Sup3rS3cret")
    target = FakeEventsServer().start()
    try:
        server.script, server.location = [code], f"{target.url}/events"
        n = _notifier(server.url, tmp_path)
        with caplog.at_level(logging.WARNING, logger="evaldag.client.notifier"):
            event_id = n.notify(tmp_path, 7)
        assert target.requests == []                           # no request, so no credentials, reached the target
        assert [(m, auth is not None) for m, _, auth in server.requests] == [("POST", True)]
        assert [p.name.endswith(f"{event_id}.json") for p in n.pending()] == [True]
        assert not list((tmp_path / "spool" / "rejected").glob("*.json"))
        assert f"HTTP {code}" in caplog.text and f"redirecting to '{target.url}/events'" in caplog.text
        assert f"final URL: set api_url / PREFECT_API_URL to '{target.url}'" in caplog.text
        assert "delivered" not in caplog.text
        assert flush_spool(tmp_path / "spool", target.url) == 1 and target.ids == [event_id]   # not lost
    finally:
        target.stop()
