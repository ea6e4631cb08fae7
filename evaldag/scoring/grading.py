"""Grading: turn (completion, gold) pairs into correct / wrong / unparseable / timeout / truncated.

The comparison itself is math-verify (`parse` + `verify`, gold first). What this module adds:

- The gold it compares with is canonical already (evaldag.scoring.gold.normalize_gold, when the rows are loaded).
- `grade_one` is the pure per-item function. It runs math-verify with its own timeouts switched off: those use
  `signal.alarm`, which raises outside the main thread and cannot interrupt sympy while it is stuck in C code.
- `grade_many` runs `grade_one` in a pebble process pool with a hard per-item timeout: pebble kills the worker
  process of an item that overruns, which works whatever the worker is doing.
- `grade_table` applies it to a generations table (`evaldag.storage.schema.GENERATION_SCHEMA` -> `GRADED_SCHEMA`),
  with each completion's arithmetic steps checked under the same per-item timeout (evaldag.scoring.steps).

math_verify (sympy) and polars are imported lazily, so `import evaldag.scoring.grading` stays cheap for the CLI and for the
pool's worker processes, which import this module to find `_grade_item`.
"""

from __future__ import annotations

import functools
import gc
import logging
import multiprocessing
import re
import signal
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import polars as pl

log = logging.getLogger(__name__)

# Part of every grade cache key: bump the suffix whenever a change here can change any grade
# (gold normalisation in evaldag.scoring.gold, extraction configs, status rules, math-verify minor version).
GRADER_VERSION: str = "math-verify-0.9/2"    # /2: graded rows carry steps_checked, steps_valid (scoring.steps)

# Statuses, spelled as in evaldag.storage.schema.GRADE_STATUSES (checked by the tests).
CORRECT, WRONG, UNPARSEABLE, TIMEOUT, TRUNCATED = "correct", "wrong", "unparseable", "timeout", "truncated"

# `pred` is for display in tables and the UI; a runaway extraction (a whole paragraph of LaTeX) is cut here.
PRED_MAX_CHARS = 200



# --------------------------------------------------------------------------------------------------------------
# Grading one item
# --------------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Grade:
    """The grade of one completion. `status` is one of `evaldag.storage.schema.GRADE_STATUSES`."""

    pred: str | None   # extracted answer as text (also for truncated rows); None when nothing was extracted
    status: str
    correct: bool
    seconds: float     # time spent grading (the timeout for a timed-out item)


class _MathVerifyNoise(logging.Filter):
    # We switch math-verify's signal timeouts off on purpose (the pool enforces the timeout), so its
    # once-per-process "Timeout is disabled" warning would only be noise in every worker's log.
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Timeout is disabled")


@lru_cache(maxsize=1)
def _math_verify() -> tuple[Any, Any]:
    """Import math_verify on first use (it pulls in sympy) and quiet its expected warning."""
    from math_verify import parse, verify

    for name in ("math_verify.parser", "math_verify.grader"):
        logging.getLogger(name).addFilter(_MathVerifyNoise())
    return parse, verify


@lru_cache(maxsize=4096)
def _parse_gold(gold: str) -> list:
    """Parse a normalized gold; cached because each problem is graded n_samples times with the same gold."""
    if not isinstance(gold, str) or not gold.strip():
        raise ValueError(f"gold {gold!r} is empty or not a string; expected a normalized gold (see normalize_gold)")
    parse, _ = _math_verify()
    # Bare LaTeX such as `\text{(C)}` or `\$18.90` parses to [] unless it is inside math delimiters.
    parsed = parse("$" + gold + "$", parsing_timeout=None)
    if not parsed:
        parsed = parse(gold, parsing_timeout=None)
    if not parsed:
        raise ValueError(f"math-verify cannot parse gold {gold!r} (tried '${gold}$' and the bare string); "
                         "fix the dataset's gold field or its gold format")
    return parsed


def _pred_text(parsed: list) -> str | None:
    """A short readable form of a math-verify parse result: the extracted string, else str() of the sympy object."""
    if not parsed:
        return None
    text = parsed[1] if len(parsed) > 1 and isinstance(parsed[1], str) else str(parsed[0])
    text = text.strip()
    return text if len(text) <= PRED_MAX_CHARS else text[: PRED_MAX_CHARS - 1] + "…"


def grade_one(completion: str, gold: str, finish_reason: str = "stop") -> Grade:
    """Grade one completion against a normalized gold, in the calling process, without any timeout.

    The caller bounds the time (see `grade_many`). Status rules, in order:
    finish_reason "length" -> "truncated" (pred still extracted, for display); nothing extracted -> "unparseable";
    else "correct"/"wrong" from math-verify's `verify(gold, pred)`.
    Raises ValueError when the gold cannot be parsed (a data error, not a wrong answer).
    """
    t0 = time.perf_counter()
    parse, verify = _math_verify()
    gold_parsed = _parse_gold(gold)
    pred_parsed = parse(completion or "", parsing_timeout=None)
    pred = _pred_text(pred_parsed)
    if finish_reason == "length":
        status, correct = TRUNCATED, False
    elif not pred_parsed:
        status, correct = UNPARSEABLE, False
    else:
        correct = bool(verify(gold_parsed, pred_parsed, timeout_seconds=None))
        status = CORRECT if correct else WRONG
    return Grade(pred=pred, status=status, correct=correct, seconds=time.perf_counter() - t0)


# --------------------------------------------------------------------------------------------------------------
# Grading many items
# --------------------------------------------------------------------------------------------------------------

def _timeout_grade(timeout_s: float) -> Grade:
    return Grade(pred=None, status=TIMEOUT, correct=False, seconds=float(timeout_s))


def _grade_item(completion: str, gold: str, finish_reason: str) -> Grade:
    """The task run in pool workers (module level so that it pickles by reference)."""
    return grade_one(completion, gold, finish_reason)


@functools.cache
def _warm_worker() -> None:
    """Import math-verify and build its parsers before the first item's timeout starts (a pool's initializer, and
    once per process before the inline timer: an alarm inside the import leaves math_verify half imported, and every
    later item then fails as if its gold could not be parsed)."""
    try:
        grade_one("\\boxed{1}", "1")
    except Exception:  # pragma: no cover - a broken install shows up again, with its traceback, on the first item
        pass


def _mp_context() -> multiprocessing.context.BaseContext:
    """The start method for grading workers.

    Not "fork": the parent may hold torch, polars and Prefect/pebble threads, and forking a threaded process can
    deadlock in the child. "forkserver" starts one clean server process (once per parent process) that preloads
    math-verify, then forks each worker from it: safe like "spawn", and a worker that replaces one killed by a
    timeout starts in milliseconds instead of re-importing sympy.
    """
    if "forkserver" in multiprocessing.get_all_start_methods():
        ctx = multiprocessing.get_context("forkserver")
        # Only takes effect if the forkserver is not running yet; otherwise workers just import it themselves.
        ctx.set_forkserver_preload(["evaldag.scoring.grading", "math_verify"])
        return ctx
    return multiprocessing.get_context("spawn")  # pragma: no cover - platforms without fork (Windows)


def start_worker_server() -> None:
    """Start the grading workers' forkserver now, without waiting for it: its imports (math-verify, sympy; 1-2 s)
    then run beside what comes before grading (a shard's own imports and engine load use one core at a time)
    instead of at the start of the first grading call. A no-op where workers are spawned, or once it runs."""
    ctx = _mp_context()
    if ctx.get_start_method() == "forkserver":
        from multiprocessing import forkserver

        forkserver.ensure_running()


class _InlineTimeout(BaseException):
    # BaseException, so that math-verify's and sympy's `except Exception` blocks do not swallow it.
    pass


def _grade_inline(completion: str, gold: str, finish_reason: str, timeout_s: float) -> Grade:
    """Grade in the calling thread; in the main thread, bound it with a SIGALRM interval timer.

    The timer only fires between Python bytecodes, so sympy stuck inside C code is not interrupted here;
    outside the main thread there is no timeout at all. Use workers >= 1 for a hard bound.
    """
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "setitimer"):
        return grade_one(completion, gold, finish_reason)

    def on_alarm(signum: int, frame: object) -> None:
        raise _InlineTimeout()

    # No cyclic garbage collection while the timer runs: an alarm that lands inside a destructor the collector
    # calls (e.g. a leftover multiprocessing connection's __del__) is printed and swallowed, and the item then
    # runs past its timeout unnoticed.
    _warm_worker()
    gc_was_enabled = gc.isenabled()
    gc.disable()
    old_handler = signal.signal(signal.SIGALRM, on_alarm)
    old_timer = signal.setitimer(signal.ITIMER_REAL, timeout_s)
    armed_at = time.monotonic()
    try:
        return grade_one(completion, gold, finish_reason)
    except _InlineTimeout:
        return _timeout_grade(timeout_s)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old_handler)
        if old_timer[0] > 0:        # a caller's own timer runs on, less the time grading took (due: at once)
            signal.setitimer(signal.ITIMER_REAL, max(old_timer[0] - (time.monotonic() - armed_at), 1e-6),
                             old_timer[1])
        if gc_was_enabled:
            gc.enable()


def _with_item(i: int, gold: str, error: ValueError) -> ValueError:
    return ValueError(f"item {i} (gold {gold!r}): {error}")


def grade_many(items: Sequence[tuple[str, str, str]], timeout_s: float = 10.0, workers: int = 2) -> list[Grade]:
    """Grade (completion, gold, finish_reason) items; returns one Grade per item, in input order.

    workers >= 1: a pebble ProcessPool; each item is its own task with a hard `timeout_s` (pebble kills the worker
    process of an item that overruns and starts a fresh one), and such an item gets status "timeout". A worker that
    dies (e.g. killed for memory) on an item also gives that item "timeout": the grader could not finish it.
    workers == 0: grade in the calling thread (for debugging); see `_grade_inline` for the weaker timeout.
    A gold that cannot be parsed raises ValueError naming the item index and the gold.

    Notes: pebble checks timeouts about every 0.1 s, so an item finishing within that can beat a smaller timeout_s.
    Workers start by "forkserver" (see `_mp_context`), so a script calling this needs the usual
    `if __name__ == "__main__":` guard, as with any non-fork multiprocessing.
    """
    items = [tuple(item) for item in items]
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
    if workers < 0:
        raise ValueError(f"workers must be >= 0, got {workers!r}")
    if not items:
        return []

    if workers == 0:
        out = []
        for i, (completion, gold, finish_reason) in enumerate(items):
            try:
                out.append(_grade_inline(completion, gold, finish_reason, timeout_s))
            except ValueError as error:
                raise _with_item(i, gold, error) from error
        return out

    from pebble import ProcessExpired, ProcessPool

    # One task per item rather than chunks: pebble's per-task overhead is well under a millisecond, and a single
    # item per task makes the timeout exactly per item (a chunk's timeout would have to be retried item by item).
    pool = ProcessPool(max_workers=min(workers, len(items)), initializer=_warm_worker, context=_mp_context())
    ok = False
    try:
        futures = [pool.schedule(_grade_item, args=item, timeout=timeout_s) for item in items]
        out = []
        for i, future in enumerate(futures):
            try:
                out.append(future.result())
            except TimeoutError:
                out.append(_timeout_grade(timeout_s))
            except ProcessExpired as error:
                log.warning("grading worker died on item %d (exit code %s); graded as timeout", i, error.exitcode)
                out.append(_timeout_grade(timeout_s))
            except ValueError as error:
                raise _with_item(i, items[i][1], error) from error
        ok = True
    finally:
        # On success every task is done and close() lets the workers exit; on an error stop() cancels the
        # remaining tasks and kills the workers instead of grading the rest of a batch that has failed.
        if ok:
            pool.close()
        else:
            pool.stop()
        pool.join()
    return out


class BoundedCalls:
    """Calls of module-level functions in a pebble process pool, each with a hard `timeout_s` (the pool kills the
    worker of a call that overruns), one at a time; a context manager. For work that, like grading, can hang in
    sympy's C code where no signal reaches it: maj@k's answer grouping (evaldag.scoring.sampling_metrics.math_equivalent).
    The pool starts on the first call, so a table that needs no call costs nothing. `timeouts` counts the calls
    that were cut (a worker that died counts too)."""

    def __init__(self, timeout_s: float, workers: int = 1) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
        self.timeout_s, self.workers, self.timeouts = timeout_s, max(1, workers), 0
        self._pool = None

    def __enter__(self) -> "BoundedCalls":
        return self

    def __exit__(self, *exc: object) -> None:
        if self._pool is not None:
            self._pool.stop()
            self._pool.join()
            self._pool = None

    def call(self, fn: Any, *args: Any, default: Any = None) -> Any:
        """`fn(*args)` in a worker; `default` when it overran `timeout_s` or its worker died."""
        from pebble import ProcessExpired, ProcessPool

        if self._pool is None:
            self._pool = ProcessPool(max_workers=self.workers, initializer=_warm_worker, context=_mp_context())
        try:
            return self._pool.schedule(fn, args=args, timeout=self.timeout_s).result()
        except (TimeoutError, ProcessExpired):
            self.timeouts += 1
            return default


_THINK_RE = re.compile(r"<think>.*?(</think>|$)", re.DOTALL)


def _warm_steps_worker() -> None:
    from evaldag.scoring.steps import count_steps

    _warm_worker()
    count_steps("12 * 4 = 48")


def check_many(completions: Sequence[str], timeout_s: float = 10.0, workers: int = 2) -> list[tuple[int | None,
                                                                                                     int | None]]:
    """(steps_checked, steps_valid) per completion (evaldag.scoring.steps.count_steps), in order. workers >= 1:
    grading's process pool, each item with a hard `timeout_s` (an item that overruns or whose worker dies gets
    (None, None)); workers == 0: in this process, unbounded (for debugging, as grade_many's)."""
    from evaldag.scoring.steps import count_steps

    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
    if workers == 0 or not completions:
        return [count_steps(c) for c in completions]
    from pebble import ProcessExpired, ProcessPool

    pool = ProcessPool(max_workers=min(workers, len(completions)), initializer=_warm_steps_worker,
                       context=_mp_context())
    out: list[tuple[int | None, int | None]] = []
    try:
        futures = [pool.schedule(count_steps, args=(c,), timeout=timeout_s) for c in completions]
        for i, future in enumerate(futures):
            try:
                out.append(future.result())
            except (TimeoutError, ProcessExpired):
                log.info("step check of item %d overran %.1f s; its steps are left unscored", i, timeout_s)
                out.append((None, None))
    finally:
        pool.stop() if len(out) < len(completions) else pool.close()
        pool.join()
    return out


def strip_thinking(completion: str) -> str:
    """Drop `<think>...</think>` blocks (and an unclosed trailing one) so the answer is read from the reply only."""
    return _THINK_RE.sub("", completion or "").strip()


_strip_thinking = strip_thinking   # grade_table's flag of the same name hides the function there


def grade_table(df: pl.DataFrame, timeout_s: float = 10.0, workers: int = 2,
                strip_thinking: bool = False) -> pl.DataFrame:
    """Grade a generations table (`GENERATION_SCHEMA`): adds pred, status, correct, grade_s,
    steps_checked, steps_valid (`GRADED_SCHEMA`).

    With `strip_thinking`, reasoning in `<think>` blocks is removed before extraction (the stored completion keeps
    it): a number the model mentions while thinking is not its answer.
    """
    import polars as pl

    from evaldag.storage.schema import GENERATION_SCHEMA, GRADED_SCHEMA, conform

    df = conform(df, GENERATION_SCHEMA)
    completions = df["completion"].fill_null("").to_list()
    if strip_thinking:
        completions = [_strip_thinking(c) for c in completions]
    items = list(zip(completions,
                     df["gold"].to_list(),
                     df["finish_reason"].fill_null("").to_list()))
    grades = grade_many(items, timeout_s=timeout_s, workers=workers)
    # the steps of the whole completion, thinking included: that is where a reasoning model computes
    steps = check_many(df["completion"].fill_null("").to_list(), timeout_s=timeout_s, workers=workers)
    graded = df.with_columns(
        pl.Series("pred", [g.pred for g in grades], dtype=pl.Utf8),
        pl.Series("status", [g.status for g in grades], dtype=pl.Utf8),
        pl.Series("correct", [g.correct for g in grades], dtype=pl.Boolean),
        pl.Series("grade_s", [g.seconds for g in grades], dtype=pl.Float64),
        pl.lit(None, dtype=pl.Int64).alias("answer_group"),   # filled by sampling_metrics.assign_answer_groups
        pl.Series("steps_checked", [s[0] for s in steps], dtype=pl.Int64),
        pl.Series("steps_valid", [s[1] for s in steps], dtype=pl.Int64),
    )
    return conform(graded, GRADED_SCHEMA)
