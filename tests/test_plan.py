"""Sharding and the eval_key: deterministic, balanced, and sensitive to everything that decides the output."""

from __future__ import annotations

import polars as pl
import pytest

from evaldag.engines import DEFAULT_ENGINE_ENV, default_engine
from evaldag.engines.dtype import DEFAULT_DTYPE_ENV
from evaldag.errors import ConfigError
from evaldag.request.checkpoint import resolve_model
from evaldag.request.plan import EvalRequest, compute_eval_key, resolve
from evaldag.request.sharding import MIN_SEQUENCES_PER_SHARD, plan_shards, plan_split_shards, shard_count


def _inputs(n: int) -> pl.DataFrame:
    return pl.DataFrame({"sample_id": [f"s{i}" for i in range(n)], "prompt": ["x" * ((i * 37) % 101) for i in range(n)]})


def test_shards_cover_every_sample_once():
    shards = plan_shards(_inputs(103), 4)
    flat = [s for shard in shards for s in shard]
    assert sorted(flat) == sorted(f"s{i}" for i in range(103))
    assert [len(s) for s in shards] == [26, 26, 26, 25]


def test_shards_are_deterministic_and_balanced_by_length():
    df = _inputs(200)
    assert plan_shards(df, 4) == plan_shards(df, 4)
    lengths = dict(zip(df["sample_id"], df["prompt"].str.len_chars()))
    totals = [sum(lengths[s] for s in shard) for shard in plan_shards(df, 4)]
    assert max(totals) - min(totals) <= max(lengths.values())


def test_more_shards_than_samples_drops_empty_ones():
    assert len(plan_shards(_inputs(3), 8)) == 3


def test_eval_key_changes_with_any_part():
    base = {"model": "abc", "sampling": {"temperature": 0.0}, "dataset": "h1"}
    key = compute_eval_key(base)
    assert compute_eval_key(dict(base)) == key
    assert compute_eval_key({**base, "model": "abd"}) != key
    assert compute_eval_key({**base, "sampling": {"temperature": 0.1}}) != key
    assert compute_eval_key({**base, "dataset": "h2"}) != key


@pytest.mark.parametrize("n, slots, expected", [
    (4, 1, 1),          # a quick slice on one slot: one shard, one start-up
    (4, 8, 1),          # ... and on many slots: smaller than the minimum shard
    (64, 1, 1),         # never more shards than slots (they would queue behind each other)
    (64, 4, 2),         # never fewer than MIN_SEQUENCES_PER_SHARD sequences a shard
    (500, 4, 4),
    (500, 64, 500 // MIN_SEQUENCES_PER_SHARD),
    (31, 2, 1),
])
def test_default_shard_count_fits_the_slots(n, slots, expected):
    assert shard_count(n, slots) == expected


def test_samples_per_problem_count_towards_the_shard_size():
    """AIME24 x 32 samples: 960 sequences, spread over every slot (one shard on one slot of 8 took ~4.5x the
    makespan in bench/bench_schedule.py), but never more shards than problems."""
    assert shard_count(30, 8) == 1
    assert shard_count(30, 8, samples_per_problem=32) == 8
    assert shard_count(4, 8, samples_per_problem=32) == 4
    assert shard_count(4, 8, samples_per_problem=4) == 1           # 16 sequences: one shard


def test_an_explicit_shard_count_is_honoured():
    assert shard_count(64, 1, requested=4) == 4              # the request's, even beyond the slots
    assert shard_count(64, 1, configured=3) == 3             # the benchmark config's
    assert shard_count(64, 1, requested=2, configured=3) == 2
    assert shard_count(3, 1, requested=8) == 3               # capped by the problems


def test_bad_slot_counts_are_refused():
    with pytest.raises(ConfigError, match="slots must be >= 1"):
        shard_count(10, 0)


def test_resolve_fits_a_slice_to_the_slots(tmp_path):
    one = resolve(EvalRequest(benchmark="gsm8k", limit=4), tmp_path, num_gpus=4)
    assert one.num_shards == 1
    two = resolve(EvalRequest(benchmark="gsm8k", limit=64), tmp_path, num_gpus=4)
    assert two.num_shards == 2 and sorted(len(s) for s in two.shards) == [32, 32]
    explicit = resolve(EvalRequest(benchmark="gsm8k", limit=4, num_shards=2), tmp_path, num_gpus=1)
    assert explicit.num_shards == 2


def _covered(shards, runs) -> list[tuple[str, int]]:
    return sorted((sid, first + k) for shard, rs in zip(shards, runs) for sid, (first, count) in zip(shard, rs)
                  for k in range(count))


def test_split_shards_hold_every_sample_once_and_a_share_of_every_problem():
    """AIME24-like: 30 problems x 32 samples on 8 shards: 4 samples of every problem on every shard."""
    df = _inputs(30)
    shards, runs = plan_split_shards(df, 8, 32)
    assert _covered(shards, runs) == sorted((sid, k) for sid in df["sample_id"] for k in range(32))
    assert all(sorted(shard) == sorted(df["sample_id"]) for shard in shards)
    assert {count for rs in runs for _, count in rs} == {4}
    # 10 samples over 4 shards: runs of 3, 3, 2, 2, rotated, so no shard gets every larger run
    shards, runs = plan_split_shards(df, 4, 10)
    assert _covered(shards, runs) == sorted((sid, k) for sid in df["sample_id"] for k in range(10))
    per_shard = [sum(c for _, c in rs) for rs in runs]
    assert sum(per_shard) == 300 and max(per_shard) - min(per_shard) <= 2, per_shard
    assert plan_split_shards(df, 4, 10) == (shards, runs)                      # deterministic


def test_sample_pieces_cut_each_run_into_near_equal_rounds_that_cover_it_once():
    """32 samples in 8 rounds of 4; a split shard's run of samples 4..7 in 4 rounds of 1; 10 samples in 5 rounds of
    2 (never more rounds than asked, never a piece of 0); with one round, piece k is problem k whole."""
    from evaldag.request.sharding import sample_pieces

    runs = [(0, 32), (4, 4), (0, 10), (7, 1)]
    pieces = sample_pieces(runs, 8)
    for i, (first, count) in enumerate(runs):
        mine = [(lo, c, r) for j, lo, c, r in pieces if j == i]
        assert [r for _, _, r in mine] == list(range(len(mine))) and len(mine) <= 8
        assert [k for lo, c, _ in mine for k in range(lo, lo + c)] == list(range(first, first + count))
    assert [c for j, _, c, _ in pieces if j == 0] == [4] * 8
    assert [c for j, _, c, _ in pieces if j == 1] == [1] * 4
    assert [c for j, _, c, _ in pieces if j == 2] == [2] * 5
    assert sample_pieces(runs, 1) == [(i, first, count, 0) for i, (first, count) in enumerate(runs)]
    with pytest.raises(ValueError, match="rounds"):
        sample_pieces(runs, 0)


def test_resolve_splits_samples_only_where_the_engine_seeds_each_sample(tmp_path):
    """vLLM with n > 1 on several slots: every problem's samples over the shards, so AIME24 x 32 fills 8 slots
    evenly; the transformers engine (one generator per prompt) and greedy n = 1 keep whole problems."""
    sampled = {"n": 32, "temperature": 0.6}
    split = resolve(EvalRequest(benchmark="aime24", engine="vllm", sampling=sampled), tmp_path, num_gpus=8)
    assert split.num_shards == 8 and split.sample_runs is not None
    assert all(len(split.shards[s]) == 30 and {c for _, c in split.shard_runs(s)} == {4} for s in range(8))
    assert _covered(split.shards, split.sample_runs) == sorted((sid, k) for sid in split.sample_ids()
                                                               for k in range(32))
    assert len(split.sample_ids()) == 30
    whole = resolve(EvalRequest(benchmark="aime24", engine="hf", sampling=sampled), tmp_path, num_gpus=8)
    assert whole.sample_runs is None and sorted(len(s) for s in whole.shards) == [3, 3, 4, 4, 4, 4, 4, 4]
    assert whole.shard_runs(0) == [(0, 32)] * len(whole.shards[0])
    greedy = resolve(EvalRequest(benchmark="gsm8k", limit=64, engine="vllm"), tmp_path, num_gpus=2)
    assert greedy.sample_runs is None and greedy.num_shards == 2
    # the split is part of what decides the generations
    assert split.generation_key != resolve(EvalRequest(benchmark="aime24", engine="vllm", sampling=sampled,
                                                       num_shards=1), tmp_path, num_gpus=8).generation_key


def test_vllm_is_the_default_engine(monkeypatch):
    monkeypatch.delenv(DEFAULT_ENGINE_ENV, raising=False)
    assert default_engine() == "vllm"
    assert resolve_model("smollm2-135m-instruct").engine == "vllm"
    monkeypatch.setenv(DEFAULT_ENGINE_ENV, "hf")
    assert resolve_model("smollm2-135m-instruct").engine == "hf"
    monkeypatch.setenv(DEFAULT_ENGINE_ENV, "tgi")
    with pytest.raises(ConfigError, match="EVALDAG_DEFAULT_ENGINE='tgi' is not an engine"):
        default_engine()


# ---- resolve(): what each real input changes among generation_key, grade_key and eval_key -------------------------

import json  # noqa: E402
import shutil  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import yaml  # noqa: E402

from conftest import complete_checkpoint  # noqa: E402
from evaldag import paths  # noqa: E402
from evaldag.request import plan as planmod  # noqa: E402

GEN, GRADE, EVAL = "generation_key", "grade_key", "eval_key"
ALL, GRADING, EVAL_ONLY, NOTHING = {GEN, GRADE, EVAL}, {GRADE, EVAL}, {EVAL}, set()


class KeyWorld:
    """A benchmark (aime24, its mirror copied), a checkpoint behind a model alias and a reference, all in tmp_path,
    each editable; `keys(**request)` resolves and returns the three keys."""

    def __init__(self, tmp: Path, monkeypatch):
        self.tmp, self.monkeypatch = tmp, monkeypatch
        self.configs = tmp / "configs"
        shutil.copytree(paths.REPO_ROOT / "configs", self.configs)
        self.data = tmp / "data"
        shutil.copytree(Path(paths.data_dir()) / "aime24", self.data / "aime24")
        monkeypatch.setenv("EVALDAG_CONFIGS_DIR", str(self.configs))
        monkeypatch.setenv("EVALDAG_DATA_DIR", str(self.data))
        self.ckpt = complete_checkpoint(tmp / "ckpts" / "checkpoint-100")
        self.reference = complete_checkpoint(tmp / "ref")
        (self.reference / "model.safetensors").write_bytes(b"r" * 64)
        self.alias = {"name": "tiny", "source": "path", "path": str(self.ckpt)}
        self.write_alias()
        self.request = {"benchmark": "aime24", "checkpoint": "tiny", "step": 100, "limit": 3, "num_shards": 1,
                        "train_run": "job", "sampling": {"n": 2, "temperature": 0.5}, "pass_k": [1, 2]}
        self.results = tmp / "results"

    def write_alias(self, **changes):
        self.alias.update(changes)
        (self.configs / "models" / "tiny.yaml").write_text(yaml.safe_dump(self.alias))

    def bench(self, edit):
        path = self.configs / "benchmarks" / "aime24.yaml"
        cfg = yaml.safe_load(path.read_text())
        edit(cfg)
        path.write_text(yaml.safe_dump(cfg))

    def mirror_row(self, i, edit):
        path = self.data / "aime24" / "test.jsonl"
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        edit(rows[i])
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))

    def keys(self, **changes) -> dict[str, str]:
        plan = resolve(EvalRequest(**{**self.request, **changes}), self.results)
        return {GEN: plan.generation_key, GRADE: plan.grade_key, EVAL: plan.eval_key}


def _sampling(w, **field):
    return {"sampling": {**w.request["sampling"], **field}}


def _set_gold(w):
    from evaldag.request import datasets
    from evaldag.scoring import gold

    real = gold.normalize_gold
    w.monkeypatch.setattr(datasets, "normalize_gold", lambda raw, fmt: "0" if raw == "204" else real(raw, fmt))


def _copy_elsewhere(w):
    other = w.tmp / "elsewhere" / "renamed"
    shutil.copytree(w.ckpt, other)
    w.write_alias(path=str(other))


# (what changes, how: a function of the world that edits files/settings and returns request changes, which keys move)
CASES = [
    ("weights", lambda w: (w.ckpt / "model.safetensors").write_bytes(b"x" * 64), ALL),
    ("model config", lambda w: (w.ckpt / "config.json").write_text('{"model_type": "llama", "x": 1}'), ALL),
    ("generation config", lambda w: (w.ckpt / "generation_config.json").write_text('{"top_k": 5}'), ALL),
    ("tokenizer", lambda w: (w.ckpt / "tokenizer.json").write_text('{"v": 2}'), ALL),
    ("chat template", lambda w: (w.ckpt / "chat_template.jinja").write_text("{{ messages }}"), ALL),
    ("dataset content (a row outside the slice)", lambda w: w.mirror_row(10, lambda r: r.update(answer="1")), ALL),
    ("selected ids", lambda w: {"limit": 4}, ALL),
    ("instruction", lambda w: w.bench(lambda c: c.update(instruction="Solve: {problem}")), ALL),
    ("sampling.n", lambda w: _sampling(w, n=3), ALL),
    ("sampling.temperature", lambda w: _sampling(w, temperature=0.6), ALL),
    ("sampling.top_p", lambda w: _sampling(w, top_p=0.9), ALL),
    ("sampling.max_new_tokens", lambda w: _sampling(w, max_new_tokens=100), ALL),
    ("sampling.seed", lambda w: _sampling(w, seed=1), ALL),
    ("engine", lambda w: {"engine": "vllm"}, ALL),
    ("engine_args", lambda w: w.write_alias(engine_args={"cache_implementation": "dynamic"}), ALL),
    ("batch size", lambda w: w.write_alias(batch_size=8), ALL),
    ("dtype", lambda w: w.write_alias(dtype="float16"), ALL),        # float16 is never the host default
    ("default dtype", lambda w: w.monkeypatch.setenv(DEFAULT_DTYPE_ENV, "float16"), ALL),
    ("shards", lambda w: {"num_shards": 2}, ALL),
    ("pipeline version", lambda w: w.monkeypatch.setattr(planmod, "PIPELINE_VERSION", "next"), ALL),
    ("grader version", lambda w: w.monkeypatch.setattr(planmod, "GRADER_VERSION", "next"), GRADING),
    ("gold format", lambda w: w.bench(lambda c: c.update(gold_format="number")), GRADING),
    ("normalised gold", _set_gold, GRADING),
    ("grading timeout", lambda w: w.bench(lambda c: c.update(grading_timeout_s=30)), GRADING),
    ("strip_thinking", lambda w: w.bench(lambda c: c.update(strip_thinking=True)), GRADING),
    ("rewards", lambda w: w.bench(lambda c: c.update(rewards=[{"name": "correctness"}, {"name": "format"}])),
     EVAL_ONLY),
    ("pass_k", lambda w: {"pass_k": [2]}, EVAL_ONLY),
    ("reference", lambda w: {"reference": str(w.reference)}, EVAL_ONLY),
    ("step", lambda w: {"step": 200}, EVAL_ONLY),
    ("train_run", lambda w: {"train_run": "other-job"}, EVAL_ONLY),
    ("optimizer state", lambda w: (w.ckpt / "optimizer.pt").write_bytes(b"adam" * 100), NOTHING),
    ("trainer state", lambda w: (w.ckpt / "trainer_state.json").write_text('{"global_step": 100}'), NOTHING),
    ("checkpoint README", lambda w: (w.ckpt / "README.md").write_text("notes"), NOTHING),
    ("same checkpoint, other folder", _copy_elsewhere, NOTHING),
    ("unmapped dataset column", lambda w: w.mirror_row(0, lambda r: r.update(url="https://x")), NOTHING),
    ("benchmark description", lambda w: w.bench(lambda c: c.update(description="new words")), NOTHING),
    ("parent MLflow run", lambda w: {"mlflow_parent_run_id": "abc123"}, NOTHING),
    ("result store", lambda w: setattr(w, "results", w.tmp / "other-results"), NOTHING),
]


@pytest.mark.parametrize("change, expected", [(c[1], c[2]) for c in CASES], ids=[c[0] for c in CASES])
def test_what_each_input_changes(tmp_path, monkeypatch, change, expected):
    world = KeyWorld(tmp_path, monkeypatch)
    before = world.keys()
    assert world.keys() == before                                  # deterministic
    made = change(world)
    after = world.keys(**(made if isinstance(made, dict) else {}))
    changed = {k for k in before if before[k] != after[k]}
    assert changed == expected, f"changed {sorted(changed)}, expected {sorted(expected)}"


def test_kl_is_exact_whatever_engine_generated(tmp_path, monkeypatch):
    """The score stage runs both models on transformers (the exact per-position KL needs the logits, not the
    generator), so a reference is accepted for vLLM-generated completions under any decoding."""
    world = KeyWorld(tmp_path, monkeypatch)
    greedy = world.keys(engine="vllm", reference=str(world.reference))
    assert greedy != world.keys(engine="vllm", reference=str(world.reference), sampling={"n": 2, "temperature": 1.0})
    world.keys(reference=str(world.reference))


def test_benchmark_pass_k_above_n_is_skipped_like_the_metrics_do(tmp_path, monkeypatch):
    """A benchmark config lists ks for several n (sampling_metrics skips k > n); a run with fewer samples uses
    the ks that fit. An explicit request for k > n is still an error naming it."""
    from evaldag.errors import ConfigError

    world = KeyWorld(tmp_path, monkeypatch)
    world.bench(lambda c: c.update(pass_k=[1, 2, 8]))
    plan = resolve(EvalRequest(**{**world.request, "pass_k": None}), world.results)      # n = 2
    assert plan.pass_k == [1, 2]
    plan = resolve(EvalRequest(**{**world.request, "pass_k": None, "sampling": None}), world.results)   # greedy
    assert plan.pass_k == [1]
    with pytest.raises(ConfigError, match=r"pass_k \[8\] must lie in 1..n"):
        resolve(EvalRequest(**{**world.request, "pass_k": [1, 8]}), world.results)


def test_a_plan_is_read_once_per_process_and_again_when_rewritten(tmp_path, monkeypatch):
    """load_plan keeps what it read (plans never change once written), keyed by the file's identity: a plan
    written again at the same path (same eval_key, another MLflow parent run) is read again."""
    from evaldag.request.checkpoint import ResolvedModel
    from evaldag.request.plan import EvalPlan, load_plan

    world = KeyWorld(tmp_path, monkeypatch)
    plan = resolve(EvalRequest(**world.request), world.results)
    path = plan.path("plan.json")
    assert isinstance(plan.model, ResolvedModel)
    assert load_plan(path) is plan                                         # resolve's own plan, not re-read
    reads = []
    real = EvalPlan.model_validate_json
    monkeypatch.setattr(EvalPlan, "model_validate_json", lambda text: reads.append(1) or real(text))
    planmod._PLANS.clear()
    first = load_plan(path)
    assert load_plan(str(path)) is first and len(reads) == 1
    assert isinstance(first.model, ResolvedModel) and first.model == plan.model
    again = resolve(EvalRequest(**world.request, mlflow_parent_run_id="parent42"), world.results)
    assert again.path("plan.json") == path
    assert load_plan(path).request.mlflow_parent_run_id == "parent42"
