"""Errors that carry a message a user can act on (what is wrong and how to fix it)."""


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
