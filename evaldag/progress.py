"""Live progress of an evaluation: published as Prefect progress artifacts, read back from them.

Each shard's generate task publishes a progress artifact (`artifact_progress`) whose description `describe` writes
and `parse` reads (problems done of total, tokens generated so far). The parent flow sums them into its own
whole-evaluation artifact (`evaluation_progress`, text by `describe_evaluation`). `evaldag run` polls `snapshot` and
shows a rich progress bar on a terminal, or one line per completed shard otherwise (`Display`).
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import re
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

_PATTERN = re.compile(r"^(?P<benchmark>\S+) shard (?P<shard>\d+): (?P<done>\d+) of (?P<total>\d+) problems, "
                      r"(?P<tokens>\d+) tokens generated")


def describe(benchmark: str, shard: int, done: int, total: int, tokens: int) -> str:
    """A progress artifact's description (readable in the Prefect UI, parsed back by `parse`)."""
    return f"{benchmark} shard {shard}: {done} of {total} problems, {tokens} tokens generated"


def parse(text: str | None) -> tuple[str, int, int, int, int] | None:
    """(benchmark, shard, done, total, tokens) from a `describe` text, or None for any other text."""
    m = _PATTERN.match(text or "")
    if m is None:
        return None
    return (m["benchmark"], int(m["shard"]), int(m["done"]), int(m["total"]), int(m["tokens"]))


def describe_evaluation(benchmarks: list[str], done: int, total: int, snap: Snapshot) -> str:
    """The parent's whole-evaluation progress text: problems of every benchmark and shard together, and the shards.

    It never matches `parse`'s pattern, so it is never counted as a shard's progress."""
    shards = (f"shards {snap.running} running, {snap.completed}/{snap.shards} done"
              + (f", {snap.retried} retried" if snap.retried else ""))
    return (f"evaluation of {' + '.join(benchmarks)}: {done} of {total} problems, {snap.tokens} tokens generated; "
            f"{shards}")


@dataclass
class Snapshot:
    """The evaluation's progress at one moment."""
    done: int = 0            # problems generated, over all shards that reported
    total: int = 0           # problems of the shards that reported so far
    tokens: int = 0
    shards: int = 0          # shard flow runs started
    running: int = 0
    completed: int = 0
    retried: int = 0         # shard flow runs that ran more than once or failed (and were relaunched)
    completed_names: list[str] = field(default_factory=list)


def snapshot(client, parent_id) -> Snapshot:
    """Read the parent flow run's shard flow runs and their progress artifacts (a sync Prefect client)."""
    from prefect.client.schemas.filters import (ArtifactFilter, ArtifactFilterFlowRunId, ArtifactFilterType,
                                                FlowRunFilter, FlowRunFilterParentFlowRunId)

    children = client.read_flow_runs(flow_run_filter=FlowRunFilter(
        parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[parent_id])))
    snap = Snapshot(shards=len(children))
    for c in children:
        state = c.state
        if state is None:
            continue
        if state.is_running():
            snap.running += 1
        elif state.is_completed():
            snap.completed += 1
            snap.completed_names.append(c.name)
        if c.run_count > 1 or state.is_failed() or state.is_crashed() or state.name == "AwaitingRetry":
            snap.retried += 1
    if not children:
        return snap
    artifacts = client.read_artifacts(artifact_filter=ArtifactFilter(
        flow_run_id=ArtifactFilterFlowRunId(any_=[c.id for c in children]), type=ArtifactFilterType(any_=["progress"])))
    latest: dict[tuple[str, int], tuple] = {}
    for a in sorted(artifacts, key=lambda a: a.updated or a.created):   # a retried task's newer artifact wins
        got = parse(a.description)
        if got is not None:
            latest[got[:2]] = got
    for _, _, done, total, tokens in latest.values():
        snap.done += done
        snap.total += total
        snap.tokens += tokens
    return snap


# ---------------------------------------------------------------------- publishing (inside flow runs)


def progress_key(benchmark: str, shard: int) -> str:
    """A shard's progress artifact key (Prefect keys: lowercase letters, digits, dashes)."""
    return re.sub(r"[^a-z0-9-]+", "-", f"progress-{benchmark}-shard-{shard}".lower())


def artifact_progress(benchmark: str, shard: int) -> Callable[[int, int, int], None]:
    """A generate_shard progress callback (evaldag.stages.Progress) that creates, then updates, one Prefect
    progress artifact."""
    from prefect.artifacts import create_progress_artifact, update_progress_artifact

    artifact_id = None

    def report(done: int, total: int, tokens: int) -> None:
        nonlocal artifact_id
        pct = 100.0 * done / total if total else 100.0
        text = describe(benchmark, shard, done, total, tokens)   # `evaldag run` parses it back
        try:
            if artifact_id is None:
                artifact_id = create_progress_artifact(pct, key=progress_key(benchmark, shard), description=text)
            else:
                update_progress_artifact(artifact_id, pct, description=text)
        except Exception as e:  # progress is for people watching; it must never fail the generation
            log.warning("shard %d: could not publish progress (%s)", shard, e)

    return report


def evaluation_progress_key(flow_run_id: str) -> str:
    """One key per evaluation (Prefect keys: lowercase letters, digits, dashes), so the Artifacts page keeps each."""
    return f"progress-evaluation-{str(flow_run_id)[:8]}"


@contextlib.contextmanager
def evaluation_progress(flow_run_id: str, benchmarks: list[str], total_problems: int,
                        every_s: float = 5.0) -> Iterator[None]:
    """Publish, then update every `every_s` seconds, one progress artifact on the parent flow run `flow_run_id` with
    the problems generated by all its shards of `total_problems`; at the end it reads 100 % if the block succeeded.

    Shards whose stored generations were reused publish nothing, so only the block's success says "all done"."""
    from prefect.artifacts import create_progress_artifact, update_progress_artifact
    from prefect.client.orchestration import get_client

    stop = threading.Event()
    finished = threading.Event()
    artifact_id = None

    def publish() -> None:
        nonlocal artifact_id
        with get_client(sync_client=True) as client:
            snap = snapshot(client, flow_run_id)
        done = total_problems if finished.is_set() else min(snap.done, total_problems)
        pct = 100.0 * done / total_problems if total_problems else 100.0
        text = describe_evaluation(benchmarks, done, total_problems, snap)
        if artifact_id is None:
            artifact_id = create_progress_artifact(pct, key=evaluation_progress_key(flow_run_id), description=text)
        else:
            update_progress_artifact(artifact_id, pct, description=text)

    def loop() -> None:
        while True:
            final = stop.is_set()           # one more publication after the block ends: the final figures
            try:
                publish()
            except Exception as e:  # progress is for people watching; it must never fail the evaluation
                log.warning("could not publish the evaluation's progress (%s)", e)
            if final:
                return
            stop.wait(every_s)

    # the copied context carries the flow run's, so the artifact belongs to the parent flow run
    thread = threading.Thread(target=contextvars.copy_context().run, args=(loop,), name="evaluation-progress",
                              daemon=True)
    thread.start()
    try:
        yield
        finished.set()
    finally:
        stop.set()
        thread.join(timeout=60)


class Display:
    """Shows snapshots: a rich progress bar on a terminal, one line per completed shard otherwise."""

    def __init__(self, console, name: str):
        self.console, self.name = console, name
        self.t0 = time.monotonic()
        self._seen: set[str] = set()
        self._bar = None
        self._task = None
        self._first_tokens: tuple[float, int] | None = None

    def __enter__(self) -> Display:
        if self.console.is_terminal:
            from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                                       TimeRemainingColumn)

            self._bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                 TextColumn("problems"), TextColumn("{task.fields[rate]}"), TimeElapsedColumn(),
                                 TextColumn("left"), TimeRemainingColumn(), TextColumn("{task.fields[shards]}"),
                                 console=self.console, transient=False)
            self._bar.__enter__()
            self._task = self._bar.add_task(self.name, total=None, rate="", shards="")
        return self

    def __exit__(self, *exc) -> None:
        if self._bar is not None:
            self._bar.__exit__(*exc)

    def tokens_per_s(self, snap: Snapshot) -> float | None:
        """Generated tokens per second since the first tokens were seen (all shards together)."""
        now = time.monotonic()
        if self._first_tokens is None:
            self._first_tokens = (now, snap.tokens)
            return None
        t, tok = self._first_tokens
        return (snap.tokens - tok) / (now - t) if now > t and snap.tokens > tok else None

    def update(self, state: str, snap: Snapshot) -> None:
        rate = self.tokens_per_s(snap)
        shards = (f"shards {snap.running} running, {snap.completed}/{snap.shards} done"
                  + (f", {snap.retried} retried" if snap.retried else ""))
        if self._bar is not None:
            self._bar.update(self._task, completed=snap.done, total=snap.total or None,
                             description=f"{self.name} ({state})", shards=shards,
                             rate=f"{rate:.0f} tok/s" if rate is not None else "")
            return
        for name in snap.completed_names:
            if name not in self._seen:
                self._seen.add(name)
                self.console.print(f"{self.name}: shard {name} done; {shards}; {snap.done}/{snap.total} problems; "
                                   f"{time.monotonic() - self.t0:.0f} s")
