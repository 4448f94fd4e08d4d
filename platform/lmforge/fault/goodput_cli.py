"""``lmforge goodput RUN [--json]``: where a run's wall time went (a sweep directory: one table per point; a
torchft job directory, ``<run.root>/<name>`` of ``fault.replica_ft=torchft``: the job's replica-seconds, also
written to ``<name>/goodput.json``)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import List

from lmforge.fault.goodput import GoodputError, account, format_report, run_dirs
from lmforge.fault.goodput_job import format_job_report, group_dirs, write_job_goodput


def main(argv: List[str]) -> int:
    parser = argparse.ArgumentParser(prog="lmforge goodput", description=__doc__)
    parser.add_argument(
        "run",
        type=Path,
        help="a run directory, a directory of runs (a sweep), or a torchft job directory (replica-<i>)",
    )
    parser.add_argument("--json", action="store_true", help="print the accounting as JSON (one object per run)")
    args = parser.parse_args(argv)
    if not args.run.is_dir():
        print(
            f"lmforge goodput: {args.run}: no such directory. Fix: name a run directory (run.root/run.name)",
            file=sys.stderr,
        )
        return 2
    if group_dirs(args.run):  # a torchft job: its replica groups' run directories, summed
        try:
            report = write_job_goodput(args.run)
        except (GoodputError, OSError) as exc:
            print(f"lmforge goodput: {exc}", file=sys.stderr)
            return 2
        print(json.dumps(report, sort_keys=True) if args.json else format_job_report(report))
        return 0
    runs = run_dirs(args.run)
    if not runs:
        print(
            f"lmforge goodput: {args.run}: no run below it has a goodput ledger (goodput/launch-NNN.jsonl). Fix: "
            "name a run directory whose training reached its first step",
            file=sys.stderr,
        )
        return 2
    for i, run in enumerate(runs):
        try:
            report = account(run)
        except GoodputError as exc:
            print(f"lmforge goodput: {exc}", file=sys.stderr)
            return 2
        if args.json:
            print(json.dumps(report, sort_keys=True))
        else:
            print(("\n" if i else "") + format_report(report))
    return 0
