"""Prefect tasks of the parent flows, one module each, thin wrappers that add retries, timeouts and logging to core
functions (the shard's own tasks live with its flow, in flows/shard_flow.py)."""

import logging

# The core logs progress (tokens/s per batch, reused stage outputs) on "evaldag" at INFO; the local stack forwards
# that logger to Prefect (PREFECT_LOGGING_EXTRA_LOGGERS), so let INFO through in flow runs.
logging.getLogger("evaldag").setLevel(logging.INFO)
