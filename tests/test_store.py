"""The result store: local folders and fsspec URLs, with a real S3 API (moto's server) standing in for S3."""

from __future__ import annotations

import json
import os

import boto3
import polars as pl
import pytest
from moto.server import ThreadedMotoServer

from evaldag.storage import store
from evaldag.errors import ConfigError
from evaldag.request.plan import EvalRequest, load_plan, resolve
from evaldag.storage.schema import INPUT_SCHEMA, read_table, write_table
from conftest import free_ports

BUCKET = "evaldag-test"


@pytest.fixture(scope="module")
def s3_server():
    """A real S3-compatible HTTP server (moto) on a free port, with one bucket; s3fs talks to it over HTTP."""
    port = free_ports(1)[0]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
           "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}"}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"]).create_bucket(Bucket=BUCKET)
    yield env
    server.stop()
    for k, v in old.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def _keys(prefix: str) -> list[str]:
    s3 = boto3.client("s3", endpoint_url=os.environ["AWS_ENDPOINT_URL"])
    pages = s3.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix)
    return sorted(o["Key"] for page in pages for o in page.get("Contents", []))


def test_root_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.delenv("EVALDAG_RESULTS_URL", raising=False)
    monkeypatch.delenv("EVALDAG_RESULTS_DIR", raising=False)
    assert str(store.root()).endswith("/results")
    monkeypatch.setenv("EVALDAG_RESULTS_DIR", str(tmp_path / "old-style"))
    assert str(store.root()) == str(tmp_path / "old-style")
    monkeypatch.setenv("EVALDAG_RESULTS_URL", "memory://evaldag/results")
    assert str(store.root()) == "memory://evaldag/results"


def test_unknown_scheme_is_a_clear_error():
    with pytest.raises(ConfigError, match="fsspec backend for 'nosuchfs'"):
        store.as_path("nosuchfs://bucket/results")
    with pytest.raises(ConfigError, match="EVALDAG_RESULTS_URL"):
        store.as_path("  ")


@pytest.mark.parametrize("url", ["sftp://svc:PW123@files.corp:22/evals", "ftp://files.corp/evals"])
def test_a_store_whose_paths_lose_their_host_as_text_is_refused(url):
    """Shard runs get plan paths as text; an sftp:// path written as text is 'sftp:///evals' (host and user go into
    storage options), so workers would use another machine's folder: refused up front, without the password."""
    with pytest.raises(ConfigError, match="loses its host") as err:
        store.as_path(url)
    assert "PW123" not in str(err.value) and "object store" in str(err.value)


@pytest.mark.parametrize("root", ["local", "memory://evaldag-store-test"])
def test_atomic_writes_and_tables_round_trip(root, tmp_path):
    base = store.as_path(tmp_path if root == "local" else root)
    target = base / "a" / "b" / "x.json"
    store.write_json(target, {"k": 1})
    store.write_json(target, {"k": 2})     # replaced whole
    assert store.read_json(target) == {"k": 2}
    df = pl.DataFrame({"sample_id": ["1", "2"], "prompt": ["p", "q"], "gold": ["1", "2"]})
    df = df.with_columns(*[pl.lit(None, dtype=t).alias(c) for c, t in INPUT_SCHEMA.items() if c not in df.columns])
    write_table(df, base / "t.parquet", INPUT_SCHEMA)
    assert read_table(base / "t.parquet", INPUT_SCHEMA)["sample_id"].to_list() == ["1", "2"]
    names = sorted(p.name for p in (base / "a" / "b").iterdir())
    assert names == ["x.json"], f"temp files left behind: {names}"
    store.remove_tree(base / "a")
    assert not target.exists()


def test_lock_of_a_remote_path_lives_in_home():
    lock = store.lock(store.as_path("memory://evaldag-store-test/x/generations.parquet"))
    assert str(os.environ["EVALDAG_HOME"]) in lock.lock_file
    local = store.lock(store.as_path("/tmp/evaldag-lock-test/out.parquet"))
    assert local.lock_file == "/tmp/evaldag-lock-test/out.parquet.lock"


def test_plan_paths_derive_from_keys_on_s3(s3_server):
    """Two benchmarks, or two slices of one, never share a folder; the plan round-trips through S3."""
    url = f"s3://{BUCKET}/keys"
    a = resolve(EvalRequest(benchmark="gsm8k", limit=2), results_root=url)
    b = resolve(EvalRequest(benchmark="gsm8k", limit=3), results_root=url)
    c = resolve(EvalRequest(benchmark="aime24", limit=2), results_root=url)
    assert len({a.result_dir, b.result_dir, c.result_dir}) == 3
    assert len({a.stage_dir, b.stage_dir, c.stage_dir}) == 3
    assert a.result_dir == f"{url}/gsm8k/{a.eval_key[:24]}"
    loaded = load_plan(f"{a.result_dir}/plan.json")
    assert loaded == a
    assert f"keys/gsm8k/{a.eval_key[:24]}/plan.json" in _keys("keys/")


@pytest.mark.model
def test_evaluation_on_s3_writes_only_to_the_store(s3_server, monkeypatch, tmp_path):
    """resolve -> generate -> grade -> reduce with the real model, the store on S3: every output is an object in
    the bucket, nothing lands in the local results folder, and a second pass reuses every stage."""
    from evaldag import paths
    from evaldag.pipeline.generate import generate_shard
    from evaldag.pipeline.grade import grade_shard
    from evaldag.pipeline.reduce import reduce_results

    url = f"s3://{BUCKET}/evals"
    monkeypatch.setenv("EVALDAG_RESULTS_URL", url)
    monkeypatch.setenv("EVALDAG_HOME", str(tmp_path / "home"))    # a home of its own: nothing may land in it
    plan = resolve(EvalRequest(benchmark="gsm8k", limit=4, num_shards=2, sampling={"max_new_tokens": 8}))
    graded = []
    for shard in range(plan.num_shards):
        generate_shard(plan, shard)
        graded.append(str(grade_shard(plan, shard)))
    assert all(g.startswith("s3://") for g in graded)
    metrics = reduce_results(plan, graded)
    assert metrics["n_samples"] == 4
    keys = _keys("evals/")
    gen = plan.stage_dir.removeprefix(f"s3://{BUCKET}/")
    res = plan.result_dir.removeprefix(f"s3://{BUCKET}/")
    for name in ("plan.json", "inputs.parquet", "metrics.json", "samples.parquet"):
        assert f"{res}/{name}" in keys
    assert f"{gen}/generations-0000-of-0002.parquet" in keys
    assert not any(".chunks/" in k or k.endswith(".tmp") for k in keys), keys
    assert paths.home() == tmp_path / "home" and not (paths.home() / "results").exists()
    samples = pl.read_parquet(plan.path("samples.parquet").read_bytes())
    assert samples.height == 4 and samples["sample_id"].n_unique() == 4

    for shard in range(plan.num_shards):      # the same evaluation again: found in the store, not recomputed
        generate_shard(plan, shard)
        grade_shard(plan, shard)
    again = reduce_results(plan, graded)
    assert again["cache_hit_rate"] == 1.0
    assert json.loads(plan.path("metrics.json").read_text())["accuracy"] == metrics["accuracy"]
