"""Atomic get-or-create of an MLflow run, and a writer lease on it, across processes and hosts.

MLflow has no "create if absent" for runs, and a find-then-create races: two evaluations with one eval_key that
finish together both find nothing and both create a run. Two things the tracking server does enforce, on its
database, for every client on every host:

- experiment names are unique: `create_experiment` of an existing name fails (RESOURCE_ALREADY_EXISTS), also when
  that experiment is deleted. A claim is an experiment named after the key, created with the chosen run's id as a
  tag in the same request: whoever creates it decides the run, everyone else reads the run id from it. Each
  contender first makes a candidate run (not yet findable by the key), then claims with it; a loser deletes its
  candidate. The claim experiment is deleted (hidden) right away; its name stays taken. If the claimed run is
  deleted later (a user wants the evaluation logged again), the next claim generation (`...:1`) decides anew.
- params are write-once: logging an existing param with another value fails (INVALID_PARAMETER_VALUE). The writer
  of a run holds the param `evaldag.writer.<g>`; taking a run over means logging generation g + 1, which only one
  contender can do. A writer refreshes the tag `evaldag.heartbeat` ("<g>:<wall-clock seconds>") while it logs;
  another may take the run over only once that heartbeat is older than the lease (default 120 s,
  EVALDAG_TRACK_LEASE_S), or, for a writer that has not beaten yet, once it has stayed silent for the lease by the
  waiting process's own clock. So a run being written is never written into by a second evaluation, and a crashed
  writer's run is finished by the next one. The lease compares clocks of different hosts: keep it well above their
  skew. A writer keeps beating from a background thread for as long as it writes (`keeping_lease`), so an upload
  longer than the lease does not lose it the run.

Whether a claimed run still exists is decided only by MLflow's own answer: RESOURCE_DOES_NOT_EXIST. Any other
failure to read it (a 503, a timeout, a restarting server) is retried with backoff and then raised as
TrackingUnavailable: read as "deleted", it would start the next claim generation and log a second run of one key.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

log = logging.getLogger("evaldag")

CLAIM_PREFIX = ".evaldag-claim"
RUN_ID_TAG = "evaldag.run_id"
WRITER_PARAM = "evaldag.writer."
HEARTBEAT_TAG = "evaldag.heartbeat"


# Reading a claimed run: tries in all, and the wait before the first retry (doubled at each one): 1+2+4+8 s. MLflow's
# REST client has already retried a 503 or a refused connection with its own backoff when an error gets here.
ALIVE_TRIES = 5
ALIVE_BACKOFF_S = 1.0


class TrackingBusy(RuntimeError):
    """Another live writer holds the evaluation's MLflow run; retry later (a transient condition)."""


class TrackingUnavailable(RuntimeError):
    """MLflow kept failing to say whether a claimed run exists; retry later. A RuntimeError, not a ValueError, so
    that the track task retries it (tasks/retry.py)."""


def lease_seconds() -> float:
    """How long a writer's heartbeat keeps its run: EVALDAG_TRACK_LEASE_S, default 120."""
    return float(os.environ.get("EVALDAG_TRACK_LEASE_S", "120"))


def _error_code(e: Exception) -> str:
    return str(getattr(e, "error_code", ""))


def claim_name(experiment_id: str, key: str, generation: int = 0) -> str:
    """The claim experiment's name for `key` in one experiment (MLflow allows 500 characters)."""
    return f"{CLAIM_PREFIX}:{experiment_id}:{key}:{generation}"


def claim_run(client, experiment_id: str, key: str, make_candidate: Callable[[], str],
              legacy: Callable[[], str | None] | None = None) -> tuple[str, bool]:
    """The one run of `key` in the experiment, created by `make_candidate()` if nobody claimed one; returns
    (run_id, created). `make_candidate` must create a run that others cannot find by `key` yet and that carries
    none of the tags that make it look like the key's run (the caller tags the winner afterwards): a candidate left
    behind by a failed claim is deleted or ended FAILED, but MLflow may refuse both. `legacy()` may name a run
    logged before claims existed, which is claimed as it is."""
    from mlflow.exceptions import MlflowException

    generation = 0
    while True:
        name = claim_name(experiment_id, key, generation)
        claim = client.get_experiment_by_name(name)
        if claim is not None:
            run_id = claim.tags.get(RUN_ID_TAG)
            if run_id and _alive(client, run_id):
                return run_id, False
            generation += 1            # the claimed run was deleted: the next generation decides anew
            continue
        existing = legacy() if legacy and generation == 0 else None
        candidate = existing or make_candidate()
        try:
            claim_id = client.create_experiment(name, tags={RUN_ID_TAG: candidate, "evaldag.claim_for": key})
        except MlflowException as e:
            if _error_code(e) != "RESOURCE_ALREADY_EXISTS":
                # the claim may have been made all the same (an answer lost after the server wrote it): the
                # candidate is ended, not deleted, so that such a claim names a run its next reader can finish
                if existing is None:
                    _end_candidate(client, candidate)
                raise
            if existing is None:
                _discard_candidate(client, candidate)     # lost the race: the winner's run is the one
            continue
        try:
            client.delete_experiment(claim_id)        # out of the UI's experiment list; the name stays taken
        except MlflowException:
            pass
        return candidate, existing is None


def _discard_candidate(client, run_id: str) -> None:
    """Delete a candidate run that lost its claim; one MLflow fails to delete is ended instead (`_end_candidate`)."""
    from mlflow.exceptions import MlflowException

    try:
        client.delete_run(run_id)
    except (MlflowException, OSError) as e:
        log.warning("could not delete candidate MLflow run %s, which lost its claim (%s); ending it FAILED", run_id, e)
        _end_candidate(client, run_id)


def _end_candidate(client, run_id: str) -> None:
    """Set a candidate run that holds no claim FAILED, so that it never shows as a second live run (it carries no
    evaluation tags: make_candidate's runs are tagged once they have won); best effort, MLflow may be down."""
    from mlflow.exceptions import MlflowException

    try:
        client.set_terminated(run_id, "FAILED")
    except (MlflowException, OSError) as e:
        log.warning("candidate MLflow run %s holds no claim but could not be ended (%s); it has no evaluation "
                    "tags, so no evaldag view takes it for one", run_id, e)


def _alive(client, run_id: str) -> bool:
    """Whether a claimed run still holds its claim: it exists and is not deleted. False only on MLflow's answer
    (lifecycle stage "deleted", or RESOURCE_DOES_NOT_EXIST); other errors are retried ALIVE_TRIES times with
    backoff, then raise TrackingUnavailable."""
    from mlflow.exceptions import MlflowException

    delay = ALIVE_BACKOFF_S
    for attempt in range(1, ALIVE_TRIES + 1):
        try:
            return client.get_run(run_id).info.lifecycle_stage != "deleted"
        except (MlflowException, OSError) as e:   # OSError: requests' connection errors, if one escapes MLflow's
            if _error_code(e) == "RESOURCE_DOES_NOT_EXIST":
                return False
            if attempt == ALIVE_TRIES:
                raise TrackingUnavailable(
                    f"MLflow failed {ALIVE_TRIES} times to read run {run_id}, the run claimed for this key, so it "
                    f"cannot tell whether that run still exists; not claiming another one (that would log a second "
                    f"run of the key). Last error: {e}") from e
            log.warning("reading claimed MLflow run %s failed (try %d of %d), retrying in %.0f s: %s",
                        run_id, attempt, ALIVE_TRIES, delay, e)
            time.sleep(delay)
            delay *= 2
    raise AssertionError("unreachable")


def current_writer(run) -> tuple[int, str | None]:
    """(generation, owner) of a run's writer slot; (-1, None) when nobody ever took it."""
    gens = [int(k[len(WRITER_PARAM):]) for k in run.data.params
            if k.startswith(WRITER_PARAM) and k[len(WRITER_PARAM):].isdigit()]
    if not gens:
        return -1, None
    g = max(gens)
    return g, run.data.params[f"{WRITER_PARAM}{g}"]


def heartbeat(client, run_id: str, generation: int) -> None:
    """Tell the others that this run's writer (of `generation`) is alive."""
    client.set_tag(run_id, HEARTBEAT_TAG, f"{generation}:{time.time():.3f}")


# (run id, writer generation) -> when this process first saw that writer without a heartbeat of its own
_silent_since: dict[tuple[str, int], float] = {}


def lease_expired(run, lease_s: float) -> bool:
    """Whether a run's writer is gone.

    Yes when the run ended unfinished, or the writer's own heartbeat is older than `lease_s` (wall clock). A writer
    that has not beaten yet (it just took the run, or died right after) is judged by this process's own clock: gone
    once it stayed silent for `lease_s` since this process first saw it."""
    if run.info.status in ("FAILED", "KILLED"):
        return True
    generation, _ = current_writer(run)
    beat = run.data.tags.get(HEARTBEAT_TAG, "")
    gen_text, _, when = beat.partition(":")
    if gen_text == str(generation):
        try:
            return time.time() - float(when) > lease_s
        except ValueError:
            pass
    first = _silent_since.setdefault((run.info.run_id, generation), time.monotonic())
    return time.monotonic() - first > lease_s


def take_writer(client, run_id: str, owner: str, lease_s: float | None = None) -> bool:
    """Become the writer of a run: at once when nobody holds it or `owner` does (a retry of the same writer), else
    only after the holder's lease expired; only one contender wins a takeover. Beats the heartbeat on success."""
    from mlflow.exceptions import MlflowException

    lease_s = lease_seconds() if lease_s is None else lease_s
    run = client.get_run(run_id)
    generation, holder = current_writer(run)
    if holder != owner:
        if holder is not None and not lease_expired(run, lease_s):
            return False
        generation += 1
        try:
            client.log_param(run_id, f"{WRITER_PARAM}{generation}", owner)
        except MlflowException as e:
            if _error_code(e) == "INVALID_PARAMETER_VALUE":    # another contender took this generation first
                return False
            raise
    heartbeat(client, run_id, generation)
    return True


def still_writer(client, run_id: str, owner: str) -> int | None:
    """The writer generation `owner` holds, or None when another took the run over (after a stall longer than the
    lease)."""
    generation, holder = current_writer(client.get_run(run_id))
    return generation if holder == owner else None


@contextmanager
def keeping_lease(client, run_id: str, owner: str, generation: int, lease_s: float) -> Iterator[None]:
    """Beat the heartbeat of `owner`'s writer generation every quarter lease from a background thread while the
    block runs: a single upload (a large samples.parquet over a slow link) may last longer than the lease, and a
    live writer must not be taken over. The thread stops beating once another writer holds the run (this process
    stalled past the lease anyway): the block's own still_writer check then gives up. A failed beat is only logged;
    the next one comes a quarter lease later."""
    stop = threading.Event()

    def beat() -> None:
        while not stop.wait(lease_s / 4):
            try:
                if still_writer(client, run_id, owner) != generation:
                    return
                heartbeat(client, run_id, generation)
            except Exception as e:   # noqa: BLE001 - the writer itself sees a lasting failure on its next request
                log.warning("heartbeat of MLflow run %s failed: %s", run_id, e)

    thread = threading.Thread(target=beat, name=f"evaldag-lease-{run_id[:8]}", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=5)   # a beat still in flight ends by itself; the block's result does not wait on it


__all__ = ["claim_run", "take_writer", "still_writer", "heartbeat", "keeping_lease", "lease_expired", "lease_seconds",
           "TrackingBusy", "TrackingUnavailable", "HEARTBEAT_TAG", "WRITER_PARAM"]
