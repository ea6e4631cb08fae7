"""The shard's GPU slots on the Prefect server (the pure GPU rules are evaldag.request.gpus).

A shard holds `tensor_parallel_size` slots of the global concurrency limit `evaldag-gpus` while it
generates, so the `gpu` pool never runs more GPU work than it has GPUs.
- limit missing (a server where nobody ran `evaldag up` or created it): the shard runs without slots, with a log
  line that says so; the worker's `--limit 1` and the cluster's GPU requests still bound GPU use;
- limit inactive: the same (Prefect treats an inactive limit as unlimited);
- tp > limit: ConfigError at once (Prefect would answer 422 on every attempt; a shard must never wait forever for
  slots that cannot exist);
- otherwise the shard waits, as long as it takes, until tp slots are free, and holds them under a lease that a
  background thread renews; a shard process that dies frees its slots when the lease expires (evaldag.request.gpus.
  GPU_LEASE_S).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator

from prefect import get_run_logger
from prefect.client.orchestration import get_client

from evaldag.request.gpus import GPU_LEASE_S, GPU_LIMIT, check_fits, check_visible_gpus


def _logger() -> logging.Logger | logging.LoggerAdapter:
    from prefect.exceptions import MissingContextError

    try:
        return get_run_logger()
    except MissingContextError:
        return logging.getLogger("evaldag")


def in_deployment() -> bool:
    """Whether this code runs in a deployed flow run (a shard on a worker), not an inline one or none."""
    from prefect.context import FlowRunContext

    ctx = FlowRunContext.get()
    return bool(ctx and ctx.flow_run and ctx.flow_run.deployment_id)


def _read_limit(name: str):
    """The global concurrency limit `name`, or None when the server has none by that name."""
    from prefect.exceptions import ObjectNotFound

    with get_client(sync_client=True) as client:
        try:
            return client.read_global_concurrency_limit_by_name(name)
        except ObjectNotFound:
            return None


@contextlib.contextmanager
def hold_gpus(tp: int, name: str = GPU_LIMIT) -> Iterator[None]:
    """Hold `tp` slots of the global concurrency limit `name` for the duration of the block (see module doc)."""
    from prefect.concurrency.sync import concurrency

    log = _logger()
    check_visible_gpus(tp, os.environ.get("CUDA_VISIBLE_DEVICES"))
    limit = _read_limit(name)
    if limit is None or not limit.active:
        why = "does not exist" if limit is None else "is inactive"
        # a warning where it matters (a deployed shard on a real pool), an info line for inline runs without a stack
        level = logging.WARNING if in_deployment() else logging.INFO
        log.log(level, "concurrency limit %r %s: running on %d GPU(s) without GPU slots (create it with `prefect "
                "gcl create %s --limit <GPUs of the pool>`, or run `evaldag up`)", name, why, tp, name)
        yield
        return
    check_fits(tp, limit.limit, name)
    log.info("waiting for %d of %d GPU slot(s) of %r (%d in use)", tp, limit.limit, name, limit.active_slots)
    # strict=False: a limit deleted between the read above and here means "no limit" (the case handled above);
    # a failed lease renewal (a server hiccup) must not kill an hour-long generation.
    with concurrency(name, occupy=tp, strict=False, raise_on_lease_renewal_failure=False,
                     lease_duration=GPU_LEASE_S):
        log.info("holding %d GPU slot(s) of %r", tp, name)
        yield


def pool_num_gpus(name: str = GPU_LIMIT) -> int:
    """GPUs of the gpu pool as the `evaldag-gpus` limit counts them (1 when it is missing or inactive: without the
    limit nothing says how many shards can run at once, and one shard never waits behind another)."""
    limit = _read_limit(name)
    return limit.limit if limit is not None and limit.active and limit.limit > 0 else 1
