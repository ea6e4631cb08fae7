"""Design study for adaptive samples (beat fixed n = 32 at equal precision; docs/statistics.md "Adaptive samples").
Reuses bench_adaptive.py's difficulty models; simulates outside the polars API for speed (the fixed-n interval and
the two-stage plan and estimate are evaldag's own functions; fixed_estimate equals adaptive.estimate to 1e-12).

Designs, spelled on the command line (cost = mean samples / (32 x problems)):
- fixed:K          K samples everywhere; mean of c/K; evaldag's interval (posterior E[p(1-p)]/K, Beta prior).
- fixedEB:K        K samples everywhere; empirical Bayes (below).
- 2stage:N0:F:B    evaldag.decisions.adaptive's plan and unbiased two-stage estimator: n0 = N0, floor = F, at most
                   64 per problem, budget B x 32 x problems. 2stEB:N0:F:B: the same samples, empirical Bayes.
- dblPool|dblRB|dblEB:N0:NMAX:NSTOP   rounds N0 -> 2 N0 -> 4 N0 ... up to NMAX; a problem continues while its
                   samples are not all equal (or n < NSTOP). Pool: c/n (biased). RB: E[first-round mean | final n, c]
                   (Rao-Blackwell over the design's paths; exactly unbiased). EB: below.
- EB: prior pi0 d0 + pi1 d1 + (1-pi0-pi1) Beta(a, b) fitted by ML on all (n, c) (a product of Bernoulli terms, valid
  under adaptive n); each problem its posterior mean; interval mean +- z sqrt(sum of posterior variances) / m.
A fresh problem set per simulated evaluation unless --fixed-set SEED holds one set fixed.
Example: study_adaptive.py --model aime --runs 4000 --seed 11 2stage:12:4:0.8 dblRB:4:32:12 fixedEB:32
"""

from __future__ import annotations

import argparse
import math
import sys
import time

import numpy as np
from scipy.optimize import minimize
from scipy.special import betaln, expit
from scipy.stats import norm

sys.path.insert(0, __file__.rsplit("/", 1)[0])
import bench_adaptive as BA  # noqa: E402
import polars as pl  # noqa: E402

from evaldag.decisions import adaptive, twostage  # noqa: E402

Z = float(norm.ppf(0.975))
MODELS = {"aime": BA.aime_like, "beta": BA.aime_beta_only, "math": BA.math500_like}


# ---------------------------------------------------------------- priors
def fit_beta_ml(n: np.ndarray, c: np.ndarray) -> tuple[float, float]:
    """Beta-binomial ML (a, b), concentration kept in [0.2, 50] like adaptive.fit_prior."""
    key, cnt = np.unique(np.stack([n, c], 1), axis=0, return_counts=True)
    nn, cc = key[:, 0].astype(float), key[:, 1].astype(float)

    def nll(t):
        mu, k = expit(t[0]), math.exp(t[1])
        a, b = mu * k, (1 - mu) * k
        return -float(cnt @ (betaln(a + cc, b + nn - cc) - betaln(a, b)))
    mu0 = np.clip((c / n).mean(), 0.01, 0.99)
    r = minimize(nll, [math.log(mu0 / (1 - mu0)), 0.0], method="L-BFGS-B",
                 bounds=[(-8, 8), (math.log(0.2), math.log(50))])
    mu, k = expit(r.x[0]), math.exp(r.x[1])
    return mu * k, (1 - mu) * k


def fit_mixture(n: np.ndarray, c: np.ndarray) -> np.ndarray:
    """ML of (pi0, pi1, a, b) for pi0 d0 + pi1 d1 + (1 - pi0 - pi1) Beta(a, b)."""
    key, cnt = np.unique(np.stack([n, c], 1), axis=0, return_counts=True)
    nn, cc = key[:, 0].astype(float), key[:, 1].astype(float)
    z0, z1 = (cc == 0).astype(float), (cc == nn).astype(float)

    def unpack(t):
        e = np.exp([t[0], t[1], 0.0])
        w = e / e.sum()
        mu, k = expit(t[2]), math.exp(t[3])
        return w[0], w[1], mu * k, (1 - mu) * k

    def nll(t):
        p0, p1, a, b = unpack(t)
        lik = p0 * z0 + p1 * z1 + (1 - p0 - p1) * np.exp(betaln(a + cc, b + nn - cc) - betaln(a, b))
        return -float(cnt @ np.log(np.maximum(lik, 1e-300)))
    f0, f1 = max((c == 0).mean(), 0.02), max((c == n).mean(), 0.02)
    fb = max(1 - f0 - f1, 0.05)
    mu0 = np.clip((c / n).mean(), 0.05, 0.95)
    r = minimize(nll, [math.log(f0 / fb), math.log(f1 / fb), math.log(mu0 / (1 - mu0)), math.log(1.5)],
                 method="L-BFGS-B", bounds=[(-12, 6), (-12, 6), (-6, 6), (math.log(0.1), math.log(200))])
    return np.array(unpack(r.x))


def mixture_posterior(theta, n, c) -> tuple[np.ndarray, np.ndarray]:
    p0, p1, a, b = theta
    n, c = n.astype(float), c.astype(float)
    w0 = p0 * (c == 0)
    w1 = p1 * (c == n)
    wb = (1 - p0 - p1) * np.exp(betaln(a + c, b + n - c) - betaln(a, b))
    W = w0 + w1 + wb
    m1 = (a + c) / (a + b + n)
    m2 = m1 * (a + c + 1) / (a + b + n + 1)
    mean = (w1 + wb * m1) / W
    ex2 = (w1 + wb * m2) / W
    return mean, np.maximum(ex2 - mean ** 2, 0.0)


def eb(n, c):
    th = fit_mixture(n, c)
    mean, var = mixture_posterior(th, n, c)
    m = n.size
    return mean.mean(), math.sqrt(var.sum()) / m


# ---------------------------------------------------------------- designs
def fixed_n(p, k, rng):
    return np.full(p.size, k), rng.binomial(k, p)


def fixed_estimate(n, c):
    """evaldag's interval for a fixed design: normal, sum of posterior E[p(1-p)]/n under fit_prior's Beta."""
    k = int(n[0])
    a, b = adaptive.fit_prior(c, k)
    u, v = a + c, b + k - c
    pq = u * v / ((u + v) * (u + v + 1))
    m = n.size
    return (c / k).mean(), math.sqrt((pq / k).sum()) / m


def doubling_schedule(n0, nmax):
    sizes = [n0]
    while sizes[-1] * 2 <= nmax:
        sizes.append(sizes[-1] * 2)
    return sizes


def doubling(p, n0, nmax, nstop, rng):
    sizes = doubling_schedule(n0, nmax)
    n = np.full(p.size, n0)
    c = rng.binomial(n0, p)
    for nxt in sizes[1:]:
        go = (n < nxt) & (((c > 0) & (c < n)) | (n < nstop)) & (n == nxt // 2)
        extra = np.where(go, nxt - n, 0)
        c = c + rng.binomial(extra, p)
        n = n + extra
    return n, c


_RB = {}


def rb_table(n0, nmax, nstop):
    """For the doubling design: terminal states (N, S) with path counts and E[first-round mean | N, S]."""
    key = (n0, nmax, nstop)
    if key in _RB:
        return _RB[key]
    sizes = doubling_schedule(n0, nmax)
    lc = lambda nn, kk: math.comb(nn, kk)  # noqa: E731
    # live[S] = (count, sum of S0 * count) of paths alive after stage with cumulative n
    live = {s: (lc(n0, s), s * lc(n0, s)) for s in range(n0 + 1)}
    term = {}
    n = n0
    for nxt in sizes[1:]:
        new = {}
        for s, (cn, sm) in live.items():
            cont = (0 < s < n) or n < nstop
            if not cont:
                term[(n, s)] = (term.get((n, s), (0, 0))[0] + cn, term.get((n, s), (0, 0))[1] + sm)
                continue
            d = nxt - n
            for j in range(d + 1):
                w = lc(d, j)
                o = new.get(s + j, (0, 0))
                new[s + j] = (o[0] + cn * w, o[1] + sm * w)
        live, n = new, nxt
    for s, (cn, sm) in live.items():
        term[(n, s)] = (term.get((n, s), (0, 0))[0] + cn, term.get((n, s), (0, 0))[1] + sm)
    keys = sorted(term)
    N = np.array([k[0] for k in keys])
    S = np.array([k[1] for k in keys])
    cnt = np.array([float(term[k][0]) for k in keys])
    T = np.array([term[k][1] / term[k][0] / n0 for k in keys])
    lut = {k: i for i, k in enumerate(keys)}
    _RB[key] = (N, S, cnt, T, lut)
    return _RB[key]


def rb_estimate(n, c, n0, nmax, nstop):
    N, S, cnt, T, lut = rb_table(n0, nmax, nstop)
    idx = np.array([lut[(int(a), int(b))] for a, b in zip(n, c)])
    t = T[idx]
    a, b = fit_beta_ml(n, c)
    u, v = a + c, b + n - c                                    # each problem's Beta posterior
    # E[Var(T|p)] = sum_states cnt T^2 E[p^S (1-p)^(N-S)] - E[p^2]
    lcnt = np.log(cnt)
    e = np.exp(lcnt[None, :] + betaln(u[:, None] + S[None, :], v[:, None] + (N - S)[None, :])
               - betaln(u, v)[:, None])
    var = e @ (T ** 2) - u * (u + 1) / ((u + v) * (u + v + 1))
    m = n.size
    return t.mean(), math.sqrt(max(var.sum(), 0.0)) / m


def pooled_estimate(n, c):
    """Pooled c/n with evaldag-like interval (Beta ML prior, posterior E[p(1-p)]/n)."""
    a, b = fit_beta_ml(n, c)
    u, v = a + c, b + n - c
    pq = u * v / ((u + v) * (u + v + 1))
    return (c / n).mean(), math.sqrt((pq / n).sum()) / n.size


def twostage_run(p, n0, floor, frac, rng):
    m = p.size
    st = adaptive.AdaptiveSettings(n0=n0, floor=floor, max_per_problem=64, budget=int(frac * 32 * m))
    s = rng.binomial(n0, p)
    counts = pl.DataFrame({"sample_id": np.arange(m), "n": np.full(m, n0), "correct": s, "first_correct": s})
    pln = adaptive.plan(counts, st)
    n1 = pln.weights.n1[s]
    k = rng.binomial(n1, p)
    t = twostage.estimates(pln.weights, s, k)
    v = twostage.expected_variance(pln.weights, pln.alpha + s + k, pln.beta + n0 + n1 - s - k)
    return n0 + n1, s + k, t.mean(), math.sqrt(max(v.sum(), 0)) / m


# ---------------------------------------------------------------- driver
def run_design(name, sets, rng):
    """rows of (estimate, se, samples) per set, for one design spec string."""
    out = []
    kind, *args = name.split(":")
    for p in sets:
        if kind == "fixed":
            n, c = fixed_n(p, int(args[0]), rng)
            est, se = fixed_estimate(n, c)
        elif kind == "fixedEB":
            n, c = fixed_n(p, int(args[0]), rng)
            est, se = eb(n, c)
        elif kind in ("2stage", "2stEB"):
            n0, floor, frac = int(args[0]), int(args[1]), float(args[2])
            n, c, est, se = twostage_run(p, n0, floor, frac, rng)
            if kind == "2stEB":
                est, se = eb(n, c)
        elif kind in ("dblPool", "dblRB", "dblEB"):
            n0, nmax, nstop = map(int, args)
            n, c = doubling(p, n0, nmax, nstop, rng)
            if kind == "dblPool":
                est, se = pooled_estimate(n, c)
            elif kind == "dblRB":
                est, se = rb_estimate(n, c, n0, nmax, nstop)
            else:
                est, se = eb(n, c)
        else:
            raise ValueError(name)
        out.append((est, se, n.sum()))
    return np.array(out)


def summarise(res, truth, m, ref):
    err = res[:, 0] - truth
    width = 2 * Z * res[:, 1]
    cover = np.abs(err) <= Z * res[:, 1]
    rmse = math.sqrt(np.mean(err ** 2))
    return dict(cost=res[:, 2].mean() / (32 * m), rmse=rmse / ref["rmse"], width=width.mean() / ref["width"],
                bias=err.mean() * 100, bias_se=err.std(ddof=1) / math.sqrt(err.size) * 100,
                cover=cover.mean() * 100)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="aime")
    ap.add_argument("--runs", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--fixed-set", type=int, default=None, help="hold one problem set (drawn with this seed) fixed")
    ap.add_argument("designs", nargs="+")
    a = ap.parse_args()
    rng = np.random.default_rng(a.seed)
    if a.fixed_set is not None:
        one = MODELS[a.model](np.random.default_rng(a.fixed_set))
        sets = [one] * a.runs
    else:
        sets = [MODELS[a.model](rng) for _ in range(a.runs)]
    truth = np.array([p.mean() for p in sets])
    m = sets[0].size
    t0 = time.perf_counter()
    r = run_design("fixed:32", sets, rng)
    err = r[:, 0] - truth
    ref = dict(rmse=math.sqrt(np.mean(err ** 2)), width=(2 * Z * r[:, 1]).mean())
    s = summarise(r, truth, m, ref)
    fs = f" fixed set seed {a.fixed_set}, set mean {truth[0]:.4f}" if a.fixed_set is not None else ""
    print(f"# model {a.model}, {m} problems, {a.runs} runs{fs}; fixed:32 RMSE {ref['rmse']*100:.3f} pp, "
          f"width {ref['width']*100:.3f} pp, bias {s['bias']:+.3f}+-{s['bias_se']:.3f}, cover {s['cover']:.1f}")
    print(f"{'design':24} {'cost':>5} {'RMSE/f':>6} {'wid/f':>6} {'bias pp':>15} {'cover':>6} {'sec':>5}")
    for d in a.designs:
        t1 = time.perf_counter()
        s = summarise(run_design(d, sets, rng), truth, m, ref)
        print(f"{d:24} {s['cost']:5.3f} {s['rmse']:6.3f} {s['width']:6.3f} {s['bias']:+7.3f} +- {s['bias_se']:.3f}"
              f" {s['cover']:6.1f} {time.perf_counter() - t1:5.1f}", flush=True)
    print(f"# wall {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
