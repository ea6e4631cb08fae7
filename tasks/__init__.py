"""Prefect tasks: one module per stage, thin wrappers that add retries, timeouts and logging to core functions."""
