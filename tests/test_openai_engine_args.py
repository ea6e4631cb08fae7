"""The openai engine's settings, model-config rules and HTTP error handling, without a model.

The HTTP side is exercised against a small scripted HTTP server on localhost (real sockets, real httpx): which
answers are retried, which are reported, and what the reports say. The engine against a real `vllm serve` is in
tests/engine_vllm/test_openai_engine.py.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from conftest import free_ports

from evaldag.request.config import ModelConfig, SamplingConfig
from evaldag.engines import load_engine
from evaldag.engines.openai import (ServerClient, ServerError, ServerSettings, ServerUnavailableError,
                                    server_fingerprint, validate_engine_args)
from evaldag.errors import CheckpointError, ConfigError
from evaldag.request.checkpoint import ResolvedModel, with_engine

OK_ARGS = {"base_url": "http://127.0.0.1:8000/v1", "model": "m"}


@pytest.mark.parametrize("args, message", [
    ({}, "base_url and model missing"),
    ({"base_url": "http://h/v1"}, "model missing"),
    ({**OK_ARGS, "concurency": 4}, "unknown key 'concurency'; allowed: api_key_env, base_url, concurrency, "
                                   "max_retries, model, timeout_s"),
    ({**OK_ARGS, "base_url": "127.0.0.1:8000"}, "must be an http(s) URL"),
    ({**OK_ARGS, "concurrency": 0}, "concurrency must be >= 1"),
    ({**OK_ARGS, "concurrency": True}, "concurrency=True must be int"),
    ({**OK_ARGS, "max_retries": -1}, "max_retries must be >= 0"),
    ({**OK_ARGS, "timeout_s": "60"}, "timeout_s='60' must be int/float"),
    ({**OK_ARGS, "api_key_env": 5}, "api_key_env=5 must be str"),
], ids=["empty", "no-model", "typo", "no-scheme", "zero-concurrency", "bool", "negative-retries", "str-timeout",
        "key-env-type"])
def test_bad_engine_args_are_refused_with_the_allowed_keys(args, message):
    with pytest.raises(ConfigError, match="openai engine_args") as err:
        validate_engine_args(args)
    assert message in str(err.value)
    # the same check behind load_engine, before any connection is tried
    with pytest.raises(ConfigError):
        load_engine("openai", "m @ server", "bfloat16", 4, args)


@pytest.mark.parametrize("base_url, message", [
    ("https://svc:K3YS3CRET@llm.corp/v1", "base_url https://***@llm.corp/v1 carries credentials"),
    ("https://K3YS3CRET@llm.corp/v1", "base_url https://***@llm.corp/v1 carries credentials"),
    ("http://llm.corp/v1?api_key=K3YS3CRET", "base_url http://llm.corp/v1?api_key=*** carries credentials"),
    ("ftp://svc:K3YS3CRET@llm.corp/v1", "base_url='ftp://***@llm.corp/v1' must be an http(s) URL"),
], ids=["user-password", "token-as-user", "query-key", "not-http"])
def test_credentials_in_base_url_are_refused_without_being_shown(base_url, message):
    """base_url ends up in the model's label, MLflow params and tags and the plan artifact: no key may ride in it."""
    with pytest.raises(ConfigError) as err:
        validate_engine_args({**OK_ARGS, "base_url": base_url})
    assert message in str(err.value) and "K3YS3CRET" not in str(err.value)
    if "carries credentials" in message:
        assert "api_key_env" in str(err.value)


def test_a_key_in_place_of_api_key_env_is_refused_without_being_shown():
    key = "sk-live-ABCDEF0123456789"
    with pytest.raises(ConfigError, match="api_key_env must name an environment variable") as err:
        validate_engine_args({**OK_ARGS, "api_key_env": key})
    assert key not in str(err.value)
    assert validate_engine_args({**OK_ARGS, "api_key_env": "VLLM_API_KEY"})["api_key_env"] == "VLLM_API_KEY"


def test_server_errors_mask_credentials_of_settings_built_without_validation():
    [port] = free_ports(1)              # nothing listens there: the error names the server
    settings = ServerSettings(base_url=f"http://svc:K3YS3CRET@127.0.0.1:{port}/v1", model="m", max_retries=0)
    client = ServerClient(settings)
    try:
        with pytest.raises(ServerUnavailableError) as err:
            client.models()
    finally:
        client.close()
    assert f"server http://***@127.0.0.1:{port}/v1 failed" in str(err.value) and "K3YS3CRET" not in str(err.value)


def test_engine_args_defaults_and_normalised_url():
    s = ServerSettings.from_engine_args({"base_url": " http://h:8000/v1/ ", "model": "m"})
    assert (s.base_url, s.concurrency, s.max_retries, s.timeout_s, s.api_key_env) == \
        ("http://h:8000/v1", 32, 6, 600.0, None)


def test_model_config_pairs_source_server_with_engine_openai():
    ModelConfig(name="s", source="server", engine="openai", engine_args=OK_ARGS)
    with pytest.raises(ValueError, match="source 'server' goes with engine 'openai'"):
        ModelConfig(name="s", source="server", engine="hf")
    with pytest.raises(ValueError, match="source 'server' goes with engine 'openai'"):
        ModelConfig(name="s", source="path", path="/x", engine="openai", engine_args=OK_ARGS)
    with pytest.raises(ValueError, match="unknown key 'port'"):
        ModelConfig(name="s", source="server", engine="openai", engine_args={**OK_ARGS, "port": 1})


def test_engine_overrides_that_cannot_work_are_refused():
    served = ResolvedModel(name="s", path="m @ http://h/v1", fingerprint="f", dtype="bfloat16", engine="openai",
                           batch_size=4, engine_args=OK_ARGS)
    local = ResolvedModel(name="c", path="/ckpt", fingerprint="f", dtype="bfloat16", engine="hf", batch_size=4)
    with pytest.raises(CheckpointError, match="no local weights"):
        with_engine(served, "vllm")
    with pytest.raises(CheckpointError, match="source: server, engine: openai"):
        with_engine(local, "openai")
    assert with_engine(local, "vllm").engine == "vllm" and with_engine(served, None) is served


def test_fingerprint_ignores_restart_time_and_follows_what_identifies_the_model():
    s = ServerSettings(**OK_ARGS)
    entry = {"id": "m", "root": "/models/a", "max_model_len": 1024, "owned_by": "vllm", "created": 1}
    fp = server_fingerprint(s, entry, "r1")
    assert fp == server_fingerprint(s, {**entry, "created": 2}, "r1")
    assert fp != server_fingerprint(s, {**entry, "root": "/models/b"}, "r1")
    assert fp != server_fingerprint(s, entry, "r2")
    assert fp != server_fingerprint(ServerSettings(base_url="http://other:8000/v1", model="m"), entry, "r1")


class _Scripted:
    """An HTTP server on localhost answering from a script: a list of (status, body) per path, consumed in order
    (the last one repeats). Records every request it got."""

    def __init__(self, script: dict[str, list[tuple[int, dict]]]) -> None:
        self.script, self.seen = script, []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def _answer(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length") or 0))
                outer.seen.append((self.command, self.path, json.loads(body) if body else None,
                                   self.headers.get("authorization")))
                steps = outer.script.get(self.path, [(404, {"detail": "Not Found"})])
                status, payload = steps.pop(0) if len(steps) > 1 else steps[0]
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                if status == 429:
                    self.send_header("retry-after", "0")
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = _answer

            def log_message(self, *args) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


MODELS = (200, {"object": "list", "data": [{"id": "served-a", "owned_by": "sglang"}, {"id": "served-b"}]})


def _chat(finish="stop", prompt_tokens=12, completion_tokens=3, text="5"):
    return (200, {"choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                               "finish_reason": finish}],
                  "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens}})


@pytest.fixture
def scripted():
    servers = []

    def make(script):
        servers.append(_Scripted(script))
        return servers[-1]

    yield make
    for s in servers:
        s.close()


def _engine(url, **args):
    return load_engine("openai", "label", "bfloat16", 4, {"base_url": url, "model": "served-a", **args})


def test_transient_answers_are_retried_and_usage_is_reported(scripted):
    srv = scripted({"/v1/models": [(503, {"error": {"message": "loading"}}), MODELS],
                    "/v1/chat/completions": [(429, {"error": "slow down"}), (502, {}), _chat()]})
    eng = _engine(srv.url, max_retries=3)
    [[c]] = eng.generate_batch(["What is 2+3?"], SamplingConfig(max_new_tokens=16), 0)
    eng.close()
    assert (c.text, c.prompt_tokens, c.completion_tokens, c.finish_reason, c.token_ids) == ("5", 12, 3, "stop", [])
    posts = [body for method, _, body, _ in srv.seen if method == "POST"]
    assert len(posts) == 3 and posts[0] == posts[2]
    # greedy: no seed; a non-vLLM server is not asked for token ids it may refuse
    assert posts[0]["temperature"] == 0.0 and "seed" not in posts[0] and "return_token_ids" not in posts[0]
    assert posts[0]["messages"] == [{"role": "user", "content": "What is 2+3?"}] and posts[0]["max_tokens"] == 16


def test_requests_carry_per_sample_seeds(scripted):
    srv = scripted({"/v1/models": [MODELS], "/v1/chat/completions": [_chat()]})
    eng = _engine(srv.url)
    s = SamplingConfig(n=2, temperature=0.7, seed=3)
    eng.generate_batch(["a", "b"], s, 5)
    eng.close()
    seeds = sorted(body["seed"] for method, _, body, _ in srv.seen if method == "POST")
    from evaldag.engines.vllm import sample_seed

    expected = sorted(sample_seed(3, 5, i) + k for i in range(2) for k in range(2))
    assert seeds == expected and len(set(seeds)) == 4


def test_retries_run_out_with_a_clear_error(scripted):
    srv = scripted({"/v1/models": [(503, {"error": {"message": "overloaded"}})]})
    with pytest.raises(ServerUnavailableError, match=r"failed 3 attempt\(s\) of GET /models .*HTTP 503: overloaded"):
        _engine(srv.url, max_retries=2)
    assert len(srv.seen) == 3
    [port] = free_ports(1)              # nothing listens there: connection refused, retried, then reported
    with pytest.raises(ServerUnavailableError, match="ConnectError.*is it running"):
        _engine(f"http://127.0.0.1:{port}/v1", max_retries=1)


def test_permanent_errors_are_not_retried_and_say_what_to_change(scripted, monkeypatch):
    srv = scripted({"/v1/models": [MODELS],
                    "/v1/chat/completions": [(400, {"error": {"message": "bad temperature"}})]})
    with pytest.raises(ConfigError, match="does not serve a model named 'nope'; it serves: 'served-a', 'served-b'"):
        load_engine("openai", "label", "bfloat16", 4, {"base_url": srv.url, "model": "nope"})
    eng = _engine(srv.url)
    with pytest.raises(ServerError, match="HTTP 400: bad temperature"):
        eng.generate_batch(["x"], SamplingConfig(), 0)
    eng.close()
    assert sum(method == "POST" for method, *_ in srv.seen) == 1
    with pytest.raises(ServerError, match="answered 404: base_url must be the OpenAI API root"):
        _engine(srv.url.removesuffix("/v1"))
    monkeypatch.delenv("EVALDAG_TEST_KEY", raising=False)
    with pytest.raises(ConfigError, match="api_key_env='EVALDAG_TEST_KEY' names an environment variable that is"):
        _engine(srv.url, api_key_env="EVALDAG_TEST_KEY")
    monkeypatch.setenv("EVALDAG_TEST_KEY", "sk-test")
    _engine(srv.url, api_key_env="EVALDAG_TEST_KEY").close()
    assert srv.seen[-1][3] == "Bearer sk-test"


def test_unauthorised_and_unfinished_completions_are_reported(scripted):
    srv = scripted({"/v1/models": [(401, {"error": {"message": "invalid key"}})]})
    with pytest.raises(ServerError, match="refused the request \\(HTTP 401: invalid key\\).*api_key_env is not set"):
        _engine(srv.url)
    srv = scripted({"/v1/models": [MODELS], "/v1/chat/completions": [_chat(finish="abort")]})
    eng = _engine(srv.url)
    with pytest.raises(ServerError, match="finish_reason 'abort'"):
        eng.generate_batch(["x"], SamplingConfig(), 0)
    eng.close()


def test_context_overflows_are_reported_with_the_fix(scripted):
    refused = (400, {"error": {"message": "This model's maximum context length is 1024 tokens. However, your prompt "
                                          "contains at least 1025 input tokens, which exceeds this limit"}})
    models = (200, {"data": [{"id": "served-a", "owned_by": "vllm", "max_model_len": 1024}]})
    srv = scripted({"/v1/models": [models], "/v1/chat/completions": [refused, _chat("length", 1000, 24)]})
    eng = _engine(srv.url)
    with pytest.raises(ServerError, match=r"context 1024 tokens, max_new_tokens 64\): the prompt alone \(at least "
                                          r"1025 tokens\) is longer than the context.*--max-model-len"):
        eng.generate_batch(["x"], SamplingConfig(max_new_tokens=64), 0)
    # a completion cut where the context ends (vLLM shortens max_tokens itself) is not passed off as a truncation
    with pytest.raises(ServerError, match="1000 prompt tokens \+ max_new_tokens 64 do not fit.*at most 24 for this"):
        eng.generate_batch(["x"], SamplingConfig(max_new_tokens=64), 0)
    [[c]] = eng.generate_batch(["x"], SamplingConfig(max_new_tokens=24), 0)      # cut by max_new_tokens: fine
    assert c.finish_reason == "length"
    assert [body.get("return_token_ids") for m, _, body, _ in srv.seen if m == "POST"] == [True] * 3
    eng.close()


def test_kl_needs_another_engine(scripted):
    srv = scripted({"/v1/models": [MODELS]})
    eng = _engine(srv.url)
    with pytest.raises(ConfigError, match="engine=hf"):
        eng.score(["x"], [[1, 2]])
    with pytest.raises(ConfigError, match="engine=hf"):
        eng.vocabulary_fingerprint()
    eng.close()


def _served_plan(tmp_path, monkeypatch, url: str, max_new_tokens: int):
    """A plan of 2 AIME24 problems on the scripted server's model `served-a`."""
    import shutil

    from evaldag import paths
    from evaldag.request.plan import EvalRequest, resolve

    configs = tmp_path / "configs"
    shutil.copytree(paths.REPO_ROOT / "configs", configs, dirs_exist_ok=True)
    (configs / "models" / "served.yaml").write_text(
        "name: served\nsource: server\nengine: openai\nbatch_size: 4\n"
        f"engine_args: {{base_url: '{url}', model: served-a, max_retries: 0}}\n")
    monkeypatch.setenv("EVALDAG_CONFIGS_DIR", str(configs))
    return resolve(EvalRequest(benchmark="aime24", checkpoint="served", limit=2, num_shards=1,
                               sampling={"max_new_tokens": max_new_tokens}), tmp_path / "results")


def test_a_shard_past_the_servers_window_is_refused_before_any_completion_request(scripted, tmp_path, monkeypatch):
    """A vLLM server reports its window in /models and counts a chat prompt's tokens at /tokenize: a shard whose
    prompt + max_new_tokens do not fit fails before its first chat request, with the local engines' message (the
    server would otherwise cut the completion where its context ends, or refuse it, mid-shard)."""
    from evaldag.pipeline.generate import generate_shard

    models = (200, {"data": [{"id": "served-a", "owned_by": "vllm", "max_model_len": 1024}]})
    srv = scripted({"/v1/models": [models], "/tokenize": [(200, {"count": 1000, "max_model_len": 1024,
                                                                 "tokens": []})],
                    "/v1/chat/completions": [_chat("length", 1000, 24)]})
    plan = _served_plan(tmp_path, monkeypatch, srv.url, 64)
    with pytest.raises(ConfigError) as err:
        generate_shard(plan, 0)
    text = str(err.value)
    assert text.startswith("aime24: 2 of 2 prompts do not fit the context window with max_new_tokens 64 (engine "
                           "openai, window 1024 tokens: the server's max_model_len)"), text
    assert "1000 + 64 = 1064 > 1024" in text and "at most 24" in text and "--max-model-len" in text
    assert not any(path == "/v1/chat/completions" for _, path, _, _ in srv.seen)
    # the server tokenized each prompt as the chat request would send it
    asked = [body for _, path, body, _ in srv.seen if path == "/tokenize"]
    assert asked and all(b["model"] == "served-a" and b["add_generation_prompt"] is True
                         and b["messages"][0]["role"] == "user" for b in asked)


def test_a_server_that_cannot_count_tokens_is_not_checked_ahead(scripted):
    """No window in /models, or no /tokenize (not vLLM, an old vLLM): prompt_fit cannot tell, the shard is not
    refused ahead, and the per-request check stays the net."""
    srv = scripted({"/v1/models": [MODELS]})                    # sglang: no max_model_len
    eng = _engine(srv.url)
    assert eng.prompt_fit(["x"]) is None and not any(p == "/tokenize" for _, p, _, _ in srv.seen)
    eng.close()
    srv = scripted({"/v1/models": [(200, {"data": [{"id": "served-a", "owned_by": "vllm", "max_model_len": 64}]})]})
    eng = _engine(srv.url)                                      # /tokenize answers 404
    assert eng.prompt_fit(["x", "y"]) is None
    eng.close()
