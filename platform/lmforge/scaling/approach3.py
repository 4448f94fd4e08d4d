"""Chinchilla Approach 3: fit the parametric law L(N, D) = E + A/N^alpha + B/D^beta directly.

As Hoffmann et al. (2022) and the Epoch AI replication (Besiroglu et al. 2024) do, the fit minimises the
Huber loss (delta = 1e-3) between the predicted and observed *log* loss,

    min_{a, b, e, alpha, beta}  sum_i Huber_delta( LSE(a - alpha ln N_i, b - beta ln D_i, e) - ln L_i ),
    A = exp(a), B = exp(b), E = exp(e),

with a damped Gauss-Newton (Levenberg-Marquardt) on the reweighted Huber objective, alpha, beta >= 0 (the
replication uses L-BFGS; both minimise the same objective), started from a grid of initialisations (alpha, beta in {0, 0.5, ..., 2}, e in {-1, -0.5, ..., 1},
a, b in {0, 5, ..., 25}). The objective is evaluated on the whole grid at once and the optimiser runs, as one batch, from the
``top_k`` best grid points (all of them with ``top_k=None``); the best optimum wins. The LSE form keeps every
term positive and the gradient is exact, which avoids the precision problems the replication reports.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from lmforge.scaling.data import Observations
from lmforge.scaling.errors import ScalingError
from lmforge.scaling.laws import Law

HUBER_DELTA = 1e-3
GRID = dict(
    alpha=np.arange(0.0, 2.01, 0.5),
    beta=np.arange(0.0, 2.01, 0.5),
    e=np.arange(-1.0, 1.01, 0.5),
    a=np.arange(0.0, 25.1, 5.0),
    b=np.arange(0.0, 25.1, 5.0),
)
MIN_POINTS = 6  # five free parameters


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
        return {
            **self.law.as_dict(),
            "objective": self.objective,
            "huber_delta": self.delta,
            "inits_tried": self.inits_tried,
            "converged": self.converged,
        }


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
    grad = np.stack(
        [
            (dh * w[..., 0, :]).sum(-1),
            (dh * w[..., 1, :]).sum(-1),
            (dh * w[..., 2, :]).sum(-1),
            -(dh * w[..., 0, :] * ln_n).sum(-1),
            -(dh * w[..., 1, :] * ln_d).sum(-1),
        ],
        axis=-1,
    )
    return val.sum(-1), grad


def init_grid() -> np.ndarray:
    rows = itertools.product(GRID["a"], GRID["b"], GRID["e"], GRID["alpha"], GRID["beta"])
    return np.array(list(rows), dtype=float)


def fit_approach3(
    obs: Observations,
    delta: Optional[float] = HUBER_DELTA,
    top_k: Optional[int] = 8,
    extra_inits: Sequence[Sequence[float]] = (),
    maxiter: int = 300,
) -> Approach3Fit:
    return fit_approach3_many([obs], delta, top_k, [extra_inits], maxiter)[0]


def stack_tables(tables: Sequence[Observations], copies: Sequence[int]) -> tuple[np.ndarray, ...]:
    """(ln N, ln D, ln L, weights), each [sum(copies), n_max]: table i repeated copies[i] times, shorter
    tables padded with weight-0 rows (which no objective sees)."""
    width = max(len(t) for t in tables)
    rows = sum(copies)
    ln_n, ln_d, y, w = (np.zeros((rows, width)) for _ in range(4))
    at = 0
    for t, c in zip(tables, copies):
        n = len(t)
        ln_n[at : at + c, :n], ln_d[at : at + c, :n], y[at : at + c, :n] = np.log(t.n), np.log(t.d), np.log(t.loss)
        w[at : at + c, :n] = 1.0
        at += c
    return ln_n, ln_d, y, w


def fit_approach3_many(
    tables: Sequence[Observations],
    delta: Optional[float] = HUBER_DELTA,
    top_k: Optional[int] = 8,
    extra_inits: Sequence[Sequence[Sequence[float]]] = (),
    maxiter: int = 300,
) -> list:
    """Point fits of several tables at once (every table's starts in one batch of ``fit_law_batch``)."""
    grid = init_grid()
    starts, copies = [], []
    for i, obs in enumerate(tables):
        obs.check()
        if len(obs) < MIN_POINTS:
            raise ScalingError(
                "Approach 3",
                f"has {len(obs)} run(s); the law has 5 free parameters and needs at least {MIN_POINTS}",
                "plan more runs (>= 5 sizes at >= 2 budgets)",
            )
        values, _ = _objective(grid, np.log(obs.n), np.log(obs.d), np.log(obs.loss), delta)
        order = np.argsort(values)
        own = grid[order if top_k is None else order[:top_k]]
        extra = extra_inits[i] if i < len(extra_inits) else ()
        if len(extra):
            own = np.concatenate([np.asarray(extra, dtype=float).reshape(-1, 5), own])
        starts.append(own)
        copies.append(len(own))
    ln_n, ln_d, y, w = stack_tables(tables, copies)
    theta, objective, converged = fit_law_batch(ln_n, ln_d, y, w, np.concatenate(starts), delta, max_iter=maxiter)
    fits, at = [], 0
    for c in copies:
        i = at + int(np.argmin(objective[at : at + c]))
        a, b, e, al, be = theta[i]
        law = Law(E=float(np.exp(e)), A=float(np.exp(a)), B=float(np.exp(b)), alpha=float(al), beta=float(be))
        fits.append(Approach3Fit(law, float(objective[i]), delta, c, bool(converged[i])))
        at += c
    return fits


def fit_law_batch(
    ln_n, ln_d, y, weights, theta0, delta: Optional[float] = HUBER_DELTA, max_iter: int = 300, tol: float = 1e-10
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Fit K data sets at once: (theta [K, 5], objective [K], converged [K]).

    ``ln_n``, ``ln_d``, ``y`` are [n] (shared) or [K, n]; ``weights`` [K, n] are per-run multiplicities (a
    pairs bootstrap is a multinomial count vector; 1 everywhere is a plain fit); ``theta0`` [K, 5] the starts.
    The objective is the same weighted Huber objective as :func:`fit_approach3`'s, minimised by
    Levenberg-Marquardt on its iteratively reweighted Gauss-Newton model (Huber weights min(1, delta/|r|)),
    a step accepted per data set only when it lowers that set's objective, alpha and beta projected onto >= 0.
    Every operation is over the whole batch, which is what makes bootstraps and calibration cheap.
    """
    w = np.asarray(weights, dtype=float)
    k, n = w.shape
    ln_n, ln_d, y = (np.broadcast_to(np.asarray(v, dtype=float), (k, n)) for v in (ln_n, ln_d, y))
    theta = np.array(theta0, dtype=float).reshape(k, 5).copy()
    theta[:, 3:] = np.maximum(theta[:, 3:], 0.0)

    def evaluate_rows(th, rows):
        t1 = th[:, 0:1] - th[:, 3:4] * ln_n[rows]
        t2 = th[:, 1:2] - th[:, 4:5] * ln_d[rows]
        t3 = np.broadcast_to(th[:, 2:3], t1.shape)
        m = np.maximum(np.maximum(t1, t2), t3)
        e1, e2, e3 = np.exp(t1 - m), np.exp(t2 - m), np.exp(t3 - m)
        s = e1 + e2 + e3
        r = m + np.log(s) - y[rows]
        val, _ = _huber(r, delta)
        return (w[rows] * val).sum(-1), r, (e1 / s, e2 / s, e3 / s)

    obj, r, sm = evaluate_rows(theta, np.arange(k))
    lam = np.full(k, 1e-3)
    done = np.zeros(k, dtype=bool)
    eye = np.eye(5)
    for _ in range(max_iter):
        act = np.flatnonzero(~done)  # only the data sets still moving are computed
        if not len(act):
            break
        w1, w2, w3 = (v[act] for v in sm)
        jac = np.stack([w1, w2, w3, -w1 * ln_n[act], -w2 * ln_d[act]], axis=-1)  # [K', n, 5]
        ra = r[act]
        omega = w[act] if delta is None else w[act] * np.minimum(1.0, delta / np.maximum(np.abs(ra), 1e-300))
        jw = jac * omega[..., None]
        h = np.einsum("kni,knj->kij", jw, jac)
        g = np.einsum("kni,kn->ki", jw, ra)
        damp = lam[act, None, None] * (h * eye + 1e-12 * eye)
        cand = theta[act] + np.linalg.solve(h + damp, -g[..., None])[..., 0]
        cand[:, 3:] = np.maximum(cand[:, 3:], 0.0)
        cobj, cr, csm = evaluate_rows(cand, act)
        better = (cobj < obj[act]) & np.isfinite(cobj)
        gain = np.where(better, (obj[act] - cobj) / np.maximum(obj[act], 1e-300), 0.0)
        upd = act[better]
        theta[upd], r[upd], obj[upd] = cand[better], cr[better], cobj[better]
        for full, part in zip(sm, csm):
            full[upd] = part[better]
        lam[act] = np.where(better, np.maximum(lam[act] / 3, 1e-9), lam[act] * 4)
        done[act] = (better & (gain < tol)) | (lam[act] > 1e10)
    return theta, obj, done  # done: the gain fell below tol, or no damped step lowers the objective any more


def theta_of(law: Law) -> list:
    return [float(np.log(law.A)), float(np.log(law.B)), float(np.log(law.E)), law.alpha, law.beta]
