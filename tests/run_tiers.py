"""Run the suite's tiers one after another and account for each: wall time, CPU-seconds, load at start.

    python tests/run_tiers.py fast                 # make test-fast
    python tests/run_tiers.py fast full            # make test (the README's command, what CI runs)
    python tests/run_tiers.py drills --enforce     # budgets enforced (CI)
    python tests/run_tiers.py fast -- -k config    # pytest arguments after --

Wall time on a shared 2-core machine depends on its load; CPU-seconds (the user + system time of the tier's
pytest and every process it waited for, from getrusage(RUSAGE_CHILDREN)) much less so, which is why the budgets
are in CPU-seconds. Daemons that detach (Slurm's slurmctld/slurmd and the jobs they run) are not counted: their
time shows in the wall time only. With ``--enforce`` a tier over its budget fails the run after all tiers ran.
The figures are printed as a table and written as JSON (``--json``, default .cache/tiers.json).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List

REPO = Path(__file__).resolve().parents[1]
# CPU-second budgets per tier, on a 2-core machine of the CI's kind (docs/testing.md has the measured figures).
BUDGET_CPU_S: Dict[str, float] = {"fast": 600.0, "full": 2400.0, "drills": 2400.0}
NO_TESTS = 5  # pytest's exit status when it collected nothing


def children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_tier(tier: str, pytest_args: List[str]) -> dict:
    load = os.getloadavg()[0]
    cpu0, t0 = children_cpu_s(), time.monotonic()
    print(f"tiers: {tier} starts (load average {load:.2f})", flush=True)
    rc = subprocess.call([sys.executable, "-m", "pytest", "--tier", tier, *pytest_args], cwd=REPO)
    wall, cpu = time.monotonic() - t0, children_cpu_s() - cpu0
    return {"tier": tier, "exit": rc, "wall_s": round(wall, 1), "cpu_s": round(cpu, 1), "load_at_start": load}


def main(argv: List[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    pytest_args: List[str] = []
    if "--" in argv:
        k = argv.index("--")
        argv, pytest_args = argv[:k], argv[k + 1 :]
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("tiers", nargs="+", choices=sorted(BUDGET_CPU_S))
    ap.add_argument("--enforce", action="store_true", help="fail a tier that is over its CPU-second budget")
    ap.add_argument("--json", default=str(REPO / ".cache" / "tiers.json"), help="where the figures are written")
    args = ap.parse_args(argv)

    rows = [run_tier(tier, pytest_args) for tier in args.tiers]
    print("tiers: tier     exit    wall s     CPU s  budget CPU s  load at start")
    for r in rows:
        print(
            f"tiers: {r['tier']:<8} {r['exit']:>4} {r['wall_s']:>9.0f} {r['cpu_s']:>9.0f} "
            f"{BUDGET_CPU_S[r['tier']]:>13.0f} {r['load_at_start']:>14.2f}"
        )
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"tiers": rows, "budgets_cpu_s": BUDGET_CPU_S}, indent=2) + "\n")

    failed = [r for r in rows if r["exit"] != 0]
    for r in failed:
        why = "ran no test" if r["exit"] == NO_TESTS else f"pytest exited {r['exit']}"
        print(f"tiers: {r['tier']} failed: {why}", flush=True)
    over = [r for r in rows if r["cpu_s"] > BUDGET_CPU_S[r["tier"]]]
    for r in over:
        verdict = "over its budget" if args.enforce else "over its budget (not enforced outside CI)"
        print(f"tiers: {r['tier']} used {r['cpu_s']:.0f} CPU-s, {verdict} of {BUDGET_CPU_S[r['tier']]:.0f}")
    if failed:
        return 1
    return 1 if (args.enforce and over) else 0


if __name__ == "__main__":
    raise SystemExit(main())
