"""The planner's predicted tokens/s per GPU beside published runs (``lmforge/parallel/published_runs.csv``).

    python -m benchmarks.planner_validation [--fit] [--json PATH] [--markdown]
    python -m benchmarks.planner_validation --search-space
    python -m benchmarks.planner_validation --search-cost

Every row of the table is mapped to a config (``published_runs.to_root_config``), validated with the trainer's
own ``validate()`` at the row's GPU count, and planned by ``lmforge.parallel.planner.make_plan`` on the row's
device (``published_runs.device_for``: the datasheet part, or a power-capped one). Printed per row: the published
and predicted tokens/s per GPU, the error ``predicted / published - 1``, the predicted MFU and where the step
goes, and the constant-MFU model the step model replaced (``constant_mfu_tokens_per_gpu``, the negative control
of ``tests/unit/test_planner_validation.py``). A row is left out of the figures (and says why) when its mapping
names a feature that changes throughput and that lmforge cannot plan (expert parallelism without an MoE shape) or
when it does not validate. fp8 rows are planned with float8 linears, tensor parallelism included.

``RANKED_GROUPS``: where a source publishes several layouts of one model on one cluster, the predicted order
against the measured one (Kendall tau) and the measured throughput of the predicted best against the measured best.

``--search-space`` prints, instead, the published layouts ``lmforge plan --search`` does not enumerate, each with
the field it misses (``layout_search.search_space_miss``), and how many of all are inside the search space.

``--search-cost`` times ``lmforge plan --search`` (``layout_search.search_layouts``, CPU-seconds of this process)
on published models and clusters (``SEARCH_COST_CASES``) and prints the layouts ranked and the best.

Figures: median |error| and the share of rows within +-25%, over every row kept, per source, and over the
calibration sources (``CALIBRATION``: the one fitted parameter, ``device_table.IN_STEP_EFFICIENCY``, is fitted on
these alone) and the held-out rows (every other source). ``--fit`` refits that parameter on the calibration rows
(grid over 0.40-1.00, minimising their median |error|) and prints both figures at the fitted value.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict
from dataclasses import replace
from typing import List, Optional

from lmforge.config.errors import ConfigError
from lmforge.config.validate import validate
from lmforge.parallel.device_table import IN_STEP_EFFICIENCY
from lmforge.parallel.layout_search import search_layouts, search_space_miss
from lmforge.parallel.planner import make_plan
from lmforge.parallel.published_runs import device_for, load_published_runs, to_root_config, tokens_per_s_per_gpu

# Features of a mapping that change throughput and that the step model cannot plan as published.
THROUGHPUT_FEATURES = ("expert parallelism",)
# The sources the in-step efficiency is fitted on; every other source is held out.
CALIBRATION = ("narayanan21", "mpt")
# The targets on the held-out rows: median |error| of tokens/s per GPU, and the share within +-25%.
TARGET_MEDIAN, TARGET_WITHIN_25 = 0.15, 0.80
# The utilization the planner assumed before the step model (``cluster.assumed_mfu``), with 4/3 for full recompute.
CONSTANT_MFU = 0.40
# Several layouts of one model on one cluster, published side by side.
RANKED_GROUPS = {
    "torchtitan 2024 Table 2: Llama 3.1 8B, 8 GPUs, FSDP x CP 1-8": (
        "torchtitan24_t2_8b_cp1",
        "torchtitan24_t2_8b_cp2",
        "torchtitan24_t2_8b_cp4",
        "torchtitan24_t2_8b_cp8",
    ),
    "torchtitan 2024 Table 5: Llama 3.1 405B, 512 GPUs, 1F1B / interleaved": (
        "torchtitan24_t5_405b_1f1b",
        "torchtitan24_t5_405b_interleaved",
    ),
    "torchtitan 2024 Table 6: Llama 3.1 405B, 512 GPUs, FSDP x CP 1-8 x TP 8 x PP 8": (
        "torchtitan24_t6_405b_cp1",
        "torchtitan24_t6_405b_cp2",
        "torchtitan24_t6_405b_cp4",
        "torchtitan24_t6_405b_cp8",
    ),
}
TARGET_TAU, TARGET_TOP_PICK = 0.6, 0.90
RANKED_SOURCES = ("torchtitan24",)


def source_of(run) -> str:
    """A row's source family: the id up to its first underscore (narayanan21, mcore08, torchtitan24, mpt, ...)."""
    return run.id.split("_")[0]


def evaluate(efficiency: float = IN_STEP_EFFICIENCY, sources=None) -> List[dict]:
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
        if published is None or blocking:
            rows.append({**out, "skipped": "; ".join(blocking) or "no published throughput"})
            continue
        try:
            cfg = validate(mapping.cfg, world_size=run.gpus)
            spec = replace(device_for(run), in_step_efficiency=efficiency)
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
                "constant_mfu_error": constant_mfu_tokens_per_gpu(plan) / published - 1,
                "mfu": plan.expected_mfu,
                "fits": plan.fits,
                "breakdown": {k: v / plan.step_time_s for k, v in plan.step.rows() if v},
                "layout": f"tp{run.tp} pp{run.pp} dp{run.dp} cp{run.cp} {mapping.cfg.parallelism.activation_checkpointing}"
                + (" fp8" if mapping.cfg.train.precision == "fp8" else ""),
            }
        )
    return rows


def constant_mfu_tokens_per_gpu(plan) -> float:
    """The planner before the step model: FLOPs / (peak x 0.40), x 4/3 under full recompute, plus the bubble."""
    recompute = 4 / 3 if plan.cfg.parallelism.activation_checkpointing == "full" else 1.0
    seconds_per_token = plan.flops_per_token * recompute * (1 + plan.bubble) / (plan.peak_tflops * 1e12 * CONSTANT_MFU)
    return 1 / seconds_per_token


def held_out(rows: List[dict]) -> List[dict]:
    return [r for r in rows if r["source"] not in CALIBRATION]


def meets_targets(f: Optional[dict]) -> bool:
    return f is not None and f["median_abs_error"] <= TARGET_MEDIAN and f["within_25pct"] >= TARGET_WITHIN_25


def kendall_tau(a: List[float], b: List[float]) -> float:
    """Kendall's tau-a of two orderings of the same items (ties count as neither concordant nor discordant)."""
    pairs = [(i, j) for i in range(len(a)) for j in range(i + 1, len(a))]
    score = sum((a[i] - a[j]) * (b[i] - b[j]) > 0 for i, j in pairs) - sum(
        (a[i] - a[j]) * (b[i] - b[j]) < 0 for i, j in pairs
    )
    return score / len(pairs)


def rank_groups(rows: List[dict]) -> List[dict]:
    """Per ``RANKED_GROUPS`` entry: Kendall tau of predicted against published tokens/s per GPU, and the published
    throughput of the predicted best layout over the published best."""
    by_id = {r["id"]: r for r in rows}
    out = []
    for name, ids in RANKED_GROUPS.items():
        group = [by_id[i] for i in ids if "predicted" in by_id.get(i, {})]
        published = [r["published"] for r in group]
        predicted = [r["predicted"] for r in group]
        pick = max(group, key=lambda r: r["predicted"])
        out.append(
            {
                "group": name,
                "ids": [r["id"] for r in group],
                "missing": [i for i in ids if i not in {r["id"] for r in group}],
                "tau": kendall_tau(published, predicted) if len(group) > 1 else 1.0,
                "top_pick": pick["id"],
                "top_pick_share": pick["published"] / max(published),
            }
        )
    return out


def figures(rows: List[dict], key: str = "error") -> Optional[dict]:
    errs = [abs(r[key]) for r in rows if key in r]
    if not errs:
        return None
    return {
        "rows": len(errs),
        "median_abs_error": statistics.median(errs),
        "within_25pct": sum(e <= 0.25 for e in errs) / len(errs),
        "mean_signed_error": statistics.mean(r[key] for r in rows if key in r),
    }


def print_table(rows: List[dict]) -> None:
    print(
        f"{'id':<44}{'layout':<26}{'published':>11}{'predicted':>11}{'error':>8}{'MFU':>7}{'0.40 MFU':>9}"
        "  where the step goes"
    )
    for r in rows:
        if "skipped" in r:
            print(f"{r['id']:<44}skipped: {r['skipped']}")
            continue
        where = ", ".join(f"{k} {v:.0%}" for k, v in r["breakdown"].items() if v >= 0.01)
        print(
            f"{r['id']:<44}{r['layout']:<26}{r['published']:>11,.0f}{r['predicted']:>11,.0f}{r['error']:>+8.1%}"
            f"{r['mfu']:>7.1%}{r['constant_mfu_error']:>+9.1%}  {where}"
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
    control = figures(held_out(rows), "constant_mfu_error")
    print(
        f"{'held-out, constant 0.40 MFU':<14} rows {control['rows']:>3}  median |error| {control['median_abs_error']:6.1%}"
        f"  within +-25% {control['within_25pct']:6.1%}  mean error {control['mean_signed_error']:+6.1%}"
    )


def print_markdown(rows: List[dict]) -> None:
    """The table of docs/planner.md: one line per row, calibration rows marked, skipped rows with the reason."""
    print("| row | layout | published tokens/s/GPU | predicted | error | split |")
    print("|---|---|---:|---:|---:|---|")
    for r in rows:
        split = "calibration" if r["source"] in CALIBRATION else "held out"
        if "skipped" in r:
            print(f"| `{r['id']}` | | {r['published']:,.0f} | | | not planned: {r['skipped']} |")
            continue
        print(
            f"| `{r['id']}` | {r['layout']} | {r['published']:,.0f} | {r['predicted']:,.0f} | {r['error']:+.1%} "
            f"| {split} |"
        )


def print_ranking(rows: List[dict]) -> None:
    print()
    for g in rank_groups(rows):
        print(
            f"{g['group']}: Kendall tau {g['tau']:+.2f}, predicted best {g['top_pick']} at "
            f"{g['top_pick_share']:.0%} of the measured best"
        )


def fit_efficiency() -> float:
    """The in-step efficiency minimising the calibration rows' median |error| (grid 0.40-1.00 by 0.01)."""
    best = None
    for i in range(40, 101):
        f = figures(evaluate(efficiency=i / 100, sources=CALIBRATION))
        if f and (best is None or f["median_abs_error"] < best[0]):
            best = (f["median_abs_error"], i / 100)
    return best[1]


def search_space_misses() -> dict:
    """{row id: the field its layout misses} for the published layouts ``lmforge plan --search`` does not
    enumerate at the row's GPU count."""
    found = {r.id: search_space_miss(to_root_config(r).cfg, r.gpus) for r in load_published_runs()}
    return {k: v for k, v in found.items() if v is not None}


# (published row, nodes, global batch; None: the row's own): Llama 3 405B at its pretraining scale and batch
# (16,384 GPUs, 2,048 x 8k tokens), and four published runs at their own scale (2,520 GPUs: many divisors).
SEARCH_COST_CASES = (
    ("torchtitan24_t5_405b_1f1b", 2048, 2048),
    ("torchtitan24_t5_405b_1f1b", None, None),
    ("mcore08_h100_177b", None, None),
    ("bloom176b_tr11", None, None),
    ("narayanan21_t1_530b", None, None),
)


def print_search_cost() -> None:
    runs = {r.id: r for r in load_published_runs()}
    for run_id, nodes, batch in SEARCH_COST_CASES:
        cfg = to_root_config(runs[run_id]).cfg
        if nodes:
            cfg = replace(
                cfg, cluster=replace(cfg.cluster, nodes=nodes), train=replace(cfg.train, global_batch_size=batch)
            )
        world = cfg.cluster.nodes * cfg.cluster.gpus_per_node
        start = time.process_time()
        cands, ranked = search_layouts(cfg, world, top=1)
        spent = time.process_time() - start
        print(
            f"{run_id:<28} {world:>6} GPUs  global batch {cfg.train.global_batch_size:>5}  {ranked:>5} layouts ranked"
            f"  {spent:6.1f} CPU-s  best {cands[0].plan.tokens_per_s:>12,.0f} tokens/s  {cands[0].overrides}"
        )


def print_search_space() -> None:
    misses, total = search_space_misses(), len(load_published_runs())
    for run_id, miss in misses.items():
        print(f"{run_id:<44} outside: {miss}")
    print(f"{total - len(misses)} of {total} published layouts are inside the search space of lmforge plan --search")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fit", action="store_true", help="refit the in-step efficiency on the calibration sources")
    ap.add_argument("--json", default="", help="also write the rows as JSON to this path")
    ap.add_argument("--markdown", action="store_true", help="also print the per-row table as markdown")
    ap.add_argument("--search-space", action="store_true", help="only: which published layouts --search misses")
    ap.add_argument("--search-cost", action="store_true", help="only: the time --search takes on large runs")
    args = ap.parse_args()
    if args.search_space:
        print_search_space()
        return
    if args.search_cost:
        print_search_cost()
        return
    efficiency = IN_STEP_EFFICIENCY
    if args.fit:
        efficiency = fit_efficiency()
        print(f"in-step efficiency fitted on {', '.join(CALIBRATION)}: {efficiency:.2f} (table: {IN_STEP_EFFICIENCY})")
    rows = evaluate(efficiency=efficiency)
    print(f"in-step efficiency {efficiency:.2f}")
    print_table(rows)
    if args.markdown:
        print_markdown(rows)
    print_ranking(rows)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main()
