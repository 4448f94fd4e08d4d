"""Tune a sweep preset's peak learning rate per model size, for ``rules.lr_by_size``.

The preset's own points at the chosen budgets (default: its smallest) are trained at every rate of a 2x grid with
``lmforge sweep plan/run/collect`` (one sweep per budget and rate, ``--rule lr_min=lr --rule lr_max=lr``), and
each size (shape: layers x width) takes the rate with the lowest final validation loss, averaged over its scanned
budgets. Sizes of the full design that no scanned budget has take the power law lr = k * width^-p * layers^-q
fitted through the tuned sizes (least squares in log space), and say so. A size whose best rate sits at the
grid's edge is flagged: widen the grid.

    python -m benchmarks.sweep_lr_scan --preset cpu_hour --budgets 1e11,2.2e11,4.6e11 --run-root runs/lr_scan

prints the table and the ``lr_by_size`` mapping for the preset, and writes ``lr_scan.json`` under the run root.
Finished runs are skipped on a re-run (the sweep runner's DONE marker).
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import subprocess
import sys
from collections import defaultdict
from pathlib import Path
from typing import Dict, List, Tuple

import numpy as np

from lmforge.scaling.plan import Rules, budget_label, plan
from lmforge.scaling.shapes import ShapeFamily


def _cli(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "lmforge.cli", *args], check=True)


def _design_sizes(preset: Dict, run_root: Path) -> List[Tuple[int, int]]:
    """The (layers, width) of every point the preset's full design plans (in process: no run is written)."""
    rules = Rules(**{**(preset.get("rules") or {}), "lr_by_size": {}})
    design = plan("design", preset["budgets"], ShapeFamily(**preset["family"]), rules, str(run_root))
    return sorted({(p.n_layers, p.d_model) for p in design.points}, key=lambda s: (s[1], s[0]))


def _scan_one(preset: str, budget: float, lr: float, run_root: Path, jobs: int) -> List[Dict]:
    name = f"c{budget_label(budget)}-lr{lr:g}"
    out = run_root / name
    _cli("sweep", "plan", "--preset", preset, "--name", name, "--budgets", f"{budget:g}", "--run-root",
         str(run_root), "--rule", f"lr_min={lr}", "--rule", f"lr_max={lr}", "--rule", "lr_by_size=")  # fmt: skip
    _cli("sweep", "run", str(out), "--jobs", str(jobs))
    _cli("sweep", "collect", str(out))
    with open(out / "results.csv", encoding="utf-8") as f:
        return [{**r, "scan_lr": lr} for r in csv.DictReader(f)]


def _name(size: Tuple[int, int]) -> str:
    return f"l{size[0]}-d{size[1]}"


def tune(rows: List[Dict], grid: List[float], sizes: List[Tuple[int, int]]) -> Dict:
    """Per size the grid rate with the lowest final validation loss, averaged over the budgets the size was scanned
    at; the rest by the power law through the tuned sizes."""
    loss: Dict[Tuple[int, int], Dict[float, List[float]]] = defaultdict(lambda: defaultdict(list))
    for r in rows:
        loss[(int(r["n_layers"]), int(r["d_model"]))][float(r["scan_lr"])].append(float(r["final_val_loss"]))
    tuned, edge = {}, []
    for size, by_lr in loss.items():
        means = {lr: float(np.mean(v)) for lr, v in by_lr.items() if len(v) == max(map(len, by_lr.values()))}
        tuned[size] = min(means, key=means.get)
        if tuned[size] in (min(grid), max(grid)):
            edge.append(_name(size))
    # log lr = log k - p log width - q log layers, least squares over the tuned sizes
    x = np.array([[1.0, math.log(w), math.log(n)] for n, w in tuned])
    coef = np.linalg.lstsq(x, np.log(list(tuned.values())), rcond=None)[0]
    law = {"k": float(math.exp(coef[0])), "p": float(-coef[1]), "q": float(-coef[2])}
    table = {_name(s): tuned.get(s, float(f"{law['k'] * s[1] ** -law['p'] * s[0] ** -law['q']:.3g}")) for s in sizes}
    return {
        "tuned": {_name(s): lr for s, lr in tuned.items()},
        "extrapolated": [_name(s) for s in sizes if s not in tuned],
        "edge": edge,
        "power_law": law,
        "lr_by_size": table,
        "losses": {_name(s): {lr: float(np.mean(v)) for lr, v in by_lr.items()} for s, by_lr in loss.items()},
        "scanned_budgets": {_name(s): len(max(by_lr.values(), key=len)) for s, by_lr in loss.items()},
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="cpu_hour")
    ap.add_argument("--budgets", default=None, help="the preset's budgets to scan at (default: its smallest)")
    ap.add_argument("--lrs", default="0.005,0.01,0.02,0.04", help="the rate grid (a 2x grid)")
    ap.add_argument("--run-root", type=Path, default=Path("runs/lr_scan"))
    ap.add_argument("--jobs", type=int, default=2)
    args = ap.parse_args(argv)
    from lmforge.scaling.cli import load_preset

    preset = load_preset(args.preset)
    budgets = [float(b) for b in args.budgets.split(",")] if args.budgets else [min(map(float, preset["budgets"]))]
    grid = sorted(float(x) for x in args.lrs.split(","))
    root = args.run_root.absolute()
    sizes = _design_sizes(preset, root)
    rows = [r for c in budgets for lr in grid for r in _scan_one(args.preset, c, lr, root, args.jobs)]
    result = {"preset": args.preset, "budgets": budgets, "grid": grid, **tune(rows, grid, sizes)}
    (root / "lr_scan.json").write_text(json.dumps(result, indent=1))
    at = ", ".join(f"{c:g}" for c in budgets)
    print(f"final validation loss (mean over the scanned budgets) by size and peak rate, budgets {at} FLOPs:")
    print(f"{'size':<8} {'budgets':>7} " + " ".join(f"{lr:>8g}" for lr in grid) + "   best")
    for s in sizes:
        name = _name(s)
        if name in result["losses"]:
            by_lr = result["losses"][name]
            cells = " ".join(f"{by_lr.get(lr, float('nan')):>8.4f}" for lr in grid)
            print(f"{name:<8} {result['scanned_budgets'][name]:>7} {cells}   {result['tuned'][name]:g}")
    law = result["power_law"]
    print(f"power law through the tuned sizes: lr = {law['k']:.3g} * width^-{law['p']:.2f} * layers^-{law['q']:.2f}")
    if result["extrapolated"]:
        print(f"extrapolated by it (no scanned budget has that size): {', '.join(result['extrapolated'])}")
    if result["edge"]:
        print(f"best rate at the grid's edge for {', '.join(result['edge'])}: widen --lrs")
    print("rules:\n  lr_by_size: {" + ", ".join(f"{k}: {lr:g}" for k, lr in result["lr_by_size"].items()) + "}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
