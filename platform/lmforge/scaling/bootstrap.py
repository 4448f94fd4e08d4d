"""Bootstrap confidence intervals for both approaches and for compute-optimal predictions.

Each replicate resamples runs with replacement *within each budget* (so every IsoFLOP profile keeps its
size), refits, and records the parameters and the predictions for the target budgets. Intervals are the
percentile intervals of the replicates. Approach 3 replicates start L-BFGS from the point estimate plus a
few grid initialisations (a warm start; the full grid is used for the point estimate). Replicates whose
refit fails (e.g. a resampled profile loses its interior minimum) are counted and skipped.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

import numpy as np

from lmforge.scaling.approach2 import fit_approach2
from lmforge.scaling.approach3 import HUBER_DELTA, fit_approach3, theta_of
from lmforge.scaling.data import Observations
from lmforge.scaling.errors import ScalingError
from lmforge.scaling.laws import Law


@dataclass
class Interval:
    low: float
    high: float
    median: float

    def as_dict(self) -> dict:
        return {"low": self.low, "high": self.high, "median": self.median}


@dataclass
class BootstrapResult:
    replicates: int
    failed: int
    level: float
    params: Dict[str, Interval] = field(default_factory=dict)
    predictions: Dict[str, Dict[str, Interval]] = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {"replicates": self.replicates, "failed": self.failed, "level": self.level,
                "params": {k: v.as_dict() for k, v in self.params.items()},
                "predictions": {c: {k: v.as_dict() for k, v in d.items()} for c, d in self.predictions.items()}}


def resample_within_budgets(obs: Observations, rng: np.random.Generator) -> Observations:
    idx: List[int] = []
    for b in obs.budgets():
        members = np.flatnonzero(obs.budget == b)
        idx += rng.choice(members, size=len(members), replace=True).tolist()
    return obs.subset(idx)


def _interval(samples: Sequence[float], level: float) -> Interval:
    arr = np.asarray(samples, dtype=float)
    q = (1 - level) / 2
    return Interval(float(np.quantile(arr, q)), float(np.quantile(arr, 1 - q)), float(np.median(arr)))


def bootstrap(obs: Observations, approach: str, replicates: int = 200, targets: Sequence[float] = (),
              level: float = 0.95, seed: int = 0, point_law: Optional[Law] = None,
              delta: Optional[float] = HUBER_DELTA) -> BootstrapResult:
    """Percentile intervals for ``approach`` in {'2', '3'} over ``replicates`` resamples."""
    if replicates < 2:
        raise ScalingError("bootstrap", f"needs >= 2 replicates, got {replicates}", "use --bootstrap 200 (0 turns it off)")
    rng = np.random.default_rng(seed)
    samples: Dict[str, List[float]] = {}
    preds: Dict[str, Dict[str, List[float]]] = {f"{c:.6g}": {"n_opt": [], "d_opt": [], "loss_opt": []} for c in targets}
    failed = 0
    for _ in range(replicates):
        rep = resample_within_budgets(obs, rng)
        try:
            if approach == "2":
                fit = fit_approach2(rep)
                values = {"a": fit.n_law.exponent, "b": fit.d_law.exponent, "k_N": fit.n_law.k, "k_D": fit.d_law.k}
                for c in targets:
                    p = preds[f"{c:.6g}"]
                    p["n_opt"].append(float(fit.n_law(c)))
                    p["d_opt"].append(float(fit.d_law(c)))
                    p["loss_opt"].append(float(fit.loss_law(c)) if fit.loss_law else float("nan"))
            else:
                extra = [theta_of(point_law)] if point_law is not None else []
                fit3 = fit_approach3(rep, delta=delta, top_k=1 if extra else 4, extra_inits=extra)
                law = fit3.law
                values = {"E": law.E, "A": law.A, "B": law.B, "alpha": law.alpha, "beta": law.beta, "a": law.a,
                          "b": law.b}
                for c in targets:
                    n, d, l_opt = law.optimal(c)
                    p = preds[f"{c:.6g}"]
                    p["n_opt"].append(float(n))
                    p["d_opt"].append(float(d))
                    p["loss_opt"].append(float(l_opt))
        except ScalingError:
            failed += 1
            continue
        for k, v in values.items():
            samples.setdefault(k, []).append(v)
    ok = replicates - failed
    if ok < 2:
        raise ScalingError(f"bootstrap (Approach {approach})", f"{failed} of {replicates} replicates failed to fit",
                           "add runs per budget so resampled profiles keep an interior minimum")
    return BootstrapResult(replicates, failed, level, {k: _interval(v, level) for k, v in samples.items()},
                           {c: {k: _interval(v, level) for k, v in d.items()} for c, d in preds.items()})
