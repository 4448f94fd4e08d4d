"""The few Slurm client calls a supervisor of several jobs needs: submit, read a job's state, cancel, list nodes.

``job_states`` reads every watched job with one ``squeue -t all`` (jobs ended less than MinJobAge ago included);
an ended job's exit code comes from ``scontrol show job``, else from ``sacct`` (a job Slurm no longer holds).
"""

from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Sequence

ACTIVE = {"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "REQUEUED", "REQUEUE_FED", "REQUEUE_HOLD", "RESIZING"}
ACTIVE |= {"SUSPENDED", "STOPPED", "SIGNALING", "STAGE_OUT", "RESV_DEL_HOLD", "SPECIAL_EXIT"}


class SlurmError(RuntimeError):
    """A Slurm client call failed (its command and last line)."""


@dataclass(frozen=True)
class JobState:
    job: str
    state: str  # Slurm's JobState: RUNNING, COMPLETED, NODE_FAIL, ...
    nodes: List[str]  # where it runs or ran ([] while pending)
    exit_code: int  # the batch script's exit code once ended (-1: unknown or still running)

    @property
    def ended(self) -> bool:
        return bool(self.state) and self.state not in ACTIVE


def _run(cmd: Sequence[str], env: Optional[Mapping[str, str]] = None) -> subprocess.CompletedProcess:
    return subprocess.run(list(cmd), capture_output=True, text=True, env=None if env is None else dict(env))


def _last_line(proc: subprocess.CompletedProcess) -> str:
    lines = (proc.stderr.strip() or proc.stdout.strip() or f"exit {proc.returncode}").splitlines()
    return lines[-1]


def sbatch(args: Sequence[str], env: Optional[Mapping[str, str]] = None) -> str:
    """Submit; the job id."""
    proc = _run(["sbatch", "--parsable", *args], env)
    if proc.returncode != 0:
        raise SlurmError(f"sbatch {' '.join(args[:4])}... failed: {_last_line(proc)}")
    return proc.stdout.strip().split(";")[0]


def scancel(jobs: Sequence[str]) -> None:
    if jobs:
        _run(["scancel", *jobs])


def hostnames(nodelist: str) -> List[str]:
    """``node[1-3]`` as node names; '', '(null)' and 'None assigned' are none."""
    if not nodelist or nodelist in ("(null)", "None") or nodelist.startswith("("):
        return []
    proc = _run(["scontrol", "show", "hostnames", nodelist])
    return proc.stdout.split() if proc.returncode == 0 else nodelist.split(",")


def _exit_code(job: str) -> int:
    out = _run(["scontrol", "-o", "show", "job", job]).stdout
    m = re.search(r"\bExitCode=(\d+):\d+", out)
    if m is None:  # Slurm no longer holds the job (older than MinJobAge): the accounting database may
        out = _run(["sacct", "-X", "-n", "-P", "-j", job, "-o", "ExitCode"]).stdout.strip()
        m = re.match(r"(\d+):\d+", out)
    return int(m.group(1)) if m else -1


def job_states(jobs: Sequence[str]) -> Dict[str, JobState]:
    """job -> its state; a job Slurm does not list is left out (the caller retries on the next poll)."""
    if not jobs:
        return {}
    proc = _run(["squeue", "-h", "-t", "all", "-j", ",".join(jobs), "-o", "%i|%T|%N"])
    out: Dict[str, JobState] = {}
    for line in proc.stdout.splitlines():
        parts = line.strip().split("|")
        if len(parts) != 3 or parts[0] not in jobs:
            continue
        job, state, nodes = parts
        ended = state not in ACTIVE
        out[job] = JobState(job, state, hostnames(nodes), _exit_code(job) if ended else -1)
    for job in jobs:
        if job not in out and proc.returncode == 0:
            out.update(_from_sacct(job))
    return out


def _from_sacct(job: str) -> Dict[str, JobState]:
    proc = _run(["sacct", "-X", "-n", "-P", "-j", job, "-o", "State,ExitCode,NodeList"])
    parts = proc.stdout.strip().split("|") if proc.returncode == 0 else []
    if len(parts) != 3:
        return {}
    state = parts[0].split()[0]  # "CANCELLED by 0"
    m = re.match(r"(\d+):\d+", parts[1])
    return {job: JobState(job, state, hostnames(parts[2]), int(m.group(1)) if m else -1)}


def usable_nodes() -> List[str]:
    """The nodes Slurm could run a job on now (not down, drained, failing or not responding)."""
    proc = _run(["sinfo", "-h", "-N", "-o", "%N %T"])
    if proc.returncode != 0:
        raise SlurmError(f"sinfo failed: {_last_line(proc)}")
    nodes = [p[0] for p in map(str.split, proc.stdout.splitlines()) if len(p) == 2 and not unhealthy(p[1])]
    return sorted(set(nodes))


def unhealthy(state: str) -> bool:
    """Slurm's node state word means the node cannot run jobs (``down*``, ``drained``, ``idle*``: not responding)."""
    bad = ("down", "drain", "fail", "not_responding", "no_respond", "maint", "reboot", "future", "unknown")
    return state.endswith("*") or state.lower().startswith(bad)


def node_states(nodes: Sequence[str]) -> Dict[str, str]:
    """node -> Slurm's state word (``down*``, ``idle``...), for ``nodes``."""
    if not nodes:
        return {}
    proc = _run(["sinfo", "-h", "-N", "-o", "%N %T", "-n", ",".join(nodes)])
    return dict(line.split() for line in proc.stdout.splitlines() if len(line.split()) == 2)


def unhealthy_nodes(nodes: Sequence[str]) -> Dict[str, str]:
    """node -> state, for the nodes of ``nodes`` that Slurm reports unable to run jobs (``unhealthy``)."""
    return {n: s for n, s in node_states(nodes).items() if unhealthy(s)}
