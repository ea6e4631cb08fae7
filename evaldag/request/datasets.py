"""Benchmark rows through the `datasets` library: a local mirror when $EVALDAG_DATA_DIR is set, else the hub.

The rows become the `inputs` table (evaldag.storage.schema.INPUT_SCHEMA) and a content hash that goes into the eval_key, so a
changed mirror or a moved hub revision can never be mistaken for the data an earlier result was computed on.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

import polars as pl

from evaldag import paths
from evaldag.request.config import BenchmarkConfig
from evaldag.errors import DatasetError
from evaldag.scoring.gold import normalize_gold
from evaldag.request.rules import check_limit


@dataclass(frozen=True)
class LoadedBenchmark:
    """The rows of one benchmark slice, ready for generation."""

    inputs: pl.DataFrame     # INPUT_SCHEMA rows, dataset order
    dataset_hash: str        # sha256 over the full split's id/problem/answer fields
    source: str              # where the rows came from (mirror path or hub id@revision)
    total_rows: int          # rows in the full split, before `limit`


def _load_rows(cfg: BenchmarkConfig) -> tuple[list[dict], str]:
    import datasets  # heavy import (~1 s); only stages that need rows pay it

    datasets.logging.set_verbosity_error()
    datasets.disable_progress_bars()
    src = cfg.dataset
    mirror_root = paths.data_dir()
    if mirror_root is not None:
        path = mirror_root / src.mirror
        if not path.is_file():
            raise DatasetError(f"benchmark {cfg.name!r}: mirror file {path} does not exist "
                               f"(EVALDAG_DATA_DIR={mirror_root}); point EVALDAG_DATA_DIR at the folder holding "
                               f"{src.mirror}, or unset it to load {src.hub_id} from the hub")
        try:
            ds = datasets.load_dataset("json", data_files=str(path), split="train")
        except Exception as e:  # datasets wraps JSON errors in several types
            raise DatasetError(f"benchmark {cfg.name!r}: cannot read mirror {path}: {e}") from None
        return ds.to_list(), str(path)
    try:
        ds = datasets.load_dataset(src.hub_id, src.hub_config, revision=src.revision, split=src.split)
    except Exception as e:
        raise DatasetError(f"benchmark {cfg.name!r}: cannot load {src.hub_id}@{src.revision} ({src.split}) from the "
                           f"hub: {e}. Without hub access set EVALDAG_DATA_DIR to a local mirror") from None
    return ds.to_list(), f"{src.hub_id}@{src.revision}:{src.split}"


def _content_hash(rows: list[dict], cfg: BenchmarkConfig) -> str:
    f = cfg.fields
    keys = [k for k in (f.id, f.problem, f.answer, f.subject, f.level) if k]
    h = hashlib.sha256()
    for row in rows:
        h.update(json.dumps([row.get(k) for k in keys], sort_keys=True, default=str).encode())
        h.update(b"\n")
    return h.hexdigest()


def load_benchmark_rows(cfg: BenchmarkConfig, limit: int | None = None) -> LoadedBenchmark:
    """Load the benchmark's split, check its fields, and build the inputs table of the first `limit` problems."""
    check_limit(limit, error=DatasetError)
    rows, source = _load_rows(cfg)
    if not rows:
        raise DatasetError(f"benchmark {cfg.name!r}: {source} has no rows")
    f = cfg.fields
    for key in (f.id, f.problem, f.answer, f.subject, f.level, f.solution):
        if key and key not in rows[0]:
            raise DatasetError(f"benchmark {cfg.name!r}: field {key!r} (from the config's `fields`) is not in the "
                               f"dataset {source}; it has {sorted(rows[0])}")
    ids = [str(r[f.id]) for r in rows]
    if len(set(ids)) != len(ids):
        raise DatasetError(f"benchmark {cfg.name!r}: id field {f.id!r} is not unique in {source}")
    dataset_hash = _content_hash(rows, cfg)
    selected = rows[:limit] if limit else rows
    records = []
    for r in selected:
        try:
            gold = normalize_gold(r[f.answer], cfg.gold_format)
        except ValueError as e:
            raise DatasetError(f"benchmark {cfg.name!r}, sample {r[f.id]}: {e}") from None
        records.append({
            "sample_id": str(r[f.id]),
            "prompt": cfg.render_prompt(str(r[f.problem])),
            "gold": gold,
            "gold_raw": str(r[f.answer]),
            "subject": str(r[f.subject]) if f.subject and r.get(f.subject) is not None else None,
            "level": int(r[f.level]) if f.level and r.get(f.level) is not None else None,
        })
    from evaldag.storage.schema import INPUT_SCHEMA
    inputs = pl.DataFrame(records, schema=INPUT_SCHEMA)
    return LoadedBenchmark(inputs=inputs, dataset_hash=dataset_hash, source=source, total_rows=len(rows))


def load_solutions(cfg: BenchmarkConfig, sample_ids: list[str]) -> list[str]:
    """The reference solutions (the `fields.solution` column) of `sample_ids`, in their order, for eval_loss
    (evaldag.scoring.eval_loss). Raises DatasetError when the config names no such column, the dataset lacks it, or
    a problem has none."""
    f = cfg.fields
    if f.solution is None:
        raise DatasetError(f"benchmark {cfg.name!r} names no reference solution column (fields.solution)")
    rows, source = _load_rows(cfg)
    by_id = {str(r[f.id]): r.get(f.solution) for r in rows}
    missing = [sid for sid in sample_ids if by_id.get(sid) in (None, "")]
    if missing:
        raise DatasetError(f"benchmark {cfg.name!r}: {len(missing)} problems have no {f.solution!r} in {source}, "
                           f"e.g. {missing[:3]}")
    return [str(by_id[sid]) for sid in sample_ids]
