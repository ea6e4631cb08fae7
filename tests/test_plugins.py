"""Plug-ins (evaldag.scoring.plugins): the example package under examples/ installed with pip, its reward and
statistic named by a benchmark config and seen in the evaluation's metrics and its MLflow run (a local SQLite store);
bad plug-ins fail when the config is read, before generation, naming the plug-in. Only installed entry points are
plug-ins: a config or a plan.json (data in a store every node writes) that names a module runs nothing."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import polars as pl
import pydantic
import re
import pytest
import yaml

from conftest import complete_checkpoint
from index_engine import ByIndexEngine
from plugin_dist import install
from evaldag import engines
from evaldag.pipeline import generate
from evaldag.errors import ConfigError
from evaldag.request.config import load_benchmark
from evaldag.scoring import plugins
from evaldag.scoring.plugins import PluginError, plugin_metrics
from evaldag.scoring.rewards import RewardSpec, reward_metrics

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "evaldag-plugin-example"


@pytest.fixture(scope="module")
def example_site(tmp_path_factory) -> Path:
    """The example package installed by pip into a folder of its own (a copy is built: the build's leftovers stay
    out of the tree)."""
    src = tmp_path_factory.mktemp("src") / "pkg"
    shutil.copytree(EXAMPLE, src)
    site = tmp_path_factory.mktemp("site")
    done = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                           "--no-index", "--target", str(site), str(src)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return site


@pytest.fixture
def installed(example_site, monkeypatch):
    """The installed example on sys.path (its entry points then visible) for one test."""
    monkeypatch.syspath_prepend(str(example_site))
    yield example_site
    sys.modules.pop("evaldag_plugin_example", None)


TEAM_STATS = (
    "import polars as pl\n"
    "def rows(graded):\n    return {'team/rows': graded.height}\n"
    "def rows_again(graded):\n    return {'team/rows': 0}\n"
    "def clash(graded):\n    return {'accuracy': 1.0}\n"
    "def raises(graded):\n    raise KeyError('no_such_column')\n"
    "def no_args():\n    return {}\n"
    "def text(graded):\n    return {'team/x': 'high'}\n"
    "def infinite(graded):\n    return {'team/ratio': float('inf')}\n"
    "def undefined(graded):\n    return {'team/ratio': float('nan')}\n"
    "def wrong_column():\n    return pl.col('no_such_column').cast(pl.Float64)\n"
    "def not_an_expr():\n    return 1.0\n")


@pytest.fixture
def a_module(tmp_path, monkeypatch):
    """A distribution `team-stats` installed on sys.path: module `team_stats` with good and bad plug-ins, each
    registered as an entry point of its own name."""
    metrics = ["rows", "rows_again", "clash", "raises", "no_args", "text", "infinite", "undefined"]
    site = install(tmp_path / "site", "team-stats", {
        plugins.METRICS_GROUP: {name: f"team_stats:{name}" for name in metrics} | {
            "broken": "no_such_team_pkg.stats:rows"},
        plugins.REWARDS_GROUP: {name: f"team_stats:{name}" for name in ["wrong_column", "not_an_expr"]}},
        {"team_stats": TEAM_STATS})
    monkeypatch.syspath_prepend(str(site))
    yield site
    sys.modules.pop("team_stats", None)


class RightEngine(ByIndexEngine):
    def answer(self, prompt: str, index: int) -> str:
        return str(type(self).gold[prompt])


def test_the_installed_examples_metric_and_reward_reach_mlflow(installed, configs, sqlite_mlflow, tmp_path,
                                                               monkeypatch):
    from mlflow import MlflowClient

    from evaldag.pipeline.generate import generate_shard
    from evaldag.pipeline.grade import grade_shard
    from evaldag.pipeline.reduce import reduce_results
    from evaldag.request.plan import EvalRequest, resolve
    from evaldag.tracking.write import track

    assert "boxed_share" in plugins.installed(plugins.METRICS_GROUP)
    assert "brevity" in plugins.installed(plugins.REWARDS_GROUP)
    bench = configs / "benchmarks" / "aime24.yaml"
    config = yaml.safe_load(bench.read_text())
    config["rewards"] = [{"name": "correctness"}, {"name": "brevity", "weight": 0.1, "params": {"target_tokens": 1}}]
    config["metrics"] = ["boxed_share"]
    bench.write_text(yaml.safe_dump(config))
    monkeypatch.setattr(engines, "load_engine", lambda *a, **k: RightEngine())
    monkeypatch.setattr(generate, "workload", lambda shard: None)
    ckpt = complete_checkpoint(tmp_path / "ckpt")
    plan = resolve(EvalRequest(benchmark="aime24", checkpoint=str(ckpt), limit=3, num_shards=1, engine="vllm"),
                   tmp_path / "results")
    RightEngine.learn(plan)
    generate_shard(plan, 0)
    metrics = reduce_results(plan, [grade_shard(plan, 0, workers=0)])
    assert metrics["boxed_share"] == 1.0 and "boxed_share/wrong" not in metrics     # every answer right and boxed
    assert metrics["reward/brevity/mean"] == pytest.approx(0.0)      # 2 tokens each, twice the target of 1
    run = track(plan, metrics)
    logged = MlflowClient().get_run(run.run_id).data.metrics
    assert logged["boxed_share"] == 1.0 and logged["reward/brevity/mean"] == pytest.approx(0.0)


def test_a_metric_plugin_in_the_config_changes_the_eval_key(installed, configs, tmp_path):
    from evaldag.request.plan import EvalRequest, resolve

    ckpt = complete_checkpoint(tmp_path / "ckpt")
    request = EvalRequest(benchmark="aime24", checkpoint=str(ckpt), limit=2, num_shards=1)
    before = resolve(request, tmp_path / "a").eval_key
    bench = configs / "benchmarks" / "aime24.yaml"
    bench.write_text(bench.read_text() + "\nmetrics: [boxed_share]\n")
    after = resolve(request, tmp_path / "b")
    assert after.eval_key != before and after.generation_key == resolve(request, tmp_path / "c").generation_key


def test_an_entry_point_that_is_not_installed_fails_the_config_naming_it(configs):
    bench = configs / "benchmarks" / "aime24.yaml"
    bench.write_text(bench.read_text() + "\nmetrics: [boxed_share]\n")
    with pytest.raises(Exception, match=r"unknown metric 'boxed_share'.*evaldag\.metrics"):
        load_benchmark("aime24")
    with pytest.raises(pydantic.ValidationError, match=r"unknown reward 'brevity'.*entry point of group "
                                                       r"'evaldag.rewards' \(installed: \[\]\)"):
        RewardSpec(name="brevity")


def test_an_import_error_names_the_plugin(a_module, configs):
    bench = configs / "benchmarks" / "aime24.yaml"
    bench.write_text(bench.read_text() + "\nmetrics: [broken]\n")
    with pytest.raises(Exception, match=r"metric plug-in 'broken' \(entry point 'no_such_team_pkg.stats:rows'\) "
                                        r"cannot be loaded: ModuleNotFoundError"):
        load_benchmark("aime24")


def test_a_wrong_signature_fails_before_generation(a_module, configs):
    with pytest.raises(PluginError, match=r"'no_args' must take one argument"):
        plugins.check_metric("no_args")
    with pytest.raises(pydantic.ValidationError, match=r"reward 'wrong_column': bad params"):
        RewardSpec(name="wrong_column", params={"x": 1})
    # a reward's expression is tried on one row where the config is loaded (before generation), not in validation
    bench = configs / "benchmarks" / "aime24.yaml"
    for name, error in [("wrong_column", r"reward 'wrong_column' failed .*no_such_column"),
                        ("not_an_expr", r"reward 'not_an_expr' returned a float")]:
        RewardSpec(name=name)
        config = yaml.safe_load(bench.read_text()) | {"rewards": [{"name": name}]}
        bench.write_text(yaml.safe_dump(config))
        with pytest.raises(ConfigError, match=rf"{bench}: {error}"):
            load_benchmark("aime24")


def test_metric_plugins_at_the_reduce(a_module):
    graded = pl.DataFrame({"correct": [True, False], "completion": ["a", "b"]})
    assert plugin_metrics(graded, ["rows"], taken={"accuracy"}) == {"team/rows": 2.0}
    with pytest.raises(PluginError, match=r"'raises' failed on the graded table \(2 rows\): KeyError"):
        plugin_metrics(graded, ["raises"], taken=set())
    with pytest.raises(PluginError, match=r"'clash' returned 'accuracy', a metric evaldag"):
        plugin_metrics(graded, ["clash"], taken={"accuracy"})
    with pytest.raises(PluginError, match=r"'text' returned 'team/x' = 'high', not a number"):
        plugin_metrics(graded, ["text"], taken=set())


def test_two_plugins_returning_one_name_clash(a_module):
    graded = pl.DataFrame({"correct": [True, False]})
    with pytest.raises(PluginError, match=r"'rows_again' returned 'team/rows', a metric evaldag or another plug-in"):
        plugin_metrics(graded, ["rows", "rows_again"], taken={"accuracy"})


@pytest.mark.parametrize("name, shown", [("infinite", "inf"), ("undefined", "nan")])
def test_a_plugin_metric_that_is_not_finite_is_refused(a_module, name, shown):
    with pytest.raises(PluginError, match=rf"'{name}' returned 'team/ratio' = {shown}; leave an undefined figure"):
        plugin_metrics(pl.DataFrame({"correct": [True]}), [name], taken=set())


def test_a_name_two_packages_register_differently_is_refused(a_module, tmp_path, monkeypatch):
    other = install(tmp_path / "other", "other-stats", {plugins.METRICS_GROUP: {"rows": "other_stats:rows"}},
                    {"other_stats": "def rows(graded):\n    return {'other/rows': 0}\n"})
    monkeypatch.syspath_prepend(str(other))
    with pytest.raises(PluginError, match=r"'rows': several packages register it in 'evaldag.metrics' "
                                          r"\(\['other_stats:rows', 'team_stats:rows'\]\); uninstall all but one"):
        plugins.check_metric("rows")


def test_a_reward_failing_on_the_rows_is_named_at_the_reduce(a_module):
    spec = [{"name": "correctness"}, {"name": "wrong_column"}]
    with pytest.raises(ValueError, match=r"reward 'wrong_column' failed"):
        reward_metrics(pl.DataFrame({"correct": [True]}), [RewardSpec.model_construct(**s) for s in spec])


def test_a_plan_naming_a_function_runs_nothing(tmp_path, monkeypatch):
    """Issue 51: a plan.json naming `os:system` as its reward wrote pwned.txt while it was validated; a metric
    naming a module imported it. Now both are refused as data, naming the entry point group, and nothing runs."""
    from evaldag.request.plan import EvalPlan

    monkeypatch.chdir(tmp_path)
    (tmp_path / "planted.py").write_text("open('imported.txt', 'w').write('imported')\ndef f(graded):\n    return {}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(pydantic.ValidationError) as raised:
        EvalPlan.model_validate_json(
            '{"benchmark": {"rewards": [{"name": "os:system", "params": {"command": "id > pwned.txt"}}]}}')
    assert not (tmp_path / "pwned.txt").exists()
    assert re.search(r"unknown reward 'os:system': not a built-in reward \(correctness, .*\) nor an entry point "
                     r"of group 'evaldag.rewards'.*\[project.entry-points.\"evaldag.rewards\"\]", str(raised.value))
    with pytest.raises(pydantic.ValidationError, match=r"unknown metric 'planted:f': not an entry point of group "
                                                       r"'evaldag.metrics'"):
        EvalPlan.model_validate_json('{"benchmark": {"metrics": ["planted:f"]}}')
    assert not (tmp_path / "imported.txt").exists() and "planted" not in sys.modules


def test_validation_never_calls_a_plugin(a_module, tmp_path):
    """A config naming an installed reward plug-in is validated from its signature: the factory is not called (it
    is, by check_rewards, where the config is loaded)."""
    calls = tmp_path / "calls.txt"
    site = install(tmp_path / "counting", "counting", {plugins.REWARDS_GROUP: {"counted": "counting:counted"}},
                   {"counting": "import polars as pl\n"
                                f"def counted():\n    open({str(calls)!r}, 'a').write('x')\n"
                                "    return pl.lit(1.0)\n"})
    sys.path.insert(0, str(site))
    try:
        RewardSpec(name="counted")
        assert not calls.exists()
    finally:
        sys.path.remove(str(site))
        sys.modules.pop("counting", None)


def test_a_plugin_runs_in_another_process_that_reads_the_plan(installed, configs, tmp_path, monkeypatch):
    """A worker is another process: the plan it reads names the plug-ins, the installed package (here on its
    PYTHONPATH) provides them, and its reduce computes their figures."""
    from evaldag.pipeline.generate import generate_shard
    from evaldag.pipeline.grade import grade_shard
    from evaldag.request.plan import EvalRequest, resolve

    bench = configs / "benchmarks" / "aime24.yaml"
    config = yaml.safe_load(bench.read_text())
    config["rewards"] = [{"name": "correctness"}, {"name": "brevity", "params": {"target_tokens": 1}}]
    config["metrics"] = ["boxed_share"]
    bench.write_text(yaml.safe_dump(config))
    monkeypatch.setattr(engines, "load_engine", lambda *a, **k: RightEngine())
    monkeypatch.setattr(generate, "workload", lambda shard: None)
    plan = resolve(EvalRequest(benchmark="aime24", checkpoint=str(complete_checkpoint(tmp_path / "ckpt")), limit=2,
                               num_shards=1, engine="vllm"), tmp_path / "results")
    RightEngine.learn(plan)
    generate_shard(plan, 0)
    graded = grade_shard(plan, 0, workers=0)
    script = ("import json, sys\n"
              "from evaldag.request.plan import load_plan\n"
              "from evaldag.pipeline.reduce import reduce_results\n"
              "print(json.dumps(reduce_results(load_plan(sys.argv[1]), [sys.argv[2]])))\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(installed), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", script, str(plan.path("plan.json")), str(graded)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    metrics = json.loads(done.stdout.strip().splitlines()[-1])
    assert metrics["boxed_share"] == 1.0 and metrics["reward/brevity/mean"] == pytest.approx(0.0)
