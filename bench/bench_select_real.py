"""`evaldag select` for real against evaluating every checkpoint in full (issue 54 item 4), on a stack of its own.

A job of five checkpoints of distinct quality (the decide demo's `arith` benchmark and copies of the default model
with Gaussian noise of growing size, examples/decide_demo.py), selected with `evaldag select`; then the same five
evaluated in full with `evaldag run`, under another seed (greedy: the same answers, but a generation of their own, so
nothing of the selection's is reused). Prints the selection's set, its tokens and wall against the full evaluations':

    select, 5 checkpoints, arith P problems: STATUS SET; tokens X of Y in full (R), wall A s of B s (W)

Run: `.venv/bin/python bench/bench_select_real.py` (a stack on ports 4300/5100 under a temporary EVALDAG_HOME,
stopped at the end). `--engine hf` (default) or `vllm`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
BIN = Path(sys.executable).parent
JOB = "select-bench"
NOISE = (1.0, 0.1, 0.0, 2.0, 0.3)


def _evaldag(*args: str, env: dict, cwd: Path) -> float:
    """Run an evaldag command to its end; returns its wall time."""
    t0 = time.monotonic()
    out = subprocess.run([str(BIN / "evaldag"), *args], env=env, cwd=cwd, capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"evaldag {' '.join(args)} failed:\n{out.stdout}\n{out.stderr}")
    return time.monotonic() - t0


def _full_tokens(client, job: str) -> int:
    exp = client.get_experiment_by_name("evaldag-arith")
    runs = client.search_runs([exp.experiment_id], filter_string=f"tags.train_run = '{job}'")
    return int(sum(r.data.metrics["mean_completion_tokens"] * r.data.metrics["n_samples"] for r in runs))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--problems", type=int, default=40)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--engine", default="hf", choices=["hf", "vllm"])
    args = p.parse_args(argv)
    from examples.decide_demo import arith_config, write_arith_rows, write_checkpoints
    from evaldag import paths

    root = Path(tempfile.mkdtemp(prefix="evaldag-bench-select-"))
    env = {**os.environ, "EVALDAG_HOME": str(root / "home"), "EVALDAG_MODELS_DIR": str(paths.models_dir()),
           "EVALDAG_PREFECT_PORT": "4300", "EVALDAG_MLFLOW_PORT": "5100", "EVALDAG_DEFAULT_ENGINE": args.engine,
           "EVALDAG_CHECKPOINT_ROOTS": str(root / "checkpoints"), "COLUMNS": "200"}
    for var in ("PREFECT_API_URL", "MLFLOW_TRACKING_URI"):
        env.pop(var, None)
    checkpoints = write_checkpoints(root, NOISE, JOB)
    (root / "arith.yaml").write_text(arith_config("{path: arith.jsonl}"))
    write_arith_rows(root / "arith.jsonl", args.problems)
    subprocess.run([BIN / "evaldag", "up"], env=env, check=True, capture_output=True)
    try:
        common = ["--limit", str(args.problems), "--max-new-tokens", str(args.max_new_tokens), "--num-shards", "1"]
        wall_select = _evaldag("select", JOB, "./arith.yaml", "--rounds", str(args.rounds), "--margin", "0.05",
                               *common, env=env, cwd=root)
        os.environ.update({"MLFLOW_TRACKING_URI": "http://127.0.0.1:5100"})
        import mlflow
        from mlflow import MlflowClient

        client = MlflowClient()
        parent = client.search_runs([client.get_experiment_by_name("evaldag-train-runs").experiment_id],
                                    filter_string=f"tags.train_run = '{JOB}' and tags.kind = 'train_job'")[0]
        summary = json.loads(mlflow.artifacts.load_text(f"runs:/{parent.info.run_id}/select/arith-rows.json"))
        wall_full = sum(_evaldag("run", "./arith.yaml", "--checkpoint", str(path), "--step", str(step), "--seed", "1",
                                 "--train-run", f"{JOB}-full", *common, env=env, cwd=root)
                        for step, path in enumerate(checkpoints))
        spent, full = summary["tokens"]["generated"], _full_tokens(client, f"{JOB}-full")
        print(f"select, {len(NOISE)} checkpoints, arith {args.problems} problems: {summary['status']} "
              f"{summary['set']}; tokens {spent} of {full} in full ({spent / full:.2f}; the selection's own estimate "
              f"of all in full: {summary['tokens']['full_est']}), wall {wall_select:.0f} s of {wall_full:.0f} s "
              f"({wall_select / wall_full:.2f})", flush=True)
        for c in summary["checkpoints"]:
            print(f"  step {c['step']}: {c['problems']} problems read, accuracy {c['mean']:.3f}, dropped at round "
                  f"{c['dropped_round']}, tokens {c['tokens']}")
    finally:
        subprocess.run([BIN / "evaldag", "down"], env=env, check=False, capture_output=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
