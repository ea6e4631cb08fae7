"""What a shard's stages leave besides their outputs: which stages were computed or reused (for the evaluation's
cache hit rate), whether the whole shard is already done, and the peak memory its stats report.

Output paths derive from the keys of what decides them (generation_key for generations, grade_key for grades, the
reference fingerprint for log-probs), and are written atomically, so an existing file is always a complete result of
the same inputs: a stage that finds its output reuses it instead of computing it again (and records that here).
"""

from __future__ import annotations

import resource

import polars as pl
from upath import UPath

from evaldag.pipeline.loss_files import STAGE, loss_path, wanted
from evaldag.request.plan import EvalPlan
from evaldag.storage import store


def peak_rss_mb() -> float:
    """The peak resident memory of this process so far, in MiB."""
    # ru_maxrss is in KiB on Linux: the peak of this process, i.e. of this shard's flow run.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def peak_gpu_mb() -> float:
    """The peak GPU memory torch allocated in this process, in MiB; 0 where torch is not loaded or has no GPU."""
    import sys

    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available():
        return 0.0
    return torch.cuda.max_memory_allocated() / 2**20


def record_stage(path: UPath, stage: str, computed: bool) -> None:
    """Record that a shard's `stage` was computed (or reused) in its stage record `path`
    (EvalPlan.cache_record_path), for the cache hit rate."""
    record = store.read_json(path) if path.is_file() else {}
    record[stage] = "computed" if computed else "reused"
    store.write_json(path, record)


def _shard_outputs(plan: EvalPlan, shard: int) -> dict[str, UPath]:
    """Each stage of one shard and the file it writes."""
    outputs = {"generate": plan.generations_path(shard), "grade": plan.graded_path(shard)}
    if plan.reference is not None:
        outputs["score"] = plan.logprobs_path(shard)
    if wanted(plan):
        outputs[STAGE] = loss_path(plan, shard)
    return outputs


def shard_done(plan: EvalPlan, shard: int) -> UPath | None:
    """The shard's graded file when every stage of the shard is already in the store, else None; reads only.
    A re-run of a finished evaluation then needs no shard run at all: no worker slot, no process start, no model
    load (record that with `record_reused`)."""
    outputs = _shard_outputs(plan, shard)
    if not all(path.is_file() for path in outputs.values()):
        return None
    if timed_out(outputs["grade"]):     # not a result: the shard runs again to grade those rows (grade_shard)
        return None
    return outputs["grade"]


def record_reused(plan: EvalPlan, shard: int) -> None:
    """Record every stage of a done shard (`shard_done`) as reused, for the evaluation's cache hit rate."""
    for stage in _shard_outputs(plan, shard):
        record_stage(plan.cache_record_path(shard), stage, computed=False)


def timed_out(graded: UPath) -> bool:
    """Whether a graded file holds rows whose grading timed out."""
    with graded.open("rb") as fh:
        return bool((pl.read_parquet(fh, columns=["status"])["status"] == "timeout").any())
