"""Requeue a Slurm job with nodes excluded from its next run, in the one window where Slurm takes the exclusion.

Slurm refuses ``scontrol update JobId=J ExcNodeList=...`` while the job runs ("Job is no longer pending
execution"). ``scontrol requeue J`` makes it pending at once (PENDING|COMPLETING) and Slurm starts it again only
once every process of the ended run is gone; this function runs inside that run (jobctl, from the batch script), so
the job cannot start before the update below lands. The order is therefore: ignore SIGTERM (Slurm signals the
run's processes on requeue; it sends SIGKILL only after KillWait), ``scontrol requeue``, then ``scontrol update``
with ExcNodeList = the job's excluded nodes plus the new ones (and ReqNodeList without them, when the job named
its nodes: otherwise the job could never start; NumNodes and NumTasks when the job shrinks), then read the job
back to check Slurm holds the exclusion.
"""

from __future__ import annotations

import re
import signal
import subprocess
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

from lmforge.runtime.env_vars import slurm_restart_count


@dataclass(frozen=True)
class Outcome:
    requeued: bool
    applied: bool  # Slurm holds every node asked for in the job's ExcNodeList
    error: str  # the first line of what went wrong ('' when nothing did)
    exc_nodes: List[str]  # the job's ExcNodeList after the update


def _scontrol(args: Sequence[str]) -> subprocess.CompletedProcess:
    return subprocess.run(["scontrol", *args], capture_output=True, text=True)


def _error(proc: subprocess.CompletedProcess) -> str:
    text = (proc.stderr.strip() or proc.stdout.strip() or f"exit {proc.returncode}").splitlines()
    return text[-1] if text else f"exit {proc.returncode}"


def hostnames(nodelist: str) -> List[str]:
    """A Slurm node list (``node[1-3],gpu7``) as node names; '' and '(null)' are empty."""
    if not nodelist or nodelist == "(null)":
        return []
    out = _scontrol(["show", "hostnames", nodelist])
    return out.stdout.split() if out.returncode == 0 else nodelist.split(",")


def job_node_fields(job: str) -> Dict[str, List[str]]:
    """The job's ExcNodeList and ReqNodeList, as node names."""
    out = _scontrol(["-o", "show", "job", job]).stdout
    fields = {k: v for k, v in re.findall(r"\b(ExcNodeList|ReqNodeList)=(\S*)", out)}
    return {k: hostnames(fields.get(k, "")) for k in ("ExcNodeList", "ReqNodeList")}


def tasks_per_node(job: str) -> int:
    """The job's tasks per node (NumTasks / NumNodes of the running job; train.sh: one); 0 when unknown."""
    out = _scontrol(["-o", "show", "job", job]).stdout
    nodes, tasks = re.search(r"\bNumNodes=(\d+)", out), re.search(r"\bNumTasks=(\d+)", out)
    if not (nodes and tasks) or int(nodes.group(1)) == 0:
        return 0
    return max(1, int(tasks.group(1)) // int(nodes.group(1)))


def requeued_by_slurm(job: str) -> str:
    """Why Slurm has already requeued or ended this run ('' when it has not): after a node failure Slurm requeues
    the job at once (``Restarts`` above this run's ``SLURM_RESTART_COUNT``; ``JobState`` COMPLETING)."""
    out = _scontrol(["-o", "show", "job", job]).stdout
    restarts = re.search(r"\bRestarts=(\d+)", out)
    if restarts and int(restarts.group(1)) > slurm_restart_count():
        return f"Slurm counts restart {restarts.group(1)}"
    return ""


def requeue_excluding(job: str, bad: Sequence[str], num_nodes: Optional[int] = None, requeue: bool = True) -> Outcome:
    """``scontrol requeue`` the job, then exclude ``bad`` from its next run (see the module docstring); with
    ``num_nodes``, the next run also asks for that many nodes (an elastic shrink); ``requeue=False`` when Slurm
    already requeued it (a node failure)."""
    if bad:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # finish the update before this run's processes end
    before = job_node_fields(job) if bad else {"ExcNodeList": [], "ReqNodeList": []}
    per_node = tasks_per_node(job) if num_nodes is not None else 0  # read while the job runs: exact
    proc = _scontrol(["requeue", job]) if requeue else subprocess.CompletedProcess([], 0, "", "")
    if proc.returncode != 0:
        return Outcome(False, False, f"scontrol requeue {job}: {_error(proc)}", before["ExcNodeList"])
    if not bad:
        return Outcome(True, True, "", before["ExcNodeList"])
    exc = sorted(set(before["ExcNodeList"]) | set(bad))
    args = ["update", f"JobId={job}", f"ExcNodeList={','.join(exc)}"]
    if set(before["ReqNodeList"]) & set(bad):
        args.append(f"ReqNodeList={','.join(n for n in before['ReqNodeList'] if n not in bad)}")
    if num_nodes is not None:
        args.append(f"NumNodes={num_nodes}-{num_nodes}")  # min-max: a bare count lowers only the minimum
        if per_node:  # without it Slurm keeps the old task count, which no longer fits ("never runnable")
            args.append(f"NumTasks={num_nodes * per_node}")
    proc = _scontrol(args)
    now = job_node_fields(job)["ExcNodeList"]
    if proc.returncode != 0:
        return Outcome(True, False, f"scontrol {' '.join(args)}: {_error(proc)}", now)
    missing = sorted(set(bad) - set(now))
    if missing:
        return Outcome(True, False, f"Slurm's ExcNodeList of job {job} lacks {','.join(missing)} after the update", now)
    return Outcome(True, True, "", now)
