"""Config validation: every shipped config loads; malformed ones fail with a message naming the problem."""

from __future__ import annotations


import pytest

from evaldag.request import config
from evaldag.errors import ConfigError
from evaldag.request.plan import EvalRequest


@pytest.mark.parametrize("name", ["math500", "aime24", "gsm8k", "amc23"])
def test_shipped_benchmarks_load(name):
    cfg = config.load_benchmark(name)
    assert cfg.name == name
    assert "{problem}" in cfg.instruction
    assert cfg.render_prompt("What is 1+1?").startswith("What is 1+1?")


def test_shipped_model_alias_loads():
    m = config.load_model("smollm2-135m-instruct")
    # no dtype of its own: it runs in the host's default (evaldag.engines.dtype.default_dtype)
    assert m.source == "gguf-package" and m.dtype is None


def test_unknown_benchmark_lists_the_known_ones():
    with pytest.raises(ConfigError, match=r"unknown benchmark 'math5000'; available: aime24, amc23, gsm8k, math500"):
        config.load_benchmark("math5000")


def test_misspelt_key_is_named(configs):
    path = configs / "benchmarks" / "math500.yaml"
    path.write_text(path.read_text().replace("gold_format:", "gold_fromat:"))
    with pytest.raises(ConfigError) as e:
        config.load_benchmark("math500")
    assert "gold_fromat" in str(e.value) and "math500.yaml" in str(e.value)


def test_invalid_yaml_is_reported(configs):
    (configs / "benchmarks" / "broken.yaml").write_text("name: broken\nfields: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        config.load_benchmark("broken")


def test_name_must_match_file(configs):
    src = (configs / "benchmarks" / "aime24.yaml").read_text()
    (configs / "benchmarks" / "aime25.yaml").write_text(src)
    with pytest.raises(ConfigError, match="must match its file name 'aime25'"):
        config.load_benchmark("aime25")


def test_instruction_needs_placeholder(configs):
    path = configs / "benchmarks" / "gsm8k.yaml"
    text = path.read_text().replace("{problem}\\n", "")
    path.write_text(text)
    with pytest.raises(ConfigError, match=r"instruction must contain the placeholder \{problem\}"):
        config.load_benchmark("gsm8k")


def test_wrong_gold_format_is_named(configs):
    path = configs / "benchmarks" / "amc23.yaml"
    path.write_text(path.read_text().replace("gold_format: number", "gold_format: float"))
    with pytest.raises(ConfigError, match="gold_format"):
        config.load_benchmark("amc23")


@pytest.mark.parametrize("overrides, message", [
    ({"n": 4}, "temperature"),
    ({"max_new_tokens": 0}, "max_new_tokens"),
    ({"top_p": 0}, "top_p"),
    ({"max_new_token": 5}, "max_new_token"),
    ("64", "must be a mapping"),
])
def test_bad_sampling_overrides(overrides, message):
    with pytest.raises(ConfigError, match=message):
        config.merge_sampling(config.SamplingConfig(), overrides)


def test_sampling_overrides_apply():
    s = config.merge_sampling(config.SamplingConfig(), {"n": 4, "temperature": 0.7, "seed": 3})
    assert (s.n, s.temperature, s.seed, s.max_new_tokens) == (4, 0.7, 3, 512)


@pytest.mark.parametrize("params, message", [
    ({"benchmark": "math500", "limit": 0}, "limit"),
    ({"benchmark": "math500", "step": -5}, "step"),
    ({"benchmark": "math500", "num_shards": 0}, "num_shards"),
    ({"benchmark": ""}, "benchmark"),
    ({"benchmark": "math500", "bogus": 1}, "bogus"),
])
def test_request_validation(params, message):
    with pytest.raises(ConfigError, match=message):
        EvalRequest.parse(**params)


def test_model_alias_source_fields(configs):
    (configs / "models" / "half.yaml").write_text("name: half\nsource: gguf-package\npackage: x\n")
    with pytest.raises(ConfigError, match=r"needs \['file'\]"):
        config.load_model("half")
