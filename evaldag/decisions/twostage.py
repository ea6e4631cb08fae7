"""An unbiased estimator of one problem's solve rate p from a two-stage design, and its variance.

The design: a first stage of n0 samples (s correct), then a second stage of n1(s) samples whose number depends on s
(more where s says the outcome is uncertain, 0 or a floor at s = 0 and s = n0). The pooled mean of all samples is
then biased, badly: a problem with p = 0.1 seen at 0/4 keeps the estimate 0 at full weight, while one seen at 1/4
gets 28 more samples that pull its estimate back to p; with n0 = 4 and n1 = 28 for 1 <= s <= 3 its mean is 0.043,
not 0.1 (Wald's identity: the bias of S/N is -cov(S/N, N) / E[N], and here the estimate and the sample size move
together).

The estimator here is T = a(s) + b(s) * B, with B = (correct second-stage samples) / n1(s), the second stage's mean
(b(s) = 0 where n1(s) = 0). Given s, B is a fresh binomial mean with expectation p, so E[T] = p for every p if and
only if the polynomial identity sum_s C(n0,s) p^s (1-p)^(n0-s) (a(s) + b(s) p) = p holds. In the Bernstein basis of
degree n0 + 1 that identity is, for k = 0..n0+1 (a(-1) = b(-1) = a(n0+1) = 0),

    (n0 + 1 - k) a(k) + k (a(k-1) + b(k-1)) = k,

so a is fixed by b through a recursion (a(0) = 0: a problem at 0/n0 is estimated from its second stage alone), and
the last equation, a(n0) + b(n0) = 1, is one linear constraint on b. Among these unbiased estimators the one used
minimises the variance averaged over a working prior p ~ Beta(alpha, beta) (fitted to the first stage across
problems): a quadratic problem with one constraint, solved exactly. The prior only decides the efficiency, never
the unbiasedness; b = constant w with a(s) = (1 - w) s / n0 is the simplest member of the family and the pooled
mean is not a member. Estimates can fall slightly outside [0, 1] (unbiasedness forbids clipping them).

Its variance at p is a polynomial in p:
    Var(T | p) = sum_s C(n0,s) p^s (1-p)^(n0-s) [(a(s) + b(s) p)^2 + b(s)^2 p (1-p) / n1(s)] - p^2,
and its expectation over any Beta(u, v) is a sum of beta functions: `expected_variance` gives it over a problem's
posterior (the interval) or over the prior given its first stage (planning).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy.special import betaln, gammaln


@dataclass(frozen=True)
class TwoStageWeights:
    """T = a[s] + b[s] * (second-stage mean) for a problem with s correct in its first stage (module docstring)."""

    n0: int
    n1: np.ndarray      # (n0 + 1,) second-stage samples by first-stage correct count
    a: np.ndarray       # (n0 + 1,)
    b: np.ndarray       # (n0 + 1,), 0 where n1 is 0


def _log_binom(n: int, k: np.ndarray) -> np.ndarray:
    return gammaln(n + 1) - gammaln(k + 1) - gammaln(n - k + 1)


def _stratum_moments(n0: int, alpha: float, beta: float) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """For each s: E[pi_s(p)], E[pi_s(p) p], E[pi_s(p) p^2], E[pi_s(p) p (1-p)] under p ~ Beta(alpha, beta), where
    pi_s(p) = C(n0,s) p^s (1-p)^(n0-s)."""
    s = np.arange(n0 + 1)
    lb = _log_binom(n0, s) - betaln(alpha, beta)
    m0 = np.exp(lb + betaln(alpha + s, beta + n0 - s))
    m1 = np.exp(lb + betaln(alpha + s + 1, beta + n0 - s))
    m2 = np.exp(lb + betaln(alpha + s + 2, beta + n0 - s))
    mpq = np.exp(lb + betaln(alpha + s + 1, beta + n0 - s + 1))
    return m0, m1, m2, mpq


def optimal_weights(n0: int, n1: np.ndarray, alpha: float, beta: float) -> TwoStageWeights:
    """The unbiased T = a(s) + b(s) B of least prior-averaged variance, for second-stage sizes n1[s] (s = 0..n0) and
    the working prior p ~ Beta(alpha, beta)."""
    n1 = np.asarray(n1, dtype=np.int64)
    if n1.shape != (n0 + 1,) or (n1 < 0).any():
        raise ValueError(f"n1 must hold n0 + 1 = {n0 + 1} non-negative sizes, got {n1.tolist()}")
    free = np.flatnonzero(n1 > 0)
    if not free.size:
        return TwoStageWeights(n0=n0, n1=n1, a=np.arange(n0 + 1) / n0, b=np.zeros(n0 + 1))
    m0, m1, m2, mpq = _stratum_moments(n0, alpha, beta)
    inv_n1 = np.where(n1 > 0, 1.0 / np.maximum(n1, 1), 0.0)
    # Unknowns x = (a[0..n0], b[free]); minimise E[T^2] = sum_s m0 a^2 + 2 m1 a b + (m2 + mpq / n1) b^2 subject to
    # the n0 + 2 Bernstein equations (n0 + 1 - k) a(k) + k (a(k-1) + b(k-1)) = k (module docstring), solved together
    # as one KKT system. (Eliminating a through the recursion instead multiplies rounding errors by up to C(n0, k):
    # at n0 = 24 with a U-shaped prior it gave weights of +-33 and Var(T | p = 0.5) of 17, at n0 = 16 errors of 3e-6.)
    na, nb = n0 + 1, free.size
    H = np.zeros((na + nb, na + nb))
    H[np.arange(na), np.arange(na)] = m0
    H[free, na + np.arange(nb)] = H[na + np.arange(nb), free] = m1[free]
    H[na + np.arange(nb), na + np.arange(nb)] = m2[free] + mpq[free] * inv_n1[free]
    C = np.zeros((n0 + 2, na + nb))
    k = np.arange(n0 + 2)
    C[k[:-1], k[:-1]] = n0 + 1 - k[:-1]                 # (n0 + 1 - k) a(k)
    C[k[1:], k[:-1]] += k[1:]                            # k a(k-1)
    C[free + 1, na + np.arange(nb)] = free + 1           # k b(k-1)
    scale = 1.0 / np.sqrt(np.diag(H))                    # equilibrate: strata of little prior mass have tiny m0
    Hs, Cs = H * scale[:, None] * scale[None, :], C * scale[None, :]
    kkt = np.block([[Hs, Cs.T], [Cs, np.zeros((n0 + 2, n0 + 2))]])
    rhs = np.concatenate([np.zeros(na + nb), k.astype(np.float64)])
    x = np.linalg.lstsq(kkt, rhs, rcond=None)[0][: na + nb] * scale
    b = np.zeros(n0 + 1)
    b[free] = x[na:]
    return TwoStageWeights(n0=n0, n1=n1, a=x[:na], b=b)


def estimates(w: TwoStageWeights, first_correct: np.ndarray, second_correct: np.ndarray) -> np.ndarray:
    """T for each problem: first_correct s of n0, second_correct of its n1[s] second-stage samples."""
    s = np.asarray(first_correct, dtype=np.int64)
    n1 = w.n1[s]
    second_mean = np.where(n1 > 0, np.asarray(second_correct, dtype=np.float64) / np.maximum(n1, 1), 0.0)
    return w.a[s] + w.b[s] * second_mean


def expected_variance(w: TwoStageWeights, u: np.ndarray, v: np.ndarray) -> np.ndarray:
    """E[Var(T | p)] for p ~ Beta(u, v), elementwise over arrays u, v (e.g. each problem's posterior)."""
    u = np.asarray(u, dtype=np.float64)[..., None]
    v = np.asarray(v, dtype=np.float64)[..., None]
    s = np.arange(w.n0 + 1)
    lb = _log_binom(w.n0, s) - betaln(u, v)

    def moment(j: int, k: int) -> np.ndarray:       # E[pi_s(p) p^j (1-p)^k]
        return np.exp(lb + betaln(u + s + j, v + w.n0 - s + k))

    inv_n1 = np.where(w.n1 > 0, 1.0 / np.maximum(w.n1, 1), 0.0)
    second_moment = (w.a ** 2 * moment(0, 0) + 2 * w.a * w.b * moment(1, 0) + w.b ** 2 * moment(2, 0)
                     + w.b ** 2 * inv_n1 * moment(1, 1)).sum(axis=-1)
    p2 = np.exp(betaln(u[..., 0] + 2, v[..., 0]) - betaln(u[..., 0], v[..., 0]))
    return second_moment - p2


def variance_at(w: TwoStageWeights, p: np.ndarray) -> np.ndarray:
    """Var(T | p) at fixed p (the polynomial of the module docstring), elementwise."""
    p = np.asarray(p, dtype=np.float64)[..., None]
    s = np.arange(w.n0 + 1)
    with np.errstate(divide="ignore"):
        pi = np.exp(_log_binom(w.n0, s)) * p ** s * (1 - p) ** (w.n0 - s)
    inv_n1 = np.where(w.n1 > 0, 1.0 / np.maximum(w.n1, 1), 0.0)
    term = (w.a + w.b * p) ** 2 + w.b ** 2 * p * (1 - p) * inv_n1
    return (pi * term).sum(axis=-1) - p[..., 0] ** 2


__all__ = ["TwoStageWeights", "estimates", "expected_variance", "optimal_weights", "variance_at"]
