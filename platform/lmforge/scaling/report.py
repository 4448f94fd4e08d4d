"""``lmforge scaling fit``: both approaches, bootstrap intervals, predictions for target budgets, plots.

The table's design (``bootstrap.design_of``: an IsoFLOP grid, or scattered budgets) decides how Approach 2
sees it (a scattered table is grouped into ``bins`` log-spaced budget bins) and, with ``method='auto'``,
which bootstrap each approach gets; both are named in the summary and in fit.json.

Each approach is fitted independently: when one fails (e.g. a budget without an interior minimum), its
error is printed and stored in fit.json, the other's results and every plot that can be drawn are still
written, and the exit status is 1.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from lmforge.scaling.approach2 import Approach2Fit, binned, fit_approach2
from lmforge.scaling.approach3 import HUBER_DELTA, Approach3Fit, fit_approach3
from lmforge.scaling.bootstrap import SCATTERED, bootstrap, design_of
from lmforge.scaling.data import Observations
from lmforge.scaling.errors import ScalingError
from lmforge.scaling.plots import make_plots

FIT_FILE = "fit.json"


@dataclass
class FitReport:
    points: int
    budgets: List[float]
    targets: List[float]
    approach2: Optional[Approach2Fit] = None
    approach3: Optional[Approach3Fit] = None
    errors: Dict[str, str] = field(default_factory=dict)
    warnings: List[str] = field(default_factory=list)
    bootstrap: Dict[str, dict] = field(default_factory=dict)
    predictions: List[dict] = field(default_factory=list)
    plots: Dict[str, str] = field(default_factory=dict)
    design: str = ""
    bins: Optional[int] = None  # Approach 2's log-spaced budget bins (scattered tables only)
    source: Dict = field(default_factory=dict)  # where the table came from: columns, units, row filters
    downstream: Optional[dict] = None  # an eval metric's sigmoidal link to loss or compute (downstream.py)

    def as_dict(self) -> dict:
        return {
            "points": self.points,
            "design": self.design,
            "approach2_bins": self.bins,
            "source": self.source,
            "budgets": self.budgets,
            "targets": self.targets,
            "downstream": self.downstream,
            "approach2": self.approach2.as_dict() if self.approach2 else None,
            "approach3": self.approach3.as_dict() if self.approach3 else None,
            "errors": self.errors,
            "warnings": self.warnings,
            "bootstrap": self.bootstrap,
            "predictions": self.predictions,
            "plots": self.plots,
        }


def predictions(report: FitReport) -> List[dict]:
    rows = []
    for c in report.targets:
        key = f"{c:.6g}"
        if report.approach2 is not None:
            f2 = report.approach2
            row = {
                "approach": "2",
                "budget": c,
                "n_opt": float(f2.n_law(c)),
                "d_opt": float(f2.d_law(c)),
                "loss_opt": float(f2.loss_law(c)) if f2.loss_law else math.nan,
            }
            ci = report.bootstrap.get("2", {}).get("predictions", {}).get(key)
            if ci:
                row["ci"] = ci
            rows.append(row)
        if report.approach3 is not None and "3" not in report.errors:
            try:
                n, d, loss = report.approach3.law.optimal(c)
            except ScalingError as e:
                report.errors["3"] = str(e)
                continue
            row = {"approach": "3", "budget": c, "n_opt": float(n), "d_opt": float(d), "loss_opt": float(loss)}
            ci = report.bootstrap.get("3", {}).get("predictions", {}).get(key)
            if ci:
                row["ci"] = ci
            rows.append(row)
    return rows


def fit_all(
    obs: Observations,
    targets: Sequence[float] = (),
    approaches: Sequence[str] = ("2", "3"),
    replicates: int = 0,
    level: float = 0.95,
    seed: int = 0,
    delta: Optional[float] = HUBER_DELTA,
    out_dir: Optional[Path] = None,
    method: str = "auto",
    bins: int = 6,
    source: Optional[Dict] = None,
) -> FitReport:
    obs.check()
    report = FitReport(
        len(obs), obs.budgets(), [float(t) for t in targets], design=design_of(obs), source=dict(source or {})
    )
    obs2 = obs
    if report.design == SCATTERED:
        report.bins = bins
        try:
            obs2 = binned(obs, bins)
        except ScalingError as e:
            report.errors["2"] = str(e)
    if "2" in approaches and "2" not in report.errors:
        try:
            report.approach2 = fit_approach2(obs2)
        except ScalingError as e:
            report.errors["2"] = str(e)
    if "3" in approaches:
        try:
            report.approach3 = fit_approach3(obs, delta=delta)
        except ScalingError as e:
            report.errors["3"] = str(e)
    if replicates:  # a failed bootstrap leaves the point estimates standing; it is reported as a warning
        for approach, fit in (("2", report.approach2), ("3", report.approach3)):
            if fit is None:
                continue
            try:
                law = report.approach3.law if approach == "3" else None
                report.bootstrap[approach] = bootstrap(
                    obs,
                    approach,
                    replicates,
                    targets,
                    level,
                    seed,
                    point_law=law,
                    delta=delta,
                    method=method,
                    bins=bins,
                ).as_dict()
            except ScalingError as e:
                report.warnings.append(f"no intervals for Approach {approach}: {e}")
    report.predictions = predictions(report)
    if out_dir is not None:
        out_dir = Path(out_dir)
        report.plots = {
            k: str(v) for k, v in make_plots(obs2, report.approach2, report.approach3, targets, out_dir).items()
        }
        write_report(report, out_dir)
    return report


def write_report(report: FitReport, out_dir: Path) -> Path:
    """fit.json, written atomically (a temporary file renamed into place)."""
    path = Path(out_dir) / FIT_FILE
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(report.as_dict(), indent=1, default=float))
    tmp.replace(path)
    return path


def add_downstream(
    report: FitReport,
    obs: Observations,
    values: Sequence[float],
    metric: str,
    against: str,
    floor: Optional[float],
    replicates: int,
    level: float,
    seed: int,
) -> None:
    """Fit ``metric`` (one value per run of ``obs``) against the runs' loss or compute; predict it at the
    targets (against loss: at Approach 3's compute-optimal loss L*(C)). Stored in ``report.downstream``."""
    # deferred: imports scipy; this module imports without it
    from lmforge.scaling.downstream import bootstrap_link, fit_link

    x = obs.loss if against == "loss" else obs.true_budget
    fit = fit_link(x, values, against, floor, metric)
    at: List[float] = (
        list(report.targets)
        if against == "compute"
        else [r["loss_opt"] for r in report.predictions if r["approach"] == "3"]
    )
    if replicates:
        fit = bootstrap_link(fit, x, values, replicates, level, seed, at)
    else:
        fit.predictions = [{"x": float(v), "value": float(fit.link(v))} for v in at]
    report.downstream = fit.as_dict()


def budget_summary(report: FitReport) -> str:
    """One line: how many runs, the budget range (never every budget) and the design."""
    b = report.budgets
    span = f"{b[0]:.3g}" if len(b) == 1 else f"{b[0]:.3g}..{b[-1]:.3g}"
    design = (
        f"scattered: Approach 2 on {report.bins} log-spaced budget bins"
        if report.design == SCATTERED
        else "an IsoFLOP grid"
    )
    return f"{report.points} runs at {len(b)} budget(s) in {span} FLOPs ({design})"


def summary_text(report: FitReport) -> str:
    lines = [budget_summary(report)]
    for f in report.source.get("filters", []):
        lines.append(f"filter {f['filter']}: dropped {len(f['dropped'])} run(s): {', '.join(f['dropped'])}")

    def ci(approach: str, name: str) -> str:
        iv = report.bootstrap.get(approach, {}).get("params", {}).get(name)
        return f" [{iv['low']:.3g}, {iv['high']:.3g}]" if iv else ""

    if report.approach2:
        f2 = report.approach2
        lines.append(
            f"Approach 2: N* = {f2.n_law.k:.3g} C^{f2.n_law.exponent:.3f}{ci('2', 'a')}, "
            f"D* = {f2.d_law.k:.3g} C^{f2.d_law.exponent:.3f}{ci('2', 'b')}"
        )
    if report.approach3:
        law = report.approach3.law
        lines.append(
            f"Approach 3: L = {law.E:.3f}{ci('3', 'E')} + {law.A:.4g}/N^{law.alpha:.3f}{ci('3', 'alpha')} "
            f"+ {law.B:.4g}/D^{law.beta:.3f}{ci('3', 'beta')};  a = {law.a:.3f}{ci('3', 'a')}"
        )
    for approach, bs in report.bootstrap.items():
        lines.append(
            f"Approach {approach} intervals: {bs['level']:.0%} percentile, bootstrap '{bs['method']}' "
            f"({bs['replicates']} replicates, {bs['failed']} failed refits)"
        )
    for approach, err in report.errors.items():
        lines.append(f"Approach {approach} FAILED: {err}")
    for w in report.warnings:
        lines.append(f"warning: {w}")
    for row in report.predictions:
        extra = ""
        if "ci" in row:
            ci_ = row["ci"]
            extra = (
                f" (N* {ci_['n_opt']['low']:.3g}..{ci_['n_opt']['high']:.3g}, D* {ci_['d_opt']['low']:.3g}.."
                f"{ci_['d_opt']['high']:.3g}, L* {ci_['loss_opt']['low']:.4f}..{ci_['loss_opt']['high']:.4f})"
            )
        lines.append(
            f"  C={row['budget']:.3g} [A{row['approach']}]: N*={row['n_opt']:.4g} D*={row['d_opt']:.4g} "
            f"L*={row['loss_opt']:.4f}{extra}"
        )
    if report.downstream:
        ds = report.downstream
        axis = "loss" if ds["against"] == "loss" else "ln C"
        lines.append(
            f"Downstream {ds['metric']}: {ds['floor']:.3g} + ({ds['ceiling']:.3g} - {ds['floor']:.3g}) * "
            f"sigmoid({ds['slope']:.3g} ({axis} - {ds['mid']:.4g})), rms {ds['rms']:.3g} over {ds['runs']} runs"
        )
        for p in ds["predictions"]:
            ci_ = f" [{p['low']:.3g}, {p['high']:.3g}]" if "low" in p else ""
            lines.append(
                f"  {ds['metric']} at {'loss' if ds['against'] == 'loss' else 'C'}={p['x']:.4g}: {p['value']:.3g}{ci_}"
            )
    for k, v in report.plots.items():
        lines.append(f"  plot {k}: {v}")
    return "\n".join(lines)
