"""Chinchilla Approach 3: fit the parametric law L(N, D) = E + A/N^alpha + B/D^beta directly.

As Hoffmann et al. (2022) and the Epoch AI replication (Besiroglu et al. 2024) do, the fit minimises the
Huber loss (delta = 1e-3) between the predicted and observed *log* loss,

    min_{a, b, e, alpha, beta}  sum_i Huber_delta( LSE(a - alpha ln N_i, b - beta ln D_i, e) - ln L_i ),
    A = exp(a), B = exp(b), E = exp(e),

with L-BFGS (alpha, beta >= 0) started from a grid of initialisations (alpha, beta in {0, 0.5, ..., 2}, e in {-1, -0.5, ..., 1},
a, b in {0, 5, ..., 25}). The objective is evaluated on the whole grid at once and L-BFGS is run from the
``top_k`` best grid points (all of them with ``top_k=None``); the best optimum wins. The LSE form keeps every
term positive and the gradient is exact, which avoids the precision problems the replication reports.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
from scipy.optimize import minimize

from lmforge.scaling.data import Observations
from lmforge.scaling.errors import ScalingError
from lmforge.scaling.laws import Law

HUBER_DELTA = 1e-3
GRID = dict(
    alpha=np.arange(0.0, 2.01, 0.5), beta=np.arange(0.0, 2.01, 0.5), e=np.arange(-1.0, 1.01, 0.5),
    a=np.arange(0.0, 25.1, 5.0), b=np.arange(0.0, 25.1, 5.0),
)
MIN_POINTS = 6  # five free parameters
# alpha, beta >= 0: loss does not grow with more parameters or data (a, b, e are free).
BOUNDS = [(None, None), (None, None), (None, None), (0.0, None), (0.0, None)]


@dataclass
class Approach3Fit:
    law: Law
    objective: float
    delta: Optional[float]
    inits_tried: int
    converged: bool

    def residuals(self, obs: Observations) -> np.ndarray:
        """ln L_observed - ln L_predicted per run."""
        return np.log(obs.loss) - np.log(self.law.loss(obs.n, obs.d))

    def as_dict(self) -> dict:
        return {**self.law.as_dict(), "objective": self.objective, "huber_delta": self.delta,
                "inits_tried": self.inits_tried, "converged": self.converged}


def _huber(r: np.ndarray, delta: Optional[float]) -> tuple[np.ndarray, np.ndarray]:
    """Huber value and derivative; ``delta=None`` is the plain squared loss 0.5 r^2."""
    if delta is None:
        return 0.5 * r * r, r
    small = np.abs(r) <= delta
    val = np.where(small, 0.5 * r * r, delta * (np.abs(r) - 0.5 * delta))
    grad = np.where(small, r, delta * np.sign(r))
    return val, grad


def _terms(theta: np.ndarray, ln_n: np.ndarray, ln_d: np.ndarray) -> np.ndarray:
    """[..., 3, n] stack of the three log-terms for parameters theta[..., (a, b, e, alpha, beta)]."""
    a, b, e, al, be = (theta[..., i, None] for i in range(5))
    return np.stack([a - al * ln_n, b - be * ln_d, np.broadcast_to(e, (a - al * ln_n).shape)], axis=-2)


def _objective(theta, ln_n, ln_d, y, delta):
    t = _terms(theta, ln_n, ln_d)
    m = t.max(axis=-2, keepdims=True)
    w = np.exp(t - m)
    s = w.sum(axis=-2, keepdims=True)
    pred = (m + np.log(s))[..., 0, :]
    val, dh = _huber(pred - y, delta)
    w = w / s
    grad = np.stack([(dh * w[..., 0, :]).sum(-1), (dh * w[..., 1, :]).sum(-1), (dh * w[..., 2, :]).sum(-1),
                     -(dh * w[..., 0, :] * ln_n).sum(-1), -(dh * w[..., 1, :] * ln_d).sum(-1)], axis=-1)
    return val.sum(-1), grad


def _objective_one(theta, ln_n, ln_d, y, delta):
    """The same objective and gradient for one parameter vector (the L-BFGS inner loop), without stacking."""
    a, b, e, al, be = theta
    t1 = a - al * ln_n
    t2 = b - be * ln_d
    m = np.maximum(np.maximum(t1, t2), e)
    w1, w2, w3 = np.exp(t1 - m), np.exp(t2 - m), np.exp(e - m)
    s = w1 + w2 + w3
    r = m + np.log(s) - y
    if delta is None:
        val, dh = 0.5 * r * r, r
    else:
        small = np.abs(r) <= delta
        val = np.where(small, 0.5 * r * r, delta * (np.abs(r) - 0.5 * delta))
        dh = np.where(small, r, delta * np.sign(r))
    dh = dh / s
    g1, g2 = dh * w1, dh * w2
    grad = np.array([g1.sum(), g2.sum(), (dh * w3).sum(), -(g1 * ln_n).sum(), -(g2 * ln_d).sum()])
    return float(val.sum()), grad


def init_grid() -> np.ndarray:
    rows = itertools.product(GRID["a"], GRID["b"], GRID["e"], GRID["alpha"], GRID["beta"])
    return np.array(list(rows), dtype=float)


def fit_approach3(obs: Observations, delta: Optional[float] = HUBER_DELTA, top_k: Optional[int] = 8,
                  extra_inits: Sequence[Sequence[float]] = (), maxiter: int = 2000) -> Approach3Fit:
    obs.check()
    if len(obs) < MIN_POINTS:
        raise ScalingError("Approach 3", f"has {len(obs)} run(s); the law has 5 free parameters and needs at least "
                           f"{MIN_POINTS}", "plan more runs (>= 5 sizes at >= 2 budgets)")
    ln_n, ln_d, y = np.log(obs.n), np.log(obs.d), np.log(obs.loss)
    grid = init_grid()
    values, _ = _objective(grid, ln_n, ln_d, y, delta)
    order = np.argsort(values)
    starts = grid[order if top_k is None else order[:top_k]]
    if len(extra_inits):
        starts = np.concatenate([np.asarray(extra_inits, dtype=float).reshape(-1, 5), starts])

    def fun(theta):
        return _objective_one(theta, ln_n, ln_d, y, delta)

    best = None
    for x0 in starts:
        res = minimize(fun, x0, jac=True, method="L-BFGS-B", bounds=BOUNDS,
                       options={"maxiter": maxiter, "ftol": 1e-15, "gtol": 1e-12})
        if best is None or res.fun < best.fun:
            best = res
    a, b, e, al, be = best.x
    law = Law(E=float(np.exp(e)), A=float(np.exp(a)), B=float(np.exp(b)), alpha=float(al), beta=float(be))
    return Approach3Fit(law, float(best.fun), delta, len(starts), bool(best.success))


def theta_of(law: Law) -> list:
    return [float(np.log(law.A)), float(np.log(law.B)), float(np.log(law.E)), law.alpha, law.beta]
