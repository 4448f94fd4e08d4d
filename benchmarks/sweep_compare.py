"""Compare a cheaper sweep design's scaling-law fit with a reference fit of the same budgets and sizes.

    python -m benchmarks.sweep_compare REFERENCE_SWEEP_DIR CHEAPER_SWEEP_DIR [--max-width-ratio 1.5]

Each directory holds the sweep's ``sweep.json`` and the ``fit/fit.json`` that ``lmforge scaling fit DIR
--bootstrap R --level L`` wrote. For the compute-optimal exponents (Approach 2's a and b from the IsoFLOP minima,
Approach 3's a = beta / (alpha + beta) and b = alpha / (alpha + beta)) it prints both bootstrap intervals, whether
they overlap and the ratio of their widths, and the FLOPs each design trained (the cheaper one as a share of the
reference's). Approach 3's alpha and beta are printed too, not judged. It passes (exit 0) when every exponent's
intervals overlap and the cheaper one is at most ``--max-width-ratio`` times as wide; exit 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Dict, List, Tuple

from lmforge.scaling.plan import load_sweep

JUDGED = [("2", "a"), ("2", "b"), ("3", "a"), ("3", "b")]
SHOWN = [("3", "alpha"), ("3", "beta")]


def _fit(sweep_dir: Path) -> Dict:
    path = sweep_dir / "fit" / "fit.json"
    if not path.is_file():
        sys.exit(f"{path}: no fit here. Fix: run `lmforge scaling fit {sweep_dir} --bootstrap 200 --level 0.9`")
    return json.loads(path.read_text(encoding="utf-8"))


def _interval(fit: Dict, approach: str, key: str) -> Tuple[float, float, float]:
    boot = fit["bootstrap"][approach]["params"][key]
    return float(fit[f"approach{approach}"][key]), float(boot["low"]), float(boot["high"])


def compare(ref: Dict, cheap: Dict, max_ratio: float) -> Tuple[List[Dict], bool]:
    rows, ok = [], True
    for approach, key in JUDGED + SHOWN:
        r, c = _interval(ref, approach, key), _interval(cheap, approach, key)
        overlap = c[1] <= r[2] and r[1] <= c[2]
        ratio = (c[2] - c[1]) / (r[2] - r[1])
        judged = (approach, key) in JUDGED
        passed = overlap and ratio <= max_ratio * (1 + 1e-9)  # a ratio of exactly max_ratio passes
        ok = ok and (passed or not judged)
        rows.append({"approach": approach, "param": key, "reference": r, "cheaper": c, "overlap": overlap,
                     "width_ratio": ratio, "judged": judged, "passed": passed})  # fmt: skip
    return rows, ok


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("reference", type=Path)
    ap.add_argument("cheaper", type=Path)
    ap.add_argument("--max-width-ratio", type=float, default=1.5)
    args = ap.parse_args(argv)
    ref, cheap = _fit(args.reference), _fit(args.cheaper)
    levels = {ref["bootstrap"]["2"]["level"], cheap["bootstrap"]["2"]["level"]}
    if len(levels) != 1:
        sys.exit(f"the two fits' intervals are at different levels {sorted(levels)}. Fix: refit both with one --level")
    rows, ok = compare(ref, cheap, args.max_width_ratio)
    f_ref, f_cheap = load_sweep(args.reference).total_flops(), load_sweep(args.cheaper).total_flops()
    print(f"FLOPs: reference {f_ref:.3g}, cheaper {f_cheap:.3g} ({f_cheap / f_ref:.1%} of the reference)")
    for name, fit in (("reference", ref), ("cheaper", cheap)):
        b2, b3 = fit["bootstrap"]["2"], fit["bootstrap"]["3"]
        print(f"{name}: bootstrap {b2['method']}, {b2['replicates']} replicates at level {b2['level']:g} "
              f"(failed refits: Approach 2 {b2['failed']}, Approach 3 {b3['failed']})")  # fmt: skip
    print(f"{'exponent':<22} {'reference [interval]':>30} {'cheaper [interval]':>30} {'overlap':>8} {'width':>6}")
    for row in rows:
        (rv, rl, rh), (cv, cl, ch) = row["reference"], row["cheaper"]
        verdict = ("pass" if row["passed"] else "FAIL") if row["judged"] else "shown"
        print(f"Approach {row['approach']} {row['param']:<11} {rv:>8.3f} [{rl:.3f}, {rh:.3f}]{'':>6} "
              f"{cv:>8.3f} [{cl:.3f}, {ch:.3f}]{'':>6} {str(row['overlap']):>8} {row['width_ratio']:>5.2f}x {verdict}")  # fmt: skip
    out = {"reference_flops": f_ref, "cheaper_flops": f_cheap, "flops_share": f_cheap / f_ref, "rows": rows,
           "max_width_ratio": args.max_width_ratio, "passed": ok}  # fmt: skip
    (args.cheaper / "fit" / "compare.json").write_text(json.dumps(out, indent=1))
    print("passes" if ok else "does NOT pass", f"(overlap and at most {args.max_width_ratio:g}x as wide)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
