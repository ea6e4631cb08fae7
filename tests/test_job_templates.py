"""The production work-pool templates in deployments/: consistent, accepted by Prefect's own validators, GPUs templated.

The server's base-job-template validation (every placeholder declared) and its JSON-schema checks of the variable
defaults, then Prefect's templating; then the workers' own job configuration classes (prefect-kubernetes,
prefect-docker) must accept the rendered templates. `make setup` installs those two packages beside the environment
(WORKERS; inside it, Prefect would import them at every flow run's start, see pyproject.toml). A missing worker
package fails the test: a skipped check would let a broken template through CI.
"""

from __future__ import annotations

import asyncio
import copy
import importlib
import json
import re
import sys
import tomllib
from pathlib import Path

import pytest
from prefect.server.schemas.actions import WorkPoolCreate
from prefect.utilities.schema_tools import is_valid_schema, validate
from prefect.utilities.templating import apply_values, find_placeholders

from evaldag.runtime.cluster import MIN_HEARTBEAT_S

DEPLOYMENTS = Path(__file__).resolve().parent.parent / "deployments"
K8S = DEPLOYMENTS / "k8s-gpu-pool.json"
DOCKER = DEPLOYMENTS / "docker-gpu-pool.json"
EVALDAG_ENV = {"EVALDAG_RESULTS_URL", "MLFLOW_TRACKING_URI", "EVALDAG_HOME", "HF_HOME"}
WORKERS = Path(sys.prefix) / "opt" / "prefect-workers"
# the lost-run automation crashes a run silent for 3 periods of evaldag's heartbeat (docs/production.md): a shard pod
# or container on Prefect's default period (180 s) would be crashed while it runs
HEARTBEAT = "PREFECT_FLOWS_HEARTBEAT_FREQUENCY"


def _load(path: Path) -> dict:
    return json.loads(path.read_text())


def _defaults(template: dict) -> dict:
    return {k: v["default"] for k, v in template["variables"]["properties"].items() if v.get("default") is not None}


def _render(template: dict, **values) -> dict:
    """The job configuration as a worker renders it: variable defaults, overridden by `values`."""
    return apply_values(copy.deepcopy(template["job_configuration"]), {**_defaults(template), **values})


def _container(rendered: dict) -> dict:
    return rendered["job_manifest"]["spec"]["template"]["spec"]["containers"][0]


@pytest.mark.parametrize("path", [K8S, DOCKER], ids=["kubernetes", "docker"])
def test_template_is_valid_for_the_server(path):
    template = _load(path)
    assert set(template) == {"job_configuration", "variables"}
    used = {p.name for p in find_placeholders(json.dumps(template["job_configuration"]))}
    declared = set(template["variables"]["properties"])
    assert used <= declared, f"undeclared variables: {used - declared}"
    # docker: job_configuration.env is a mapping, and Prefect merges the `env` variable into it (no placeholder)
    unused = declared - used
    assert unused <= ({"env"} if isinstance(template["job_configuration"]["env"], dict) else set()), unused
    # what the Prefect server runs on `prefect work-pool create --base-job-template FILE`
    WorkPoolCreate(name="gpu", type="kubernetes" if path == K8S else "docker", base_job_template=template)
    is_valid_schema(template["variables"], preprocess=False)
    assert validate(_defaults(template), template["variables"], raise_on_error=True, ignore_required=True) == []
    assert "gpus_per_shard" in declared and template["variables"]["properties"]["gpus_per_shard"]["default"] == 1


def test_kubernetes_template():
    template = _load(K8S)
    c = _container(template["job_configuration"])
    assert c["resources"]["limits"]["nvidia.com/gpu"] == "{{ gpus_per_shard }}"
    rendered = _render(template, gpus_per_shard=4, results_url="s3://b/evaldag")
    c = _container(rendered)
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 4 and c["resources"]["requests"]["nvidia.com/gpu"] == 4
    env = {e["name"]: e["value"] for e in c["env"]}
    assert EVALDAG_ENV <= set(env) and env["EVALDAG_RESULTS_URL"] == "s3://b/evaldag"
    assert env[HEARTBEAT] == str(MIN_HEARTBEAT_S)
    assert c["envFrom"][0]["secretRef"]["name"] == "evaldag-results"
    pod = rendered["job_manifest"]["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    assert volumes[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory"
    assert "persistentVolumeClaim" in volumes[mounts["/cache"]] and env["HF_HOME"].startswith("/cache/")
    assert pod["nodeSelector"] and pod["tolerations"][0]["key"] == "nvidia.com/gpu"
    # the parts of prefect-kubernetes' default template that its worker relies on are still there
    c = _container(template["job_configuration"])
    assert c["name"] == "prefect-job" and c["args"] == "{{ command }}" and c["image"] == "{{ image }}"
    assert template["job_configuration"]["env"] == "{{ env }}"


def test_docker_template():
    template = _load(DOCKER)
    kwargs = template["job_configuration"]["container_create_kwargs"]
    assert kwargs["device_requests"][0]["count"] == "{{ gpus_per_shard }}"
    rendered = _render(template, gpus_per_shard=2)
    request = rendered["container_create_kwargs"]["device_requests"][0]
    assert request == {"driver": "nvidia", "count": 2, "capabilities": [["gpu"]]}
    assert rendered["container_create_kwargs"]["shm_size"]
    assert EVALDAG_ENV <= set(rendered["env"]) and rendered["env"][HEARTBEAT] == str(MIN_HEARTBEAT_S)
    assert any(v.endswith(":/cache") for v in rendered["volumes"])


@pytest.mark.parametrize(("path", "module", "cls"), [
    (K8S, "prefect_kubernetes.worker", "KubernetesWorkerJobConfiguration"),
    (DOCKER, "prefect_docker.worker", "DockerWorkerJobConfiguration"),
], ids=["kubernetes", "docker"])
def test_worker_accepts_template(path, module, cls, monkeypatch):
    monkeypatch.syspath_prepend(str(WORKERS))
    try:
        worker = importlib.import_module(module)
    except ImportError as e:
        pytest.fail(f"{module} cannot be imported ({e}): the pool templates are checked against the worker's "
                    f"own job configuration; `make setup` installs it into {WORKERS}")
    config_cls = getattr(worker, cls)
    template = _load(path)
    # the worker's own default template: ours keeps all its variables (docker: container_create_kwargs is ours now)
    default = (worker.KubernetesWorker if "kubernetes" in module else worker.DockerWorker).get_default_base_job_template()
    missing = set(default["variables"]["properties"]) - set(template["variables"]["properties"])
    assert missing <= {"container_create_kwargs"}, missing
    config = asyncio.run(config_cls.from_template_and_values(template, {"gpus_per_shard": 2, "env": {"X": "1"}},
                                                             client=object()))  # no block/variable references
    if "kubernetes" in module:
        c = config.job_manifest["spec"]["template"]["spec"]["containers"][0]
        assert c["resources"]["limits"]["nvidia.com/gpu"] == 2
        assert config.env == {"X": "1"}
        assert {"name": HEARTBEAT, "value": str(MIN_HEARTBEAT_S)} in c["env"]
    else:
        assert config.container_create_kwargs["device_requests"][0]["count"] == 2
        assert config.env["X"] == "1" and EVALDAG_ENV <= set(config.env)  # Prefect merges env over the template's
        assert config.env[HEARTBEAT] == str(MIN_HEARTBEAT_S)


def test_dockerfile_matches_templates():
    text = (DEPLOYMENTS / "Dockerfile").read_text()
    assert "/opt/evaldag" in text  # where the templates' docs say the repository lives (EVALDAG_REPO when deploying)
    for path in (K8S, DOCKER):
        assert "/opt/evaldag" in _load(path)["variables"]["properties"]["image"]["description"]


def test_dockerfile_installs_what_the_templates_use():
    """The image's evaldag install: with the tested versions (constraints.txt) and the extra of the templates'
    default result store (s3:// needs s3fs, the `s3` extra); every `make` target it names exists."""
    text = (DEPLOYMENTS / "Dockerfile").read_text()
    [install] = re.findall(r'pip install (-c constraints\.txt )?-e "?\.(\[[a-z0-9,-]+\])?"?', text)
    assert install[0], "evaldag goes in with -c constraints.txt, as `make setup` does"
    extras = set(install[1].strip("[]").split(",")) if install[1] else set()
    assert re.search(r"^COPY .*constraints\.txt", text, re.M)
    project = tomllib.loads((DEPLOYMENTS.parent / "pyproject.toml").read_text())["project"]
    for path in (K8S, DOCKER):
        scheme = _defaults(_load(path))["results_url"].split("://")[0]
        assert scheme == "s3" and "s3" in extras, (path.name, scheme, extras)
    assert any(r.startswith("s3fs") for r in project["optional-dependencies"]["s3"])
    targets = set(re.findall(r"^([a-zA-Z][\w-]*):", (DEPLOYMENTS.parent / "Makefile").read_text(), re.M))
    named = set(re.findall(r"`make ([\w-]+)`", text))
    assert named <= targets, f"the Dockerfile names make targets that do not exist: {named - targets}"


def test_no_prefect_collection_is_installed_in_the_environment():
    """Prefect imports every installed collection at the start of every flow run (prefect-kubernetes and
    prefect-docker took ~1.4 s per process here): the workers' packages stay in WORKERS, outside the environment."""
    from importlib.metadata import entry_points

    assert [ep.name for ep in entry_points(group="prefect.collections")] == [], \
        f"install Prefect worker packages with `pip install --target {WORKERS}`, not into the environment"
