"""An evaluation on the vLLM engine through the real stack, all of it (servers and workers) running from .venv-vllm:
`prefect deployment run eval/gsm8k -p engine=vllm` must give the same kind of result as the transformers path."""

from __future__ import annotations

import psutil
import pytest

pytest.importorskip("vllm", reason="the vLLM engine's tests run in .venv-vllm (make test-vllm)")

from mlflow import MlflowClient  # noqa: E402
from prefect.deployments import run_deployment  # noqa: E402

from evaldag.tracking import experiment_name, load_samples  # noqa: E402

pytestmark = [pytest.mark.stack, pytest.mark.model]


def _vllm_processes() -> list[psutil.Process]:
    found = []
    for p in psutil.process_iter(["name", "cmdline"]):
        try:
            if (p.info["name"] or "").startswith("VLLM::"):
                found.append(p)
        except psutil.Error:
            continue
    return found


def test_eval_flow_on_the_vllm_engine(live_stack):
    fr = run_deployment("eval/gsm8k", timeout=900, parameters={
        "limit": 4, "num_shards": 2, "step": 5, "train_run": "vllm-e2e", "engine": "vllm",
        "sampling": {"max_new_tokens": 24}})
    assert fr.state.is_completed(), fr.state.message
    summary = fr.state.result()
    assert summary["metrics"]["n_samples"] == 4
    assert summary["metrics"]["generation_tokens_per_s"] > 0

    client = MlflowClient()
    exp = client.get_experiment_by_name(experiment_name("gsm8k"))
    [run] = client.search_runs([exp.experiment_id], filter_string="tags.train_run = 'vllm-e2e'")
    assert run.data.params["engine"] == "vllm"
    samples = load_samples(run.info.run_id)
    assert samples.height == 4 and samples["sample_id"].n_unique() == 4
    assert samples["completion"].str.len_chars().min() > 0
    assert set(samples["finish_reason"]) <= {"stop", "length"}
    assert not _vllm_processes(), "a vLLM engine process outlived its shard"
