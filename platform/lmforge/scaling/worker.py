"""Run sweep points one after another in this process (imports, tokenizer and data cache paid once).

    python -m lmforge.scaling.worker SWEEP_FILE [--points ID,ID,...]     # local launcher
    python -m lmforge.scaling.worker SWEEP_FILE --index $SLURM_ARRAY_TASK_ID   # one point per array task
    python -m lmforge.scaling.worker SWEEP_FILE --index I --after-exit-code RC [--signalled]   # then: decide

The last form is slurm/sweep_worker.sh's decision after its task's run (the array-task twin of ``jobctl after``):
it prints ``done``, ``requeue`` or ``stop <exit code>``. A stable run whose branch-start checkpoints are all
complete, or a point with DONE, is done; otherwise lmforge.fault.retry decides as for any Slurm job (a preemption,
exit 42, requeues; a crash requeues within ``cluster.max_requeues``; a deterministic verdict stops).

Stable runs and cooldown branches (``sweep plan --wsd-branches``) are runs like the points: a branch whose stable
run has no complete checkpoint at its start step is not started (reported; the sweep's next run retries it).
For each point: skip it when its run directory holds the DONE marker; otherwise append a ``sweep_point`` event
(budget, N, D, ...) to the run's metrics.jsonl, compose the point's overrides exactly as ``lmforge train``
would, and train through ``lmforge train``'s start-up (``trainer.startup.train``: the same checks, the same
verdict). A failing point writes its traceback to ``<run>/logs/sweep-failure.txt`` and its verdict
(lmforge.fault.verdict) and the next point runs; a point whose verdict is deterministic (config, layout or data
error, divergence, repeated crash, corrupted replicas) is not retried when the sweep runs again (remove
``<run>/verdicts`` after fixing it). A preemption (exit 42) stops the worker so Slurm can requeue it; a replica
mismatch (exit 47, ``Corrupted``, a SystemExit like the preemption) ends the worker too. Exit status: 0 if every
point finished, 1 if any failed.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path
from typing import List, Optional, Sequence, Union

from lmforge.checkpoint.layout import is_complete, step_dir
from lmforge.fault.hooks import Diverged
from lmforge.fault.retry import record
from lmforge.fault.verdict import archive, deciding, verdicts_dir
from lmforge.runtime.file_modes import open_append, write_text
from lmforge.runtime.rundir import RunPaths
from lmforge.scaling.plan import Point, StableRun, Sweep, load_sweep

FAILURE_FILE = "sweep-failure.txt"


def failure_path(paths: RunPaths) -> Path:
    return paths.logs / FAILURE_FILE


def tag_record(sweep: Sweep, p: Union[Point, StableRun]) -> dict:
    head = {"kind": "event", "time": time.time(), "sweep": sweep.name, "point": p.id}
    if isinstance(p, StableRun):
        return {
            **head,
            "event": "sweep_stable_run",
            "n_params": p.n_params,
            "n_flops": p.n_flops,
            "branch_starts": p.branch_starts,
            "branches": p.branches,
            "run_flops": p.run_flops,
        }
    record = {
        **head,
        "event": "sweep_point",
        "budget": p.budget,
        "n_params": p.n_params,
        "n_flops": p.n_flops,
        "tokens": p.tokens,
        "flops_per_token": p.flops_per_token,
        "planned_flops": p.planned_flops,
    }
    if p.stable_run:
        record.update(stable_run=p.stable_run, branch_start=p.branch_start, decay_steps=p.decay_steps)
    return record


def stable_done(r: StableRun) -> bool:
    """A stable run is done when the checkpoint at every branch start is complete (it stops before its
    train.max_steps, so it never writes DONE)."""
    root = RunPaths(Path(r.run_dir)).checkpoints
    return all(is_complete(step_dir(root, s)) for s in r.branch_starts)


def is_done(p: Union[Point, StableRun]) -> bool:
    return stable_done(p) if isinstance(p, StableRun) else RunPaths(Path(p.run_dir)).done_marker.exists()


def branch_checkpoint(sweep: Sweep, p: Point) -> Path:
    """The stable run's checkpoint a cooldown branch resumes."""
    return step_dir(RunPaths(Path(sweep.stable(p.stable_run).run_dir)).checkpoints, p.branch_start)


def _describe(p: Union[Point, StableRun]) -> str:
    if isinstance(p, StableRun):
        return f"stable run (N={p.n_flops:.4g}, {p.max_steps} steps, branches at {','.join(map(str, p.branch_starts))})"
    if p.stable_run:
        return (
            f"cooldown branch of {p.stable_run} (C={p.budget:.3g}, N={p.n_flops:.4g}, D={p.tokens:.4g}, steps "
            f"{p.branch_start + 1}..{p.max_steps})"
        )
    return f"training (C={p.budget:.3g}, N={p.n_flops:.4g}, D={p.tokens:.4g}, {p.max_steps} steps)"


def run_point(sweep: Sweep, p: Union[Point, StableRun]) -> bool:
    from lmforge.config.compose import compose  # deferred: imports omegaconf; this module imports without it
    from lmforge.trainer.startup import train  # deferred: imports torch; this module imports without it

    paths = RunPaths(Path(p.run_dir))
    if is_done(p):
        print(f"[sweep] {p.id}: already done", flush=True)
        return True
    if isinstance(p, Point) and p.stable_run and not is_complete(branch_checkpoint(sweep, p)):
        print(
            f"[sweep] {p.id}: not started: its stable run {p.stable_run} has no complete checkpoint at step "
            f"{p.branch_start} ({branch_checkpoint(sweep, p)}); run {p.stable_run} first (`lmforge sweep run` does)",
            file=sys.stderr,
            flush=True,
        )
        return False

    stopped = deciding(paths.root)
    if stopped is not None:
        print(
            f"[sweep] {p.id}: not retried: {stopped.summary()} (after fixing it, remove {verdicts_dir(paths.root)})",
            file=sys.stderr,
            flush=True,
        )
        return False
    paths.make()
    archive(paths.root)
    failure_path(paths).unlink(missing_ok=True)
    with open_append(paths.metrics) as fh:
        fh.write(json.dumps(tag_record(sweep, p), sort_keys=True) + "\n")
    print(f"[sweep] {p.id}: {_describe(p)}", flush=True)
    try:
        train(lambda: compose(p.overrides), paths.root)  # `lmforge train`'s start-up: its checks, its verdict
    except (Exception, Diverged):  # noqa: BLE001  one point's failure must not stop the sweep; a preemption passes
        write_text(failure_path(paths), traceback.format_exc())
        print(
            f"[sweep] {p.id}: FAILED, see {failure_path(paths)}\n{traceback.format_exc(limit=3)}",
            file=sys.stderr,
            flush=True,
        )
        return False
    return True


def after(p: Union[Point, StableRun], exit_code: int, signalled: bool) -> str:
    """The array task's decision after its run: ``done``, ``requeue`` or ``stop <exit code>``."""
    if is_done(p):  # a stable run ends without DONE (exit 0): its branch-start checkpoints make it done
        return "done"
    from lmforge.config.compose import compose  # deferred: imports omegaconf; only a run not done needs it

    budget = compose(p.overrides).cluster.max_requeues
    decision = record(Path(p.run_dir), exit_code, signalled=signalled, max_failures=budget)
    print(f"[sweep] {p.id}: {decision.action}: {decision.reason}", file=sys.stderr, flush=True)
    return decision.word(exit_code)


def unit_at(sweep: Sweep, index: int) -> Union[Point, StableRun]:
    units = sweep.units()
    if not 0 <= index < len(units):
        print(
            f"[sweep] --index {index}: sweep {sweep.name} has runs 0..{len(units) - 1}; submit the array with "
            "`lmforge sweep run --launcher slurm-array`, which numbers them",
            file=sys.stderr,
            flush=True,
        )
        raise SystemExit(2)
    return units[index]


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m lmforge.scaling.worker", description=__doc__.splitlines()[0])
    ap.add_argument("sweep", type=Path)
    ap.add_argument("--points", default="", help="comma-separated point ids (default: every point)")
    ap.add_argument(
        "--index", type=int, default=None, help="run only the run at this index of stable runs + points (Slurm array)"
    )
    ap.add_argument("--after-exit-code", type=int, default=None, help="with --index: decide after the run (Slurm)")
    ap.add_argument("--signalled", action="store_true", help="with --after-exit-code: the task was preempted")
    args = ap.parse_args(argv)
    sweep = load_sweep(args.sweep)
    if args.after_exit_code is not None:
        if args.index is None:
            ap.error("--after-exit-code needs --index")
        print(after(unit_at(sweep, args.index), args.after_exit_code, args.signalled), flush=True)
        return 0
    if args.index is not None:
        points: List[Union[Point, StableRun]] = [unit_at(sweep, args.index)]
    elif args.points:
        points = [sweep.point(pid) for pid in args.points.split(",") if pid]
    else:
        points = sweep.units()
    failed = [p.id for p in points if not run_point(sweep, p)]
    if failed:
        print(f"[sweep] failed points: {', '.join(failed)}", file=sys.stderr, flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
