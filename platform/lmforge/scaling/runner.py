"""``lmforge sweep run``: execute the pending points of a sweep and report which failed.

Launchers:
- ``local`` (default): ``--jobs`` worker processes (``python -m lmforge.scaling.worker``), each training its
  share of the points one after another in-process; ``--isolate`` starts one process per point instead.
- ``hydra``: Hydra multirun of ``lmforge.train`` over the per-point config group the planner wrote
  (``<sweep dir>/hydra/sweep_point/<id>.yaml``), with ``--hydra-launcher basic|submitit_local|submitit_slurm``
  and extra ``hydra.launcher.*`` settings; run directories are pinned to the sweep's run dirs.
- ``slurm-array``: ``sbatch --array=<pending indices> slurm/sweep_worker.sh <sweep.json>``; the array script runs
  ``python -m lmforge.scaling.worker <sweep.json> --index $SLURM_ARRAY_TASK_ID`` with train.sh's preemption
  forwarding and requeue (exit 42 requeues that array task). The script is ``$LMFORGE_REPO/slurm/sweep_worker.sh``
  (else ``slurm/sweep_worker.sh`` under the current directory) unless ``--slurm-script`` names another.

A wsd-branches design (``sweep plan --wsd-branches``) trains each stable run before its cooldown branches: locally
a stable run and its branches form one chain in one worker; Hydra runs two multiruns (stable runs, then
branches); on Slurm each stable run's branches are an array that depends on that stable run's array task
(``--dependency=afterok:<job>_<task>``).

``--dry-run`` prints the commands without running them. Points whose run directory holds DONE are skipped
(re-running a sweep resumes it); unfinished points resume from their checkpoints (train.resume=auto).
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Union

from lmforge.fault.verdict import deciding
from lmforge.runtime.env_vars import read
from lmforge.runtime.rundir import RunPaths
from lmforge.scaling.errors import ScalingError
from lmforge.scaling.plan import SWEEP_FILE, Point, StableRun, Sweep
from lmforge.scaling.worker import failure_path, is_done

DONE, FAILED, STARTED, PENDING = "done", "failed", "started", "pending"


def point_status(p: Union[Point, StableRun]) -> str:
    paths = RunPaths(Path(p.run_dir))
    if is_done(p):
        return DONE
    if failure_path(paths).exists():
        return FAILED
    if paths.metrics.exists():
        return STARTED  # running now, or killed without a traceback (a crash, a preemption)
    return PENDING


def status(sweep: Sweep) -> Dict[str, str]:
    return {p.id: point_status(p) for p in sweep.units()}


def status_report(sweep: Sweep) -> str:
    st = status(sweep)
    counts = {k: sum(1 for v in st.values() if v == k) for k in (DONE, FAILED, STARTED, PENDING)}
    runs = (
        f" ({len(sweep.stable_runs)} stable runs, {len(sweep.points)} cooldown branches)" if sweep.stable_runs else ""
    )
    lines = [f"sweep {sweep.name}{runs}: " + ", ".join(f"{v} {k}" for k, v in counts.items())]
    for p in sweep.units():
        if st[p.id] == FAILED:
            stopped = deciding(Path(p.run_dir))
            if stopped is not None:
                lines.append(f"  FAILED {p.id}: {stopped.summary()}; not retried ({p.run_dir})")
                continue
            first = failure_path(RunPaths(Path(p.run_dir))).read_text().strip().splitlines()
            lines.append(f"  FAILED {p.id}: {first[-1] if first else '?'} ({p.run_dir})")
        elif st[p.id] == STARTED:
            lines.append(f"  unfinished {p.id}: started but no DONE marker ({p.run_dir})")
    return "\n".join(lines)


def _todo(sweep: Sweep) -> List[Union[Point, StableRun]]:
    """Unfinished runs, stable runs first (their branches resume them)."""
    return [p for p in sweep.units() if point_status(p) != DONE]


def _cost(unit: Union[Point, StableRun]) -> float:
    return unit.run_flops or unit.planned_flops


def chains(sweep: Sweep) -> List[List[Union[Point, StableRun]]]:
    """Per stable run: itself (unless done), then its unfinished branches, the dearest chain first; a chain runs
    in one worker, in order, so a branch starts only after its stable run wrote the checkpoint it resumes."""
    todo = {u.id for u in _todo(sweep)}
    out = []
    for r in sweep.stable_runs:
        chain = [r] * (r.id in todo) + [p for p in sweep.points if p.stable_run == r.id and p.id in todo]
        if chain:
            out.append(chain)
    return sorted(out, key=lambda c: -sum(_cost(u) for u in c))


def _lanes(groups: List[List[Union[Point, StableRun]]], jobs: int) -> List[List[Union[Point, StableRun]]]:
    lanes: List[List[Union[Point, StableRun]]] = [[] for _ in range(max(1, jobs))]
    load = [0.0] * len(lanes)
    for g in groups:  # dearest first onto the least-loaded worker
        i = load.index(min(load))
        lanes[i] += g
        load[i] += sum(_cost(u) for u in g)
    return lanes


def _sweep_file(sweep_dir: Path) -> Path:
    return Path(sweep_dir).absolute() / SWEEP_FILE


def local_commands(sweep: Sweep, sweep_dir: Path, jobs: int = 1, isolate: bool = False) -> List[List[str]]:
    """Worker commands; with ``isolate`` one per run, to be run one after another (stable runs first)."""
    if sweep.stable_runs:
        groups = [[u] for u in _todo(sweep)] if isolate else _lanes(chains(sweep), jobs)
    else:
        todo = sorted(_todo(sweep), key=lambda p: -p.planned_flops)  # largest first balances the workers
        groups = [[p] for p in todo] if isolate else [todo[i :: max(1, jobs)] for i in range(max(1, jobs))]
    return [
        [
            sys.executable,
            "-m",
            "lmforge.scaling.worker",
            str(_sweep_file(sweep_dir)),
            "--points",
            ",".join(p.id for p in g),
        ]
        for g in groups
        if g
    ]


def hydra_commands(
    sweep: Sweep, sweep_dir: Path, launcher: str = "basic", launcher_args: Sequence[str] = ()
) -> List[List[str]]:
    """One multirun, or two for a wsd-branches design: the stable runs, then (once they finished) the branches."""
    todo = _todo(sweep)
    phases = [[u for u in todo if isinstance(u, StableRun)], [u for u in todo if isinstance(u, Point)]]
    return [hydra_command(sweep, sweep_dir, launcher, launcher_args, units) for units in phases if units]


def hydra_command(
    sweep: Sweep,
    sweep_dir: Path,
    launcher: str = "basic",
    launcher_args: Sequence[str] = (),
    units: Optional[Sequence[Union[Point, StableRun]]] = None,
) -> List[str]:
    todo = _todo(sweep) if units is None else list(units)
    if launcher not in ("basic", "submitit_local", "submitit_slurm"):
        raise ScalingError(
            "sweep run --hydra-launcher",
            f"'{launcher}' is not a known launcher",
            "use basic, submitit_local or submitit_slurm",
        )
    group_dir = Path(sweep_dir).absolute() / "hydra"
    cmd = [
        sys.executable,
        "-m",
        "lmforge.train",
        "--multirun",
        f"hydra.searchpath=[file://{group_dir}]",
        f"+sweep_point={','.join(p.id for p in todo)}",
        f"hydra/launcher={launcher}",
        f"hydra.sweep.dir={sweep.run_root}",
        "hydra.sweep.subdir=${run.sweep_point}",
        *sweep.common_overrides,
    ]
    return cmd + [f"hydra.launcher.{a}" if not a.startswith("hydra.") else a for a in launcher_args]


def slurm_array_command(
    sweep: Sweep,
    sweep_dir: Path,
    script: Path,
    sbatch_args: Sequence[str] = (),
    units: Optional[Sequence[Union[Point, StableRun]]] = None,
    head: Sequence[str] = (),
) -> List[str]:
    index = {p.id: i for i, p in enumerate(sweep.units())}
    todo = [str(index[p.id]) for p in (_todo(sweep) if units is None else units)]
    return [
        "sbatch",
        *head,
        f"--array={','.join(todo)}",
        f"--job-name=sweep-{sweep.name}",
        *sbatch_args,
        str(script),
        str(_sweep_file(sweep_dir)),
    ]


STABLE_JOB = "$STABLE_JOB"  # the stable runs' array job id, filled in from `sbatch --parsable` when submitted


def slurm_array_commands(
    sweep: Sweep, sweep_dir: Path, script: Path, sbatch_args: Sequence[str] = ()
) -> List[List[str]]:
    """The sbatch lines; for a wsd-branches design, first the stable runs' array (``--parsable``: its job id is
    read back), then per stable run an array of its branches with ``--dependency=afterok:<job>_<task>``, so a
    branch waits for its own stable run only (a stable run already done: no dependency)."""
    if not sweep.stable_runs:
        return [slurm_array_command(sweep, sweep_dir, script, sbatch_args)]
    todo = {u.id for u in _todo(sweep)}
    index = {u.id: i for i, u in enumerate(sweep.units())}
    pending = [r for r in sweep.stable_runs if r.id in todo]
    cmds = [slurm_array_command(sweep, sweep_dir, script, sbatch_args, pending, ["--parsable"])] if pending else []
    for r in sweep.stable_runs:
        branches = [p for p in sweep.points if p.stable_run == r.id and p.id in todo]
        if branches:
            after = [f"--dependency=afterok:{STABLE_JOB}_{index[r.id]}"] if r.id in todo else []
            cmds.append(slurm_array_command(sweep, sweep_dir, script, sbatch_args, branches, after))
    return cmds


def _submit(cmds: List[List[str]], env: Dict[str, str], log) -> int:
    """Submit the sbatch lines in order, the stable runs' job id substituted into the branches' dependencies."""
    job = None
    for c in cmds:
        c = [a.replace(STABLE_JOB, job) if job else a for a in c]
        proc = subprocess.run(c, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            log(f"sbatch failed (exit {proc.returncode}): {proc.stderr.strip()}")
            return proc.returncode
        if "--parsable" in c:
            job = proc.stdout.strip().split(";")[0]
        log(proc.stdout.strip())
    return 0


def default_slurm_script() -> Path:
    return Path(read("LMFORGE_REPO", ".")) / "slurm" / "sweep_worker.sh"


def run_sweep(
    sweep: Sweep,
    sweep_dir: Path,
    launcher: str = "local",
    jobs: int = 1,
    isolate: bool = False,
    hydra_launcher: str = "basic",
    launcher_args: Sequence[str] = (),
    slurm_script: Optional[Path] = None,
    dry_run: bool = False,
    log=print,
) -> int:
    """Run (or print) the commands for the pending points; returns 0 when every point is done afterwards."""
    if not _todo(sweep):
        log(status_report(sweep))
        return 0
    if launcher == "local":
        cmds = local_commands(sweep, sweep_dir, jobs, isolate)
    elif launcher == "hydra":
        cmds = hydra_commands(sweep, sweep_dir, hydra_launcher, launcher_args)
    elif launcher == "slurm-array":
        script = Path(slurm_script) if slurm_script else default_slurm_script()
        if not script.is_file() and not dry_run:
            raise ScalingError(
                str(script),
                "the Slurm array script is missing",
                "pass --slurm-script PATH; it must run `python -m lmforge.scaling.worker SWEEP_JSON "
                "--index $SLURM_ARRAY_TASK_ID`",
            )
        cmds = slurm_array_commands(sweep, sweep_dir, script, launcher_args)
    else:
        raise ScalingError("sweep run --launcher", f"'{launcher}' is not a launcher", "use local, hydra or slurm-array")
    if dry_run:
        for c in cmds:
            log(" ".join(shlex.quote(x) for x in c))
        return 0
    env = dict(os.environ)
    if launcher == "slurm-array" and sweep.stable_runs:
        rc = _submit(cmds, env, log)
        if rc:
            return rc
    elif (launcher == "local" and len(cmds) > 1 and isolate) or launcher == "hydra":
        for c in cmds:  # one process per point (or per hydra phase: stable runs, then branches), in order
            subprocess.run(c, env=env)
    else:
        procs = [subprocess.Popen(c, env=env) for c in cmds]
        for pr in procs:
            pr.wait()
    if launcher == "slurm-array":
        log("submitted; check progress with `lmforge sweep status`")
        return 0
    report = status_report(sweep)
    log(report)
    return 0 if not _todo(sweep) else 1
