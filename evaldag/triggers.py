"""What a "checkpoint saved" event or a sweep turns into: which evaluations to start, under which identity.

Pure functions: the Prefect flows in flows/checkpoint_flow.py and flows/sweeper_flow.py call them.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from evaldag.config import available
from evaldag.errors import ConfigError


def requested_benchmarks(event_benchmarks: list[str] | None, default: list[str]) -> list[str]:
    """The benchmarks an event asks for (or the configured default set), each checked against configs/."""
    wanted = list(dict.fromkeys(event_benchmarks or default))
    if not wanted:
        raise ConfigError("no benchmark to run: the event names none and the deployment's default_benchmarks is "
                          "empty")
    known = set(available("benchmarks"))
    unknown = [b for b in wanted if b not in known]
    if unknown:
        raise ConfigError(f"unknown benchmarks {unknown} in the event; available: {', '.join(sorted(known))}")
    return wanted


def evaluation_id(train_run: str, step: int, benchmark: str, checkpoint: str | Path) -> str:
    """Identity of "this checkpoint on this benchmark": the idempotency key of its evaluation flow run, so the same
    event delivered twice (or by the trainer and the sweeper) starts one run."""
    digest = hashlib.sha256(str(checkpoint).encode()).hexdigest()[:16]
    return f"evaldag-eval:{train_run}:{step}:{benchmark}:{digest}"


def train_run_of(checkpoint: Path, root: Path) -> str:
    """The training job a discovered checkpoint belongs to: <root>/<run>/<ckpt> -> run, <root>/<ckpt> -> root name."""
    parent = checkpoint.parent
    return parent.name if parent != root else root.name
