"""The time-left forecast replayed offline on recorded shards: each report's inputs (written by
`bench/bench_time_left_real.py --record FILE`) fed again to evaldag.pipeline.time_left, so that estimates can be
compared on the same real runs, quiet and busy, without generating again.

    .venv/bin/python bench/replay_time_left.py /tmp/quiet.json /tmp/busy.json

Printed per recording and estimate: the relative error |forecast - truth| / truth of the seconds left over the
reports made once 20 % of the work (tokens) was done and while more than 10 % of the generation was left (as
bench_time_left_real.py counts it): largest and median, and at the first report past 20, 50 and 80 % of the work.
Beside them the tokens-left error alone (the length model), and the truth's tokens over the recent rate (the rate
alone).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import _common  # noqa: F401 - the project on the path

import numpy as np


def replay(rec: dict, seconds_of, base_fraction: float) -> list[tuple[float, int, float | None, int]]:
    """(time, tokens so far, forecast seconds left, forecast tokens left) per report, `seconds_of(tl, est,
    running, not_started)` choosing the seconds from a TimeLeft with step-time prior `base_fraction` fed the
    recorded reports."""
    from evaldag.pipeline.time_left import TimeLeft

    now = [0.0]
    tl = TimeLeft(rec["completions"], rec["cap"], window_s=rec["window_s"], min_span_s=rec["min_span_s"],
                  clock=lambda: now[0], base_fraction=base_fraction)
    done, out = 0, []
    for r in rec["reports"]:
        now[0] = r["t"]
        tl.finish(rec["finished"][done:r["finished"]])
        done = r["finished"]
        est = tl.estimate(r["tokens"], r["running"], r["not_started"], r.get("fresh", True))
        out.append((r["t"], r["tokens"], seconds_of(tl, est, r["running"], r["not_started"]), est.tokens_left))
    return out


def as_built(tl, est, running, not_started):
    return est.seconds_left


def tokens_over_rate(tl, est, running, not_started):
    """Tokens left / the rate over the TimeLeft's window."""
    if est.seconds_left is None or not est.tokens_per_s:
        return None
    return est.tokens_left / est.tokens_per_s


def errors(rows, label: str) -> None:
    end, total = rows[-1][0], rows[-1][1]
    first = next(t for t, tok, *_ in rows if tok > 0)
    span = end - first
    errs, marks, tok_errs = [], {}, []
    for t, tok, seconds, tokens_left in rows:
        truth = end - t
        if seconds is None or tok < 0.2 * total or truth <= 0.1 * span:
            continue
        err = (seconds - truth) / truth
        errs.append(abs(err))
        tok_errs.append((tokens_left - (total - tok)) / max(total - tok, 1))
        for mark in (0.2, 0.5, 0.8):
            if tok >= mark * total and mark not in marks:
                marks[mark] = err
    print(f"  {label:<44} max {max(errs):4.0%}, median {np.median(errs):4.0%}; at 20/50/80 % of the work "
          + " / ".join(f"{marks[m]:+.0%}" if m in marks else "-" for m in (0.2, 0.5, 0.8))
          + f"   (tokens left: max |{max(map(abs, tok_errs)):.0%}|, median {np.median(tok_errs):+.0%})")


def estimates(device: str) -> dict:
    """label -> (seconds_of, step-time prior): the forecast as built for the recording's device, the step-time
    model with a CPU's former prior (0.02) and a GPU's, and tokens left / the recent rate."""
    from evaldag.pipeline.time_left import BASE_FRACTION

    return {f"as built for {device} now": (as_built, BASE_FRACTION[device]),
            "step time fitted, prior 0.02 (CPU before)": (as_built, 0.02),
            "step time fitted, prior 0.2 (GPU)": (as_built, BASE_FRACTION["cuda"]),
            "tokens left / recent rate": (tokens_over_rate, 0.0)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("recordings", nargs="+", type=Path)
    args = ap.parse_args()
    for path in args.recordings:
        rec = json.loads(path.read_text())
        reports = rec["reports"]
        span = reports[-1]["t"] - next(r["t"] for r in reports if r["tokens"] > 0)
        print(f"{path}: {rec['benchmark']}, {rec['completions']} completions, cap {rec['cap']}, "
              f"{reports[-1]['tokens']} tokens in {span:.0f} s, {len(reports)} reports")
        # recordings before "device" was written: a CPU's prior was 0.02, a GPU's 0.2
        device = rec.get("device") or ("cpu" if rec["base_fraction"] < 0.1 else "cuda")
        for label, (fn, prior) in estimates(device).items():
            errors(replay(rec, fn, prior), label)


if __name__ == "__main__":
    main()
