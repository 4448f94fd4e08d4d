"""A replica fault-tolerant job's goodput (``fault.replica_ft=torchft``), in replica-seconds: ``<job>/goodput.json``.

Each replica group has its own run directory (``<job>/replica-<i>``) and its own ``goodput.json``
(``fault/goodput.py``). The job's is their sum over the job's wall time W, from the first process start of any group
to the last mark of any::

    goodput = sum of the groups' committed tokens / (G x a group's full-membership tokens/s x W)

with G the groups, a group's full-membership rate the median of theirs, and every cause summed over the groups, so
the causes sum to G x W replica-seconds. A group's seconds outside its own span are booked too: before its first
process start to ``startup``, after its last mark to ``restart_wait`` (a group whose last launch did not finish)
or ``other``. This is the scale of a whole-job run of the same G replicas (its ``goodput.json``: committed tokens of
all ranks / (their rate x wall)), so the two compare directly.
"""

from __future__ import annotations

import json
import re
import statistics
from pathlib import Path
from typing import List, Optional

from lmforge.fault.goodput import CAUSES, GoodputError, account
from lmforge.runtime.file_modes import write_text
from lmforge.runtime.rundir import RunPaths

GROUP_DIR = re.compile(r"replica-(\d+)$")


def group_dirs(job_dir: Path) -> List[Path]:
    """The replica groups' run directories under a torchft job directory that have goodput ledgers, by group id;
    [] for anything else (a run, a sweep)."""
    found = [p for p in Path(job_dir).glob("replica-*") if GROUP_DIR.search(p.name)]
    found = [p for p in found if RunPaths(p).goodput_ledgers.is_dir()]
    return sorted(found, key=lambda p: int(GROUP_DIR.search(p.name).group(1)))


def account_job(job_dir: Path) -> dict:
    """The job's goodput and its replica-seconds by cause (see the module doc)."""
    job_dir = Path(job_dir)
    dirs = group_dirs(job_dir)
    if not dirs:
        raise GoodputError(f"{job_dir}: no replica group (replica-<i>/goodput/launch-NNN.jsonl): not a torchft job")
    groups = [account(d) for d in dirs]
    start = min(g["started_at"] for g in groups)
    wall = max(g["started_at"] + g["wall_s"] for g in groups) - start
    causes = dict.fromkeys(CAUSES, 0.0)
    for g in groups:
        for cause, seconds in g["seconds"].items():
            causes[cause] += seconds
        causes["startup"] += g["started_at"] - start
        tail = start + wall - (g["started_at"] + g["wall_s"])
        causes["other" if g["ended"] in ("done", "stopped") else "restart_wait"] += tail
    rates = [g["full_membership_tokens_per_s"] for g in groups if g["full_membership_tokens_per_s"] > 0]
    rate = statistics.median(rates) if rates else 0.0
    tokens = sum(g["committed_tokens"] for g in groups)
    n = len(groups)
    return {
        "job": str(job_dir),
        "goodput": tokens / (n * rate * wall) if rate > 0 and wall > 0 else 0.0,
        "replica_groups": n,
        "wall_s": wall,
        "replica_seconds": n * wall,
        "seconds": causes,
        "committed_tokens": tokens,
        "group_full_membership_tokens_per_s": rate,
        "groups": [
            {
                "run": g["run"],
                "goodput": g["goodput"],
                "wall_s": g["wall_s"],
                "launches": g["launches"],
                "committed_steps": g["committed_steps"],
                "redone_steps": g["redone_steps"],
                "skipped_steps": g["skipped_steps"],
                "reduced_membership_steps": g["reduced_membership_steps"],
                "committed_tokens": g["committed_tokens"],
                "seconds": g["seconds"],
            }
            for g in groups
        ],
    }


def write_job_goodput(job_dir: Path) -> dict:
    """Account the job and write ``<job>/goodput.json`` (a temporary name, then a rename); returns the report."""
    report = account_job(job_dir)
    target = Path(job_dir) / "goodput.json"
    tmp = target.with_name(".goodput.json.tmp")
    write_text(tmp, json.dumps(report, indent=1, sort_keys=True) + "\n")
    tmp.replace(target)
    return report


def announce_job_goodput(job_dir: Path) -> Optional[dict]:
    """What a torchft launcher (local or Slurm) does at its end: write ``<job>/goodput.json`` and print its one line;
    the report, or None after a one-line warning (the accounting never fails a job)."""
    job_dir = Path(job_dir)
    try:
        if not group_dirs(job_dir):
            raise GoodputError(f"no replica group under {job_dir} wrote a goodput ledger (none trained)")
        report = write_job_goodput(job_dir)
    except (GoodputError, OSError, ValueError, KeyError) as exc:
        print(f"lmforge: warning: the job's goodput.json not written: {exc}", flush=True)
        return None
    print(
        f"lmforge: job goodput {report['goodput']:.1%} over {report['replica_groups']} replica groups, wall "
        f"{report['wall_s']:.1f} s ({report['replica_seconds']:.1f} replica-seconds); table: lmforge goodput {job_dir}",
        flush=True,
    )
    return report


def format_job_report(report: dict) -> str:
    """The table ``lmforge goodput JOB`` prints: the job's replica-seconds by cause, then one line per group."""
    total = report["replica_seconds"]
    lines = [
        f"goodput {report['goodput']:.3f}  {report['job']}  (replica fault tolerance, {report['replica_groups']} "
        f"groups)",
        f"  wall {report['wall_s']:.1f} s = {total:.1f} replica-seconds; a group's full-membership rate "
        f"{report['group_full_membership_tokens_per_s']:,.0f} tokens/s; {report['committed_tokens']:,} tokens "
        "committed",
    ]
    for cause in CAUSES:
        s = report["seconds"][cause]
        lines.append(f"  {cause:<19} {s:10.2f} s  {s / total if total > 0 else 0.0:6.1%}")
    for g in report["groups"]:
        lines.append(
            f"  {Path(g['run']).name}: goodput {g['goodput']:.3f}, {g['launches']} launch(es), "
            f"{g['committed_steps']} steps committed, {g['redone_steps']} redone, {g['skipped_steps']} skipped "
            f"(healed), {g['reduced_membership_steps']} at reduced membership"
        )
    return "\n".join(lines)
