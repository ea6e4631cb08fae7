"""The resolve stage: validate a request, resolve model and data, compute the eval_key, plan the shards.

The plan is written to the result store as plan.json next to inputs.parquet; every later stage reads only those,
so a shard on another machine needs nothing but the plan's path. A plan never changes once written, so each process
reads and validates it once (`load_plan` keeps it, keyed by the file's identity).
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict
from os import PathLike
from pathlib import Path
from typing import Literal

import polars as pl
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, field_validator
from upath import UPath

from evaldag import __version__
from evaldag.storage import store
from evaldag.request.config import (BenchmarkConfig, EngineName, EngineSettings, SamplingConfig, load_benchmark,
                                   merge_sampling)
from evaldag.request.datasets import LoadedBenchmark, load_benchmark_rows
from evaldag.errors import ConfigError
from evaldag.request.gpus import shard_gpus
from evaldag.scoring.eval_loss import EVAL_LOSS_VERSION
from evaldag.scoring.grading import GRADER_VERSION
from evaldag.request.keys import result_engine_args
from evaldag.request.checkpoint import ResolvedModel, resolve_model, with_engine, with_settings
from evaldag.request import adaptive_rules
from evaldag.request.sharding import plan_shards, plan_split_shards, shard_count, splits_samples
from evaldag.request.rules import (MIN_LIMIT, MIN_STEP, RUN_ID_PATTERN, TRAIN_RUN_PATTERN, check_benchmark_ref,
                                   describe_errors)
from evaldag.storage.schema import INPUT_SCHEMA, read_table, write_table
from evaldag.decisions.adaptive import AdaptiveSettings
from evaldag.decisions.verdicts import DEFAULT_ALPHA, DEFAULT_MARGIN

# Times the sequential verdict is read, at equal steps of the problems (evaldag.decisions.decide)
DEFAULT_ROUNDS = 10


def resolved_decide(decide: str | None, alpha: float | None = None, margin: float | None = None,
                    rounds: int | None = None) -> tuple[str, float, float, int] | None:
    """A sequential verdict's settings with the defaults filled in: (decide, alpha, margin, rounds), or None when
    none is asked for. The keys hold this form (eval_key here, settings_key in evaldag.events.identity), so that a
    request naming a default value is the same request as one leaving it out."""
    if decide is None:
        return None
    return (decide, DEFAULT_ALPHA if alpha is None else alpha, DEFAULT_MARGIN if margin is None else margin,
            DEFAULT_ROUNDS if rounds is None else rounds)

DEFAULT_CHECKPOINT = "smollm2-135m-instruct"
# Bump when a stage's code changes what it writes; it is part of every eval_key.
PIPELINE_VERSION = f"{__version__}/5"   # 2: static KV cache (hf); 3: exact sampling distribution, per-shard seeds;
# 4: vLLM seeds each request by (seed, sample id) instead of (shard seed, batch, position): sampled vLLM
# completions change (greedy ones do not); its latency_s is the request's own
# 5: the hf engine prefills each prompt once for its n samples (n > 1): the same distributions, computed in another
# order, so sampled hf completions may change in rare rows (greedy ones do not)


class EvalRequest(BaseModel):
    """What a user or trigger asks for: one checkpoint on one benchmark."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    benchmark: str = Field(min_length=1, description="a benchmark config's name (built-in or in "
                                                    "$EVALDAG_CONFIGS_DIR) or a config file's absolute path")
    checkpoint: str = Field(DEFAULT_CHECKPOINT, description="model alias from configs/models, a checkpoint folder, "
                                                            "or a hub model id org/name[@revision]")
    step: int = Field(0, ge=MIN_STEP, description="training step of the checkpoint; the x axis in MLflow")
    limit: int | None = Field(None, ge=MIN_LIMIT, description="evaluate only the first `limit` problems")
    num_shards: int | None = Field(None, ge=1, le=4096, description="shard flow runs; default: as many as the gpu "
                                                                    "slots run at once (see shard_count)")
    sampling: dict | None = Field(None, description="overrides of the benchmark's sampling, e.g. {max_new_tokens: 64}")
    engine_settings: EngineSettings | None = Field(None, description="over the model config's: tensor_parallel_size, "
                                                                     "max_model_len, gpu_memory_utilization, dtype "
                                                                     "(evaldag.request.config.EngineSettings)")
    pass_k: list[int] | None = Field(None, description="ks for pass@k and maj@k (each 1 <= k <= n)")
    reference: str | None = Field(None, description="reference model (alias or folder) for KL estimates")
    engine: EngineName | None = Field(None, description="inference engine for this run; default: the model "
                                                        "config's (hf for a plain folder)")
    train_run: str | None = Field(None, pattern=TRAIN_RUN_PATTERN,
                                  description="training job the checkpoint belongs to; default: its parent folder")
    mlflow_parent_run_id: str | None = Field(None, pattern=RUN_ID_PATTERN,
                                             description="the training job's MLflow run, when the trainer made one")
    # Not part of any key (evaldag.request.keys.NOT_RESULT_SETTINGS): whom the result is compared with, not the result.
    baseline: str | None = Field(None, min_length=1, max_length=1000,
                                 description="also compare with this evaluation (paired verdict): a run id, "
                                             "checkpoint path, model name or JOB@STEP, as `evaldag compare "
                                             "--baseline`")
    # Not part of any key either: where the job is headed, for the forecast logged on its parent run.
    final_step: int | None = Field(None, ge=1, description="the training job's planned last step: the forecast of "
                                                           "its accuracy there is logged on the job's parent run")
    # Sequential stopping (evaldag.decisions.decide). Part of the eval_key (a stopped evaluation's metrics are over a prefix
    # of the problems), not of the generation key: a later full evaluation reuses the rows generated before the stop.
    # "select": one checkpoint's part of a selection (evaldag.decisions.select_rows): its shards generate the prefix
    # of the decision order the selection names in the stop file, and nothing decides inside the evaluation.
    decide: Literal["vs_best", "select"] | None = Field(None, description="stop generating as soon as the paired "
                                                                          "verdict against the job's best "
                                                                          "checkpoint so far is decided (repeated "
                                                                          "confidence intervals, valid at every "
                                                                          "round end); `select`: a selection's "
                                                                          "prefix only (evaldag select)")
    decide_alpha: float | None = Field(None, gt=0, lt=1, description="error rate of the sequential verdict "
                                                                     f"(default {DEFAULT_ALPHA})")
    decide_margin: float | None = Field(None, ge=0, lt=1, description="accuracy difference within which two "
                                                                      "checkpoints are `equivalent` (default "
                                                                      f"{DEFAULT_MARGIN})")
    decide_rounds: int | None = Field(None, ge=1, le=1000, description="how many times, at equal steps of the "
                                                                       "problems, the verdict is read (default "
                                                                       f"{DEFAULT_ROUNDS})")
    eval_loss: bool | None = Field(None, description="score the benchmark's reference solutions after each prompt "
                                                     "and log eval_loss (evaldag.scoring.eval_loss); default: the "
                                                     "benchmark config's eval_loss")
    # Adaptive samples (evaldag.decisions.adaptive, evaldag.request.second_round). Part of the eval_key (the metrics
    # are its estimate), not of the first round's generation key: a fixed n = n0 evaluation shares those rows.
    adaptive: AdaptiveSettings | None = Field(None, description="n0 samples of every problem, then more where the "
                                                                "outcome is uncertain, up to a sample `budget` or a "
                                                                "`target_ci_width` (needs engine vllm, temperature > 0)")

    @field_validator("benchmark")
    @classmethod
    def _benchmark_ref(cls, ref: str) -> str:
        return check_benchmark_ref(ref)

    @classmethod
    def parse(cls, **params: object) -> "EvalRequest":
        """Validate raw parameters into a request, raising ConfigError with every problem named."""
        try:
            return cls.model_validate({k: v for k, v in params.items() if v is not None})
        except ValidationError as e:
            raise ConfigError(f"invalid evaluation request: {describe_errors(e.errors())}") from None


class EvalPlan(BaseModel):
    """Everything a shard needs, and everything that decides the evaluation's output."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    eval_key: str
    request: EvalRequest
    benchmark: BenchmarkConfig
    model: ResolvedModel
    sampling: SamplingConfig
    num_shards: int
    dataset_hash: str
    dataset_source: str
    n_problems: int
    shards: list[list[str]]           # sample ids per shard
    # Where shards split problems' samples (see plan_split_shards): per shard, per sample id of `shards`, the run
    # (first sample index, count) it holds. None: every shard holds all n samples of each of its problems.
    sample_runs: list[list[tuple[int, int]]] | None = None
    pass_k: list[int]
    train_run: str
    reference: ResolvedModel | None   # the reference model, when KL is asked for
    generation_key: str               # decides the generations (model, data, prompt, sampling, engine, shards)
    grade_key: str                    # generation_key + grading settings
    result_dir: str                   # this evaluation's folder (plan, inputs, samples, metrics)
    stage_dir: str                    # generations/grades/logprobs, shared by evaluations with the same generation_key
    pipeline_version: str = PIPELINE_VERSION
    grader_version: str = GRADER_VERSION
    round: int = 1                    # 2: an adaptive evaluation's second round (evaldag.request.second_round)
    eval_loss: bool = False           # the shards score the reference solutions (evaldag.pipeline.eval_loss)
    _inputs: pl.DataFrame | None = PrivateAttr(default=None)

    def path(self, name: str) -> UPath:
        """A file of this evaluation's folder in the result store."""
        return store.as_path(self.result_dir) / name

    def _stage(self, name: str, shard: int, ext: str = "parquet") -> UPath:
        return store.as_path(self.stage_dir) / f"{name}-{shard:04d}-of-{self.num_shards:04d}.{ext}"

    def generations_path(self, shard: int) -> UPath:
        return self._stage("generations", shard)

    def graded_path(self, shard: int) -> UPath:
        return self._stage(f"graded-{self.grade_key[:12]}", shard)

    def logprobs_path(self, shard: int) -> UPath:
        return self._stage(f"logprobs2-{self.reference.fingerprint[:12]}", shard)   # 2: with the exact KL column

    def stats_path(self, stage: str, shard: int) -> UPath:
        """Figures of one stage of one shard (wall time, tokens, memory), kept beside its output."""
        tag = {"generate": "generations", "grade": f"graded-{self.grade_key[:12]}"}.get(stage, stage)
        return self._stage(f"stats-{tag}", shard, "json")

    def cache_record_path(self, shard: int) -> UPath:
        """Which stages of this shard this evaluation computed and which it found done (cache hit rate)."""
        return self.path(f"shards/stages-{shard:04d}.json")

    def shard_sampling(self, shard: int) -> SamplingConfig:
        """The sampling of one shard: the plan's, with a seed of its own derived from (seed, shard). Engines seed
        each batch from the seed and the batch's index, so shards seeded alike would draw the same random
        streams for their first, second, ... batches."""
        digest = hashlib.sha256(f"{self.sampling.seed}:shard:{shard}".encode()).digest()
        return self.sampling.model_copy(update={"seed": int.from_bytes(digest[:8], "little") >> 2})

    def inputs(self) -> pl.DataFrame:
        """Every input row of the evaluation, read from the result store once per plan object (load_plan keeps one
        object per plan file and process, so a shard's flow and tasks read them once)."""
        if self._inputs is None:
            self._inputs = read_table(self.path("inputs.parquet"), INPUT_SCHEMA)
        return self._inputs

    def shard_runs(self, shard: int) -> list[tuple[int, int]]:
        """(first sample index, number of samples) of each problem of shard_inputs(shard), in its order."""
        if self.sample_runs is None:
            return [(0, self.sampling.n)] * len(self.shards[shard])
        return [(int(first), int(count)) for first, count in self.sample_runs[shard]]

    @property
    def progress_total(self) -> int:
        """Samples over all shards, what shard progress counts (one per problem at n = 1)."""
        return sum(count for shard in range(self.num_shards) for _, count in self.shard_runs(shard))

    @property
    def decide_settings(self) -> tuple[float, float, int] | None:
        """(alpha, margin, rounds) of the sequential verdict when the request asks for one (decide), else None."""
        r = self.request
        resolved = resolved_decide(r.decide, r.decide_alpha, r.decide_margin, r.decide_rounds)
        return None if resolved is None else resolved[1:]

    @property
    def progress_unit(self) -> str:
        """What progress counts, in words: samples, which are "problems" where each problem has one."""
        return "problems" if self.sample_runs is None and self.sampling.n == 1 else "samples"

    def sample_ids(self) -> list[str]:
        """Every problem of the evaluation once, in the order of the shards (a split problem is in several)."""
        return list(dict.fromkeys(sid for shard in self.shards for sid in shard))

    def shard_inputs(self, shard: int) -> pl.DataFrame:
        """The input rows of one shard, in the plan's order."""
        if not 0 <= shard < self.num_shards:
            raise ConfigError(f"shard index {shard} is outside 0..{self.num_shards - 1}")
        ids = self.shards[shard]
        order = pl.DataFrame({"sample_id": ids, "_pos": list(range(len(ids)))})
        return self.inputs().join(order, on="sample_id").sort("_pos").drop("_pos")


def compute_eval_key(parts: dict) -> str:
    """sha256 over the canonical JSON of everything that decides the output."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


def resolve(request: EvalRequest, results_root: str | PathLike | None = None, num_gpus: int = 1) -> EvalPlan:
    """Run the resolve stage: load config, model and data; write plan.json and inputs.parquet; return the plan.

    `num_gpus`: GPUs of the gpu pool (the `evaldag-gpus` limit); the default shard count fits the shards that can
    run at once, num_gpus // GPUs per shard."""
    bench = load_benchmark(request.benchmark)
    adaptive = request.adaptive
    sampling = (merge_sampling(bench.sampling, request.sampling) if adaptive is None
                else adaptive_rules.first_round_sampling(bench.sampling, request.sampling, adaptive))
    model = resolve_model(request.checkpoint)
    model = with_settings(with_engine(model, request.engine), request.engine_settings)
    data = load_benchmark_rows(bench, request.limit)
    if request.limit and request.limit > data.total_rows:
        raise ConfigError(f"limit {request.limit} is larger than {bench.name}'s {data.total_rows} problems")
    if adaptive is not None:
        adaptive_rules.check_request(adaptive, model.engine, request.sampling, data.inputs.height, request.decide,
                                   request.reference)
    per_shard = shard_gpus(model)       # 0 for a served model: its shards hold no gpu slot
    slots = max(1, num_gpus // per_shard if per_shard else num_gpus)
    split = splits_samples(model.engine, sampling.n)
    num_shards = shard_count(data.inputs.height, slots, request.num_shards, bench.num_shards, sampling.n, split)
    split = split and num_shards > 1
    shards, runs = (plan_split_shards(data.inputs, num_shards, sampling.n) if split
                    else (plan_shards(data.inputs, num_shards), None))
    pass_k = _pass_k(request.pass_k, bench.pass_k, sampling.n)
    reference = resolve_model(request.reference) if request.reference else None
    _check_reference(reference, model, request)
    eval_loss = _eval_loss(request, bench, model)
    generation_key = _generation_key(request, bench, data, model, sampling, shards, runs)
    grade_key = _grade_key(generation_key, bench, data)
    train_run = request.train_run or _default_train_run(request.checkpoint, model)
    decided = resolved_decide(request.decide, request.decide_alpha, request.decide_margin, request.decide_rounds)
    decide = {} if decided is None else {"decide": list(decided)}
    # answer groups for maj@k are made over all shards of a split problem at the reduce (before, per shard: wrong)
    regrouped = {} if runs is None else {"answer_groups": "across-shards"}
    adaptive_key = {} if adaptive is None else {"adaptive": adaptive.model_dump()}
    plugin_metrics = {"metrics": bench.metrics} if bench.metrics else {}    # metric plug-ins' figures are results
    loss_key = {"eval_loss": EVAL_LOSS_VERSION} if eval_loss else {}
    eval_key = compute_eval_key({
        **decide, **regrouped, **adaptive_key, **plugin_metrics, **loss_key,    # absent when not asked for: older
        # keys stay valid
        "grade": grade_key, "rewards": [r.model_dump() for r in bench.rewards], "pass_k": pass_k,
        "reference": reference.fingerprint if reference else None, "step": request.step, "train_run": train_run,
    })
    root = store.as_path(results_root) if results_root is not None else store.root()
    plan = EvalPlan(
        eval_key=eval_key, request=request, benchmark=bench, model=model, sampling=sampling,
        num_shards=len(shards), dataset_hash=data.dataset_hash, dataset_source=data.source,
        n_problems=data.inputs.height, shards=shards, sample_runs=runs, pass_k=pass_k, train_run=train_run,
        reference=reference, generation_key=generation_key, grade_key=grade_key, eval_loss=eval_loss,
        result_dir=str(root / bench.name / eval_key[:24]), stage_dir=str(root / bench.name / f"gen-{generation_key[:24]}"),
    )
    write_table(data.inputs, plan.path("inputs.parquet"), INPUT_SCHEMA)
    path = store.write_text(plan.path("plan.json"), plan.model_dump_json(indent=2))
    _remember((str(path), _identity(path)), plan)
    return plan


def _check_reference(reference: ResolvedModel | None, model: ResolvedModel, request: EvalRequest) -> None:
    """Refuse a reference model (KL) where it cannot be had: on a served model, or with stopping early."""
    if reference and "openai" in (model.engine, reference.engine):
        raise ConfigError("KL to a reference model needs log-probabilities of given completions, which engine "
                          "'openai' (a server's API) cannot give; evaluate with a reference on local weights with "
                          "engine=hf")
    if reference and request.decide:
        raise ConfigError("decide (stopping early) and a reference model (KL) cannot be combined: the KL estimate "
                          "scores every completion of the evaluation; drop `reference` or `decide`")


def _generation_key(request: EvalRequest, bench: BenchmarkConfig, data: LoadedBenchmark, model: ResolvedModel,
                    sampling: SamplingConfig, shards: list[list[str]], runs: list | None) -> str:
    """The key of everything that decides the generated rows."""
    split_key = {} if runs is None else {"sample_runs": runs}   # absent when not split: older keys stay valid
    if request.decide is not None and model.engine != "vllm":
        # a static-batch engine cuts its batches along the decision order (evaldag.pipeline.shard_runs), which changes
        # what each batch generates; vLLM seeds and schedules per request, whatever the order
        split_key["batches"] = "decision-order"
    generation_key = compute_eval_key({
        **split_key,
        "pipeline": PIPELINE_VERSION,
        "instruction": bench.instruction,
        "dataset_hash": data.dataset_hash,
        "sample_ids": data.inputs["sample_id"].to_list(),
        "model_fingerprint": model.fingerprint,
        # engine_args that only size memory or scheduling are left out (evaldag.request.keys.NOT_RESULT_SETTINGS)
        "engine": [model.engine, model.dtype, model.batch_size, result_engine_args(model.engine_args)],
        "sampling": sampling.model_dump(),
        "shards": shards,   # batch composition changes greedy outputs slightly, so it is part of the identity
    })
    return generation_key


def _grade_key(generation_key: str, bench: BenchmarkConfig, data: LoadedBenchmark) -> str:
    """The key of everything that decides the grades of those rows."""
    return compute_eval_key({
        "generation": generation_key, "grader": GRADER_VERSION, "gold_format": bench.gold_format,
        "strip_thinking": bench.strip_thinking,
        "timeout_s": bench.grading_timeout_s,   # a longer limit can turn timeouts into grades
        # the normalised golds themselves: grading reads them from this plan's inputs, so a gold-normalisation fix
        # regrades even where nobody bumped GRADER_VERSION
        "golds": compute_eval_key(data.inputs.select("sample_id", "gold").rows()),
    })


def _eval_loss(request: EvalRequest, bench: BenchmarkConfig, model: ResolvedModel) -> bool:
    """Whether the evaluation scores its reference solutions (evaldag.scoring.eval_loss): the request's eval_loss,
    else the benchmark's. Asked for explicitly, it is refused where it cannot be had (no solution column, an engine
    that cannot score given text); on by the benchmark's default, it is left out there instead."""
    asked = request.eval_loss
    if asked is False or (asked is None and not bench.eval_loss):
        return False
    if bench.fields.solution is None:
        raise ConfigError(f"eval_loss: benchmark {bench.name!r} has no reference solutions (fields.solution)")
    if model.engine == "openai":
        if asked:
            raise ConfigError("eval_loss scores the reference solutions' tokens, which engine 'openai' (a server's "
                              "API) cannot do; use engine vllm or hf, or eval_loss=false")
        return False
    return True


def _pass_k(requested: list[int] | None, configured: list[int] | None, n: int) -> list[int]:
    """The ks of pass@k/maj@k.

    Asked for in the request: as asked, each checked against n (a k > n is the user's mistake, named). From the
    benchmark config: those <= n, since one config serves runs with different n (as sampling_metrics skips larger
    ks). Otherwise, or when none fits: 1, 2, 4, ... up to n, and n itself."""
    if requested:
        bad = [k for k in requested if not 1 <= k <= n]
        if bad:
            raise ConfigError(f"pass_k {bad} must lie in 1..n where n={n} samples per problem; raise sampling.n "
                              "(with temperature > 0; with adaptive samples: adaptive.n0, the first round over "
                              "which pass@k is computed) or drop those ks")
        return sorted(set(requested))
    if any(k < 1 for k in configured or []):
        raise ConfigError(f"the benchmark config's pass_k {configured} holds ks below 1; each k must be >= 1")
    fitting = sorted({k for k in configured or [] if k <= n})
    if fitting:
        return fitting
    out, k = [], 1
    while k <= n:
        out.append(k)
        k *= 2
    return sorted(set(out) | {n})


def _default_train_run(checkpoint: str, model: ResolvedModel) -> str:
    """A checkpoint folder belongs to the run folder holding it (/ckpts/run-42/checkpoint-1200 -> run-42; verl's
    /ckpts/run-42/global_step_100/actor/huggingface -> run-42); a hub model to its repo (Qwen/Qwen2.5-Math-1.5B at
    any revision -> Qwen-Qwen2.5-Math-1.5B)."""
    from evaldag.request.layouts import step_folder
    from evaldag.request.rules import train_run_name

    if model.hub is not None:
        return train_run_name(model.name)
    folder = step_folder(Path(model.path))
    return train_run_name(folder.parent.name if checkpoint != model.name else model.name)


# Plans this process has read or written, newest last. The key holds the file's identity, not only its path: a test
# or a re-run may remove an evaluation's folder and resolve it again (mlflow_parent_run_id, for one, changes the plan
# but not its path).
_PLANS: OrderedDict[tuple[str, tuple], EvalPlan] = OrderedDict()
_PLANS_LOCK = threading.Lock()
_PLANS_KEPT = 64


def _identity(path: UPath) -> tuple:
    """What changes when a file at `path` is written again: size and modification time, or (where the store gives
    no modification time) a hash of the content."""
    st = path.stat()
    mtime = getattr(st, "st_mtime_ns", None) or getattr(st, "st_mtime", None)
    if mtime:
        return (st.st_size, mtime)
    return ("sha256", hashlib.sha256(path.read_bytes()).hexdigest())


def _remember(key: tuple[str, tuple], plan: EvalPlan) -> None:
    with _PLANS_LOCK:
        _PLANS[key] = plan
        _PLANS.move_to_end(key)
        while len(_PLANS) > _PLANS_KEPT:
            _PLANS.popitem(last=False)


def load_plan(path: str | PathLike) -> EvalPlan:
    """The plan in a plan.json written by `resolve` (a local path or a result store URL), read and validated once
    per process and file version."""
    path = store.as_path(path)
    if not path.is_file():
        raise ConfigError(f"plan {path} does not exist; was the resolve stage run with the same result store?")
    key = (str(path), _identity(path))
    with _PLANS_LOCK:
        plan = _PLANS.get(key)
    if plan is None:
        plan = EvalPlan.model_validate_json(path.read_text())
        _remember(key, plan)
    return plan
