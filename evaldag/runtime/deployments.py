"""The names under which evaldag's flows run on Prefect: flows, deployments, work pools; one place for all of them.

Prefect names a deployment `<flow name>/<deployment name>`. The flow names are the `@flow(name=...)` of flows/, which
import them from here; the deployment names are those of the one manifest, deployments/prefect.yaml, which has one
`eval/<benchmark>` per built-in benchmark config in configs/benchmarks/, and eval/suite, which evaluates any benchmarks
(a user folder's configs, config files) without a deployment of their own.
tests/test_deployments.py checks that the manifest and the configs agree with this module, so a renamed deployment
or a new benchmark that misses one of them fails a fast test instead of a flow run.
"""

from __future__ import annotations

from pathlib import Path

from evaldag import paths

MANIFEST: Path = paths.REPO_ROOT / "deployments" / "prefect.yaml"

# flow names (the first half of a deployment name)
EVAL_FLOW = "eval"
SHARD_FLOW = "eval-shard"
CHECKPOINT_FLOW = "on-checkpoint"
SWEEPER_FLOW = "eval-sweeper"
LATEST_FLOW = "eval-latest"
SELECT_FLOW = "eval-select"

# work pools: parent flows only orchestrate on `cpu`; shards generate and grade on `gpu`
CPU_POOL = "cpu"
GPU_POOL = "gpu"
POOLS = (CPU_POOL, GPU_POOL)

SUITE = "suite"                                  # eval/suite: one checkpoint on several benchmarks
SUITE_DEPLOYMENT = f"{EVAL_FLOW}/{SUITE}"
SHARD_DEPLOYMENT = f"{SHARD_FLOW}/{GPU_POOL}"    # one shard per flow run, on the gpu pool
CHECKPOINT_DEPLOYMENT = f"{CHECKPOINT_FLOW}/{CHECKPOINT_FLOW}"
SWEEPER_DEPLOYMENT = f"{SWEEPER_FLOW}/hourly"
LATEST_DEPLOYMENT = f"{LATEST_FLOW}/nightly"
SELECT_DEPLOYMENT = f"{SELECT_FLOW}/{SELECT_FLOW}"   # a job's best checkpoint (evaldag select)


def eval_deployment(benchmark: str) -> str:
    """The deployment that evaluates one benchmark: `eval/<benchmark>`."""
    return f"{EVAL_FLOW}/{benchmark}"


def builtin_benchmarks() -> list[str]:
    """The benchmarks shipped in configs/benchmarks/ of this repository: each has a deployment eval/<name>."""
    return sorted(p.stem for p in (paths.REPO_ROOT / "configs" / "benchmarks").glob("*.yaml"))


def evaluation_deployment(benchmarks: list[str]) -> str:
    """The deployment that evaluates `benchmarks` together: `eval/<b>` for one built-in benchmark, eval/suite for
    several and for any other benchmark (a user folder's config, a config file): eval/suite evaluates whatever
    benchmarks its `benchmarks` parameter names, so a new benchmark needs no deployment of its own."""
    one = len(benchmarks) == 1 and benchmarks[0] in builtin_benchmarks()
    return eval_deployment(benchmarks[0]) if one else SUITE_DEPLOYMENT


def benchmark_deployments() -> list[str]:
    """`eval/<b>` for every built-in benchmark config (configs/benchmarks/), the deployments `evaldag up` creates."""
    return [eval_deployment(b) for b in builtin_benchmarks()]


__all__ = ["MANIFEST", "EVAL_FLOW", "SHARD_FLOW", "CHECKPOINT_FLOW", "SWEEPER_FLOW", "LATEST_FLOW", "CPU_POOL",
           "GPU_POOL", "POOLS", "SUITE", "SUITE_DEPLOYMENT", "SHARD_DEPLOYMENT", "CHECKPOINT_DEPLOYMENT",
           "SWEEPER_DEPLOYMENT", "LATEST_DEPLOYMENT", "SELECT_FLOW", "SELECT_DEPLOYMENT", "eval_deployment",
           "evaluation_deployment",
           "benchmark_deployments", "builtin_benchmarks"]
