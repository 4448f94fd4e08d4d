"""A sweep planned by ``lmforge sweep plan --wsd-branches`` run by ``lmforge sweep run --launcher slurm-array`` on
the real 4-node test cluster: the stable runs' array, then per stable run an array of its cooldown branches
waiting on it (``--dependency=afterok:<job>_<task>``), each task one ``slurm/sweep_worker.sh`` worker process.
One stable run is preempted (USR1 to its batch shell): the worker checkpoints, exits 42 and the array task is
requeued and resumes; its branch starts only after the requeued run completed. ``sweep collect`` then gives every
point. Negative control: the points-file script (``slurm/sweep_array.sh``), given the sweep file, refuses it in
one line (before this worker script existed, the runner submitted that script and each task failed); given the
planner's overrides.txt line of a stable run (shell-quoted overrides such as ``'checkpoint.at_steps=[46]'``), it
strips the quotes and trains that run through train.sh with the worker's losses, ending at its train.stop_at_step
without a requeue.

Five one-layer sizes at one budget (the planner's minimum is five sizes a budget): 5 stable runs + 5 branches.
"""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO, events, train_losses

from lmforge.cli import main as lmforge
from lmforge.scaling.data import read_csv
from lmforge.scaling.plan import load_sweep

pytestmark = [pytest.mark.slurm]

PLAN = [
    "sweep", "plan", "--preset", "tiny_cpu", "--name", "wsd", "--budgets", "4e9", "--family", "max_width=24",
    "--tpp", "0.5,2000", "--sizes", "5", "--rule", "min_steps=10", "--rule", "micro_batch_size=4",
    "--rule", "eval_batches=2", "--wsd-branches",
    "--", "fault.drill.step_sleep_s=0.04",  # a few seconds a run: time to preempt one mid-run
]  # fmt: skip
PREEMPTED = 0  # the task index of the stable run preempted (stable-l1-d8, the longest: 175 steps)


def job_logs(root: Path) -> str:
    return "\n".join(f"--- {p.name} ---\n{p.read_text(errors='replace')[-2500:]}" for p in sorted(root.glob("*.*")))


def wait_task(cluster, task: str, logs: Path, timeout: float, restarts: int = 0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        try:
            info = cluster.wait_state(task, {"COMPLETED"}, timeout=max(1.0, deadline - time.monotonic()))
        except AssertionError as e:
            raise AssertionError(f"{e}\n{job_logs(logs)}") from None
        if int(info.get("Restarts", "0")) >= restarts or time.monotonic() > deadline:
            return info
        time.sleep(0.5)


def last_train_step(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return 0
    steps = [json.loads(line).get("step", 0) for line in path.read_text().splitlines() if '"kind": "train"' in line]
    return max(steps, default=0)


@pytest.mark.timeout(600)
def test_planned_wsd_sweep_runs_as_dependent_arrays_with_requeue_and_collects_every_point(
    slurm_cluster, job_env, tmp_path
):
    runs, logs = tmp_path / "runs", tmp_path / "logs"
    logs.mkdir()
    i = PLAN.index("--")
    assert lmforge([*PLAN[:i], "--run-root", str(runs), *PLAN[i:]]) == 0
    sweep_dir = runs / "wsd"
    sweep = load_sweep(sweep_dir)
    units = sweep.units()
    assert [type(u).__name__ for u in units] == ["StableRun"] * 5 + ["Point"] * 5

    # Negative control first (it ends in a second): the old path, the points-file script given sweep.json.
    old = slurm_cluster.sbatch(
        ["--array=0", "-o", f"{logs}/old-%A_%a.out", "-e", f"{logs}/old-%A_%a.err", str(REPO / "slurm" / "sweep_array.sh"),
         str(sweep_dir / "sweep.json")],
        cwd=tmp_path,
        env=job_env,
    )  # fmt: skip

    out = slurm_cluster.client(
        [sys.executable, "-m", "lmforge.cli", "sweep", "run", str(sweep_dir), "--launcher", "slurm-array",
         f"--launcher-arg=--output={logs}/%A_%a.out", f"--launcher-arg=--error={logs}/%A_%a.err"],
        cwd=tmp_path,
        env=job_env,
        timeout=120,
    ).stdout  # fmt: skip
    stable_job = re.search(r"^(\d+)$", out, re.M).group(1)  # --parsable: the stable runs' array
    branch_jobs = re.findall(r"Submitted batch job (\d+)", out)
    assert len(branch_jobs) == 5 and "submitted; check progress with `lmforge sweep status`" in out, out

    # The points-file script (train.sh) on the planner's overrides.txt line of the smallest stable run, in a run
    # directory of its own: shell-quoted overrides ('~data.sources.code', 'checkpoint.at_steps=[46]') reach Hydra
    # unquoted, and its clean stop at train.stop_at_step (no DONE) ends the job instead of requeuing it.
    stable = units[4]
    line = (sweep_dir / "overrides.txt").read_text().splitlines()[4]
    assert "'checkpoint.at_steps=[46]'" in line and f"run.sweep_point=wsd/{stable.id} " in line
    (tmp_path / "points.txt").write_text(line.replace(f"=wsd/{stable.id} ", f"=wsd/points-{stable.id} ") + "\n")
    pf = slurm_cluster.sbatch(
        ["--array=0", "-o", f"{logs}/pf-%A_%a.out", "-e", f"{logs}/pf-%A_%a.err", str(REPO / "slurm" / "sweep_array.sh"),
         str(tmp_path / "points.txt")],
        cwd=tmp_path,
        env=job_env,
    )  # fmt: skip

    info = slurm_cluster.wait_state(f"{old}_0", {"FAILED"}, timeout=60, fail_states=("COMPLETED", "CANCELLED"))
    assert info["ExitCode"] == "2:0"
    err = next(logs.glob("old-*.err")).read_text().strip().splitlines()
    assert err == [
        f"lmforge sweep: {sweep_dir / 'sweep.json'} is a sweep file, not a points file (one line of overrides per "
        "point); submit it with `lmforge sweep run --launcher slurm-array` (slurm/sweep_worker.sh)"
    ]

    # Preempt the longest stable run mid-run: USR1 to its batch shell (what --signal=B:USR1@lead does).
    victim = Path(units[PREEMPTED].run_dir)
    deadline = time.monotonic() + 240
    while last_train_step(victim) < 20:
        assert time.monotonic() < deadline, f"stable run {victim.name} did not reach step 20\n{job_logs(logs)}"
        time.sleep(0.2)
    slurm_cluster.client(["scancel", "--signal=USR1", "--batch", f"{stable_job}_{PREEMPTED}"])

    done = {}
    for i in range(5):
        done[i] = wait_task(slurm_cluster, f"{stable_job}_{i}", logs, 300, restarts=int(i == PREEMPTED))
    for r, job in zip(sweep.stable_runs, branch_jobs):
        own = next(p for p in sweep.points if p.stable_run == r.id)
        b = wait_task(slurm_cluster, f"{job}_{units.index(own)}", logs, 300)
        # The branch array waited for its own stable run's task, through its requeue.
        assert b["StartTime"] >= done[units.index(r)]["EndTime"], (b, done[units.index(r)])

    assert int(done[PREEMPTED]["Restarts"]) == 1
    ev = events(victim)
    assert [e["decision"] for e in ev if e["event"] == "requeue"] == ["preempted"], ev
    pre = [e for e in ev if e["event"] == "preemption_checkpoint"]
    assert len(pre) == 1 and pre[0]["cause"] == "SIGUSR1", ev
    # The requeued task resumed in the same run directory from the preemption checkpoint.
    assert f"resumed from step {pre[0]['step']}" in (logs / f"{stable_job}_{PREEMPTED}.out").read_text()

    info = wait_task(slurm_cluster, f"{pf}_0", logs, 300)
    via_points = sweep_dir / f"points-{stable.id}"
    assert info["Restarts"] == "0" and (via_points / "checkpoints" / "step-00000046" / "COMPLETE").exists(), info
    assert train_losses(via_points) == train_losses(Path(stable.run_dir))  # the worker's stable run, step for step

    assert lmforge(["sweep", "status", str(sweep_dir)]) == 0
    assert lmforge(["sweep", "collect", str(sweep_dir)]) == 0
    rows = {r["id"]: r for r in read_csv(sweep_dir / "results.csv")}
    assert sorted(rows) == sorted(p.id for p in sweep.points)
    for p in sweep.points:
        row = rows[p.id]
        assert row["stable_run"] == p.stable_run and int(float(row["final_step"])) == p.max_steps, row
        assert row["resumed_from"].endswith(f"step-{p.branch_start:08d}") and float(row["final_val_loss"]) > 0, row
