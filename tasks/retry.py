"""Which failures deserve a retry: transient I/O and server faults yes, bad data or bad config never."""

from __future__ import annotations

from evaldag.errors import EvalDagError

# Errors that a second attempt cannot fix.
_PERMANENT = (EvalDagError, ValueError, TypeError, KeyError, FileNotFoundError)


def retry_transient(task, task_run, state) -> bool:
    """retry_condition_fn for Prefect tasks: retry unless the failure is a data or configuration error."""
    try:
        state.result()
    except _PERMANENT:
        return False
    except Exception:
        return True
    return False
