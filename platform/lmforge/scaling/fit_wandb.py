"""``lmforge scaling fit --wandb``: the fit as one W&B run (job_type ``scaling-fit``) in the sweep's group.

The run holds, in one row:

- ``scaling/law``: a table of the fitted law, one row per parameter (Approach 3: E, A, alpha, B, beta, a, b, G;
  Approach 2: a, k_N, b, k_D) with its bootstrap interval (``low``, ``high`` at ``level``; empty without one);
- ``scaling/predictions``: the compute-optimal N*, D*, L* per target budget and approach, with their intervals;
- ``scaling/points``: the runs fitted (id, budget, N, D, loss);
- ``scaling/isoflop``, ``scaling/frontier``, ``scaling/residuals``: the plots as images;

and the laws' numbers in its summary (``approach3/alpha``, ...). The mode is chosen as for training
(``metrics.wandb_sink.resolve_mode``): ``auto`` follows ``WANDB_MODE``, else is online with an API key and
offline without one, announced in one line with the ``wandb sync`` command.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, List, Optional

from lmforge.metrics.wandb_sink import new_run_id, resolve_mode
from lmforge.scaling.data import Observations
from lmforge.scaling.report import FitReport

LAW_COLUMNS = ["approach", "parameter", "value", "low", "high", "level"]
PREDICTION_COLUMNS = [
    "approach",
    "budget",
    "n_opt",
    "n_opt_low",
    "n_opt_high",
    "d_opt",
    "d_opt_low",
    "d_opt_high",
    "loss_opt",
    "loss_opt_low",
    "loss_opt_high",
]
POINT_COLUMNS = ["id", "budget", "N", "D", "loss"]


def _fitted(report: FitReport) -> List[tuple]:
    """(approach, its fitted numbers) for each approach that fitted."""
    out = []
    if report.approach3 is not None:
        out.append(("3", {k: v for k, v in report.approach3.law.as_dict().items() if isinstance(v, (int, float))}))
    if report.approach2 is not None:
        out.append(("2", {k: v for k, v in report.approach2.as_dict().items() if isinstance(v, (int, float))}))
    return out


def law_rows(report: FitReport) -> List[list]:
    """One row per fitted parameter: approach, name, point estimate, interval bounds and level (None without)."""
    rows = []
    for approach, values in _fitted(report):
        bs = report.bootstrap.get(approach, {})
        for name, value in values.items():
            iv = bs.get("params", {}).get(name)
            low, high = (float(iv["low"]), float(iv["high"])) if iv else (None, None)
            rows.append([approach, name, float(value), low, high, bs.get("level")])
    return rows


def prediction_rows(report: FitReport) -> List[list]:
    rows = []
    for p in report.predictions:
        row: list = [p["approach"], float(p["budget"])]
        for key in ("n_opt", "d_opt", "loss_opt"):
            iv = p.get("ci", {}).get(key)
            row += [float(p[key]), float(iv["low"]) if iv else None, float(iv["high"]) if iv else None]
        rows.append(row)
    return rows


def log_fit(
    report: FitReport,
    obs: Observations,
    *,
    mode: str,
    project: str,
    group: Optional[str],
    out_dir: Path,
    say: Callable[[str], None] = print,
) -> Optional[Path]:
    """Log the fit to one W&B run under ``out_dir/wandb``; returns the run's files directory (None: disabled)."""
    run_id = new_run_id()
    mode, message = resolve_mode(mode, sync_path=f"{out_dir}/wandb/offline-run-*-{run_id}*")
    if message:
        say(f"lmforge scaling fit: {message}")
    if mode == "disabled":
        return None
    import wandb

    out_dir.mkdir(parents=True, exist_ok=True)
    run = wandb.init(
        project=project,
        group=group,
        job_type="scaling-fit",
        id=run_id,
        mode=mode,
        dir=str(out_dir),
        config={"targets": report.targets, "budgets": report.budgets, "design": report.design},
        settings=wandb.Settings(
            console="off", disable_git=True, x_disable_meta=True, x_disable_stats=True, silent=True
        ),
    )
    try:
        payload = {
            "scaling/law": wandb.Table(columns=LAW_COLUMNS, data=law_rows(report)),
            "scaling/predictions": wandb.Table(columns=PREDICTION_COLUMNS, data=prediction_rows(report)),
            "scaling/points": wandb.Table(
                columns=POINT_COLUMNS,
                data=[
                    [i, float(c), float(n), float(d), float(loss)]
                    for i, c, n, d, loss in zip(obs.ids, obs.budget, obs.n, obs.d, obs.loss)
                ],
            ),
            **{f"scaling/{name}": wandb.Image(str(path)) for name, path in report.plots.items()},
        }
        run.log(payload)
        for approach, values in _fitted(report):
            run.summary.update({f"approach{approach}/{k}": v for k, v in values.items()})
        if mode == "online":
            say(f"lmforge scaling fit: W&B run {run.url}")
        return Path(run.dir)
    finally:
        run.finish()
