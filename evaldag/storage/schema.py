"""The per-sample table: one versioned schema, read and written here by every stage and tool.

Stages hand each other parquet files, never in-memory objects:
  inputs (resolve) -> generations (generate) -> graded (grade) -> metrics (reduce).
Each file carries `evaldag.schema_version` in its parquet metadata so a reader can refuse a file it does not know.
"""

from __future__ import annotations

import io
from os import PathLike
from typing import TYPE_CHECKING

import polars as pl

if TYPE_CHECKING:
    from upath import UPath

SCHEMA_VERSION = "2"

# One row per problem of the benchmark slice, written by resolve.
INPUT_SCHEMA: dict[str, pl.DataType] = {
    "sample_id": pl.Utf8,        # stable id of the problem in its dataset (unique_id, id, idx, ...)
    "prompt": pl.Utf8,           # user message: the problem plus the benchmark's instruction
    "gold": pl.Utf8,             # normalised gold answer (see evaldag.scoring.gold.normalize_gold)
    "gold_raw": pl.Utf8,         # gold field exactly as in the dataset
    "subject": pl.Utf8,          # null when the dataset has none
    "level": pl.Int64,           # null when the dataset has none
}

# One row per completion (sample_id x sample_index), written by generate.
GENERATION_SCHEMA: dict[str, pl.DataType] = {
    **INPUT_SCHEMA,
    "sample_index": pl.Int64,    # 0..n-1 when n samples are drawn per problem
    "shard_index": pl.Int64,
    "completion": pl.Utf8,
    "completion_ids": pl.List(pl.Int64),   # generated token ids (end-of-sequence included), for log-prob scoring
    "prompt_tokens": pl.Int64,   # tokens of the full chat-formatted prompt
    "completion_tokens": pl.Int64,
    "finish_reason": pl.Utf8,    # "stop" (end of sequence) or "length" (hit max_new_tokens)
    # vLLM: seconds from the engine step that gave the completion's request its first token to the one that ended
    # it (each sample is a request of its own where the shard deals them); a static-batch engine: its batch's time
    "latency_s": pl.Float64,
    "batch_size": pl.Int64,      # the batch's size; vLLM: the requests its engine was given together
}

# Grading adds these columns.
GRADE_STATUSES = ("correct", "wrong", "unparseable", "timeout", "truncated")
GRADED_SCHEMA: dict[str, pl.DataType] = {
    **GENERATION_SCHEMA,
    "pred": pl.Utf8,             # extracted answer as text, null when nothing could be extracted
    "status": pl.Utf8,           # one of GRADE_STATUSES
    "correct": pl.Boolean,
    "grade_s": pl.Float64,       # time spent grading this row
    "answer_group": pl.Int64,    # per problem: samples with mathematically equivalent answers share it (maj@k)
    # arithmetic steps of the completion checked and found valid (evaldag.scoring.steps); null where the check
    # overran the grading timeout, or in a file graded before steps were checked
    "steps_checked": pl.Int64,
    "steps_valid": pl.Int64,
}
# Columns added to a schema after files without them were written: such a file reads them as nulls.
ADDED_LATER: dict[str, pl.DataType] = {"steps_checked": pl.Int64, "steps_valid": pl.Int64}

# Per-token log-probabilities of each completion under the evaluated model and the reference (KL estimates).
LOGPROB_SCHEMA: dict[str, pl.DataType] = {
    "sample_id": pl.Utf8,
    "sample_index": pl.Int64,
    "logp": pl.List(pl.Float64),
    "ref_logp": pl.List(pl.Float64),
    # exact KL(policy || reference) over the vocabulary at each position; null where the engines cannot give it
    "kl_exact": pl.List(pl.Float64),
}


def conform(df: pl.DataFrame, schema: dict[str, pl.DataType]) -> pl.DataFrame:
    """Select and cast `df` to `schema` (column order included); raise naming any missing column."""
    missing = [c for c in schema if c not in df.columns]
    if missing:
        raise ValueError(f"table is missing columns {missing}; expected {list(schema)}")
    return df.select([pl.col(c).cast(t) for c, t in schema.items()])


def write_table(df: pl.DataFrame, path: str | PathLike, schema: dict[str, pl.DataType]) -> UPath:
    """Write `df` (conformed to `schema`) to the result store atomically: readers never see a half-written file."""
    from evaldag.storage import store

    return store.write_parquet(store.as_path(path), conform(df, schema),
                               metadata={"evaldag.schema_version": SCHEMA_VERSION})


def read_table(path: str | PathLike, schema: dict[str, pl.DataType], columns: list[str] | None = None) -> pl.DataFrame:
    """Read a stage file of the result store, checking its schema version and columns (only `columns` of the
    schema's, where given)."""
    from evaldag.storage import store

    path = store.as_path(path)
    with path.open("rb") as f:
        data = f.read()
    meta = pl.read_parquet_metadata(io.BytesIO(data))
    version = meta.get("evaldag.schema_version")
    if version != SCHEMA_VERSION:
        raise ValueError(f"{path} has schema version {version!r}, this evaldag reads {SCHEMA_VERSION!r}; "
                         "re-run the stage that wrote it")
    if columns is not None:
        schema = {c: schema[c] for c in columns}
    stored = pl.read_parquet_schema(io.BytesIO(data))
    older = {c: t for c, t in ADDED_LATER.items() if c in schema and c not in stored}
    df = pl.read_parquet(io.BytesIO(data),
                         columns=[c for c in schema if c not in older] if columns is not None else None)
    return conform(df.with_columns(*[pl.lit(None, dtype=t).alias(c) for c, t in older.items()]), schema)
