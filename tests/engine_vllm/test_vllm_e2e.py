"""An evaluation on the vLLM engine through the real stack, all of it (servers and workers) running from .venv-vllm:
`prefect deployment run eval/gsm8k -p engine=vllm` must give the same kind of result as the transformers path."""

from __future__ import annotations

import time

import psutil
import pytest

pytest.importorskip("vllm", reason="the vLLM engine's tests run in .venv-vllm (make test-vllm)")

from mlflow import MlflowClient  # noqa: E402
from prefect.client.orchestration import get_client  # noqa: E402
from prefect.deployments import run_deployment  # noqa: E402

from evaldag.stack import STACK_ID_ENV  # noqa: E402
from evaldag.tracking import experiment_name, load_samples  # noqa: E402

pytestmark = [pytest.mark.stack, pytest.mark.model]


def _ours(p: psutil.Process, stack_id: str) -> bool:
    """Started by this stack: it or an ancestor (the flow-run process) carries the stack id. An engine process's own
    environment cannot tell: vLLM retitles it with setproctitle, which overwrites the memory /proc reads it from."""
    for q in (p, *p.parents()):
        try:
            if q.environ().get(STACK_ID_ENV) == stack_id:
                return True
        except psutil.Error:
            continue
    return False


def _vllm_processes(stack_id: str) -> set[int]:
    """Live vLLM engine processes (vLLM titles them VLLM::...) started by this stack's flow runs."""
    found = set()
    for p in psutil.process_iter(["name", "cmdline"]):
        try:
            if (any("VLLM" in part for part in [p.info["name"] or "", *(p.info["cmdline"] or [])])
                    and p.status() != psutil.STATUS_ZOMBIE and _ours(p, stack_id)):
                found.add(p.pid)
        except psutil.Error:
            continue
    return found


def test_eval_flow_on_the_vllm_engine(live_stack):
    stack_id = live_stack._load_state()["stack_id"]
    fr = run_deployment("eval/gsm8k", timeout=0, parameters={
        "limit": 4, "num_shards": 2, "step": 5, "train_run": "vllm-e2e", "engine": "vllm",
        "sampling": {"max_new_tokens": 24}})
    seen: set[int] = set()
    deadline = time.monotonic() + 900
    with get_client(sync_client=True) as client:
        while not (state := client.read_flow_run(fr.id).state).is_final():
            assert time.monotonic() < deadline, "the evaluation did not finish within 900 s"
            seen |= _vllm_processes(stack_id)    # the shards' engines, while they run
            time.sleep(0.5)
    assert state.is_completed(), state.message
    summary = state.result()
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
    assert seen, "no vLLM engine process of the shards was ever seen: the check below would prove nothing"
    assert not _vllm_processes(stack_id), "a vLLM engine process outlived its shard"
