"""What the openai engine is given: its engine_args, checked without the engine (pure, no config import), so a model
config is validated when it is loaded (evaldag.request.config) without importing the engine."""

from __future__ import annotations

import httpx

from evaldag.errors import ConfigError

# name -> (accepted types, what it does)
ENGINE_ARGS: dict[str, tuple[tuple[type, ...], str]] = {
    "base_url": ((str,), "the server's OpenAI API root, e.g. http://127.0.0.1:8000/v1 (required)"),
    "model": ((str,), "the name the server serves the model under, as GET {base_url}/models lists it (required)"),
    "concurrency": ((int,), "requests in flight at once per shard (default 32)"),
    "max_retries": ((int,), "retries of one request after a transient failure: connection refused or reset, "
                            "timeout, HTTP 408/429/5xx (default 6, about a minute of backoff)"),
    "timeout_s": ((int, float), "seconds one request may take, generation included (default 600)"),
    "api_key_env": ((str,), "name of the environment variable holding the API key, sent as a Bearer token; the "
                            "key itself never goes in a config (default: no key)"),
}
_REQUIRED = ("base_url", "model")


def validate_engine_args(args: dict) -> dict:
    """Check `args` against ENGINE_ARGS (types, ranges, required keys); return them, with base_url normalised."""
    allowed = ", ".join(sorted(ENGINE_ARGS))
    if not isinstance(args, dict):
        raise ConfigError(f"openai engine_args must be a mapping, got {args!r}; allowed keys: {allowed}")
    for key, value in args.items():
        if key not in ENGINE_ARGS:
            raise ConfigError(f"openai engine_args: unknown key {key!r}; allowed: {allowed}")
        types, what = ENGINE_ARGS[key]
        if not isinstance(value, types) or isinstance(value, bool):
            raise ConfigError(f"openai engine_args: {key}={value!r} must be {'/'.join(t.__name__ for t in types)}: "
                              f"{what}")
    missing = [k for k in _REQUIRED if not args.get(k)]
    if missing:
        raise ConfigError(f"openai engine_args: {' and '.join(missing)} missing: the engine needs the server's API "
                          f"root and the served model's name, e.g. engine_args: {{base_url: http://127.0.0.1:8000/v1, "
                          f"model: my-model}}")
    out = dict(args)
    try:
        url = httpx.URL(out["base_url"].strip())
    except httpx.InvalidURL:
        url = httpx.URL("")
    if url.scheme not in ("http", "https") or not url.host:
        raise ConfigError(f"openai engine_args: base_url={args['base_url']!r} must be an http(s) URL such as "
                          "http://127.0.0.1:8000/v1")
    out["base_url"] = str(url).rstrip("/")
    if out.get("concurrency", 1) < 1:
        raise ConfigError(f"openai engine_args: concurrency must be >= 1, got {out['concurrency']}")
    if out.get("max_retries", 0) < 0:
        raise ConfigError(f"openai engine_args: max_retries must be >= 0, got {out['max_retries']}")
    if out.get("timeout_s", 1) <= 0:
        raise ConfigError(f"openai engine_args: timeout_s must be > 0, got {out['timeout_s']}")
    return out
