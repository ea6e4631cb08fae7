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

_PATTERN = re.compile(r"^(?P<benchmark>\S+) shard (?P<shard>\d+): (?P<done>\d+) of (?P<total>\d+) "
                      r"(?P<unit>problems|samples|requests), "
                      r"(?P<tokens>\d+) tokens generated"
                      r"(?:; (?P<rate>\d+(?:\.\d+)?) tok/s)?(?:; (?P<tokens_left>\d+) tokens, (?P<seconds_left>\d+) s left)?")


@dataclass(frozen=True)
class ShardProgress:
    """Where a shard's generation stands: samples done (resumed ones included) of the shard's, tokens generated
    (those of rows an earlier attempt wrote included, so a retried shard's count does not fall back to 0), and the
    forecast of its end (evaldag.pipeline.time_left; None until it is known). `unit` names what is counted
    (EvalPlan.progress_unit): "problems" where each has one sample, else "samples" ("requests" in artifacts of
    earlier versions)."""
    done: int
    total: int
    tokens: int
    tokens_per_s: float | None = None
    tokens_left: int | None = None
    seconds_left: float | None = None
    unit: str = "problems"


@dataclass(frozen=True)
class Reported:
    """What a shard's progress artifact says (`describe` writes it, `parse` reads it back)."""
    benchmark: str
    shard: int
    progress: ShardProgress


def describe(benchmark: str, shard: int, p: ShardProgress) -> str:
    """A progress artifact's description (readable in the Prefect UI, parsed back by `parse`)."""
    text = f"{benchmark} shard {shard}: {p.done} of {p.total} {p.unit}, {p.tokens} tokens generated"
    if p.tokens_per_s is not None:
        text += f"; {p.tokens_per_s:.1f} tok/s"
    if p.tokens_left is not None and p.seconds_left is not None:
        text += f"; {p.tokens_left} tokens, {p.seconds_left:.0f} s left"
    return text


ROUND_TAG = "evaldag-round-"     # + the round: the tag of an adaptive evaluation's later rounds' shard flow runs


def round_label(benchmark: str, round: int) -> str:
    """What a shard of `round` reports as its benchmark: the name, with "/round-N" after the first round."""
    return benchmark if round == 1 else f"{benchmark}/round-{round}"


def label_round(label: str) -> int:
    """The round a shard's reported label (round_label) names."""
    head, _, tail = label.rpartition("/round-")
    return int(tail) if head and tail.isdigit() else 1


def run_round(tags: list[str]) -> int:
    """The round of a shard flow run, from its tags (ROUND_TAG; none: the first)."""
    found = [t.removeprefix(ROUND_TAG) for t in tags if t.startswith(ROUND_TAG)]
    return int(found[0]) if found and found[0].isdigit() else 1


def parse(text: str | None) -> Reported | None:
    """What a `describe` text says, or None for any other text."""
    m = _PATTERN.match(text or "")
    if m is None:
        return None
    return Reported(m["benchmark"], int(m["shard"]), ShardProgress(
        int(m["done"]), int(m["total"]), int(m["tokens"]), float(m["rate"]) if m["rate"] else None,
        int(m["tokens_left"]) if m["tokens_left"] else None, float(m["seconds_left"]) if m["seconds_left"] else None,
        m["unit"]))


def duration(seconds: float) -> str:
    """A time left as people say it: 45 s, 12 min, 1 h 05 min."""
    if seconds < 90:
        return f"{max(seconds, 0):.0f} s"
    minutes = round(seconds / 60)
    return f"{minutes} min" if minutes < 60 else f"{minutes // 60} h {minutes % 60:02d} min"


def describe_evaluation(benchmarks: list[str], done: int, total: int, snap: Snapshot, unit: str = "problems") -> str:
    """The parent's whole-evaluation progress text: problems (or samples, `ShardProgress.unit`) of every benchmark
    and shard together, the generation rate and time left, and the shards.

    It never matches `parse`'s pattern, so it is never counted as a shard's progress."""
    return (f"evaluation of {' + '.join(benchmarks)}: {done} of {total} {unit}, {snap.tokens} tokens generated"
            f"{snap.rate_and_left()}; {snap.shards_text()}")


@dataclass
class Snapshot:
    """The evaluation's progress at one moment."""
    done: int = 0            # problems (or samples: `unit`) generated, over all shards that reported
    total: int = 0           # problems (or samples) of the shards that reported so far
    unit: str = "problems"   # "samples" once a shard of a plan with several samples per problem reported
    tokens: int = 0
    shards: int = 0          # shard flow runs started
    running: int = 0
    completed: int = 0
    retried: int = 0         # shard flow runs that ran more than once or failed (and were relaunched)
    completed_names: list[str] = field(default_factory=list)
    tokens_per_s: float | None = None     # all generating shards together
    seconds_left: float | None = None     # the forecast end of the generation (see `forecast`)

    def rate_text(self) -> str:
        """'152 tok/s', or '' before a rate is known."""
        return f"{self.tokens_per_s:.0f} tok/s" if self.tokens_per_s else ""

    def left_text(self) -> str:
        """'about 14 min left', or '' before the end is forecast."""
        return f"about {duration(self.seconds_left)} left" if self.seconds_left is not None else ""

    def rate_and_left(self) -> str:
        """'; 152 tok/s, about 14 min left' as far as known, or ''."""
        parts = [x for x in (self.rate_text(), self.left_text()) if x]
        return "; " + ", ".join(parts) if parts else ""

    def shards_text(self) -> str:
        """'shards 2 running, 1/4 done, 1 retried'."""
        return (f"shards {self.running} running, {self.completed}/{self.shards} done"
                + (f", {self.retried} retried" if self.retried else ""))


def forecast(reports: list[ShardProgress], problems: int | None = None) -> tuple[float | None, float | None]:
    """(tokens/s of the generating shards together, seconds left of the whole generation) from the shards' latest
    reports. Shards run side by side, so the end is the later of the slowest shard's forecast and of all the work
    left (shards not reporting yet included, at the reporting shards' tokens per problem) at the shards' combined
    rate; `problems` is the evaluation's total, where known. (None, None) before anything is known."""
    live = [r for r in reports if r.done < r.total]
    rates = [r.tokens_per_s for r in live if r.tokens_per_s]
    rate = sum(rates) if rates else None
    known = [r for r in reports if r.seconds_left is not None and r.tokens_left is not None]
    if not known or (live and rate is None):
        return rate, None if live or not reports else 0.0
    slowest = max(r.seconds_left for r in known)
    tokens_left = sum(r.tokens_left for r in known)
    reported = sum(r.total for r in reports)
    if problems and problems > reported and reported:
        per_problem = sum(r.tokens + r.tokens_left for r in known) / max(sum(r.total for r in known), 1)
        tokens_left += (problems - reported) * per_problem
    return rate, max(slowest, tokens_left / rate) if rate else slowest


def snapshot(client, parent_id, problems: int | None = None, round: int | None = None) -> Snapshot:
    """Read the parent flow run's shard flow runs and their progress artifacts (a sync Prefect client); `problems`
    (the evaluation's total, where known) lets the forecast count shards that have not reported yet. `round`: only
    the shard runs and reports of that round of an adaptive evaluation (evaldag.request.second_round); None: all."""
    from prefect.client.schemas.filters import (
        ArtifactFilter,
        ArtifactFilterFlowRunId,
        ArtifactFilterType,
        FlowRunFilter,
        FlowRunFilterParentFlowRunId,
    )

    children = client.read_flow_runs(flow_run_filter=FlowRunFilter(
        parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[parent_id])))
    if round is not None:
        children = [c for c in children if run_round(c.tags or []) == round]
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
    latest: dict[tuple[str, int], Reported] = {}
    for a in sorted(artifacts, key=lambda a: a.updated or a.created):   # a retried task's newer artifact wins
        got = parse(a.description)
        if got is not None and (round is None or label_round(got.benchmark) == round):
            latest[(got.benchmark, got.shard)] = got
    shards = [r.progress for r in latest.values()]
    for p in shards:
        if p.unit != "problems":
            snap.unit = p.unit
        snap.done += p.done
        snap.total += p.total
        snap.tokens += p.tokens
    snap.tokens_per_s, snap.seconds_left = forecast(shards, problems)
    return snap


# ---------------------------------------------------------------------- publishing (inside flow runs)


def progress_key(benchmark: str, shard: int) -> str:
    """A shard's progress artifact key (Prefect keys: lowercase letters, digits, dashes)."""
    return re.sub(r"[^a-z0-9-]+", "-", f"progress-{benchmark}-shard-{shard}".lower())


def artifact_progress(benchmark: str, shard: int) -> Callable[[ShardProgress], None]:
    """A generate_shard progress callback (evaldag.pipeline.shard_runs.Progress) that creates, then updates, one Prefect
    progress artifact."""
    from prefect.artifacts import create_progress_artifact, update_progress_artifact

    artifact_id = None

    def report(p: ShardProgress) -> None:
        nonlocal artifact_id
        pct = 100.0 * p.done / p.total if p.total else 100.0
        text = describe(benchmark, shard, p)   # `evaldag run` parses it back
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
                        every_s: float = 5.0, unit: str = "problems", round: int | None = None) -> Iterator[None]:
    """Publish, then update every `every_s` seconds, one progress artifact on the parent flow run `flow_run_id` with
    the problems (or samples, `unit`) generated by all its shards of `total_problems`; at the end it reads 100 % if
    the block succeeded. `round`: count only that round's shard runs (snapshot).

    A shard whose stored generations were reused publishes one report, already complete, and shard runs that were
    never launched (every stage found done) publish nothing, so only the block's success says "all done"."""
    from prefect.artifacts import create_progress_artifact, update_progress_artifact
    from prefect.client.orchestration import get_client

    stop = threading.Event()
    finished = threading.Event()
    artifact_id = None

    def publish() -> None:
        nonlocal artifact_id
        with get_client(sync_client=True) as client:
            snap = snapshot(client, flow_run_id, total_problems, round)
        done = total_problems if finished.is_set() else min(snap.done, total_problems)
        pct = 100.0 * done / total_problems if total_problems else 100.0
        text = describe_evaluation(benchmarks, done, total_problems, snap, unit)
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
    """Shows snapshots: a rich progress bar on a terminal; otherwise (a log, CI, nohup) a line every `every_s`
    seconds (problems, tokens/s, time left) and one per completed shard."""

    def __init__(self, console, name: str, every_s: float = 60.0, clock=time.monotonic):
        self.console, self.name, self.every_s, self.clock = console, name, every_s, clock
        self.t0 = clock()
        self._last_line = self.t0
        self._seen: set[str] = set()
        self._bar = None
        self._task = None

    def __enter__(self) -> Display:
        if self.console.is_terminal:
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
            )

            self._bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                 TextColumn("{task.fields[unit]}"), TextColumn("{task.fields[rate]}"),
                                 TimeElapsedColumn(),
                                 TextColumn("{task.fields[left]}"), TextColumn("{task.fields[shards]}"),
                                 console=self.console, transient=False)
            self._bar.__enter__()
            self._task = self._bar.add_task(self.name, total=None, rate="", left="", shards="", unit="problems")
        return self

    def __exit__(self, *exc) -> None:
        if self._bar is not None:
            self._bar.__exit__(*exc)

    def update(self, state: str, snap: Snapshot) -> None:
        shards, rate, left = snap.shards_text(), snap.rate_text(), snap.left_text()
        if self._bar is not None:
            self._bar.update(self._task, completed=snap.done, total=snap.total or None,
                             description=f"{self.name} ({state})", shards=shards, rate=rate, left=left,
                             unit=snap.unit)
            return
        now = self.clock()
        for name in snap.completed_names:
            if name not in self._seen:
                self._seen.add(name)
                self.console.print(f"{self.name}: shard {name} done; {shards}; {snap.done}/{snap.total} {snap.unit}; "
                                   f"{now - self.t0:.0f} s")
        if now - self._last_line >= self.every_s and state == "Running":
            self._last_line = now
            figures = ", ".join(x for x in (f"{snap.tokens} tokens", rate, left) if x)
            self.console.print(f"{self.name}: {snap.done}/{snap.total} {snap.unit}, {figures}; {shards}; "
                               f"{now - self.t0:.0f} s")
