"""The deployment manifest, the benchmark configs and evaldag.runtime.deployments name the same deployments."""

from __future__ import annotations

import importlib

import yaml

from evaldag.runtime import deployments as d
from evaldag.request.config import available


def _manifest() -> list[dict]:
    return yaml.safe_load(d.MANIFEST.read_text())["deployments"]


def _flow_name(entrypoint: str) -> str:
    module, attr = entrypoint.split(":")
    return getattr(importlib.import_module(module.removesuffix(".py").replace("/", ".")), attr).name


def test_manifest_deploys_exactly_the_named_deployments():
    names = {f"{_flow_name(dep['entrypoint'])}/{dep['name']}" for dep in _manifest()}
    assert names == {*d.benchmark_deployments(), d.SUITE_DEPLOYMENT, d.SHARD_DEPLOYMENT, d.CHECKPOINT_DEPLOYMENT,
                     d.SWEEPER_DEPLOYMENT, d.LATEST_DEPLOYMENT, d.SELECT_DEPLOYMENT}


def test_one_eval_deployment_per_benchmark_config_on_the_pools_stack_creates():
    by_name = {dep["name"]: dep for dep in _manifest()}
    for benchmark in available("benchmarks"):
        assert by_name[benchmark]["parameters"] == {"benchmark": benchmark}
    assert {dep["work_pool"]["name"] for dep in _manifest()} == set(d.POOLS)
    assert by_name[d.SHARD_DEPLOYMENT.split("/")[1]]["work_pool"]["name"] == d.GPU_POOL


def test_evaluation_deployment():
    assert d.evaluation_deployment(["gsm8k"]) == "eval/gsm8k"
    assert d.evaluation_deployment(["gsm8k", "math500"]) == d.SUITE_DEPLOYMENT == "eval/suite"
    assert d.SHARD_DEPLOYMENT == "eval-shard/gpu"
