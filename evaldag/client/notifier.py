"""Trainer side of evaluate-on-checkpoint: decide when to evaluate, and tell Prefect that a checkpoint is ready.

This module is imported by training scripts, so it uses the standard library only: no prefect (1 s, 78 MB to
import), no pydantic, no torch (its input rules come from evaldag.request.rules, standard library only too). It must stay that way; tests/test_trainer.py checks it in a fresh interpreter.

- `EvalTrigger` answers "is an evaluation due at (epoch, step)?" for step, epoch and wall-clock frequencies, and
  saves its state with the trainer's so a resumed run neither evaluates twice nor skips one.
- `CheckpointNotifier.notify(path, step)` POSTs one `evaldag.checkpoint.saved` event to `$PREFECT_API_URL/events`
  (answered 204 by the server; a deployment trigger turns it into an eval flow run). `prefect.events.emit_event` is
  not used: when the server is down it drops events silently. Here a failed delivery is spooled to disk, one JSON
  file per event, and re-sent (same event id, so the consumer can deduplicate) at the start of the next notify()
  or by `flush()` / `flush_spool()`. notify() blocks the training loop for at most `max_block_s` and never raises
  for network faults.

Call these from one process only (rank 0 in distributed training): two processes flushing the same spool folder at
once may each send an event; the shared event id keeps that harmless for a deduplicating consumer.
"""

from __future__ import annotations

import base64
import http.client
import itertools
import json
import logging
import os
import random
import re
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

from evaldag.request.rules import (TRAIN_RUN_PATTERN, check_benchmark_names, check_count, check_decide, check_run_id,
                           check_step, check_train_run)

log = logging.getLogger("evaldag.client.notifier")

EVENT_NAME = "evaldag.checkpoint.saved"
RESOURCE_PREFIX = "evaldag.train-run."
_RETRYABLE_4XX = (408, 429)                            # request timeout, rate limited: the payload is fine
# Refusals of the sender, not of the event: a missing or expired key, no permission, a wrong api_url (so is any
# redirect, 3xx, which is never followed: see _NoRedirect). The events stay spooled, in order, until whoever runs
# the trainer fixes it; nothing is moved to rejected/.
_HELD_4XX = (401, 403, 404)
_MIN_ATTEMPT_S = 0.05                                  # no HTTP attempt is started with less time than this left
_BACKOFF_CAP_S = 2.0


# ---------------------------------------------------------------------------------------------------------------
# When to evaluate
# ---------------------------------------------------------------------------------------------------------------

def _positive(name: str, value: float | None, kind: type) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float) if kind is float else int):
        raise ValueError(f"{name} must be {'a number' if kind is float else 'an int'} > 0 or None, got {value!r}")
    if not value > 0:
        raise ValueError(f"{name} must be > 0 (or None to disable it), got {value!r}")


class EvalTrigger:
    """Decides when an evaluation is due, from step, epoch and wall-clock frequencies (any combination).

    Call `check(epoch, step)` after every optimizer step (or as often as you like); it returns True when at least
    one configured condition is due, and then records the trigger (its step, epoch and time):

    - steps: due when `step` has crossed a multiple of `freq_steps` since the last trigger, i.e.
      `step // freq_steps > last_step // freq_steps`. "Every 100 steps" fires at steps 100, 200, 300, ... and
      never at step 0. Called every step, this is exactly `step - last_step >= freq_steps`; it also keeps that grid
      when calls are irregular (fires at 120, then at 205) or when a seconds/epoch trigger fired in between (a
      trigger at step 150 does not move the next one to 250).
    - epochs: the same with `epoch // freq_epochs`. The first trigger is when `epoch` reaches `freq_epochs`, so pass
      either the 0-based index of the current epoch (fires at the first step of epoch 1, 2, ...: the previous epoch
      just ended) or the number of completed epochs; both mean "every N epochs".
    - seconds: due when `freq_secs` have passed since the last trigger (of any kind) or, before the first one,
      since the trigger was created. Any trigger restarts this clock: the goal is "never more than N seconds
      without an evaluation".

    `last_reasons` holds which conditions made the last True answer ("steps", "epochs", "secs").
    `state_dict()` / `load_state_dict()` carry the state across a restart; see load_state_dict.
    """

    def __init__(self, freq_steps: int | None = None, freq_epochs: int | None = None, freq_secs: float | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        _positive("freq_steps", freq_steps, int)
        _positive("freq_epochs", freq_epochs, int)
        _positive("freq_secs", freq_secs, float)
        if freq_steps is None and freq_epochs is None and freq_secs is None:
            raise ValueError("EvalTrigger needs at least one of freq_steps, freq_epochs, freq_secs "
                             "(e.g. EvalTrigger(freq_steps=500))")
        self.freq_steps = freq_steps
        self.freq_epochs = freq_epochs
        self.freq_secs = float(freq_secs) if freq_secs is not None else None
        self._clock = clock
        self.last_step = 0
        self.last_epoch = 0
        self.last_time = clock()
        self.num_triggers = 0
        self.last_reasons: tuple[str, ...] = ()

    def due(self, epoch: int, step: int) -> tuple[str, ...]:
        """Which conditions are due at (epoch, step), without recording anything."""
        epoch = check_count("epoch", epoch)
        step = check_step(step)
        reasons = []
        if self.freq_steps is not None and step // self.freq_steps > self.last_step // self.freq_steps:
            reasons.append("steps")
        if self.freq_epochs is not None and epoch // self.freq_epochs > self.last_epoch // self.freq_epochs:
            reasons.append("epochs")
        if self.freq_secs is not None and self._clock() - self.last_time >= self.freq_secs:
            reasons.append("secs")
        return tuple(reasons)

    def check(self, epoch: int, step: int) -> bool:
        """True when an evaluation is due at (epoch, step); a True answer records this point as the last trigger."""
        reasons = self.due(epoch, step)
        if not reasons:
            return False
        # max(): a step or epoch that went backwards (e.g. a trainer that rewound) never re-opens passed grid points.
        self.last_step = max(self.last_step, step)
        self.last_epoch = max(self.last_epoch, epoch)
        self.last_time = self._clock()
        self.num_triggers += 1
        self.last_reasons = reasons
        return True

    def state_dict(self) -> dict:
        """JSON-serialisable state to save with the trainer's checkpoint.

        Time is stored as seconds elapsed since the last trigger, not as a clock reading: a monotonic timestamp
        means nothing in another process.
        """
        return {"version": 1, "freq_steps": self.freq_steps, "freq_epochs": self.freq_epochs,
                "freq_secs": self.freq_secs, "last_step": self.last_step, "last_epoch": self.last_epoch,
                "secs_since_last": max(0.0, self._clock() - self.last_time), "num_triggers": self.num_triggers}

    def load_state_dict(self, state: dict) -> None:
        """Restore `state_dict()` output: the resumed trainer neither re-triggers passed points nor skips due ones.

        The frequencies of this object (from its constructor) are kept, so a resumed run may change them; only the
        record of the last trigger is restored. Seconds resume from the saved elapsed time: the time the job was
        down does not count.
        """
        if not isinstance(state, dict):
            raise ValueError(f"EvalTrigger state must be a dict from state_dict(), got {type(state).__name__}")
        missing = [k for k in ("last_step", "last_epoch", "secs_since_last") if k not in state]
        if missing:
            raise ValueError(f"EvalTrigger state lacks {missing}; pass the dict returned by EvalTrigger.state_dict()")
        last_step = check_count("state['last_step']", state["last_step"])
        last_epoch = check_count("state['last_epoch']", state["last_epoch"])
        secs = state["secs_since_last"]
        if isinstance(secs, bool) or not isinstance(secs, (int, float)) or secs < 0:
            raise ValueError(f"state['secs_since_last'] must be a number >= 0, got {secs!r}")
        self.last_step, self.last_epoch = last_step, last_epoch
        self.last_time = self._clock() - float(secs)
        self.num_triggers = check_count("state['num_triggers']", state.get("num_triggers", 0))


# ---------------------------------------------------------------------------------------------------------------
# Delivery: one HTTP POST with retries, and the spool folder
# ---------------------------------------------------------------------------------------------------------------

_OK, _REJECTED, _TRANSIENT, _NO_TIME, _HELD = "ok", "rejected", "transient", "no-time", "held"
_seq = itertools.count()
_name_lock = threading.Lock()
_last_ns = 0


def _auth_headers() -> dict[str, str]:
    """The Authorization header the Prefect client would send (Prefect Cloud key, or a self-hosted auth string)."""
    if key := os.environ.get("PREFECT_API_KEY"):
        return {"Authorization": f"Bearer {key}"}
    if auth := os.environ.get("PREFECT_API_AUTH_STRING"):
        return {"Authorization": "Basic " + base64.b64encode(auth.encode()).decode()}
    return {}


def _check_api_url(api_url: str | None) -> str | None:
    if api_url is None or not str(api_url).strip():
        return None
    api_url = str(api_url).strip().rstrip("/")
    if not re.match(r"^https?://[^/\s]+", api_url):
        raise ValueError(f"api_url must be an http(s) URL such as http://127.0.0.1:4200/api, got {api_url!r}")
    return api_url


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    """Refuses every redirect, so that a 3xx reaches _post as an HTTPError.

    urllib would follow it with the Authorization header (the Prefect key) to whatever host Location names, turn
    the POST into a GET without the event, and report the redirect target's 200 as a delivery.
    """

    def redirect_request(self, req: urllib.request.Request, fp: Any, code: int, msg: str, headers: Any,
                         newurl: str) -> None:
        """Never build the follow-up request."""
        return None


def _open(req: urllib.request.Request, timeout: float) -> http.client.HTTPResponse:
    """urlopen without redirects; built per call so that proxy variables set after import still count."""
    return urllib.request.build_opener(_NoRedirect).open(req, timeout=timeout)


def _post(api_url: str, body: bytes, timeout: float, headers: dict[str, str]) -> tuple[str, int | None, str]:
    """One POST of a JSON body to {api_url}/events: (outcome, HTTP status or None, detail).

    A redirect (3xx) is held, not followed, with its Location as the detail: see _NoRedirect and _refusal.
    """
    req = urllib.request.Request(f"{api_url}/events", data=body, method="POST",
                                 headers={"Content-Type": "application/json", **headers})
    try:
        with _open(req, timeout) as resp:
            resp.read()
            return (_OK if 200 <= resp.status < 300 else _TRANSIENT), resp.status, ""
    except urllib.error.HTTPError as e:
        if 300 <= e.code < 400:
            # Sending again to the same URL gets the same answer: the URL needs fixing, like a 404's.
            location = e.headers.get("Location")
            e.close()
            return _HELD, e.code, urllib.parse.urljoin(req.full_url, location) if location else ""
        try:
            detail = e.read(300).decode("utf-8", "replace")
        except Exception:
            detail = ""
        if e.code in _HELD_4XX:
            return _HELD, e.code, detail
        if 400 <= e.code < 500 and e.code not in _RETRYABLE_4XX:
            return _REJECTED, e.code, detail
        return _TRANSIENT, e.code, detail
    except (OSError, http.client.HTTPException, ValueError) as e:
        # URLError (refused, DNS), socket timeouts, resets, a garbled response: all worth another try later.
        return _TRANSIENT, None, f"{type(e).__name__}: {getattr(e, 'reason', e)}"


def _deliver(api_url: str, event: dict, deadline: float | None, timeout_s: float, retries: int, backoff_s: float,
             headers: dict[str, str]) -> tuple[str, int | None, str]:
    """POST `[event]`, retrying connection errors, timeouts and 5xx with exponential backoff and jitter.

    Never starts an attempt or a sleep that would end after `deadline` (a time.monotonic() value; None = no limit).
    A 4xx other than 408/429, or a 3xx, is not retried: the server will answer the same payload the same way.
    """
    body = json.dumps([event]).encode()
    outcome: tuple[str, int | None, str] = (_NO_TIME, None, "time budget exhausted before the first attempt")
    for attempt in range(retries + 1):
        remaining = None if deadline is None else deadline - time.monotonic()
        if remaining is not None and remaining < _MIN_ATTEMPT_S:
            break
        outcome = _post(api_url, body, timeout_s if remaining is None else min(timeout_s, remaining), headers)
        if outcome[0] != _TRANSIENT or attempt == retries:
            break
        delay = min(_BACKOFF_CAP_S, backoff_s * 2 ** attempt) * random.uniform(0.5, 1.5)
        if deadline is not None and time.monotonic() + delay + _MIN_ATTEMPT_S > deadline:
            break
        time.sleep(delay)
    return outcome


def _spool_name(event_id: str) -> str:
    """`<ns since epoch, 19 digits>-<seq>-<id>.json`: names sort by creation time (strictly, within a process)."""
    global _last_ns
    with _name_lock:
        _last_ns = max(time.time_ns(), _last_ns + 1)
        return f"{_last_ns:019d}-{next(_seq) % 1000000:06d}-{event_id}.json"


def _write_atomic(path: Path, data: dict) -> None:
    """Write JSON to a hidden temp file, fsync it, then os.replace: readers never see half an event."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".tmp-{path.name}")
    try:
        with open(tmp, "w", encoding="utf-8") as fh:
            json.dump(data, fh)
            fh.flush()
            os.fsync(fh.fileno())   # the spool exists to survive crashes: the bytes must be on disk before the rename
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _pending(spool_dir: Path) -> list[Path]:
    if not spool_dir.is_dir():
        return []
    return sorted(p for p in spool_dir.glob("*.json") if not p.name.startswith("."))


def _reject(spool_dir: Path, file: Path | None, event: dict, why: str) -> None:
    """Park an event the server will never take in spool_dir/rejected/, with a warning saying how to retry it."""
    target = spool_dir / "rejected" / (file.name if file is not None else _spool_name(event.get("id", "unknown")))
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        if file is not None:
            os.replace(file, target)
        else:
            _write_atomic(target, event)
    except OSError as e:
        log.error("could not keep rejected event %s in %s: %s", event.get("id"), target.parent, e)
        return
    log.warning("checkpoint event %s: %s; it will not be retried and is kept in %s. Fix the cause, then move the "
                "file back into %s to send it again.", event.get("id"), why, target, spool_dir)


def _redirect_refusal(status: int, location: str) -> str:
    """Why a redirected event was not sent, and the api_url to use instead when Location shows it."""
    fix = (f"set api_url / PREFECT_API_URL to {location[:-len('/events')]!r}" if location.endswith("/events")
           else "set api_url / PREFECT_API_URL to the final URL of the Prefect API (e.g. https://HOST/api)")
    where = f"redirecting to {location[:300]!r}" if location else "a redirect without a Location"
    return (f"the server answered HTTP {status}, {where}, which is not followed (the event would be lost and the "
            f"Prefect credentials sent to that address); point the notifier at the final URL: {fix}")


def _refusal(status: int | None, detail: str) -> str:
    """The warning's words for a held or rejected answer: the status, the server's detail and the likely fix."""
    if status is not None and 300 <= status < 400:
        return _redirect_refusal(status, detail)
    hint = {404: " (is api_url right? it usually ends in /api)",
            401: " (is PREFECT_API_KEY or PREFECT_API_AUTH_STRING set and current?)",
            403: " (does the key allow writing events?)"}.get(status or 0, "")
    return f"the server refused it with HTTP {status}: {detail.strip()[:300]!r}{hint}"


def _flush_dir(spool_dir: Path, api_url: str, deadline: float | None, *, timeout_s: float, retries: int,
               backoff_s: float, headers: dict[str, str], probe_first: bool = False) -> tuple[int, str]:
    """Send spooled events oldest first until done, out of time, or the server fails.

    Returns (delivered, state) with state "done" (spool empty), "no-time" or "transient" (the server failed).

    Stops at the first transient failure so that events are never sent out of order. With `probe_first`, the first
    event gets a single attempt (no retries): the server was just seen down, so the trainer should not pay for
    a full retry cycle on each notify while it stays down.
    """
    delivered = 0
    for file in _pending(spool_dir):
        try:
            event = json.loads(file.read_text(encoding="utf-8"))
            if not isinstance(event, dict) or "id" not in event:
                raise ValueError("not an event object")
        except FileNotFoundError:
            continue                      # another flusher delivered it meanwhile
        except (ValueError, UnicodeDecodeError, OSError) as e:
            _reject(spool_dir, file, {"id": file.name}, f"the spool file is unreadable ({e})")
            continue
        tries = 0 if (probe_first and delivered == 0) else retries
        outcome, status, detail = _deliver(api_url, event, deadline, timeout_s, tries, backoff_s, headers)
        if outcome == _OK:
            try:
                file.unlink()
            except FileNotFoundError:
                pass
            delivered += 1
        elif outcome == _REJECTED:
            _reject(spool_dir, file, event, _refusal(status, detail))
        elif outcome == _HELD:
            log.warning("spooled checkpoint events kept until Prefect at %s takes them: %s; %d pending in %s",
                        api_url, _refusal(status, detail), len(_pending(spool_dir)), spool_dir)
            return delivered, outcome
        else:
            log.info("spooled checkpoint events not delivered yet (%s); %d left in %s",
                     detail or f"HTTP {status}", len(_pending(spool_dir)), spool_dir)
            return delivered, outcome
    return delivered, "done"


def flush_spool(spool_dir: str | Path, api_url: str | None = None, max_seconds: float | None = None, *,
                timeout_s: float = 5.0, retries: int = 3, backoff_s: float = 0.2) -> int:
    """Deliver the events spooled in `spool_dir`, oldest first; returns how many were delivered.

    For `evaldag flush-events` and for cleanup after training. `api_url` defaults to $PREFECT_API_URL. Stops at the
    first event the server cannot take yet (they stay spooled) or after `max_seconds`. Never raises for network
    faults; raises ValueError when no API URL is given or set.
    """
    url = _check_api_url(api_url if api_url is not None else os.environ.get("PREFECT_API_URL"))
    if url is None:
        raise ValueError("no Prefect API URL: pass api_url or set PREFECT_API_URL (e.g. http://127.0.0.1:4200/api)")
    deadline = None if max_seconds is None else time.monotonic() + max_seconds
    delivered, _ = _flush_dir(Path(spool_dir).expanduser(), url, deadline, timeout_s=timeout_s, retries=retries,
                              backoff_s=backoff_s, headers=_auth_headers())
    return delivered


# ---------------------------------------------------------------------------------------------------------------
# The notifier
# ---------------------------------------------------------------------------------------------------------------

class CheckpointNotifier:
    """Announces saved checkpoints to Prefect as `evaldag.checkpoint.saved` events, reliably and cheaply.

    notify() first re-sends spooled events (oldest first), then POSTs the new one, all within `max_block_s`
    seconds. An event that cannot be delivered (server down, timeout, 5xx after `retries` retries) is spooled to
    `spool_dir` and re-sent later with its original id; so is one refused for the sender (401, 403, 404) or
    redirected (3xx: never followed, so the credentials never go to another host), with a warning naming the fix.
    One the server refuses with another 4xx (a payload bug; 408 and 429 excepted) is moved to
    `spool_dir/rejected/` with a warning and never retried. Without an API URL (argument
    or $PREFECT_API_URL) every event is spooled, with one warning, for a later `flush_spool(spool_dir, api_url)`.

    Bounds: each HTTP attempt waits at most min(timeout_s, time left); name resolution (DNS) is not covered by
    socket timeouts, so use an IP or a resolvable host name in api_url. While the server stays down, each notify
    makes one attempt only (no retry cycle) until a delivery succeeds again.

    `final_step`, the step training is planned to end at, travels with every event: the job's parent MLflow run
    then gets a forecast of the accuracy at that step (evaldag.decisions.forecast) from the checkpoints evaluated so far.
    `decide` ("vs_best", or {"against": "vs_best", "alpha": 0.05, "margin": 0.02, "rounds": 10}) asks every
    evaluation of the job to stop as soon as its paired verdict against the job's best checkpoint so far is decided
    (evaldag.decisions.decide): cheaper evaluations, each a verdict rather than a full measurement.
    """

    def __init__(self, train_run: str, api_url: str | None = None, benchmarks: list[str] | None = None,
                 spool_dir: str | Path | None = None, timeout_s: float = 2.0, max_block_s: float = 5.0,
                 retries: int = 3, model: str | None = None, mlflow_parent_run_id: str | None = None,
                 backoff_s: float = 0.2, final_step: int | None = None,
                 decide: str | dict | None = None) -> None:
        check_train_run(train_run)
        if benchmarks is not None:
            benchmarks = check_benchmark_names(benchmarks)
        if model is not None and (not isinstance(model, str) or not model):
            raise ValueError(f"model must be a non-empty string or None, got {model!r}")
        check_run_id(mlflow_parent_run_id)
        _positive("final_step", final_step, int)
        self.decide = check_decide(decide)
        _positive("timeout_s", timeout_s, float)
        _positive("max_block_s", max_block_s, float)
        _positive("backoff_s", backoff_s, float)
        check_count("retries", retries)
        self.train_run = train_run
        self.api_url = _check_api_url(api_url if api_url is not None else os.environ.get("PREFECT_API_URL"))
        self.benchmarks = benchmarks
        self.model = model
        self.mlflow_parent_run_id = mlflow_parent_run_id
        self.final_step = final_step
        self.spool_dir = (Path(spool_dir).expanduser() if spool_dir is not None
                          else Path(os.environ.get("EVALDAG_HOME", Path.home() / ".evaldag")).expanduser()
                          / "spool" / train_run).absolute()
        self.timeout_s, self.max_block_s, self.retries, self.backoff_s = timeout_s, max_block_s, retries, backoff_s
        self._lock = threading.Lock()
        self._server_down = False
        self._warned_no_url = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- public API ------------------------------------------------------------------------------------------

    def notify(self, path: str | os.PathLike, step: int, epoch: int | None = None, **extra: Any) -> str:
        """Announce the checkpoint saved at `path` for `step`; returns the event id (a UUID string).

        Blocks for at most `max_block_s`; never raises for network or disk faults (they are logged, and the event
        is spooled when it could not be sent). Raises ValueError for caller bugs: an empty path, a step or epoch
        that is not an int >= 0, or `extra` values that are not JSON-serialisable.
        """
        event = self._build_event(path, step, epoch, extra)
        deadline = time.monotonic() + self.max_block_s
        try:
            self._notify(event, deadline)
        except Exception:  # noqa: BLE001 - the training loop must survive anything the notifier does wrong
            log.exception("checkpoint event %s for step %s could not be sent or spooled", event["id"], step)
        return event["id"]

    def flush(self, max_seconds: float | None = None) -> int:
        """Re-send spooled events, oldest first, for at most `max_seconds` (None: until done or the server fails).

        Returns how many were delivered. Never raises for network faults.
        """
        if self.api_url is None:
            self._warn_no_url()
            return 0
        deadline = None if max_seconds is None else time.monotonic() + max_seconds
        if not self._lock.acquire(timeout=-1 if max_seconds is None else max(0.0, max_seconds)):
            return 0
        try:
            delivered, _ = self._flush(deadline)
            return delivered
        finally:
            self._lock.release()

    def pending(self) -> list[Path]:
        """Spooled events waiting for delivery, oldest first (rejected ones are in `spool_dir / "rejected"`)."""
        return _pending(self.spool_dir)

    def start_background_flush(self, interval_s: float = 60.0) -> None:
        """Opt-in: a daemon thread calls flush() every `interval_s` seconds, so spooled events go out between
        checkpoints. Stop it with close(). Without it, spooled events go out at the next notify() or flush()."""
        _positive("interval_s", interval_s, float)
        if self._thread is not None and self._thread.is_alive():
            return
        self._stop.clear()

        def loop() -> None:
            while not self._stop.wait(interval_s):
                try:
                    if self.pending():
                        self.flush(max_seconds=self.max_block_s)
                except Exception:  # noqa: BLE001 - a background helper must never die noisily in the trainer
                    log.exception("background flush of %s failed", self.spool_dir)

        self._thread = threading.Thread(target=loop, name=f"evaldag-flush-{self.train_run}", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop the background flush thread, if one was started. Spooled events stay on disk."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.max_block_s + self.timeout_s)
            self._thread = None

    # -- internals -------------------------------------------------------------------------------------------

    def _build_event(self, path: str | os.PathLike, step: int, epoch: int | None, extra: dict) -> dict:
        if isinstance(path, bytes) or not isinstance(path, (str, os.PathLike)) or not str(os.fspath(path)).strip():
            raise ValueError(f"path must be the checkpoint folder (a non-empty str or Path), got {path!r}")
        if "\0" in os.fspath(path):
            raise ValueError("path must not contain NUL characters")
        check_step(step)
        if epoch is not None:
            check_count("epoch", epoch)
        try:
            json.dumps(extra)
        except (TypeError, ValueError) as e:
            raise ValueError(f"notify() extra keyword values must be JSON-serialisable: {e}") from None
        abspath = os.path.abspath(os.path.expanduser(os.fspath(path)))
        if not os.path.isdir(abspath):
            log.warning("notify(): checkpoint folder %s does not exist (yet); the evaluation will refuse it unless "
                        "it is complete by then", abspath)
        return {
            "id": str(uuid.uuid4()),
            "occurred": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ"),
            "event": EVENT_NAME,
            "resource": {"prefect.resource.id": f"{RESOURCE_PREFIX}{self.train_run}",
                         "prefect.resource.name": self.train_run},
            "payload": {"path": abspath, "step": step, "epoch": epoch, "train_run": self.train_run,
                        "benchmarks": self.benchmarks, "model": self.model,
                        "mlflow_parent_run_id": self.mlflow_parent_run_id, "final_step": self.final_step,
                        **({"decide": self.decide} if self.decide else {}),
                        "extra": dict(extra)},
        }

    def _notify(self, event: dict, deadline: float) -> None:
        if self.api_url is None:
            self._warn_no_url()
            self._spool(event)
            return
        if not self._lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
            self._spool(event)        # a background flush holds the lock; the next flush sends this one
            return
        try:
            _, state = self._flush(deadline)
            if state != "done":
                # Older events are still waiting (server down or out of time): queue behind them, keep the order.
                self._spool(event)
                why = {_TRANSIENT: "it is down or failing", _HELD: "it refuses this sender: see the warning above"}.get(
                    state, f"max_block_s={self.max_block_s} ran out")
                log.warning("older checkpoint events could not be sent to Prefect at %s (%s); event %s for step %s "
                            "is spooled behind them in %s, %d pending", self.api_url, why, event["id"],
                            event["payload"]["step"], self.spool_dir, len(self.pending()))
                return
            outcome, status, detail = _deliver(self.api_url, event, deadline, self.timeout_s,
                                               0 if self._server_down else self.retries, self.backoff_s,
                                               _auth_headers())
            if outcome == _OK:
                self._server_down = False
                log.debug("checkpoint event %s delivered (step %s)", event["id"], event["payload"]["step"])
            elif outcome == _REJECTED:
                _reject(self.spool_dir, None, event, _refusal(status, detail))
            elif outcome == _HELD:
                self._spool(event)
                log.warning("Prefect at %s did not take checkpoint event %s for step %s: %s; spooled to %s, %d "
                            "pending, sent once it does", self.api_url, event["id"], event["payload"]["step"],
                            _refusal(status, detail), self.spool_dir, len(self.pending()))
            else:
                self._server_down = self._server_down or outcome == _TRANSIENT
                self._spool(event)
                log.warning("Prefect at %s did not take checkpoint event %s for step %s (%s); spooled to %s, "
                            "%d pending, re-sent at the next notify() or flush()", self.api_url, event["id"],
                            event["payload"]["step"], detail or f"HTTP {status}", self.spool_dir,
                            len(self.pending()))
        finally:
            self._lock.release()

    def _flush(self, deadline: float | None) -> tuple[int, str]:
        if not self.pending():
            return 0, "done"
        delivered, state = _flush_dir(self.spool_dir, self.api_url, deadline, timeout_s=self.timeout_s,
                                         retries=self.retries, backoff_s=self.backoff_s, headers=_auth_headers(),
                                         probe_first=self._server_down)
        if delivered:
            self._server_down = False
            log.info("delivered %d spooled checkpoint event(s) from %s", delivered, self.spool_dir)
        if state == _TRANSIENT and not delivered:
            self._server_down = True
        return delivered, state

    def _spool(self, event: dict) -> None:
        _write_atomic(self.spool_dir / _spool_name(event["id"]), event)

    def _warn_no_url(self) -> None:
        if not self._warned_no_url:
            self._warned_no_url = True
            log.warning("no Prefect API URL (set PREFECT_API_URL or pass api_url): checkpoint events are spooled to "
                        "%s; send them later with evaldag.client.notifier.flush_spool(%r, api_url)",
                        self.spool_dir, str(self.spool_dir))


__all__ = ["EvalTrigger", "CheckpointNotifier", "flush_spool", "EVENT_NAME", "RESOURCE_PREFIX",
           "TRAIN_RUN_PATTERN"]
