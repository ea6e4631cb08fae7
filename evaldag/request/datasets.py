"""Benchmark rows: a data file (`dataset.path`, read by polars through fsspec), or a hub dataset through the
`datasets` library, from the local mirror under $EVALDAG_DATA_DIR where that is set and from the hub otherwise.

The rows become the `inputs` table (evaldag.storage.schema.INPUT_SCHEMA) and a content hash that goes into the
eval_key, so a changed file or mirror or a moved hub revision can never be mistaken for the data an earlier result
was computed on. Every row is checked before any is used (columns, ids, problems, golds): an evaluation never runs on
a partly read set, and a bad row is named with its fix.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

import polars as pl

from evaldag import paths
from evaldag.request.config import BenchmarkConfig, data_format
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


def _read_file(cfg: BenchmarkConfig) -> tuple[list[dict], str]:
    """The rows of `dataset.path`, a local file or any fsspec URL, in the format its suffix names."""
    import fsspec

    url = cfg.dataset.path
    fmt = data_format(url)
    read = {"parquet": pl.read_parquet, "json": _read_json, "csv": pl.read_csv}[fmt]
    try:
        with fsspec.open(url, "rb") as f:
            frame = read(f)
    except Exception as e:  # fsspec's and polars' errors differ per protocol and format
        raise DatasetError(f"benchmark {cfg.name!r}: cannot read {url} as {fmt}: {type(e).__name__}: {e}. Check "
                           "that the file exists and is readable from here, and that its suffix names its format "
                           "(.parquet, .jsonl, .csv)") from None
    return frame.to_dicts(), url


def _read_json(f) -> pl.DataFrame:
    """JSON lines, or one JSON array of objects (a .json file may hold either)."""
    data = f.read()
    return pl.read_json(data) if data.lstrip()[:1] == b"[" else pl.read_ndjson(data)


def _load_rows(cfg: BenchmarkConfig) -> tuple[list[dict], str]:
    src = cfg.dataset
    if src.path is not None:
        return _read_file(cfg)
    import datasets  # heavy import (~1 s); only stages that need rows pay it

    datasets.logging.set_verbosity_error()
    datasets.disable_progress_bars()
    mirror_root = paths.data_dir()
    if mirror_root is not None and src.mirror is not None:
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
        mirror = f"a folder holding {src.mirror}" if src.mirror else "a local mirror"
        raise DatasetError(f"benchmark {cfg.name!r}: cannot load {src.hub_id}@{src.revision} ({src.split}) from the "
                           f"Hugging Face hub ({type(e).__name__}: {e}). Where the hub cannot be reached, set "
                           f"EVALDAG_DATA_DIR to {mirror} (the layout of ../shared/data), or give the benchmark a "
                           "data file (dataset.path)") from None
    return ds.to_list(), f"{src.hub_id}@{src.revision}:{src.split}"


def _content_hash(rows: list[dict], cfg: BenchmarkConfig) -> str:
    f = cfg.fields
    keys = [k for k in (f.id, f.problem, f.answer, f.subject, f.level) if k]
    h = hashlib.sha256()
    for row in rows:
        h.update(json.dumps([row.get(k) for k in keys], sort_keys=True, default=str).encode())
        h.update(b"\n")
    return h.hexdigest()


def row_ids(rows: list[dict], cfg: BenchmarkConfig) -> list[str]:
    """Each row's id: its `fields.id` column, or its index in the split (0, 1, ...) where the config names none."""
    return [str(r[cfg.fields.id]) for r in rows] if cfg.fields.id else [str(i) for i in range(len(rows))]


def _check_rows(rows: list[dict], cfg: BenchmarkConfig, source: str) -> tuple[list[str], list[str]]:
    """Every row's id and normalised gold, after checking the whole split: the configured columns exist, ids are
    unique, problems and golds are there and the golds read as `gold_format`. The first problem raises
    DatasetError naming the data, the row and the fix."""
    name, f = cfg.name, cfg.fields
    if not rows:
        raise DatasetError(f"benchmark {name!r}: {source} has no rows")
    for field, key in (("id", f.id), ("problem", f.problem), ("answer", f.answer), ("subject", f.subject),
                       ("level", f.level), ("solution", f.solution)):
        if key and key not in rows[0]:
            raise DatasetError(f"benchmark {name!r}: column {key!r} (the config's fields.{field}) is not in "
                               f"{source}, which has {sorted(rows[0])}; set fields.{field} to one of those")
    ids = row_ids(rows, cfg)
    first: dict[str, int] = {}
    for i, sid in enumerate(ids):
        if sid in first:
            raise DatasetError(f"benchmark {name!r}: {source} rows {first[sid]} and {i} have the same id {sid!r} in "
                               f"column {f.id!r}; ids must be unique: fix the data, or drop fields.id to number "
                               "the rows 0, 1, 2, ...")
        first[sid] = i
    golds = []
    for i, (sid, r) in enumerate(zip(ids, rows)):
        where = f"benchmark {name!r}: {source} row {i} (id {sid!r})"
        if r.get(f.problem) is None or not str(r[f.problem]).strip():
            raise DatasetError(f"{where} has no problem in column {f.problem!r}; fill it in or remove the row")
        raw = r.get(f.answer)
        if raw is None or (isinstance(raw, str) and not raw.strip()):
            raise DatasetError(f"{where} has no gold answer in column {f.answer!r}; fill it in or remove the row")
        try:
            golds.append(normalize_gold(raw, cfg.gold_format))
        except ValueError as e:
            raise DatasetError(f"{where}, column {f.answer!r}: {e}. Fix the row, or set gold_format to the one "
                               "its answers are written in (latex reads any non-empty answer)") from None
    return ids, golds


def load_benchmark_rows(cfg: BenchmarkConfig, limit: int | None = None) -> LoadedBenchmark:
    """Load the benchmark's split, check every row, and build the inputs table of the first `limit` problems."""
    check_limit(limit, error=DatasetError)
    rows, source = _load_rows(cfg)
    ids, golds = _check_rows(rows, cfg, source)
    dataset_hash = _content_hash(rows, cfg)
    f = cfg.fields
    selected = range(min(limit, len(rows)) if limit else len(rows))
    records = [{
        "sample_id": ids[i],
        "prompt": cfg.render_prompt(str(rows[i][f.problem])),
        "gold": golds[i],
        "gold_raw": str(rows[i][f.answer]),
        "subject": str(rows[i][f.subject]) if f.subject and rows[i].get(f.subject) is not None else None,
        "level": int(rows[i][f.level]) if f.level and rows[i].get(f.level) is not None else None,
    } for i in selected]
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
    by_id = {sid: r.get(f.solution) for sid, r in zip(row_ids(rows, cfg), rows)}
    missing = [sid for sid in sample_ids if by_id.get(sid) in (None, "")]
    if missing:
        raise DatasetError(f"benchmark {cfg.name!r}: {len(missing)} problems have no {f.solution!r} in {source}, "
                           f"e.g. {missing[:3]}")
    return [str(by_id[sid]) for sid in sample_ids]
