"""Live progress of an evaluation, read back from its shards' Prefect progress artifacts.

Each shard's generate task publishes a progress artifact whose description `describe` writes and `parse` reads
(problems done of total, tokens generated so far). The parent flow sums them into its own whole-evaluation artifact
(`describe_evaluation`, published by tasks/evaluation_progress.py). `evaldag run` polls `snapshot` and shows a rich
progress bar on a terminal, or one line per completed shard otherwise (`Display`).
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field

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
