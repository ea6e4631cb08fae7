"""Evaluations on the vLLM engine (the default engine of the gpu pool) through the real stack:
`prefect deployment run eval/gsm8k -p engine=vllm` must give the same kind of result as the transformers path."""

from __future__ import annotations

import time

import psutil
import pytest

from mlflow import MlflowClient
from prefect.deployments import run_deployment

from cluster_helpers import alive, children, flow_run_processes, progress_artifacts
from evaldag.tracking.names import experiment_name
from evaldag.tracking.samples import load_samples

pytestmark = [pytest.mark.stack, pytest.mark.model]


def _vllm_processes(stack) -> list[psutil.Process]:
    """vLLM engine processes under the stack's workers (their flow runs' children), alive or zombie."""
    found = []
    for row in stack.status():
        try:
            found += [p for p in psutil.Process(row.pid).children(recursive=True)
                      if p.name().startswith("VLLM::") or any("VLLM" in part for part in p.cmdline()[:1])]
        except psutil.Error:
            continue
    return found


def _assert_shards_left_nothing(stack, parent_id) -> None:
    """Every shard flow run's processes have exited (the engine lives in them: on a CPU host vLLM's core runs inside
    the shard's process, so a shard that does not exit keeps the engine, its KV cache and threads), and no vLLM
    engine process outlived its shard (hosts whose engine core is a process of its own: GPUs)."""
    shards = children(parent_id)
    assert shards and all(r.state.is_final() for r in shards)
    deadline = time.monotonic() + 30          # the worker reaps a finished run's process within moments
    while (procs := [p for r in shards for p in flow_run_processes(r.id) if alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not procs, f"shard processes still running after their runs ended: {procs}"
    assert not _vllm_processes(stack), "a vLLM engine process outlived its shard"


def test_eval_flow_on_the_vllm_engine(live_stack):
    """Sampled (n = 4) on two shards: vLLM seeds each sample alone, so the plan splits every problem's samples over
    both shards (evaldag.request.sharding.plan_split_shards); each shard holds 2 samples of each of the 4 problems, and the
    evaluation ends with every (problem, sample) once."""
    fr = run_deployment("eval/gsm8k", timeout=900, poll_interval=1, parameters={
        "limit": 4, "num_shards": 2, "step": 5, "train_run": "vllm-e2e", "engine": "vllm",
        "sampling": {"max_new_tokens": 24, "n": 4, "temperature": 1.0, "seed": 11}})
    assert fr.state.is_completed(), fr.state.message
    summary = fr.state.result()
    assert summary["metrics"]["n_samples"] == 16
    assert summary["metrics"]["generation_tokens_per_s"] > 0

    client = MlflowClient()
    exp = client.get_experiment_by_name(experiment_name("gsm8k"))
    [run] = client.search_runs([exp.experiment_id], filter_string="tags.train_run = 'vllm-e2e'")
    assert run.data.params["engine"] == "vllm"
    samples = load_samples(run.info.run_id)
    assert samples.height == 16 and samples.select("sample_id", "sample_index").is_unique().all()
    assert samples["sample_id"].n_unique() == 4 and set(samples["sample_index"]) == {0, 1, 2, 3}
    per_shard = samples.group_by("sample_id", "shard_index").len()
    assert per_shard.height == 8 and set(per_shard["len"]) == {2}, per_shard    # 2 samples per problem per shard
    assert samples["completion"].str.len_chars().min() > 0
    assert set(samples["finish_reason"]) <= {"stop", "length"}
    # progress counts samples, and says so: 8 per shard, 16 for the evaluation
    shard_texts = sorted(a.description.split(": ", 1)[1] for a in progress_artifacts([r.id for r in children(fr.id)]))
    assert [t.split(",")[0] for t in shard_texts] == ["8 of 8 samples"] * 2, shard_texts
    [whole] = progress_artifacts([fr.id])
    assert whole.description.startswith("evaluation of gsm8k: 16 of 16 samples"), whole.description
    _assert_shards_left_nothing(live_stack, fr.id)


def test_a_checkpoint_on_two_benchmarks_loads_the_engine_once(live_stack):
    """eval/suite (what a checkpoint event naming two benchmarks starts): one slot, so one shard flow run that loads
    the engine once and generates both benchmarks' prompts on it; each benchmark gets its own MLflow run."""
    fr = run_deployment("eval/suite", timeout=900, poll_interval=1, parameters={
        "benchmarks": ["gsm8k", "aime24"], "limit": 2, "step": 6, "train_run": "vllm-suite", "engine": "vllm",
        "sampling": {"max_new_tokens": 16}})
    assert fr.state.is_completed(), fr.state.message
    summaries = fr.state.result()["benchmarks"]
    assert set(summaries) == {"gsm8k", "aime24"}
    assert [s["metrics"]["n_samples"] for s in summaries.values()] == [2, 2]
    assert sum(s["metrics"]["engine_loads"] for s in summaries.values()) == 1
    shard_runs = [r for r in children(fr.id) if r.name.startswith("gsm8k+aime24-")]
    assert len(shard_runs) == 1 and shard_runs[0].state.is_completed()

    client = MlflowClient()
    for bench in ("gsm8k", "aime24"):
        exp = client.get_experiment_by_name(experiment_name(bench))
        [run] = client.search_runs([exp.experiment_id], filter_string="tags.train_run = 'vllm-suite'")
        assert run.data.params["engine"] == "vllm"
        assert load_samples(run.info.run_id).height == 2
    _assert_shards_left_nothing(live_stack, fr.id)
