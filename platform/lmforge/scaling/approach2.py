"""Chinchilla Approach 2: IsoFLOP profiles.

For each budget C the runs' final losses are fitted with a parabola in log N,

    L(N) ~ p2 (ln N)^2 + p1 ln N + p0,      ln N*(C) = -p1 / (2 p2),

and likewise in ln D for D*(C). The minima across budgets then give power laws by least squares in log space:

    N*(C) = k_N C^a,     D*(C) = k_D C^b.

A parabola needs 3 points (the planner gives >= 5); its vertex must lie inside the budget's grid, because a
vertex outside is an extrapolation the data cannot support.

**Scattered tables** (runs at their own budgets, as in published tables) have no IsoFLOP profiles: their
budgets are grouped into ``bins`` log-spaced bins (``binned``), each labelled by the geometric mean C_b of its
runs' budgets, and each bin's profile carries a first-order correction for the spread of budgets inside it,

    L ~ p2 (ln N)^2 + p1 ln N + p0 + q ln(C_i / C_b),

so the vertex is the minimum at C_b (q is fitted; with one budget per bin the term is absent). The
correction is first order only: wide bins still bias N*, so prefer more, narrower bins when runs allow.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional

import numpy as np

from lmforge.scaling.data import Observations
from lmforge.scaling.errors import ScalingError

MIN_POINTS_PER_BUDGET = 3


@dataclass
class IsoFlopMinimum:
    budget: float
    n_opt: float
    d_opt: float
    loss_opt: float
    n_coef: List[float]  # parabola coefficients in ln N (highest power first)
    d_coef: List[float]
    points: int
    budget_coef: float = 0.0  # q: d loss / d ln(C_i / C_b) inside a budget bin (0 on an IsoFLOP grid)

    def predict(self, obs: Observations, sel: np.ndarray) -> np.ndarray:
        """The profile's fitted losses for the runs ``sel`` (of this budget)."""
        return np.polyval(self.n_coef, np.log(obs.n[sel])) + self.budget_coef * np.log(
            obs.true_budget[sel] / self.budget
        )


@dataclass
class PowerLaw:
    """y = k * C^exponent."""

    k: float
    exponent: float

    def __call__(self, c):
        return self.k * np.asarray(c, dtype=float) ** self.exponent


@dataclass
class Approach2Fit:
    minima: List[IsoFlopMinimum]
    n_law: PowerLaw
    d_law: PowerLaw
    loss_law: Optional[PowerLaw] = None
    extras: Dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {
            "a": self.n_law.exponent,
            "k_N": self.n_law.k,
            "b": self.d_law.exponent,
            "k_D": self.d_law.k,
            "minima": [m.__dict__ for m in self.minima],
        }


def _fmt_c(c: float) -> str:
    return f"{c:.3g}"


def _vertex(
    x: np.ndarray, y: np.ndarray, budget: float, axis: str, u: Optional[np.ndarray] = None
) -> tuple[float, List[float], float]:
    if u is None:
        coef, q = np.polyfit(x, y, 2), 0.0
    else:
        sol = np.linalg.lstsq(np.stack([x * x, x, np.ones_like(x), u], axis=1), y, rcond=None)[0]
        coef, q = sol[:3], float(sol[3])
    p2, p1, _ = coef
    lo, hi = float(np.exp(x.min())), float(np.exp(x.max()))
    if not p2 > 0:
        best = float(np.exp(x[np.argmin(y)]))
        side = "smaller" if best <= lo * 1.0001 else ("larger" if best >= hi * 0.9999 else "both smaller and larger")
        raise ScalingError(
            f"budget C={_fmt_c(budget)}",
            f"the IsoFLOP profile in {axis} has no minimum inside the grid (the loss is not convex in ln {axis}; "
            f"the lowest loss is at {axis}={best:.4g}, grid spans {lo:.4g}..{hi:.4g})",
            f"extend the grid for this budget towards {side} {axis} (sweep plan: widen --tpp or the shape family's "
            f"layer range) so the minimum is bracketed",
        )
    xv = -p1 / (2 * p2)
    if not x.min() <= xv <= x.max():
        side = "smaller" if xv < x.min() else "larger"
        raise ScalingError(
            f"budget C={_fmt_c(budget)}",
            f"the IsoFLOP minimum is not inside the grid: the parabola's vertex is at {axis}={np.exp(xv):.4g}, "
            f"outside the grid's {lo:.4g}..{hi:.4g}",
            f"extend the grid for this budget towards {side} {axis} (sweep plan: widen --tpp or the shape family's "
            f"layer range) so the minimum is bracketed",
        )
    return float(xv), [float(c) for c in coef], q


def isoflop_minimum(obs: Observations, budget: float, min_points: int = MIN_POINTS_PER_BUDGET) -> IsoFlopMinimum:
    sel = obs.budget == budget
    k = int(sel.sum())
    sizes = len(set(obs.n[sel].tolist()))
    if k < min_points or sizes < min_points:
        raise ScalingError(
            f"budget C={_fmt_c(budget)}",
            f"has {sizes} distinct model size(s) ({k} run(s)); an IsoFLOP parabola needs at least {min_points}",
            "plan at least 5 sizes per budget (sweep plan --sizes 5) and check that their runs finished "
            "(lmforge sweep run lists failed runs)",
        )
    ln_n, ln_d, y = np.log(obs.n[sel]), np.log(obs.d[sel]), obs.loss[sel]
    u = np.log(obs.true_budget[sel] / budget)
    u = u if np.ptp(u) > 1e-9 and k > min_points else None  # a spread of budgets inside a bin: correct for it
    xn, ncoef, q = _vertex(ln_n, y, budget, "N", u)
    xd, dcoef, _ = _vertex(ln_d, y, budget, "D", u)
    return IsoFlopMinimum(
        budget, float(np.exp(xn)), float(np.exp(xd)), float(np.polyval(ncoef, xn)), ncoef, dcoef, k, q
    )


def budget_bins(obs: Observations, bins: int) -> np.ndarray:
    """Each run's bin label: ``bins`` log-spaced bins over the table's budgets, each labelled by the geometric
    mean of the budgets it holds."""
    if bins < 2:
        raise ScalingError(
            f"--bins {bins}", "Approach 2 needs at least 2 budget bins to fit a power law", "use --bins 6"
        )
    c = obs.true_budget
    ln_c = np.log(c)
    edges = np.linspace(ln_c.min(), ln_c.max(), bins + 1)
    which = np.clip(np.searchsorted(edges, ln_c, side="right") - 1, 0, bins - 1)
    labels = np.empty_like(c)
    for b in set(which.tolist()):
        sel = which == b
        labels[sel] = float(np.exp(ln_c[sel].mean()))
    return labels


def binned(obs: Observations, bins: int) -> Observations:
    """The table with each run's budget replaced by its log-spaced bin's label (``true_budget`` keeps its own)."""
    return Observations(budget_bins(obs, bins), obs.n, obs.d, obs.loss, list(obs.ids), obs.true_budget, obs.groups)


def fit_power_law(c: np.ndarray, y: np.ndarray) -> PowerLaw:
    slope, intercept = np.polyfit(np.log(c), np.log(y), 1)
    return PowerLaw(float(np.exp(intercept)), float(slope))


def fit_approach2(obs: Observations, min_points: int = MIN_POINTS_PER_BUDGET) -> Approach2Fit:
    obs.check()
    budgets = obs.budgets()
    if len(budgets) < 2:
        raise ScalingError(
            "Approach 2",
            f"needs IsoFLOP profiles at >= 2 budgets to fit a power law, got "
            f"{len(budgets)} ({', '.join(_fmt_c(b) for b in budgets)})",
            "plan more budgets (sweep plan --budgets 1e11,3e11,1e12)",
        )
    minima = [isoflop_minimum(obs, b, min_points) for b in budgets]
    c = np.array([m.budget for m in minima])
    return Approach2Fit(
        minima,
        fit_power_law(c, np.array([m.n_opt for m in minima])),
        fit_power_law(c, np.array([m.d_opt for m in minima])),
        fit_power_law(c, np.array([m.loss_opt for m in minima])),
    )
