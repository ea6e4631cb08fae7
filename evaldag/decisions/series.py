"""Which evaluations of a training job measure the same thing, so that comparing them across checkpoints is fair.

Two evaluations are comparable when everything that defines the measured quantity is the same: the benchmark's data
and slice, prompt, gold format and grader, reward definition, the sampling distribution (n, temperature, top_p,
token cap), and the numeric format the model ran in (dtype, quantization). What only moves the noise (the seed) or
the execution (engine, batch size, shards, where results go) does not separate them. The job-history diagnostics
and the parent run's curves use one series per comparison key, so a greedy slice is never set next to an n=8 full
run, nor a bfloat16 run next to a float32 one.
"""

from __future__ import annotations

import hashlib
import json
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from evaldag.request.plan import EvalPlan

_SAMPLING = ("n", "temperature", "top_p", "max_new_tokens")


def comparison_settings(plan: EvalPlan) -> dict:
    """The settings that define what an evaluation measures (see the module docstring)."""
    bench = plan.benchmark
    return {
        "benchmark": bench.name, "dataset_hash": plan.dataset_hash,
        "sample_ids": hashlib.sha256("\n".join(sorted(plan.sample_ids())).encode())
        .hexdigest(),
        "instruction": bench.instruction, "gold_format": bench.gold_format, "strip_thinking": bench.strip_thinking,
        "grader": plan.grader_version, "rewards": [r.model_dump() for r in bench.rewards],
        "sampling": {k: getattr(plan.sampling, k) for k in _SAMPLING},
        # the numeric format of the weights: a bfloat16 or fp8 model is not the float32 model measured again
        "dtype": plan.model.dtype, "quantization": plan.model.engine_args.get("quantization"),
        # adaptive samples: another estimator, with another spread; absent otherwise, so older keys stay valid
        **({} if plan.request.adaptive is None else {"adaptive": plan.request.adaptive.model_dump()}),
    }


def comparison_key(plan: EvalPlan) -> str:
    """16 hex digits: equal for evaluations that measure the same thing."""
    blob = json.dumps(comparison_settings(plan), sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def series_label(plan: EvalPlan) -> str:
    """The parent run's curve suffix: "" for the benchmark's own settings, else what differs from them
    ("limit4", "n8.t0.6", ...), so each kind of evaluation gets its own curve (`<benchmark>.<label>/accuracy`)."""
    parts = []
    if plan.request.limit is not None:
        parts.append(f"limit{plan.request.limit}")
    default = plan.benchmark.sampling
    for key, short in (("n", "n"), ("temperature", "t"), ("top_p", "p"), ("max_new_tokens", "tok")):
        value = getattr(plan.sampling, key)
        if value != getattr(default, key):
            parts.append(f"{short}{value:g}" if isinstance(value, float) else f"{short}{value}")
    if (adaptive := plan.request.adaptive) is not None:
        # every setting that differs from its default, as the comparison key separates them all
        label = (f"adaptive-b{adaptive.budget}" if adaptive.budget is not None
                 else f"adaptive-w{adaptive.target_ci_width:g}")
        defaults = type(adaptive).model_fields
        for key, short in (("n0", "n0"), ("floor", "f"), ("max_per_problem", "max"), ("confidence", "c")):
            if getattr(adaptive, key) != defaults[key].default:
                label += f"-{short}{getattr(adaptive, key):g}"
        parts.append(label.replace(".", "p"))
    return ".".join(parts)


def describe(plan: EvalPlan) -> str:
    """What the evaluation measured, in words (for the diagnostics' "compared ...")."""
    s = plan.sampling
    decoding = "greedy" if s.temperature == 0 else f"temperature {s.temperature:g}, top_p {s.top_p:g}"
    problems = (f"the first {plan.n_problems} problems" if plan.request.limit is not None
                else f"all {plan.n_problems} problems")
    rewards = " + ".join(f"{r.weight:g} x {r.name}" for r in plan.benchmark.rewards)
    samples = f"n={s.n}" if plan.request.adaptive is None else f"adaptive samples from n0={s.n}"
    return (f"{plan.benchmark.name}, {problems}, {samples}, {decoding}, max_new_tokens={s.max_new_tokens}, "
            f"reward {rewards}, grader {plan.grader_version}")
