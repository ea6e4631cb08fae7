"""Conditional bias and coverage of study_adaptive.py's designs across many fixed problem sets: for each of K sets
drawn from the model, R simulated evaluations of that set. Prints per design the spread over sets."""
import argparse, sys, time
import numpy as np
sys.path.insert(0, __file__.rsplit("/", 1)[0])
import study_adaptive as S

ap = argparse.ArgumentParser()
ap.add_argument("--model", default="aime"); ap.add_argument("--sets", type=int, default=40)
ap.add_argument("--reps", type=int, default=250); ap.add_argument("designs", nargs="+")
a = ap.parse_args()
rng = np.random.default_rng(5)
t0 = time.perf_counter()
print(f"# {a.model}: {a.sets} fixed sets x {a.reps} evaluations each; bias in pp (per-set MC se ~ sd/sqrt(reps))")
print(f"{'design':20} {'mean bias':>9} {'sd of set biases':>16} {'max |set bias|':>14} {'cover mean':>10} "
      f"{'cover min':>9} {'cover max':>9} {'z(bias) sd':>10}")
for d in a.designs:
    b, cv, zs = [], [], []
    for k in range(a.sets):
        one = S.MODELS[a.model](np.random.default_rng(1000 + k))
        res = S.run_design(d, [one] * a.reps, rng)
        err = res[:, 0] - one.mean()
        b.append(err.mean() * 100); cv.append((np.abs(err) <= S.Z * res[:, 1]).mean() * 100)
        zs.append(err.mean() / (err.std(ddof=1) / np.sqrt(a.reps)))
    b, cv = np.array(b), np.array(cv)
    print(f"{d:20} {b.mean():+9.3f} {b.std(ddof=1):16.3f} {np.abs(b).max():14.3f} {cv.mean():10.1f} {cv.min():9.1f} "
          f"{cv.max():9.1f} {np.std(zs, ddof=1):10.2f}", flush=True)
print(f"# wall {time.perf_counter() - t0:.1f} s")
