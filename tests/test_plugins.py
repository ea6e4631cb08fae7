"""Plug-ins (evaldag.scoring.plugins): the example package under examples/ installed with pip, its reward and
statistic named by a benchmark config and seen in the evaluation's metrics and its MLflow run (a local SQLite store);
bad plug-ins fail when the config is read, before generation, naming the plug-in."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import polars as pl
import pydantic
import pytest
import yaml

from conftest import complete_checkpoint
from index_engine import ByIndexEngine
from evaldag import engines
from evaldag.pipeline import generate
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


@pytest.fixture
def a_module(tmp_path, monkeypatch):
    """A module `team_stats` on sys.path with good and bad plug-ins, named as package.module:function."""
    (tmp_path / "team_stats.py").write_text(
        "import polars as pl\n"
        "def rows(graded):\n    return {'team/rows': graded.height}\n"
        "def clash(graded):\n    return {'accuracy': 1.0}\n"
        "def raises(graded):\n    raise KeyError('no_such_column')\n"
        "def no_args():\n    return {}\n"
        "def text(graded):\n    return {'team/x': 'high'}\n"
        "def wrong_column():\n    return pl.col('no_such_column').cast(pl.Float64)\n"
        "def not_an_expr():\n    return 1.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield
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
    with pytest.raises(pydantic.ValidationError, match=r"unknown reward 'brevity'.*plug-ins installed"):
        RewardSpec(name="brevity")


def test_an_import_error_names_the_plugin(configs):
    bench = configs / "benchmarks" / "aime24.yaml"
    bench.write_text(bench.read_text() + "\nmetrics: ['no_such_team_pkg.stats:rows']\n")
    with pytest.raises(Exception, match=r"metric plug-in 'no_such_team_pkg.stats:rows' cannot be loaded: "
                                        r"ModuleNotFoundError"):
        load_benchmark("aime24")


def test_a_wrong_signature_fails_before_generation(a_module):
    with pytest.raises(PluginError, match=r"'team_stats:no_args' must take one argument"):
        plugins.check_metric("team_stats:no_args")
    with pytest.raises(pydantic.ValidationError, match=r"reward 'team_stats:wrong_column' failed .*no_such_column"):
        RewardSpec(name="team_stats:wrong_column")
    with pytest.raises(pydantic.ValidationError, match=r"'team_stats:not_an_expr' returned a float"):
        RewardSpec(name="team_stats:not_an_expr")
    with pytest.raises(pydantic.ValidationError, match=r"reward 'team_stats:wrong_column': bad params"):
        RewardSpec(name="team_stats:wrong_column", params={"x": 1})


def test_metric_plugins_at_the_reduce(a_module):
    graded = pl.DataFrame({"correct": [True, False], "completion": ["a", "b"]})
    assert plugin_metrics(graded, ["team_stats:rows"], taken={"accuracy"}) == {"team/rows": 2.0}
    with pytest.raises(PluginError, match=r"'team_stats:raises' failed on the graded table \(2 rows\): KeyError"):
        plugin_metrics(graded, ["team_stats:raises"], taken=set())
    with pytest.raises(PluginError, match=r"'team_stats:clash' returned 'accuracy', a metric evaldag"):
        plugin_metrics(graded, ["team_stats:clash"], taken={"accuracy"})
    with pytest.raises(PluginError, match=r"'team_stats:text' returned 'team/x' = 'high', not a number"):
        plugin_metrics(graded, ["team_stats:text"], taken=set())


def test_a_reward_failing_on_the_rows_is_named_at_the_reduce(a_module):
    spec = [{"name": "correctness"}, {"name": "team_stats:wrong_column"}]
    with pytest.raises(ValueError, match=r"reward 'team_stats:wrong_column' failed"):
        reward_metrics(pl.DataFrame({"correct": [True]}), [RewardSpec.model_construct(**s) for s in spec])
