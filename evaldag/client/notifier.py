"""Trainer side of evaluate-on-checkpoint: decide when to evaluate, and tell Prefect that a checkpoint is ready.

This module is imported by training scripts, so it uses the standard library only: no prefect (1 s, 78 MB to
import), no pydantic, no torch (its input rules come from evaldag.request.rules, standard library only too). It must stay that way; tests/test_trainer.py checks it in a fresh interpreter.

- `EvalTrigger` (evaldag.client.trigger) answers "is an evaluation due at (epoch, step)?" for step, epoch and
  wall-clock frequencies, and saves its state with the trainer's so a resumed run neither evaluates twice nor skips
  one.
- `CheckpointNotifier.notify(path, step)` POSTs one `evaldag.checkpoint.saved` event to `$PREFECT_API_URL/events`
  (answered 204 by the server; a deployment trigger turns it into an eval flow run). `prefect.events.emit_event` is
  not used: when the server is down it drops events silently. Here a failed delivery is spooled to disk, one JSON
  file per event, and re-sent (same event id, so the consumer can deduplicate) at the start of the next notify()
  or by `flush()` / `flush_spool()` (the POST and the spool: evaldag.client.delivery). notify() blocks the
  training loop for at most `max_block_s` and never raises for network faults.

Call these from one process only (rank 0 in distributed training): two processes flushing the same spool folder at
once may each send an event; the shared event id keeps that harmless for a deduplicating consumer.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import uuid
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

# EvalTrigger, flush_spool and TRAIN_RUN_PATTERN stay importable from here (__all__): training scripts import them
# from evaldag.client.notifier, and the notifier's own warning names evaldag.client.notifier.flush_spool
from evaldag.client.delivery import (HELD, OK, REJECTED, TRANSIENT, auth_headers, check_api_url, deliver,
                                     failed_checkpoint_runs, flush_dir, flush_spool, pending_files, refusal, reject,
                                     spool_name, write_atomic)
from evaldag.client.trigger import EvalTrigger, positive
from evaldag.request.rules import (ENGINE_SETTING_KEYS, SAMPLING_KEYS, TRAIN_RUN_PATTERN, check_benchmark_names,
                                   check_count, check_decide, check_run_id, check_settings, check_step,
                                   check_train_run)

log = logging.getLogger("evaldag.client.notifier")

EVENT_NAME = "evaldag.checkpoint.saved"
RESOURCE_PREFIX = "evaldag.train-run."
# Delivered events whose evaluation may still be refused: watched at each notify() for this long, at most this many
# (an on-checkpoint run waits for a free cpu worker, which a busy pool may not have for hours)
WATCH_S, MAX_WATCHED = 24 * 3600.0, 256
# The trainer's and the server's clocks may differ: the server is asked for runs since this long before the event
_CLOCK_SLACK = timedelta(minutes=10)


class CheckpointNotifier:
    """Announces saved checkpoints to Prefect as `evaldag.checkpoint.saved` events, reliably and cheaply.

    notify() first re-sends spooled events (oldest first), then POSTs the new one, all within `max_block_s`
    seconds. An event that cannot be delivered (server down, timeout, 5xx after `retries` retries) is spooled to
    `spool_dir` and re-sent later with its original id; so is one refused for the sender (401, 403, 404) or
    redirected (3xx: never followed, so the credentials never go to another host), with a warning naming the fix.
    One the server refuses with another 4xx (a payload bug; 408 and 429 excepted) is moved to
    `spool_dir/rejected/` with a warning and never retried. Without an API URL (argument
    or $PREFECT_API_URL) every event is spooled, with one warning, for a later `flush_spool(spool_dir, api_url)`.
    An event the server takes but then refuses (its on-checkpoint flow run fails: a folder outside the server's
    checkpoint roots, an incomplete checkpoint) gets one warning with the reason at the next notify(): each notify
    asks the Prefect API once for the failed on-checkpoint runs of the events delivered in the last WATCH_S.

    Bounds: each HTTP attempt waits at most min(timeout_s, time left); name resolution (DNS) is not covered by
    socket timeouts, so use an IP or a resolvable host name in api_url. While the server stays down, each notify
    makes one attempt only (no retry cycle) until a delivery succeeds again.

    `final_step`, the step training is planned to end at, travels with every event: the job's parent MLflow run
    then gets a forecast of the accuracy at that step (evaldag.decisions.forecast) from the checkpoints evaluated so far.
    `decide` ("vs_best", or {"against": "vs_best", "alpha": 0.05, "margin": 0.02, "rounds": 10}) asks every
    evaluation of the job to stop as soon as its paired verdict against the job's best checkpoint so far is decided
    (evaldag.decisions.decide): cheaper evaluations, each a verdict rather than a full measurement.
    `sampling` ({"n": 8, "temperature": 0.6, "max_new_tokens": 32768}: n, temperature, top_p, max_new_tokens,
    seed) and `engine_settings` ({"tensor_parallel_size": 4, "max_model_len": 34816}: tensor_parallel_size,
    max_model_len, gpu_memory_utilization, dtype) travel with every event: this job's evaluations run with them,
    over the benchmark's sampling and the model's engine settings (the server checks their values).
    """

    def __init__(self, train_run: str, api_url: str | None = None, benchmarks: list[str] | None = None,
                 spool_dir: str | Path | None = None, timeout_s: float = 2.0, max_block_s: float = 5.0,
                 retries: int = 3, mlflow_parent_run_id: str | None = None,
                 backoff_s: float = 0.2, final_step: int | None = None,
                 decide: str | dict | None = None, sampling: dict | None = None,
                 engine_settings: dict | None = None) -> None:
        check_train_run(train_run)
        if benchmarks is not None:
            benchmarks = check_benchmark_names(benchmarks)
        self.sampling = check_settings("sampling", sampling, SAMPLING_KEYS)
        self.engine_settings = check_settings("engine_settings", engine_settings, ENGINE_SETTING_KEYS)
        check_run_id(mlflow_parent_run_id)
        positive("final_step", final_step, int)
        self.decide = check_decide(decide)
        positive("timeout_s", timeout_s, float)
        positive("max_block_s", max_block_s, float)
        positive("backoff_s", backoff_s, float)
        check_count("retries", retries)
        self.train_run = train_run
        self.api_url = check_api_url(api_url if api_url is not None else os.environ.get("PREFECT_API_URL"))
        self.benchmarks = benchmarks
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
        # delivered events not known to be accepted yet, by id: (payload, sent at: monotonic, wall clock)
        self._watched: dict[str, tuple[dict, float, datetime]] = {}

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
        return pending_files(self.spool_dir)

    def start_background_flush(self, interval_s: float = 60.0) -> None:
        """Opt-in: a daemon thread calls flush() every `interval_s` seconds, so spooled events go out between
        checkpoints. Stop it with close(). Without it, spooled events go out at the next notify() or flush()."""
        positive("interval_s", interval_s, float)
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
                        "benchmarks": self.benchmarks,
                        "mlflow_parent_run_id": self.mlflow_parent_run_id, "final_step": self.final_step,
                        **({"decide": self.decide} if self.decide else {}),
                        **({"sampling": self.sampling} if self.sampling else {}),
                        **({"engine_settings": self.engine_settings} if self.engine_settings else {}),
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
            self._report_refusals(deadline)
            _, state = self._flush(deadline)
            if state != "done":
                # Older events are still waiting (server down or out of time): queue behind them, keep the order.
                self._spool(event)
                why = {TRANSIENT: "it is down or failing", HELD: "it refuses this sender: see the warning above"}.get(
                    state, f"max_block_s={self.max_block_s} ran out")
                log.warning("older checkpoint events could not be sent to Prefect at %s (%s); event %s for step %s "
                            "is spooled behind them in %s, %d pending", self.api_url, why, event["id"],
                            event["payload"]["step"], self.spool_dir, len(self.pending()))
                return
            outcome, status, detail = deliver(self.api_url, event, deadline, self.timeout_s,
                                               0 if self._server_down else self.retries, self.backoff_s,
                                               auth_headers())
            if outcome == OK:
                self._server_down = False
                self._watch(event)
                log.debug("checkpoint event %s delivered (step %s)", event["id"], event["payload"]["step"])
            elif outcome == REJECTED:
                reject(self.spool_dir, None, event, refusal(status, detail))
            elif outcome == HELD:
                self._spool(event)
                log.warning("Prefect at %s did not take checkpoint event %s for step %s: %s; spooled to %s, %d "
                            "pending, sent once it does", self.api_url, event["id"], event["payload"]["step"],
                            refusal(status, detail), self.spool_dir, len(self.pending()))
            else:
                self._server_down = self._server_down or outcome == TRANSIENT
                self._spool(event)
                log.warning("Prefect at %s did not take checkpoint event %s for step %s (%s); spooled to %s, "
                            "%d pending, re-sent at the next notify() or flush()", self.api_url, event["id"],
                            event["payload"]["step"], detail or f"HTTP {status}", self.spool_dir,
                            len(self.pending()))
        finally:
            self._lock.release()

    def _watch(self, event: dict) -> None:
        """Remember a delivered event until the server is seen to refuse it or WATCH_S passes."""
        self._watched[event["id"]] = (event["payload"], time.monotonic(), datetime.now(timezone.utc))
        while len(self._watched) > MAX_WATCHED:
            del self._watched[next(iter(self._watched))]

    def _report_refusals(self, deadline: float) -> None:
        """One warning per delivered event whose on-checkpoint flow run failed: the server refused it (a folder
        outside its checkpoint roots, a bad name) or could not start its evaluation, with the run's reason. One
        request to the Prefect API, within the time left; nothing when it cannot be asked (asked again next time)."""
        now = time.monotonic()
        self._watched = {k: v for k, v in self._watched.items() if now - v[1] < WATCH_S}
        remaining = deadline - now
        if not self._watched or self._server_down or remaining < 0.05:
            return
        since = min(sent for _, _, sent in self._watched.values()) - _CLOCK_SLACK
        runs = failed_checkpoint_runs(self.api_url, since, min(self.timeout_s, remaining), auth_headers())
        for run in runs or []:
            refused = run.get("parameters", {}).get("event")
            refused = refused if isinstance(refused, dict) else {}
            for event_id, (payload, _, _) in list(self._watched.items()):
                if all(refused.get(k) == payload[k] for k in ("train_run", "step", "path")):
                    del self._watched[event_id]
                    log.warning("the server refused checkpoint event %s for step %s (%s): %s; no evaluation was "
                                "started (flow run %s of on-checkpoint)", event_id, payload["step"], payload["path"],
                                (run.get("state") or {}).get("message") or run.get("state_name"), run.get("name"))

    def _flush(self, deadline: float | None) -> tuple[int, str]:
        if not self.pending():
            return 0, "done"
        delivered, state = flush_dir(self.spool_dir, self.api_url, deadline, timeout_s=self.timeout_s,
                                         retries=self.retries, backoff_s=self.backoff_s, headers=auth_headers(),
                                         probe_first=self._server_down)
        if delivered:
            self._server_down = False
            log.info("delivered %d spooled checkpoint event(s) from %s", delivered, self.spool_dir)
        if state == TRANSIENT and not delivered:
            self._server_down = True
        return delivered, state

    def _spool(self, event: dict) -> None:
        write_atomic(self.spool_dir / spool_name(event["id"]), event)

    def _warn_no_url(self) -> None:
        if not self._warned_no_url:
            self._warned_no_url = True
            log.warning("no Prefect API URL (set PREFECT_API_URL or pass api_url): checkpoint events are spooled to "
                        "%s; send them later with evaldag.client.notifier.flush_spool(%r, api_url)",
                        self.spool_dir, str(self.spool_dir))


__all__ = ["EvalTrigger", "CheckpointNotifier", "flush_spool", "EVENT_NAME", "RESOURCE_PREFIX",
           "TRAIN_RUN_PATTERN"]
