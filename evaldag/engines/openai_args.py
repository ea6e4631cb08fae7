"""What the openai engine is given: its engine_args, checked without the engine (pure, no config import), so a model
config is validated when it is loaded (evaldag.request.config) without importing the engine."""

from __future__ import annotations

import re

import httpx

from evaldag.errors import ConfigError, redact_url

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
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


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
        raise ConfigError(f"openai engine_args: base_url={redact_url(args['base_url'])!r} must be an http(s) URL "
                          "such as http://127.0.0.1:8000/v1")
    out["base_url"] = str(url).rstrip("/")
    _check_no_credentials(out)
    if out.get("concurrency", 1) < 1:
        raise ConfigError(f"openai engine_args: concurrency must be >= 1, got {out['concurrency']}")
    if out.get("max_retries", 0) < 0:
        raise ConfigError(f"openai engine_args: max_retries must be >= 0, got {out['max_retries']}")
    if out.get("timeout_s", 1) <= 0:
        raise ConfigError(f"openai engine_args: timeout_s must be > 0, got {out['timeout_s']}")
    return out


def _check_no_credentials(args: dict) -> None:
    """Refuse a key inside base_url or in place of api_key_env's variable name: base_url is shown in the model's
    label, MLflow params and tags, the plan artifact and error messages, and api_key_env in error messages."""
    shown = redact_url(args["base_url"])
    if shown != args["base_url"]:
        raise ConfigError(f"openai engine_args: base_url {shown} carries credentials (user:password@ or a secret "
                          "query parameter), which would be shown wherever the model is named; give the URL without "
                          "them, put the key in an environment variable and name that variable in api_key_env")
    env = args.get("api_key_env")
    if env is not None and not _ENV_NAME.fullmatch(env):
        # not echoed: a value that is no variable name is most likely the key itself
        raise ConfigError("openai engine_args: api_key_env must name an environment variable (letters, digits, _; "
                          "not starting with a digit), not hold the key itself; put the key in an environment "
                          "variable and name it here")
