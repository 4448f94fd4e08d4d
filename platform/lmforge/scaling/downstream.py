"""Downstream scaling: an eval metric (accuracy, pass rate, ...) as a sigmoidal function of loss or of compute.

Loss falls smoothly with compute, but a task's accuracy moves from chance towards a ceiling along an
S-curve; recent scaling-law work (e.g. the Llama 3 report's two-step prediction, Gadre et al. 2024) fits
that link so a small-run sweep can predict a large run's benchmark score. The link is

    m(x) = floor + (ceiling - floor) / (1 + exp(-slope (x - mid)))

with x = loss (then slope < 0: lower loss, higher score) or x = ln C (``against='compute'``). ``floor`` may
be fixed at the task's chance level (e.g. 0.25 for four-way multiple choice); otherwise it is fitted with
the other three parameters by bounded least squares (scipy), from a grid of starts. ``bootstrap`` gives
percentile intervals by resampling runs across the table.

The link is fitted inside the observed range of x; a prediction far outside it is an extrapolation of the
S-curve's shape, which a sweep whose scores all sit near chance cannot constrain (the fit says so: the
mid-point then lies outside the data and its interval is wide).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

import numpy as np
from scipy.optimize import least_squares

from lmforge.scaling.errors import ScalingError

AGAINST = ("loss", "compute")
MIN_RUNS = 5
PARAMS = ("floor", "ceiling", "slope", "mid")


@dataclass
class SigmoidLink:
    floor: float
    ceiling: float
    slope: float
    mid: float
    against: str = "loss"

    def __call__(self, x) -> np.ndarray:
        x = np.asarray(x, dtype=float)
        z = np.log(x) if self.against == "compute" else x
        return self.floor + (self.ceiling - self.floor) / (1.0 + np.exp(-self.slope * (z - self.mid)))

    def as_dict(self) -> dict:
        return {
            "floor": self.floor,
            "ceiling": self.ceiling,
            "slope": self.slope,
            "mid": self.mid,
            "against": self.against,
        }


@dataclass
class DownstreamFit:
    metric: str
    link: SigmoidLink
    rms: float
    runs: int
    fixed_floor: Optional[float]
    intervals: Dict[str, dict] = field(default_factory=dict)
    failed: int = 0
    predictions: List[dict] = field(default_factory=list)

    def as_dict(self) -> dict:
        return {
            "metric": self.metric,
            **self.link.as_dict(),
            "rms": self.rms,
            "runs": self.runs,
            "fixed_floor": self.fixed_floor,
            "intervals": self.intervals,
            "failed_refits": self.failed,
            "predictions": self.predictions,
        }


def _fit_z(z: np.ndarray, m: np.ndarray, against: str, floor: Optional[float]) -> tuple[np.ndarray, float]:
    """Best (floor, ceiling, slope, mid) for metric ``m`` at ``z`` (loss or ln C), and its rms residual."""
    sign = -1.0 if against == "loss" else 1.0
    span = float(np.ptp(z)) or 1.0
    lo_m, hi_m = float(m.min()), float(m.max())

    def unpack(p):
        return (floor, *p) if floor is not None else tuple(p)

    def resid(p):
        f, c, s, mid = unpack(p)
        return f + (c - f) / (1.0 + np.exp(-s * (z - mid))) - m

    best = None
    for mid0 in np.quantile(z, [0.25, 0.5, 0.75]):
        for s0 in (2.0 / span, 8.0 / span):
            start = [hi_m + 0.05 * (hi_m - lo_m), sign * s0, mid0]
            lower, upper = [lo_m - 1.0, -np.inf, z.min() - 3 * span], [hi_m + 1.0, np.inf, z.max() + 3 * span]
            if floor is None:
                start, lower, upper = [lo_m] + start, [lo_m - 1.0] + lower, [hi_m + 1.0] + upper
            if sign < 0:
                lower[-2], upper[-2] = -np.inf, 0.0
                start[-2] = min(start[-2], -1e-6)
            else:
                lower[-2], upper[-2] = 0.0, np.inf
            res = least_squares(resid, start, bounds=(lower, upper), max_nfev=400)
            if best is None or res.cost < best.cost:
                best = res
    return np.asarray(unpack(best.x), dtype=float), float(np.sqrt(np.mean(best.fun**2)))


def fit_link(
    x: Sequence[float],
    metric: Sequence[float],
    against: str = "loss",
    floor: Optional[float] = None,
    name: str = "metric",
) -> DownstreamFit:
    if against not in AGAINST:
        raise ScalingError(
            f"--metric-against {against}", "is not a downstream axis", f"choose one of {', '.join(AGAINST)}"
        )
    x, m = np.asarray(x, dtype=float), np.asarray(metric, dtype=float)
    ok = np.isfinite(x) & np.isfinite(m) & (x > 0)
    if ok.sum() < MIN_RUNS:
        raise ScalingError(
            f"downstream '{name}'",
            f"{int(ok.sum())} run(s) carry a finite value; the sigmoidal link "
            f"has up to 4 parameters and needs at least {MIN_RUNS}",
            "evaluate the task in more runs",
        )
    x, m = x[ok], m[ok]
    if np.ptp(m) <= 0:
        raise ScalingError(
            f"downstream '{name}'",
            f"every run scores {m[0]:g}: a constant has no link to fit",
            "use a task the sweep's models can partly solve, or bigger budgets",
        )
    z = np.log(x) if against == "compute" else x
    p, rms = _fit_z(z, m, against, floor)
    return DownstreamFit(name, SigmoidLink(*map(float, p), against=against), rms, int(len(m)), floor)


def bootstrap_link(
    fit: DownstreamFit,
    x: Sequence[float],
    metric: Sequence[float],
    replicates: int = 100,
    level: float = 0.95,
    seed: int = 0,
    at: Sequence[float] = (),
) -> DownstreamFit:
    """Percentile intervals of the link's parameters (and of its values ``at``) by resampling runs."""
    x, m = np.asarray(x, dtype=float), np.asarray(metric, dtype=float)
    ok = np.isfinite(x) & np.isfinite(m) & (x > 0)
    x, m = x[ok], m[ok]
    z = np.log(x) if fit.link.against == "compute" else x
    rng = np.random.default_rng(seed)
    draws, failed = [], 0
    for _ in range(replicates):
        idx = rng.integers(0, len(m), size=len(m))
        if np.ptp(m[idx]) <= 0:
            failed += 1
            continue
        p, _ = _fit_z(z[idx], m[idx], fit.link.against, fit.fixed_floor)
        draws.append(p)
    if len(draws) < 2:
        raise ScalingError(
            f"downstream '{fit.metric}'",
            f"{failed} of {replicates} bootstrap refits failed",
            "evaluate the task in more runs",
        )
    draws = np.array(draws)
    q = (1 - level) / 2
    fit.intervals = {
        k: {"low": float(np.quantile(draws[:, i], q)), "high": float(np.quantile(draws[:, i], 1 - q))}
        for i, k in enumerate(PARAMS)
    }
    fit.failed = failed
    for x0 in at:
        vals = [float(SigmoidLink(*p, against=fit.link.against)(x0)) for p in draws]
        fit.predictions.append(
            {
                "x": float(x0),
                "value": float(fit.link(x0)),
                "low": float(np.quantile(vals, q)),
                "high": float(np.quantile(vals, 1 - q)),
            }
        )
    return fit
