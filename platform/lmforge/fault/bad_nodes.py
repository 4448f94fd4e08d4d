"""Nodes at fault: which nodes of an attempt a requeue should leave out, and the record of every exclusion.

A node is at fault when Slurm reports it unhealthy (down, drained, failing, not responding: the launcher asks
``sinfo``), when the replica check found silent data corruption on its replica in the attempt that just ended
(``corrupted`` events with ``hosts``: named only where the check could tell which replica is wrong, the minority of
three or more; a pair or a tie names no host, so it excludes nobody), or when the straggler detector flagged it at
least ``fault.exclude_straggler_flags`` times (``straggler`` events); events are read from ``<run>/metrics.jsonl``
after the attempt's ``requeued`` event, by host. ``slurm/train.sh`` (``lmforge.launch.jobctl after``) excludes such nodes from the
job's next run and records each one, with its reason and whether Slurm took it, in ``<run>/excluded_nodes.json``
(cumulative over the run: a node once excluded stays excluded for the job) and in the requeue's
``requeues.json`` entry.
"""

from __future__ import annotations

import json
import os
import time
from collections import Counter
from pathlib import Path
from typing import Dict, Iterable, Mapping

from lmforge.runtime.file_modes import write_text
from lmforge.runtime.rundir import RunPaths

EXCLUSIONS_FILE = "excluded_nodes.json"


def short_host(host: str) -> str:
    """A host name as Slurm names nodes (the first label of a fully qualified name)."""
    return host.split(".", 1)[0]


def attempt_events(run_dir: Path) -> Iterable[dict]:
    """The events of the attempt that is ending: those after the last ``requeued`` event (a requeued run's start)."""
    path = RunPaths(Path(run_dir)).metrics
    if not path.exists():
        return []
    out: list = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if rec.get("kind") != "event":
            continue
        if rec.get("event") == "requeued":
            out = []
        else:
            out.append(rec)
    return out


def straggler_flags(run_dir: Path) -> Dict[str, int]:
    """host -> how many times the straggler detector flagged a rank on it in the attempt that is ending."""
    return dict(
        Counter(
            short_host(str(e["host"]))
            for e in attempt_events(run_dir)
            if e.get("event") == "straggler" and e.get("host")
        )
    )


def corrupted_hosts(run_dir: Path) -> Dict[str, str]:
    """host -> why, for the hosts a ``corrupted`` event of the attempt that is ending names (its suspect replica's
    hosts; an ambiguous finding names none)."""
    out: Dict[str, str] = {}
    for e in attempt_events(run_dir):
        if e.get("event") != "corrupted":
            continue
        where = "replica group's state" if e.get("replica_groups") is not None else "replica"
        for host in e.get("hosts") or []:
            out.setdefault(
                short_host(str(host)),
                f"silent data corruption on its {where} at step {e.get('step')} (fault.consistency_every)",
            )
    return out


def at_fault(run_dir: Path, nodes: Iterable[str], unhealthy: Mapping[str, str], straggler_limit: int) -> Dict[str, str]:
    """node -> why it is at fault, for the nodes of this attempt (``unhealthy``: node -> the state Slurm reports)."""
    nodes = list(nodes)
    reasons = {n: f"Slurm reports it {state}" for n, state in unhealthy.items() if n in nodes}
    for host, why in corrupted_hosts(run_dir).items():
        if host in nodes and host not in reasons:
            reasons[host] = why
    if straggler_limit > 0:
        for host, count in sorted(straggler_flags(run_dir).items()):
            if host in nodes and count >= straggler_limit and host not in reasons:
                reasons[host] = (
                    f"flagged as a straggler {count} times in this run "
                    f"(fault.exclude_straggler_flags={straggler_limit})"
                )
    return reasons


def load(run_dir: Path) -> Dict[str, dict]:
    path = Path(run_dir) / EXCLUSIONS_FILE
    try:
        return json.loads(path.read_text()).get("nodes", {})
    except (OSError, ValueError, AttributeError):
        return {}


def excluded(run_dir: Path) -> Dict[str, dict]:
    """node -> its record, for the nodes whose exclusion Slurm took."""
    return {n: r for n, r in load(run_dir).items() if r.get("applied")}


def save(run_dir: Path, reasons: Mapping[str, str], *, job: str, slurm_restart: int, applied: bool, error: str) -> None:
    """Add this requeue's exclusions to ``<run>/excluded_nodes.json`` (tmp + rename)."""
    nodes = load(run_dir)
    for node, reason in reasons.items():
        nodes[node] = {
            "reason": reason,
            "job": job,
            "slurm_restart": slurm_restart,
            "time": time.time(),
            "applied": applied,
            "error": error,
        }
    path = Path(run_dir) / EXCLUSIONS_FILE
    tmp = path.with_suffix(".tmp")
    write_text(tmp, json.dumps({"nodes": nodes}, indent=1, sort_keys=True))
    os.replace(tmp, path)
