"""The time left a real evaluation shows, against the truth (issue 40): polls a shard's Prefect progress artifact
(evaldag.pipeline.progress) once a second while an evaluation runs through the stack, records each new text with
its time, and when the shard reports its last problem prints the error of every forecast made once 20 % of the
work (tokens) was done and while more than 10 % of the generation was left: (said - true) / true, where true is
the time from the report to the shard's last one.

    make up
    .venv/bin/python bench/watch_time_left.py &            # start it first: it reads only artifacts created after
    .venv/bin/evaldag run math500 --seed 7                  # a new seed: a fresh generation (greedy ignores it)

With a low-priority neighbour: `nice -n 19 python3 -c "while True: pass" &` in the same shell before the run.
"""

from __future__ import annotations

import argparse
import json
import time

import _common  # noqa: F401 - the project on the path


def watch(key: str, record: str | None, poll_s: float = 1.0) -> list[tuple[float, object]]:
    """(time, ShardProgress) of each new text of artifact `key` created after the call, until the shard is done."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    from evaldag.pipeline.progress import parse

    start, seen, reports = time.time(), None, []
    with get_client(sync_client=True) as client:
        while True:
            try:
                found = client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key])))
            except Exception:       # the server busy or restarting: the next poll
                found = []
            found = [a for a in found if a.created and a.created.timestamp() >= start]
            text = max(found, key=lambda a: a.updated).description if found else None
            if text is not None and text != seen:
                seen, now = text, time.time()
                if record:
                    with open(record, "a") as fh:
                        fh.write(json.dumps({"t": now, "text": text}) + "\n")
                if (got := parse(text)) is not None:
                    reports.append((now, got.progress))
                    if got.progress.done == got.progress.total:
                        return reports
            time.sleep(poll_s)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--key", default="progress-math500-shard-0", help="the shard's artifact key")
    ap.add_argument("--record", default=None, help="also append each text with its time to this JSON-lines file")
    args = ap.parse_args()
    reports = watch(args.key, args.record)
    t0, (t_end, last) = reports[0][0], reports[-1]
    errors = []
    for t, p in reports:
        true = t_end - t
        if p.seconds_left is None or p.tokens < 0.2 * last.tokens or true < 0.1 * (t_end - t0):
            continue
        errors.append((p.tokens / last.tokens, p.seconds_left, true))
        print(f"work {errors[-1][0]:4.0%}: said {p.seconds_left:4.0f} s, true {true:4.0f} s, "
              f"error {(p.seconds_left - true) / true:+.0%}")
    if errors:
        sizes = sorted(abs(said - true) / true for _, said, true in errors)
        print(f"{len(errors)} forecasts from 20 % of the work on: max {sizes[-1]:.0%}, median "
              f"{sizes[len(sizes) // 2]:.0%}; generation {t_end - t0:.0f} s")


if __name__ == "__main__":
    main()
