"""Bootstrap intervals for both approaches and for compute-optimal predictions, honest for any table design.

A table is an **IsoFLOP grid** when its median budget holds >= 3 runs (budgets are profiles) and
**scattered** otherwise (e.g. every run at its own budget, as in published tables). Resampling only
within budgets on a scattered table resamples each run onto itself and every interval collapses to a
point, so the method follows the design (``auto``):

============  ===========================  ==========================================================
design        Approach 2                   Approach 3
============  ===========================  ==========================================================
IsoFLOP grid  ``within-budget``            ``within-budget``
scattered     ``within-budget`` of the     ``runs``
              log-spaced budget bins
============  ===========================  ==========================================================

Methods (each replicate refits the whole table; percentile intervals at ``level``):

- ``within-budget``: runs drawn with replacement inside each budget (a stratified bootstrap: every
  profile keeps its size). Refused on a table whose budgets hold one run each (no variation to draw).
- ``runs``: runs drawn with replacement across the whole table (the pairs bootstrap).
- ``budget-blocks``: whole log-spaced budget bins drawn with replacement (keeps whatever is correlated
  within a range of budgets, e.g. one learning-rate rule or one data order; needs >= 3 bins).
- ``stable-runs``: whole clusters drawn with replacement (a cluster bootstrap): the cooldown branches of one
  stable run (``sweep plan --wsd-branches``; the ``stable_run`` column) share its trajectory up to their branch
  points, so their losses are not independent draws. The default (``auto``) for both approaches whenever the
  table names stable runs; needs >= 3 of them.
- ``residual``: the point fit's log-loss residuals, inflated by sqrt(n / (n - p)) for the p fitted
  parameters, drawn with replacement and added back to the fitted values (fixed design; assumes the law's
  form is right and the noise exchangeable).

Approach 3 replicates are fitted together as one batch (``fit_law_batch``), started from the point
estimate; a replicate whose fit did not converge, or whose law does not decrease in both N and D (no
compute-optimal allocation), is counted as failed and left out. Approach 2 replicates that lose an
interior minimum are counted the same way.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

import numpy as np

from lmforge.scaling.approach2 import binned, budget_bins, fit_approach2
from lmforge.scaling.approach3 import HUBER_DELTA, fit_approach3, fit_law_batch, theta_of
from lmforge.scaling.data import Observations
from lmforge.scaling.errors import ScalingError
from lmforge.scaling.laws import Law

METHODS = ("auto", "within-budget", "runs", "budget-blocks", "stable-runs", "residual")
MIN_CLUSTERS = 3
ISOFLOP, SCATTERED = "isoflop-grid", "scattered"
MIN_SIZES_PER_PROFILE = 3


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
    method: str = ""
    design: str = ""
    params: Dict[str, Interval] = field(default_factory=dict)
    predictions: Dict[str, Dict[str, Interval]] = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {
            "replicates": self.replicates,
            "failed": self.failed,
            "level": self.level,
            "method": self.method,
            "design": self.design,
            "params": {k: v.as_dict() for k, v in self.params.items()},
            "predictions": {c: {k: v.as_dict() for k, v in d.items()} for c, d in self.predictions.items()},
        }


def design_of(obs: Observations) -> str:
    """``isoflop-grid`` when the median budget holds >= 3 runs (profiles; a grid with one broken budget stays
    a grid, so Approach 2 names that budget), else ``scattered``."""
    counts = [int((obs.budget == b).sum()) for b in obs.budgets()]
    return ISOFLOP if float(np.median(counts)) >= MIN_SIZES_PER_PROFILE else SCATTERED


def default_method(design: str, approach: str, obs: Optional[Observations] = None) -> str:
    if obs is not None and obs.clustered():
        return "stable-runs"
    return "runs" if design == SCATTERED and approach == "3" else "within-budget"


def resample_within_budgets(obs: Observations, rng: np.random.Generator) -> Observations:
    return obs.subset(_within_budget_idx(obs, rng))


def _within_budget_idx(obs: Observations, rng: np.random.Generator) -> np.ndarray:
    idx: List[int] = []
    for b in obs.budgets():
        members = np.flatnonzero(obs.budget == b)
        idx += rng.choice(members, size=len(members), replace=True).tolist()
    return np.asarray(idx, dtype=int)


def _block_idx(labels: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    groups = [np.flatnonzero(labels == g) for g in sorted(set(labels.tolist()))]
    picks = rng.integers(0, len(groups), size=len(groups))
    return np.concatenate([groups[i] for i in picks])


def check_method(obs: Observations, method: str, bins: int) -> None:
    """Refuse a method this table cannot support (``obs``: as the approach sees it, binned for Approach 2)."""
    if method not in METHODS[1:]:
        raise ScalingError(
            f"--bootstrap-method {method}", "is not a bootstrap method", f"choose one of {', '.join(METHODS)}"
        )
    if method == "within-budget" and all((obs.budget == b).sum() < 2 for b in obs.budgets()):
        raise ScalingError(
            "--bootstrap-method within-budget",
            "every budget of this table holds one run, so resampling "
            "within budgets redraws each run onto itself and every interval would have zero width",
            "use --bootstrap-method auto (runs for a scattered table) or runs/residual",
        )
    if method == "stable-runs" and (obs.groups is None or len(set(obs.groups)) < MIN_CLUSTERS):
        raise ScalingError(
            "--bootstrap-method stable-runs",
            f"the table names {0 if obs.groups is None else len(set(obs.groups))} stable run(s) (column stable_run); "
            f"a cluster bootstrap needs at least {MIN_CLUSTERS}",
            "collect a wsd-branches sweep with more sizes, or use --bootstrap-method auto",
        )
    if method == "budget-blocks" and len(set(budget_bins(obs, bins).tolist())) < 3:
        raise ScalingError(
            "--bootstrap-method budget-blocks",
            f"the table's budgets fill fewer than 3 of {bins} bins",
            "raise --bins, or use --bootstrap-method runs",
        )


def _interval(samples: Sequence[float], level: float) -> Interval:
    arr = np.asarray(samples, dtype=float)
    q = (1 - level) / 2
    return Interval(float(np.quantile(arr, q)), float(np.quantile(arr, 1 - q)), float(np.median(arr)))


def _law_of(theta: np.ndarray) -> Law:
    a, b, e, al, be = (float(v) for v in theta)
    return Law(E=float(np.exp(e)), A=float(np.exp(a)), B=float(np.exp(b)), alpha=al, beta=be)


def _approach3_draws(
    obs: Observations, method: str, replicates: int, point_law: Law, bins: int, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """(ln L [R, n], weights [R, n]) of ``replicates`` resamples of one table."""
    n = len(obs)
    y = np.log(obs.loss)
    weights = np.zeros((replicates, n))
    if method == "residual":
        fitted = np.log(point_law.loss(obs.n, obs.d))
        resid = (y - fitted) * np.sqrt(n / max(1, n - 5))
        return fitted + resid[rng.integers(0, n, size=(replicates, n))], weights + 1.0
    labels = budget_bins(obs, bins) if method == "budget-blocks" else None
    for r in range(replicates):
        if method == "runs":
            idx = rng.integers(0, n, size=n)
        elif method == "within-budget":
            idx = _within_budget_idx(obs, rng)
        elif method == "stable-runs":
            idx = _block_idx(np.asarray(obs.groups), rng)
        else:
            idx = _block_idx(labels, rng)
        np.add.at(weights[r], idx, 1.0)
    return np.broadcast_to(y, (replicates, n)).copy(), weights


def bootstrap_approach3_many(
    tables: Sequence[Observations],
    point_laws: Sequence[Law],
    replicates: int,
    targets: Sequence[float] = (),
    level: float = 0.95,
    seed: int = 0,
    delta: Optional[float] = HUBER_DELTA,
    method: str = "auto",
    bins: int = 6,
    seeds: Optional[Sequence[int]] = None,
) -> List[BootstrapResult]:
    """Approach 3 intervals for several tables, every replicate of every table fitted in one batch
    (``bootstrap(obs, '3', ...)`` is the one-table case; the calibration test uses many)."""
    if replicates < 2:
        raise ScalingError(
            "bootstrap", f"needs >= 2 replicates, got {replicates}", "use --bootstrap 200 (0 turns it off)"
        )
    seeds = list(seeds) if seeds is not None else [seed + i for i in range(len(tables))]
    width = max(len(t) for t in tables)
    ln_n, ln_d, ys, ws, theta0, meta = [], [], [], [], [], []
    for obs, law, s in zip(tables, point_laws, seeds):
        design = design_of(obs)
        m = default_method(design, "3", obs) if method == "auto" else method
        check_method(obs, m, bins)
        y, w = _approach3_draws(obs, m, replicates, law, bins, np.random.default_rng(s))
        pad = width - len(obs)
        ln_n.append(np.broadcast_to(np.pad(np.log(obs.n), (0, pad)), (replicates, width)))
        ln_d.append(np.broadcast_to(np.pad(np.log(obs.d), (0, pad)), (replicates, width)))
        ys.append(np.pad(y, ((0, 0), (0, pad))))
        ws.append(np.pad(w, ((0, 0), (0, pad))))
        theta0.append(np.broadcast_to(np.asarray(theta_of(law)), (replicates, 5)))
        meta.append((m, design))
    theta, _, converged = fit_law_batch(
        np.concatenate(ln_n),
        np.concatenate(ln_d),
        np.concatenate(ys),
        np.concatenate(ws),
        np.concatenate(theta0),
        delta,
    )
    # A replicate counts only when its law has a compute-optimal allocation (the test Law.optimal applies).
    ok_all = converged & np.isfinite(theta).all(-1) & np.array([_law_of(t).has_optimum for t in theta], dtype=bool)
    results = []
    keys = [f"{c:.6g}" for c in targets]
    for i, (m, design) in enumerate(meta):
        rows = slice(i * replicates, (i + 1) * replicates)
        th, ok = theta[rows][ok_all[rows]], ok_all[rows]
        failed = int((~ok).sum())
        if replicates - failed < 2:
            raise ScalingError(
                f"bootstrap (Approach 3, {m})",
                f"{failed} of {replicates} replicates failed to fit",
                "add runs, or try another --bootstrap-method",
            )
        laws = [_law_of(t) for t in th]
        params = {
            k: _interval([getattr(law, k) for law in laws], level)
            for k in ("E", "A", "B", "alpha", "beta", "a", "b", "G")
        }
        preds = {}
        for key, c in zip(keys, targets):
            opt = np.array([law.optimal(c) for law in laws], dtype=float)  # [R', 3]
            preds[key] = {name: _interval(opt[:, j], level) for j, name in enumerate(("n_opt", "d_opt", "loss_opt"))}
        results.append(BootstrapResult(replicates, failed, level, m, design, params, preds))
    return results


def bootstrap(
    obs: Observations,
    approach: str,
    replicates: int = 200,
    targets: Sequence[float] = (),
    level: float = 0.95,
    seed: int = 0,
    point_law: Optional[Law] = None,
    delta: Optional[float] = HUBER_DELTA,
    method: str = "auto",
    bins: int = 6,
) -> BootstrapResult:
    """Percentile intervals for ``approach`` in {'2', '3'} over ``replicates`` resamples.

    Approach 2 on a scattered table is fitted on its log-spaced budget bins (``bins``), as ``fit_approach2``
    is by the report; ``point_law`` (Approach 3's point estimate) is the replicates' start and, for the
    residual method, the fitted values.
    """
    if replicates < 2:
        raise ScalingError(
            "bootstrap", f"needs >= 2 replicates, got {replicates}", "use --bootstrap 200 (0 turns it off)"
        )
    if approach == "3":
        if point_law is None:
            point_law = fit_approach3(obs, delta=delta).law
        return bootstrap_approach3_many([obs], [point_law], replicates, targets, level, seed, delta, method, bins)[0]
    design = design_of(obs)
    if design == SCATTERED:
        obs = binned(obs, bins)
    method = default_method(design, approach, obs) if method == "auto" else method
    check_method(obs, method, bins)
    rng = np.random.default_rng(seed)
    samples: Dict[str, List[float]] = {}
    keys = [f"{c:.6g}" for c in targets]
    preds: Dict[str, Dict[str, List[float]]] = {k: {"n_opt": [], "d_opt": [], "loss_opt": []} for k in keys}
    failed = 0
    point2 = fit_approach2(obs) if method == "residual" else None
    for _ in range(replicates):
        try:
            fit = fit_approach2(_approach2_resample(obs, method, point2, bins, rng))
        except ScalingError:
            failed += 1
            continue
        for k, v in {"a": fit.n_law.exponent, "b": fit.d_law.exponent, "k_N": fit.n_law.k, "k_D": fit.d_law.k}.items():
            samples.setdefault(k, []).append(v)
        for key, c in zip(keys, targets):
            preds[key]["n_opt"].append(float(fit.n_law(c)))
            preds[key]["d_opt"].append(float(fit.d_law(c)))
            preds[key]["loss_opt"].append(float(fit.loss_law(c)) if fit.loss_law else float("nan"))
    ok_count = replicates - failed
    if ok_count < 2:
        raise ScalingError(
            f"bootstrap (Approach {approach}, {method})",
            f"{failed} of {replicates} replicates failed to fit",
            "add runs per budget so resampled profiles keep an interior minimum, or try another --bootstrap-method",
        )
    return BootstrapResult(
        replicates,
        failed,
        level,
        method,
        design,
        {k: _interval(v, level) for k, v in samples.items()},
        {c: {k: _interval(v, level) for k, v in d.items()} for c, d in preds.items()},
    )


def _approach2_resample(obs: Observations, method: str, point2, bins: int, rng: np.random.Generator) -> Observations:
    if method == "within-budget":
        return obs.subset(_within_budget_idx(obs, rng))
    if method == "runs":
        return obs.subset(rng.integers(0, len(obs), size=len(obs)))
    if method == "budget-blocks":
        return obs.subset(_block_idx(obs.budget, rng))
    if method == "stable-runs":
        return obs.subset(_block_idx(np.asarray(obs.groups), rng))
    fitted = np.empty(len(obs))
    for m in point2.minima:  # residual: around each profile's own fitted parabola
        sel = obs.budget == m.budget
        fitted[sel] = m.predict(obs, sel)
    resid = (np.log(obs.loss) - np.log(fitted)) * np.sqrt(len(obs) / max(1, len(obs) - 3 * len(point2.minima)))
    loss = fitted * np.exp(resid[rng.integers(0, len(obs), size=len(obs))])
    return Observations(obs.budget, obs.n, obs.d, loss, list(obs.ids), true_budget=obs.true_budget, groups=obs.groups)
