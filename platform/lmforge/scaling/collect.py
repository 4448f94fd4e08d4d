"""``lmforge sweep collect``: one row per finished run, read from the run directories' metrics.jsonl.

Columns: the plan's numbers (budget, n_params, n_flops, n_matmul, flops_per_token, tokens, ...), what the run
realised (final step, tokens_seen, flops_seen, flops_error = flops_seen / budget - 1), and losses:

- ``final_val_loss``: the last evaluation, averaged over validation sources with the run's mixture weights
  (per-source values are kept as ``val/<source>/loss``);
- ``smoothed_val_loss``: the mean of that average over the evaluations in the last ``smooth_fraction`` of the
  run's tokens (equal to the final value when only the final evaluation falls there);
- ``final_train_loss`` / ``smoothed_train_loss``: the same for the logged training loss;
- every other number of the last evaluation record (e.g. eval-task accuracies), under its own name, for
  ``lmforge scaling fit --metric-col NAME`` (the downstream link).

Only runs with a DONE marker are collected (an unfinished run's loss is not its final loss); the rest are
reported. A cooldown branch (``sweep plan --wsd-branches``) is a point whose row also names its provenance:
``stable_run`` (the fit's bootstrap resamples by it: branches of one stable run are not independent),
``stable_run_dir``, ``branch_start``, ``decay_steps``, ``resumed_from`` (the checkpoint its first launch
resumed) and ``run_flops`` (what the branch itself trained). ``collect_wandb`` reads the same numbers from W&B's public API when online (see docs).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from lmforge.runtime.rundir import RunPaths
from lmforge.scaling.data import write_csv
from lmforge.scaling.errors import ScalingError
from lmforge.scaling.plan import Point, Sweep
from lmforge.scaling.runner import DONE, point_status

RESULTS_FILE = "results.csv"


def read_metrics(path: Path) -> List[dict]:
    records = []
    if not path.exists():
        return records
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ScalingError(
            str(path),
            "is not JSON lines text (binary content is never read as metrics)",
            "re-run the point, or remove the file",
        ) from None
    for line in text.splitlines():
        line = line.strip()
        if not line:
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a torn last line of a killed run
    return records


def _float(v) -> float:
    try:
        return float(v)
    except (TypeError, ValueError):
        return float("nan")


def source_weights(paths: RunPaths) -> Dict[str, float]:
    if not paths.config.exists():
        return {}
    import yaml
    from omegaconf import OmegaConf

    try:  # OmegaConf's loader is yaml's SafeLoader: a python/object tag is refused, never constructed
        cfg = OmegaConf.to_container(OmegaConf.load(paths.config), resolve=False)
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ScalingError(
            str(paths.config),
            f"is not a plain YAML run config ({first})",
            "restore it from the run, or re-run the point",
        ) from None
    sources = (cfg.get("data") or {}).get("sources") or {}
    raw = {k: float(v.get("weight", 1.0)) for k, v in sources.items()}
    total = sum(raw.values()) or 1.0
    return {k: v / total for k, v in raw.items()}


def _val_average(record: dict, weights: Dict[str, float]) -> float:
    per = {k.split("/")[1]: _float(v) for k, v in record.items() if k.startswith("val/") and k.endswith("/loss")}
    if not per:
        return float("nan")
    w = {s: weights.get(s, 0.0) for s in per} if weights and all(s in weights for s in per) else {s: 1.0 for s in per}
    total = sum(w.values())
    return sum(per[s] * w[s] for s in per) / total


def summarise_run(records: List[dict], weights: Dict[str, float], smooth_fraction: float = 0.1) -> dict:
    train = [r for r in records if r.get("kind") == "train"]
    evals = [r for r in records if r.get("kind") == "eval"]
    out: dict = {}
    if train:
        last = max(train, key=lambda r: r.get("step", 0))
        end_tokens = _float(last.get("tokens_seen"))
        out.update(
            final_step=last.get("step"),
            tokens_seen=last.get("tokens_seen"),
            flops_seen=last.get("flops_seen"),
            final_train_loss=_float(last.get("loss")),
        )
        tail = [
            _float(r.get("loss")) for r in train if _float(r.get("tokens_seen")) >= (1 - smooth_fraction) * end_tokens
        ]
        out["smoothed_train_loss"] = sum(tail) / len(tail) if tail else float("nan")
    if evals:
        last_eval = max(evals, key=lambda r: r.get("step", 0))
        out["final_val_loss"] = _val_average(last_eval, weights)
        for k, v in last_eval.items():
            if k.startswith("val/") and k.endswith("/loss"):
                out[k] = _float(v)
            elif k not in ("kind", "step", "tokens_seen") and isinstance(v, (int, float)) and not isinstance(v, bool):
                out[k] = float(v)  # any other metric of the last evaluation (eval tasks): `scaling fit --metric-col`
        end_tokens = _float(last_eval.get("tokens_seen"))
        tail = [
            _val_average(r, weights)
            for r in evals
            if _float(r.get("tokens_seen")) >= (1 - smooth_fraction) * end_tokens
        ]
        out["smoothed_val_loss"] = sum(tail) / len(tail) if tail else float("nan")
    return out


def branch_provenance(p: Point, sweep: Optional[Sweep]) -> dict:
    """Where a cooldown branch came from: the plan's stable run, start step and decay, and the checkpoint its
    first launch actually resumed (``launches/launch-000.yaml``)."""
    import yaml  # deferred: a sweep file loads without yaml

    first = RunPaths(Path(p.run_dir)).launch_record(0)
    record = yaml.safe_load(first.read_text()) if first.is_file() else {}
    out = {"stable_run": p.stable_run, "branch_start": p.branch_start, "decay_steps": p.decay_steps}
    if sweep is not None:
        out["stable_run_dir"] = sweep.stable(p.stable_run).run_dir
    out["resumed_from"] = (record or {}).get("resumed_from") or ""
    out["run_flops"] = p.run_flops
    return out


def point_row(p: Point, smooth_fraction: float = 0.1, sweep: Optional[Sweep] = None) -> dict:
    paths = RunPaths(Path(p.run_dir))
    row = {
        "id": p.id,
        "budget": p.budget,
        "n_params": p.n_params,
        "n_flops": p.n_flops,
        "n_matmul": p.n_matmul,
        "flops_per_token": p.flops_per_token,
        "tokens": p.tokens,
        "tokens_per_param": p.tokens_per_param,
        "n_layers": p.n_layers,
        "d_model": p.d_model,
        "max_steps": p.max_steps,
        "global_batch_size": p.global_batch_size,
        "lr": p.lr,
        "planned_flops": p.planned_flops,
        "run_dir": p.run_dir,
    }
    if p.stable_run:
        row.update(branch_provenance(p, sweep))
    row.update(summarise_run(read_metrics(paths.metrics), source_weights(paths), smooth_fraction))
    flops = _float(row.get("flops_seen"))
    row["flops_error"] = flops / p.budget - 1 if math.isfinite(flops) else float("nan")
    return row


def collect(sweep: Sweep, smooth_fraction: float = 0.1) -> Tuple[List[dict], List[str]]:
    """(rows of finished runs, ids of runs not finished)."""
    rows, missing = [], []
    for p in sweep.points:
        if point_status(p) != DONE:
            missing.append(p.id)
            continue
        rows.append(point_row(p, smooth_fraction, sweep))
    return rows, missing


def write_results(rows: List[dict], out_dir: Path) -> Path:
    path = write_csv(rows, Path(out_dir) / RESULTS_FILE)
    (Path(out_dir) / "results.json").write_text(json.dumps(rows, indent=1))
    return path


def collect_wandb(project: str, group: str, sweep: Sweep, entity: Optional[str] = None) -> List[dict]:
    """Rows from W&B (online only): runs of ``group`` matched to points by their ``run.sweep_point`` config.

    Needs network access and WANDB_API_KEY; the losses are the runs' summary values (last logged), so
    ``smoothed_*`` columns are not available from this source.
    """
    import wandb

    api = wandb.Api()
    path = f"{entity}/{project}" if entity else project
    by_point = {p.sweep_point: p for p in sweep.points}
    rows = []
    for run in api.runs(path, filters={"group": group}):
        cfg = run.config or {}
        sp = (
            (cfg.get("run") or {}).get("sweep_point")
            if isinstance(cfg.get("run"), dict)
            else cfg.get("run.sweep_point")
        )
        if sp not in by_point:
            continue
        p = by_point[sp]
        summary = dict(run.summary)
        vals = {k: _float(v) for k, v in summary.items() if k.startswith("val/") and k.endswith("/loss")}
        rows.append(
            {
                "id": p.id,
                "budget": p.budget,
                "n_params": p.n_params,
                "n_flops": p.n_flops,
                "tokens": p.tokens,
                "flops_seen": summary.get("flops_seen"),
                "final_train_loss": _float(summary.get("loss")),
                "final_val_loss": sum(vals.values()) / len(vals) if vals else float("nan"),
                **vals,
                "wandb_run": run.path and "/".join(run.path),
            }
        )
    return rows
