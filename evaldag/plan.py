"""The resolve stage: validate a request, resolve model and data, compute the eval_key, plan the shards.

The plan is written to the result store as plan.json next to inputs.parquet; every later stage reads only those,
so a shard on another machine needs nothing but the plan's path.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import polars as pl
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from evaldag import __version__, paths
from evaldag.config import BenchmarkConfig, SamplingConfig, _format_validation, load_benchmark, merge_sampling
from evaldag.datasets import load_benchmark_rows
from evaldag.errors import ConfigError
from evaldag.grading import GRADER_VERSION
from evaldag.models import ResolvedModel, resolve_model
from evaldag.schema import INPUT_SCHEMA, read_table, write_table

DEFAULT_CHECKPOINT = "smollm2-135m-instruct"
# Bump when a stage's code changes what it writes; it is part of every eval_key.
PIPELINE_VERSION = f"{__version__}/1"


class EvalRequest(BaseModel):
    """What a user or trigger asks for: one checkpoint on one benchmark."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    benchmark: str = Field(min_length=1)
    checkpoint: str = Field(DEFAULT_CHECKPOINT, description="model alias from configs/models or a checkpoint folder")
    step: int = Field(0, ge=0, description="training step of the checkpoint; the x axis in MLflow")
    limit: int | None = Field(None, ge=1, description="evaluate only the first `limit` problems")
    num_shards: int | None = Field(None, ge=1, le=4096, description="shard flow runs; default from the benchmark")
    sampling: dict | None = Field(None, description="overrides of the benchmark's sampling, e.g. {max_new_tokens: 64}")

    @classmethod
    def parse(cls, **params: object) -> "EvalRequest":
        """Validate raw parameters into a request, raising ConfigError with every problem named."""
        try:
            return cls.model_validate({k: v for k, v in params.items() if v is not None})
        except ValidationError as e:
            raise ConfigError(f"invalid evaluation request: {_format_validation(e)}") from None


class EvalPlan(BaseModel):
    """Everything a shard needs, and everything that decides the evaluation's output."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    eval_key: str
    request: EvalRequest
    benchmark: BenchmarkConfig
    model: dict                       # ResolvedModel as a dict
    sampling: SamplingConfig
    num_shards: int
    dataset_hash: str
    dataset_source: str
    n_problems: int
    shards: list[list[str]]           # sample ids per shard
    result_dir: str
    pipeline_version: str = PIPELINE_VERSION
    grader_version: str = GRADER_VERSION

    @property
    def resolved_model(self) -> ResolvedModel:
        return ResolvedModel(**self.model)

    def path(self, name: str) -> Path:
        return Path(self.result_dir) / name

    def generations_path(self, shard: int) -> Path:
        return self.path(f"shards/generations-{shard:04d}-of-{self.num_shards:04d}.parquet")

    def graded_path(self, shard: int) -> Path:
        return self.path(f"shards/graded-{shard:04d}-of-{self.num_shards:04d}.parquet")

    def stats_path(self, shard: int) -> Path:
        return self.path(f"shards/stats-{shard:04d}-of-{self.num_shards:04d}.json")

    def shard_inputs(self, shard: int) -> pl.DataFrame:
        """The input rows of one shard, in the plan's order."""
        if not 0 <= shard < self.num_shards:
            raise ConfigError(f"shard index {shard} is outside 0..{self.num_shards - 1}")
        ids = self.shards[shard]
        inputs = read_table(self.path("inputs.parquet"), INPUT_SCHEMA)
        order = pl.DataFrame({"sample_id": ids, "_pos": list(range(len(ids)))})
        return inputs.join(order, on="sample_id").sort("_pos").drop("_pos")


def compute_eval_key(parts: dict) -> str:
    """sha256 over the canonical JSON of everything that decides the output."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


def plan_shards(inputs: pl.DataFrame, num_shards: int) -> list[list[str]]:
    """Deterministic shards balanced by prompt length: longest first, dealt round-robin."""
    ranked = (inputs.with_row_index("_pos")
              .with_columns(_len=pl.col("prompt").str.len_chars())
              .sort(["_len", "_pos"], descending=[True, False]))
    shards: list[list[str]] = [[] for _ in range(num_shards)]
    for i, sid in enumerate(ranked["sample_id"]):
        shards[i % num_shards].append(sid)
    return [s for s in shards if s]


def resolve(request: EvalRequest, results_root: Path | None = None) -> EvalPlan:
    """Run the resolve stage: load config, model and data; write plan.json and inputs.parquet; return the plan."""
    bench = load_benchmark(request.benchmark)
    sampling = merge_sampling(bench.sampling, request.sampling)
    model = resolve_model(request.checkpoint)
    data = load_benchmark_rows(bench, request.limit)
    if request.limit and request.limit > data.total_rows:
        raise ConfigError(f"limit {request.limit} is larger than {bench.name}'s {data.total_rows} problems")
    num_shards = min(request.num_shards or bench.num_shards, data.inputs.height)
    shards = plan_shards(data.inputs, num_shards)
    key_parts = {
        "pipeline": PIPELINE_VERSION,
        "grader": GRADER_VERSION,
        "benchmark": bench.model_dump(exclude={"description", "num_shards"}),
        "dataset_hash": data.dataset_hash,
        "sample_ids": data.inputs["sample_id"].to_list(),
        "model_fingerprint": model.fingerprint,
        "engine": [model.engine, model.dtype, model.batch_size],
        "sampling": sampling.model_dump(),
        "shards": shards,   # batch composition changes greedy outputs slightly, so it is part of the identity
        "step": request.step,
    }
    eval_key = compute_eval_key(key_parts)
    root = results_root or paths.results_dir()
    result_dir = root / bench.name / eval_key[:24]
    plan = EvalPlan(
        eval_key=eval_key, request=request, benchmark=bench, model=model.__dict__, sampling=sampling,
        num_shards=len(shards), dataset_hash=data.dataset_hash, dataset_source=data.source,
        n_problems=data.inputs.height, shards=shards, result_dir=str(result_dir),
    )
    write_table(data.inputs, plan.path("inputs.parquet"), INPUT_SCHEMA)
    tmp = plan.path("plan.json.tmp")
    tmp.write_text(plan.model_dump_json(indent=2))
    tmp.replace(plan.path("plan.json"))
    return plan


def load_plan(path: str | Path) -> EvalPlan:
    """Read a plan.json written by `resolve`."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"plan {path} does not exist; was the resolve stage run with the same result store?")
    return EvalPlan.model_validate_json(path.read_text())
