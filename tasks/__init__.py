"""Every Prefect task of the flows, thin wrappers that add retries, timeouts and logging to core functions: the
parent's (resolve, launch_shard, reduce, track, start_evaluation, lookup, decide, second_round), the shard's (shard_stages: generate and
grade; gpu_slots: the GPU slots it holds while generating), and the retry rule they share (retry)."""

import logging

# The core logs progress (tokens/s per batch, reused stage outputs) on "evaldag" at INFO; the local stack forwards
# that logger to Prefect (PREFECT_LOGGING_EXTRA_LOGGERS), so let INFO through in flow runs.
logging.getLogger("evaldag").setLevel(logging.INFO)
