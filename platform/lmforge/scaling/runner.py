"""``lmforge sweep run``: execute the pending points of a sweep and report which failed.

Launchers:
- ``local`` (default): ``--jobs`` worker processes (``python -m lmforge.scaling.worker``), each training its
  share of the points one after another in-process; ``--isolate`` starts one process per point instead.
- ``hydra``: Hydra multirun of ``lmforge.train`` over the per-point config group the planner wrote
  (``<sweep dir>/hydra/sweep_point/<id>.yaml``), with ``--hydra-launcher basic|submitit_local|submitit_slurm``
  and extra ``hydra.launcher.*`` settings; run directories are pinned to the sweep's run dirs.
- ``slurm-array``: ``sbatch --array=<pending indices> slurm/sweep_array.sh <sweep.json>``; the array script runs
  ``python -m lmforge.scaling.worker <sweep.json> --index $SLURM_ARRAY_TASK_ID``.

``--dry-run`` prints the commands without running them. Points whose run directory holds DONE are skipped
(re-running a sweep resumes it); unfinished points resume from their checkpoints (train.resume=auto).
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from lmforge.fault.verdict import deciding
from lmforge.runtime.rundir import RunPaths
from lmforge.scaling.errors import ScalingError
from lmforge.scaling.plan import SWEEP_FILE, Point, Sweep
from lmforge.scaling.worker import failure_path

DONE, FAILED, STARTED, PENDING = "done", "failed", "started", "pending"


def point_status(p: Point) -> str:
    paths = RunPaths(Path(p.run_dir))
    if paths.done_marker.exists():
        return DONE
    if failure_path(paths).exists():
        return FAILED
    if paths.metrics.exists():
        return STARTED  # running now, or killed without a traceback (a crash, a preemption)
    return PENDING


def status(sweep: Sweep) -> Dict[str, str]:
    return {p.id: point_status(p) for p in sweep.points}


def status_report(sweep: Sweep) -> str:
    st = status(sweep)
    counts = {k: sum(1 for v in st.values() if v == k) for k in (DONE, FAILED, STARTED, PENDING)}
    lines = [f"sweep {sweep.name}: " + ", ".join(f"{v} {k}" for k, v in counts.items())]
    for p in sweep.points:
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


def _todo(sweep: Sweep) -> List[Point]:
    return [p for p in sweep.points if point_status(p) != DONE]


def _sweep_file(sweep_dir: Path) -> Path:
    return Path(sweep_dir).absolute() / SWEEP_FILE


def local_commands(sweep: Sweep, sweep_dir: Path, jobs: int = 1, isolate: bool = False) -> List[List[str]]:
    todo = sorted(_todo(sweep), key=lambda p: -p.planned_flops)  # largest first balances the workers
    if isolate:
        groups = [[p] for p in todo]
    else:
        groups = [todo[i :: max(1, jobs)] for i in range(max(1, jobs))]
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


def hydra_command(
    sweep: Sweep, sweep_dir: Path, launcher: str = "basic", launcher_args: Sequence[str] = ()
) -> List[str]:
    todo = _todo(sweep)
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


def slurm_array_command(sweep: Sweep, sweep_dir: Path, script: Path, sbatch_args: Sequence[str] = ()) -> List[str]:
    index = {p.id: i for i, p in enumerate(sweep.points)}
    todo = [str(index[p.id]) for p in _todo(sweep)]
    return [
        "sbatch",
        f"--array={','.join(todo)}",
        f"--job-name=sweep-{sweep.name}",
        *sbatch_args,
        str(script),
        str(_sweep_file(sweep_dir)),
    ]


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
        cmds = [hydra_command(sweep, sweep_dir, hydra_launcher, launcher_args)]
    elif launcher == "slurm-array":
        script = Path(slurm_script) if slurm_script else Path("slurm/sweep_array.sh")
        if not script.is_file() and not dry_run:
            raise ScalingError(
                str(script),
                "the Slurm array script is missing",
                "pass --slurm-script PATH; it must run `python -m lmforge.scaling.worker SWEEP_JSON "
                "--index $SLURM_ARRAY_TASK_ID`",
            )
        cmds = [slurm_array_command(sweep, sweep_dir, script, launcher_args)]
    else:
        raise ScalingError("sweep run --launcher", f"'{launcher}' is not a launcher", "use local, hydra or slurm-array")
    if dry_run:
        for c in cmds:
            log(" ".join(shlex.quote(x) for x in c))
        return 0
    env = dict(os.environ)
    if launcher == "local" and len(cmds) > 1 and isolate:
        for c in cmds:  # one process per point, one after another
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
