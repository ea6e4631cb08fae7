"""Errors that carry a message a user can act on (what is wrong and how to fix it), and `redact_url`, which keeps
credentials out of what messages, logs and UI links show."""

import re
from urllib.parse import unquote

# scheme://USERINFO@host: userinfo cannot hold an unescaped / ? or #, so it ends at the last @ before them
_USERINFO = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*://)[^/?#]*@")
_QUERY_PARAM = re.compile(r"([?&])([^=&#?/]+)=([^&#]*)")
# matches api_key, apikey, access_token, X-Amz-Signature, X-Amz-Credential, sig (Azure SAS), password, secret, ...;
# masking a harmless parameter costs a reader little, showing a secret one costs a credential. Not author, design or
# passage: the openai engine refuses a base_url with a parameter this matches, so a common word must not
_SECRET_PARAM = re.compile(r"token|key|pass(?!age)|secret|(?<![a-z])sig|credential|auth(?!ors?(?![a-z]))", re.I)


class EvalDagError(Exception):
    """Base class: bad input or an environment problem, reported without a traceback by the CLI."""


class ConfigError(EvalDagError):
    """A config file, request or parameter is invalid."""


class CheckpointError(EvalDagError):
    """A checkpoint folder or model alias cannot be used."""


class DatasetError(EvalDagError):
    """A benchmark dataset cannot be loaded or does not have the configured fields."""


class StackError(EvalDagError):
    """The local stack (Prefect server, workers, MLflow server) cannot start or is not healthy."""


class MissingDependencyError(EvalDagError):
    """An optional dependency is not installed; the message says what to install."""


def warn_deprecated(old: str, new: str) -> None:
    """Say on one line that `old` (a command-line option, environment variable or settings key) still works but is
    deprecated, and which name replaces it."""
    import logging

    logging.getLogger("evaldag").warning("warning: %s is deprecated; use %s", old, new)


def redact_url(url: str) -> str:
    """`url` as it may be shown to people: the userinfo (`user:password@`) becomes `***@` and the value of each query
    parameter whose name looks secret becomes `***`; the rest is kept byte for byte. The whole userinfo goes, not only
    the password, because some services take the token as the user name (https://TOKEN@host). Only for showing a URL:
    connect with the original."""
    url = _USERINFO.sub(r"\1***@", url)
    return _QUERY_PARAM.sub(lambda m: f"{m[1]}{m[2]}=***" if _SECRET_PARAM.search(unquote(m[2])) else m[0], url)
