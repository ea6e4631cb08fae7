"""How the notifier's checkpoint events reach Prefect: one HTTP POST with retries within a deadline (never following a
redirect, so the credentials never go to another host), and the spool folder that holds the events not delivered
yet, one JSON file per event, re-sent oldest first with their original ids (`flush_spool`). Standard library only,
like all of evaldag.client (training scripts import it)."""

from __future__ import annotations

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
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

# the notifier's logger: one name for everything a trainer sees from evaldag.client
log = logging.getLogger("evaldag.client.notifier")

_RETRYABLE_4XX = (408, 429)                            # request timeout, rate limited: the payload is fine
# Refusals of the sender, not of the event: a missing or expired key, no permission, a wrong api_url (so is any
# redirect, 3xx, which is never followed: see _NoRedirect). The events stay spooled, in order, until whoever runs
# the trainer fixes it; nothing is moved to rejected/.
_HELD_4XX = (401, 403, 404)
_MIN_ATTEMPT_S = 0.05                                  # no HTTP attempt is started with less time than this left
_BACKOFF_CAP_S = 2.0
OK, REJECTED, TRANSIENT, NO_TIME, HELD = "ok", "rejected", "transient", "no-time", "held"
_seq = itertools.count()
_name_lock = threading.Lock()
_last_ns = 0


def auth_headers() -> dict[str, str]:
    """The Authorization header the Prefect client would send (Prefect Cloud key, or a self-hosted auth string)."""
    if key := os.environ.get("PREFECT_API_KEY"):
        return {"Authorization": f"Bearer {key}"}
    if auth := os.environ.get("PREFECT_API_AUTH_STRING"):
        return {"Authorization": "Basic " + base64.b64encode(auth.encode()).decode()}
    return {}


def check_api_url(api_url: str | None) -> str | None:
    """The Prefect API URL without its trailing slash, None when unset or blank; refuses one that is not http(s)."""
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

    A redirect (3xx) is held, not followed, with its Location as the detail: see _NoRedirect and refusal.
    """
    req = urllib.request.Request(f"{api_url}/events", data=body, method="POST",
                                 headers={"Content-Type": "application/json", **headers})
    try:
        with _open(req, timeout) as resp:
            resp.read()
            return (OK if 200 <= resp.status < 300 else TRANSIENT), resp.status, ""
    except urllib.error.HTTPError as e:
        if 300 <= e.code < 400:
            # Sending again to the same URL gets the same answer: the URL needs fixing, like a 404's.
            location = e.headers.get("Location")
            e.close()
            return HELD, e.code, urllib.parse.urljoin(req.full_url, location) if location else ""
        try:
            detail = e.read(300).decode("utf-8", "replace")
        except Exception:
            detail = ""
        if e.code in _HELD_4XX:
            return HELD, e.code, detail
        if 400 <= e.code < 500 and e.code not in _RETRYABLE_4XX:
            return REJECTED, e.code, detail
        return TRANSIENT, e.code, detail
    except (OSError, http.client.HTTPException, ValueError) as e:
        # URLError (refused, DNS), socket timeouts, resets, a garbled response: all worth another try later.
        return TRANSIENT, None, f"{type(e).__name__}: {getattr(e, 'reason', e)}"


def deliver(api_url: str, event: dict, deadline: float | None, timeout_s: float, retries: int, backoff_s: float,
             headers: dict[str, str]) -> tuple[str, int | None, str]:
    """POST `[event]`, retrying connection errors, timeouts and 5xx with exponential backoff and jitter.

    Never starts an attempt or a sleep that would end after `deadline` (a time.monotonic() value; None = no limit).
    A 4xx other than 408/429, or a 3xx, is not retried: the server will answer the same payload the same way.
    """
    body = json.dumps([event]).encode()
    outcome: tuple[str, int | None, str] = (NO_TIME, None, "time budget exhausted before the first attempt")
    for attempt in range(retries + 1):
        remaining = None if deadline is None else deadline - time.monotonic()
        if remaining is not None and remaining < _MIN_ATTEMPT_S:
            break
        outcome = _post(api_url, body, timeout_s if remaining is None else min(timeout_s, remaining), headers)
        if outcome[0] != TRANSIENT or attempt == retries:
            break
        delay = min(_BACKOFF_CAP_S, backoff_s * 2 ** attempt) * random.uniform(0.5, 1.5)
        if deadline is not None and time.monotonic() + delay + _MIN_ATTEMPT_S > deadline:
            break
        time.sleep(delay)
    return outcome


# The flow a checkpoint event's trigger runs (evaldag.runtime.deployments.CHECKPOINT_FLOW; not imported: this
# package is the standard library only)
CHECKPOINT_FLOW = "on-checkpoint"


def failed_checkpoint_runs(api_url: str, since: datetime, timeout_s: float,
                           headers: dict[str, str]) -> list[dict] | None:
    """The on-checkpoint flow runs that failed (or crashed) since `since`, newest first: each the server's flow-run
    JSON, whose `parameters.event` is the payload of the event it refused and `state.message` the reason. None when
    the server could not be asked (down, slow, refusing this sender): the caller asks again later."""
    body = {"flows": {"name": {"any_": [CHECKPOINT_FLOW]}},
            "flow_runs": {"state": {"type": {"any_": ["FAILED", "CRASHED"]}},
                          "expected_start_time": {"after_": since.astimezone(timezone.utc).isoformat()}},
            "sort": "EXPECTED_START_TIME_DESC", "limit": 200}
    req = urllib.request.Request(f"{api_url}/flow_runs/filter", data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json", **headers})
    try:
        with _open(req, timeout_s) as resp:
            runs = json.loads(resp.read())
    except (OSError, http.client.HTTPException, ValueError):   # HTTPError is an OSError too
        return None
    return runs if isinstance(runs, list) else None


def spool_name(event_id: str) -> str:
    """`<ns since epoch, 19 digits>-<seq>-<id>.json`: names sort by creation time (strictly, within a process)."""
    global _last_ns
    with _name_lock:
        _last_ns = max(time.time_ns(), _last_ns + 1)
        return f"{_last_ns:019d}-{next(_seq) % 1000000:06d}-{event_id}.json"


def write_atomic(path: Path, data: dict) -> None:
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


def pending_files(spool_dir: Path) -> list[Path]:
    """The spooled events of `spool_dir` not delivered yet, oldest first."""
    if not spool_dir.is_dir():
        return []
    return sorted(p for p in spool_dir.glob("*.json") if not p.name.startswith("."))


def reject(spool_dir: Path, file: Path | None, event: dict, why: str) -> None:
    """Park an event the server will never take in spool_dir/rejected/, with a warning saying how to retry it."""
    target = spool_dir / "rejected" / (file.name if file is not None else spool_name(event.get("id", "unknown")))
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        if file is not None:
            os.replace(file, target)
        else:
            write_atomic(target, event)
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


def refusal(status: int | None, detail: str) -> str:
    """The warning's words for a held or rejected answer: the status, the server's detail and the likely fix."""
    if status is not None and 300 <= status < 400:
        return _redirect_refusal(status, detail)
    hint = {404: " (is api_url right? it usually ends in /api)",
            401: " (is PREFECT_API_KEY or PREFECT_API_AUTH_STRING set and current?)",
            403: " (does the key allow writing events?)"}.get(status or 0, "")
    return f"the server refused it with HTTP {status}: {detail.strip()[:300]!r}{hint}"


def flush_dir(spool_dir: Path, api_url: str, deadline: float | None, *, timeout_s: float, retries: int,
               backoff_s: float, headers: dict[str, str], probe_first: bool = False) -> tuple[int, str]:
    """Send spooled events oldest first until done, out of time, or the server fails.

    Returns (delivered, state) with state "done" (spool empty), "no-time" or "transient" (the server failed).

    Stops at the first transient failure so that events are never sent out of order. With `probe_first`, the first
    event gets a single attempt (no retries): the server was just seen down, so the trainer should not pay for
    a full retry cycle on each notify while it stays down.
    """
    delivered = 0
    for file in pending_files(spool_dir):
        try:
            event = json.loads(file.read_text(encoding="utf-8"))
            if not isinstance(event, dict) or "id" not in event:
                raise ValueError("not an event object")
        except FileNotFoundError:
            continue                      # another flusher delivered it meanwhile
        except (ValueError, UnicodeDecodeError, OSError) as e:
            reject(spool_dir, file, {"id": file.name}, f"the spool file is unreadable ({e})")
            continue
        tries = 0 if (probe_first and delivered == 0) else retries
        outcome, status, detail = deliver(api_url, event, deadline, timeout_s, tries, backoff_s, headers)
        if outcome == OK:
            try:
                file.unlink()
            except FileNotFoundError:
                pass
            delivered += 1
        elif outcome == REJECTED:
            reject(spool_dir, file, event, refusal(status, detail))
        elif outcome == HELD:
            log.warning("spooled checkpoint events kept until Prefect at %s takes them: %s; %d pending_files in %s",
                        api_url, refusal(status, detail), len(pending_files(spool_dir)), spool_dir)
            return delivered, outcome
        else:
            log.info("spooled checkpoint events not delivered yet (%s); %d left in %s",
                     detail or f"HTTP {status}", len(pending_files(spool_dir)), spool_dir)
            return delivered, outcome
    return delivered, "done"


def flush_spool(spool_dir: str | Path, api_url: str | None = None, max_seconds: float | None = None, *,
                timeout_s: float = 5.0, retries: int = 3, backoff_s: float = 0.2) -> int:
    """Deliver the events spooled in `spool_dir`, oldest first; returns how many were delivered.

    For `evaldag flush-events` and for cleanup after training. `api_url` defaults to $PREFECT_API_URL. Stops at the
    first event the server cannot take yet (they stay spooled) or after `max_seconds`. Never raises for network
    faults; raises ValueError when no API URL is given or set.
    """
    url = check_api_url(api_url if api_url is not None else os.environ.get("PREFECT_API_URL"))
    if url is None:
        raise ValueError("no Prefect API URL: pass api_url or set PREFECT_API_URL (e.g. http://127.0.0.1:4200/api)")
    deadline = None if max_seconds is None else time.monotonic() + max_seconds
    delivered, _ = flush_dir(Path(spool_dir).expanduser(), url, deadline, timeout_s=timeout_s, retries=retries,
                              backoff_s=backoff_s, headers=auth_headers())
    return delivered
