"""The planner's predicted tokens/s per GPU beside published runs (``lmforge/parallel/published_runs.csv``).

    python -m benchmarks.planner_validation [--all] [--fit] [--json PATH]

Every row of the table is mapped to a config (``published_runs.to_root_config``), validated with the trainer's
own ``validate()`` at the row's GPU count, and planned by ``lmforge.parallel.planner.make_plan`` (the step model,
nothing fitted). Printed per row: the published and predicted tokens/s per GPU, the error
``predicted / published - 1``, the predicted MFU and where the step goes. A row is left out of the figures
(and says why) when its mapping names a feature that changes throughput and that lmforge does not plan
(fp8 linears, expert parallelism without an MoE shape) or when it does not validate. ``--all`` keeps the fp8
rows (planned as bf16, so predicted too slow by design).

Figures: median |error| and the share of rows within +-25%, over every row kept, per source, and over the
calibration sources (``CALIBRATION``: the one fitted parameter, ``device_table.IN_STEP_EFFICIENCY``, is fitted on
these alone) and the held-out rows (every other source). ``--fit`` refits that parameter on the calibration rows
(grid over 0.40-1.00, minimising their median |error|) and prints both figures at the fitted value.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from dataclasses import replace
from typing import List, Optional

from lmforge.config.errors import ConfigError
from lmforge.config.validate import validate
from lmforge.parallel.device_table import IN_STEP_EFFICIENCY, device_spec
from lmforge.parallel.planner import device_kind, make_plan
from lmforge.parallel.published_runs import load_published_runs, to_root_config, tokens_per_s_per_gpu

# Features of a mapping that change throughput and that the step model cannot plan as published.
THROUGHPUT_FEATURES = ("fp8", "expert parallelism")
# The sources the in-step efficiency is fitted on; every other source is held out.
CALIBRATION = ("narayanan21", "mpt")


def source_of(run) -> str:
    """A row's source family: the id up to its first underscore (narayanan21, mcore08, torchtitan24, mpt, ...)."""
    return run.id.split("_")[0]


def evaluate(keep_fp8: bool = False, efficiency: float = IN_STEP_EFFICIENCY, sources=None) -> List[dict]:
    rows = []
    for run in load_published_runs():
        if sources is not None and source_of(run) not in sources:
            continue
        published = tokens_per_s_per_gpu(run)
        out = {"id": run.id, "source": source_of(run), "published": published}
        try:
            mapping = to_root_config(run)
        except ValueError as e:
            rows.append({**out, "skipped": str(e)})
            continue
        blocking = [u for u in mapping.unsupported if any(f in u for f in THROUGHPUT_FEATURES)]
        if keep_fp8:
            blocking = [u for u in blocking if "fp8" not in u]
        if published is None or blocking:
            rows.append({**out, "skipped": "; ".join(blocking) or "no published throughput"})
            continue
        try:
            cfg = validate(mapping.cfg, world_size=run.gpus)
            spec = replace(device_spec(device_kind(cfg)), in_step_efficiency=efficiency)
            plan = make_plan(cfg, run.gpus, device=spec)
        except ConfigError as e:
            rows.append({**out, "skipped": f"not valid in lmforge: {e}"})
            continue
        predicted = plan.tokens_per_s / run.gpus
        rows.append(
            {
                **out,
                "predicted": predicted,
                "error": predicted / published - 1,
                "mfu": plan.expected_mfu,
                "fits": plan.fits,
                "breakdown": {k: v / plan.step_time_s for k, v in plan.step.rows() if v},
                "layout": f"tp{run.tp} pp{run.pp} dp{run.dp} cp{run.cp} {mapping.cfg.parallelism.activation_checkpointing}",
            }
        )
    return rows


def figures(rows: List[dict]) -> Optional[dict]:
    errs = [abs(r["error"]) for r in rows if "error" in r]
    if not errs:
        return None
    return {
        "rows": len(errs),
        "median_abs_error": statistics.median(errs),
        "within_25pct": sum(e <= 0.25 for e in errs) / len(errs),
        "mean_signed_error": statistics.mean(r["error"] for r in rows if "error" in r),
    }


def print_table(rows: List[dict]) -> None:
    print(f"{'id':<44}{'layout':<24}{'published':>11}{'predicted':>11}{'error':>8}{'MFU':>7}  where the step goes")
    for r in rows:
        if "skipped" in r:
            print(f"{r['id']:<44}skipped: {r['skipped']}")
            continue
        where = ", ".join(f"{k} {v:.0%}" for k, v in r["breakdown"].items() if v >= 0.01)
        print(
            f"{r['id']:<44}{r['layout']:<24}{r['published']:>11,.0f}{r['predicted']:>11,.0f}{r['error']:>+8.1%}"
            f"{r['mfu']:>7.1%}  {where}"
        )
    by_source = defaultdict(list)
    for r in rows:
        by_source[r["source"]].append(r)
    print()
    split = [
        ("calibration", [r for r in rows if r["source"] in CALIBRATION]),
        ("held-out", [r for r in rows if r["source"] not in CALIBRATION]),
    ]
    for name, group in [("all", rows), *split, *sorted(by_source.items())]:
        f = figures(group)
        if f:
            print(
                f"{name:<14} rows {f['rows']:>3}  median |error| {f['median_abs_error']:6.1%}  within +-25% "
                f"{f['within_25pct']:6.1%}  mean error {f['mean_signed_error']:+6.1%}"
            )


def fit_efficiency(keep_fp8: bool = False) -> float:
    """The in-step efficiency minimising the calibration rows' median |error| (grid 0.40-1.00 by 0.01)."""
    best = None
    for i in range(40, 101):
        f = figures(evaluate(keep_fp8, efficiency=i / 100, sources=CALIBRATION))
        if f and (best is None or f["median_abs_error"] < best[0]):
            best = (f["median_abs_error"], i / 100)
    return best[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--all", action="store_true", help="keep the fp8 rows (planned as bf16)")
    ap.add_argument("--fit", action="store_true", help="refit the in-step efficiency on the calibration sources")
    ap.add_argument("--json", default="", help="also write the rows as JSON to this path")
    args = ap.parse_args()
    efficiency = IN_STEP_EFFICIENCY
    if args.fit:
        efficiency = fit_efficiency(args.all)
        print(f"in-step efficiency fitted on {', '.join(CALIBRATION)}: {efficiency:.2f} (table: {IN_STEP_EFFICIENCY})")
    rows = evaluate(keep_fp8=args.all, efficiency=efficiency)
    print(f"in-step efficiency {efficiency:.2f}")
    print_table(rows)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main()
