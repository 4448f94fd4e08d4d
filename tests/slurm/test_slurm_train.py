"""slurm/train.sh on a real 4-node Slurm cluster: parity with a local run, in-job restarts, preemption
requeue, hang watchdog, node failure. Each job is one tiny 2-node x 1-task data-parallel run (model=tiny,
30 steps); several checks share a job to keep the number of torchrun launches small.
"""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from conftest import MAX_STEPS, REPO, TRAIN_OVERRIDES, events, train_losses

from lmforge.runtime.device_contract import install_fix

pytestmark = [pytest.mark.slurm, pytest.mark.distributed]


def submit(cluster, tmp: Path, name: str, overrides, env, sbatch=()):
    root = tmp / name
    root.mkdir(parents=True, exist_ok=True)
    args = [
        "--nodes=2",
        f"--job-name={name}",
        "-o",
        f"{root}/job-%j.out",
        "-e",
        f"{root}/job-%j.err",
        *sbatch,
        str(REPO / "slurm" / "train.sh"),
        *TRAIN_OVERRIDES,
        f"run.root={root}/runs",
        *overrides,
    ]
    job = cluster.sbatch(args, cwd=root, env=env)
    return job, root, root / "runs" / f"slurm-{job}"


def submit_with_submitit(cluster, tmp: Path, name: str, overrides, env, sbatch_arg: str):
    root = tmp / name
    root.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "lmforge.cli",
        "launch",
        "--slurm",
        "--submitit",
        "--nodes",
        "2",
        "--submitit-folder",
        str(root / "submitit"),
        f"--sbatch-arg={sbatch_arg}",
        *TRAIN_OVERRIDES,
        f"run.root={root}/runs",
        *overrides,
    ]
    job = cluster.client(cmd, cwd=root, env=env, timeout=120).stdout.strip().splitlines()[-1]
    return job, root, root / "runs" / f"slurm-{job}"


SWEEP_POINTS = (
    "# one sweep point per line\noptim.lr=1e-3 run.sweep_point=lr1e-3\n\noptim.lr=2e-3 run.sweep_point=lr2e-3\n"
)


def submit_sweep(cluster, tmp: Path, env):
    """Job E: a 2-point array through slurm/sweep_array.sh, single-process points on node3."""
    root = tmp / "sweep"
    root.mkdir(parents=True, exist_ok=True)
    (root / "points.txt").write_text(SWEEP_POINTS)
    overrides = [
        o for o in TRAIN_OVERRIDES if not o.startswith(("parallelism=", "train.max_steps=", "train.global_batch_size="))
    ]
    args = [
        "--array=0-1",
        "--nodes=1",
        "--nodelist=node3",
        "-o",
        f"{root}/job-%A_%a.out",
        "-e",
        f"{root}/job-%A_%a.err",
        str(REPO / "slurm" / "sweep_array.sh"),
        str(root / "points.txt"),
        *overrides,
        "train.max_steps=3",
        "train.global_batch_size=4",
        f"run.root={root}/runs",
    ]
    return cluster.sbatch(args, cwd=root, env=env), root, root / "runs"


def logs(root: Path, job: str) -> str:
    out = root / f"job-{job}.out"
    err = root / f"job-{job}.err"
    if (root / "submitit").is_dir():
        out, err = root / "submitit" / f"{job}_0_log.out", root / "submitit" / f"{job}_0_log.err"
    return (
        (out.read_text(errors="replace") if out.exists() else "")
        + "\n--- stderr ---\n"
        + (err.read_text(errors="replace") if err.exists() else "")
    )


def wait_completed(cluster, job: str, root: Path, timeout: float, restarts: int = 0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        try:
            info = cluster.wait_state(job, {"COMPLETED"}, timeout=max(1.0, deadline - time.monotonic()))
        except AssertionError as e:
            raise AssertionError(f"{e}\n{logs(root, job)[-6000:]}") from None
        if int(info.get("Restarts", "0")) >= restarts:
            return info
        if time.monotonic() > deadline:
            raise AssertionError(f"job {job} completed with Restarts={info.get('Restarts')}, expected {restarts}")
        time.sleep(0.5)


def wait_for(path: Path, timeout: float, what: str, root: Path, job: str) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not appear ({path}) within {timeout}s\n{logs(root, job)[-4000:]}")
        time.sleep(0.2)


PAIR = "--nodelist=node1,node2"  # jobs A, B, C and F fill node1+node2 (4 CPUs each); D gets node3+node4


@pytest.fixture(scope="module")
def concurrent_jobs(slurm_cluster, job_env, tmp_path_factory, local_reference):
    """All four jobs run side by side, so their restart and requeue waits overlap:

    A  kill + hang drills (in-job restarts)      B  USR1 to the batch shell (preemption, requeue)
    C  submitit, USR1 to the job steps            D  node failure: its second node is killed
    E  a 2-point sweep array (sweep_array.sh)     F  a crash beyond torchrun's restarts: retry budget
    G  a GPU config on CPU nodes: refused at prepare
    """
    tmp = tmp_path_factory.mktemp("jobs")
    a = submit(
        slurm_cluster,
        tmp,
        "faults",
        [
            "fault.watchdog_timeout_s=8",
            "fault.drill.kill_step=14",
            "fault.drill.kill_rank=1",
            "fault.drill.hang_step=24",
            "fault.drill.hang_rank=0",
            "fault.drill.hang_s=120",
        ],
        job_env,
        sbatch=[PAIR],
    )
    # G: a GPU cluster config on these CPU-only nodes: refused by the prepare step, before srun (first: it is quick).
    g = submit(
        slurm_cluster,
        tmp,
        "gpu",
        ["cluster=h100_node", "train.device=auto"],
        job_env,
        sbatch=["--nodelist=node3,node4"],
    )
    # B's layout follows the node count (no cluster.nodes given): dp_replicate = cluster.nodes = SLURM_NNODES = 2.
    b = submit(
        slurm_cluster,
        tmp,
        "preempt",
        ["fault.drill.step_sleep_s=0.3", "parallelism.dp_replicate=${cluster.nodes}"],
        job_env,
        sbatch=[PAIR],
    )
    c = submit_with_submitit(slurm_cluster, tmp, "submitit", ["fault.drill.step_sleep_s=0.3"], job_env, PAIR)
    # F: a crash that torchrun may not restart (max_restarts=0) -> the job-level retry budget requeues it.
    f = submit(
        slurm_cluster,
        tmp,
        "crash",
        ["fault.max_restarts=0", "cluster.max_requeues=1", "fault.drill.kill_step=14", "fault.drill.kill_rank=0"],
        job_env,
        sbatch=[PAIR],
    )
    d = submit(slurm_cluster, tmp, "nodefail", ["fault.drill.step_sleep_s=0.3"], job_env)
    jobs = {
        "gpu": g,
        "faults": a,
        "preempt": b,
        "submitit": c,
        "crash": f,
        "nodefail": d,
        "sweep": submit_sweep(slurm_cluster, tmp, job_env),
    }

    def preempt_batch(job):  # what --signal=B:USR1@lead does before the time limit: USR1 to the batch shell
        slurm_cluster.client(["scancel", "--signal=USR1", "--batch", job])

    def preempt_steps(job):  # submitit's --signal=USR1@lead (no B:): USR1 to the job steps
        slurm_cluster.client(["scancel", "--signal=USR1", job])

    def fail_node(job):  # a node failure: slurmd, slurmstepd and tasks of the job's second node are killed
        nodes = slurm_cluster.client(["scontrol", "show", "hostnames", slurm_cluster.job_info(job)["NodeList"]])
        victim = nodes.stdout.split()[1]
        assert slurm_cluster.kill_node(victim), f"nothing ran on {victim}"
        jobs["victim"] = victim

    # Act on each job as soon as its first checkpoint exists (all while training goes on).
    todo = {"preempt": preempt_batch, "submitit": preempt_steps, "nodefail": fail_node}
    deadline = time.monotonic() + 300
    while todo:
        for name in list(todo):
            job, root, run_dir = jobs[name]
            if (run_dir / "checkpoints" / "step-00000010" / "COMPLETE").exists():
                todo.pop(name)(job)
        if time.monotonic() > deadline:
            raise AssertionError(
                f"no first checkpoint for {sorted(todo)} within 300s\n"
                + "\n".join(logs(jobs[n][1], jobs[n][0])[-3000:] for n in todo)
            )
        time.sleep(0.2)
    return jobs


@pytest.mark.timeout(600)
def test_train_sh_matches_local_run_through_sigkill_and_hung_collective(
    slurm_cluster, concurrent_jobs, local_reference
):
    job, root, run_dir = concurrent_jobs["faults"]
    info = wait_completed(slurm_cluster, job, root, timeout=360)
    text = logs(root, job)

    # Head node address: the first node of the allocation, by its own address, never loopback.
    first = slurm_cluster.client(["scontrol", "show", "hostnames", info["NodeList"]]).stdout.split()[0]
    m = re.search(r"MASTER_ADDR=(\S+)", text)
    assert m and m.group(1) == slurm_cluster.addr[first], text[-3000:]
    assert m.group(1).startswith("127.100.") and m.group(1) not in ("127.0.0.1", "localhost", "::1"), m.group(1)
    hosts = {json.loads(p.read_text())["host"] for p in (run_dir / "heartbeats").glob("rank*.json")}
    assert len(hosts) == 2 and first in hosts, hosts  # one rank per node, each with its node's own hostname

    # SIGKILL of rank 1 after step 14 -> torchrun restarted the group, resumed from the step-10 checkpoint.
    assert "resumed from step 10" in text, text[-4000:]
    # Rank 0 withheld its collective after step 24: rank 1's watchdog dumped its stacks, inside the collective.
    dumps = sorted((run_dir / "dumps").glob("watchdog-rank1-*.txt"))
    assert dumps, f"no watchdog dump in {run_dir / 'dumps'}\n{text[-4000:]}"
    stack = dumps[0].read_text()
    assert "distributed_c10d.py" in stack and re.search(r"all_reduce|all_gather", stack), stack
    assert "resumed from step 20" in text, text[-4000:]

    ev = events(run_dir)
    kinds = [e["event"] for e in ev]
    watchdog = [e for e in ev if e["event"] == "watchdog"]
    assert watchdog and watchdog[0]["rank"] == 1 and watchdog[0]["step"] == 24, ev
    hang = json.loads((run_dir / "verdicts" / "rank1.json").read_text())  # retryable: torchrun restarted it
    assert (hang["kind"], hang["step"], hang["exit_code"], hang["deterministic"]) == ("hang", 24, 43, False), hang
    assert kinds.count("restart") >= 2 and "resume" in kinds, kinds

    # The loss curve equals the uninterrupted local 2-process run, bit for bit.
    assert train_losses(run_dir) == local_reference


@pytest.mark.timeout(600)
def test_usr1_checkpoints_requeues_and_resumes(slurm_cluster, concurrent_jobs, local_reference):
    job, root, run_dir = concurrent_jobs["preempt"]
    info = wait_completed(slurm_cluster, job, root, timeout=300, restarts=1)
    text = logs(root, job)

    ev = events(run_dir)
    pre = [e for e in ev if e["event"] == "preemption_checkpoint"]
    assert len(pre) == 1, ev
    k = pre[0]["step"]
    assert 10 <= k < MAX_STEPS
    assert (run_dir / "checkpoints" / f"step-{k:08d}" / "COMPLETE").exists()
    requeued = [e for e in ev if e["event"] == "requeued"]
    assert requeued and requeued[0]["slurm_restart"] == 1, ev  # SLURM_RESTART_COUNT=1 in the requeued run
    assert f"resumed from step {k}" in text, text[-4000:]
    assert int(info["Restarts"]) == 1
    state = json.loads((run_dir / "requeues.json").read_text())
    assert state["preemptions"] == 1 and state["failures"] == 0, state
    # Same run directory across the requeue (runs/slurm-<jobid>), hence the same W&B run id (kept in the
    # checkpoint sidecar), and the same losses as the uninterrupted run.
    ids = {
        json.loads((run_dir / "checkpoints" / f"step-{s:08d}" / "state.json").read_text()).get("wandb_run_id")
        for s in (k, MAX_STEPS)
    }
    assert len(ids) == 1, ids
    assert train_losses(run_dir) == local_reference
    # The allocation's node count fed the layout: sbatch --nodes=2, no cluster.nodes on the command line.
    resolved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert resolved["cluster"]["nodes"] == 2 and resolved["parallelism"]["dp_replicate"] == 2, resolved["cluster"]


@pytest.mark.timeout(300)
def test_gpu_config_on_cpu_nodes_fails_at_prepare_before_any_worker(slurm_cluster, concurrent_jobs):
    job, root, run_dir = concurrent_jobs["gpu"]
    info = slurm_cluster.wait_state(job, {"FAILED"}, timeout=240, fail_states=("COMPLETED", "CANCELLED", "TIMEOUT"))
    text = logs(root, job)
    assert info["ExitCode"] == "2:0", (info, text[-3000:])
    h, m, sec = map(int, info["RunTime"].split(":")[-3:])
    assert h * 3600 + m * 60 + sec < 90, info["RunTime"]  # seconds, not a training start-up (load allowing)
    err = text.split("--- stderr ---\n", 1)[1].splitlines()
    assert err[0] == (
        f"lmforge: node node3 (job {job} prepare): cluster=h100_node names h100 GPUs (train.device=auto) but torch "
        f"{torch.__version__} (torch.version.cuda=None) is a CPU-only build. Fix: {install_fix()}, or set "
        "train.device=cpu to train on CPU on purpose"
    ), err
    assert err[1:] == ["lmforge: prepare refused the job (exit 2); no worker was started"], err
    # No worker: srun never ran (no MASTER_ADDR line, no step), nothing was written under the run root.
    assert "MASTER_ADDR=" not in text and "training step ended" not in text, text
    assert not (root / "runs").exists(), sorted(p.name for p in (root / "runs").rglob("*"))


@pytest.mark.timeout(600)
def test_node_failure_requeues_on_other_nodes_and_completes(slurm_cluster, concurrent_jobs, local_reference):
    job, root, run_dir = concurrent_jobs["nodefail"]
    victim = concurrent_jobs["victim"]
    try:
        info = wait_completed(slurm_cluster, job, root, timeout=360, restarts=1)
        nodes = slurm_cluster.client(["scontrol", "show", "hostnames", info["NodeList"]]).stdout.split()
        assert victim not in nodes and len(nodes) == 2, (victim, nodes)  # the failed node is excluded
        text = logs(root, job)
        assert re.search(r"resumed from step [1-9]\d*", text), text[-4000:]
        requeued = [e for e in events(run_dir) if e["event"] == "requeued"]
        assert requeued and victim not in requeued[0]["nodes"], requeued
        assert train_losses(run_dir) == local_reference
        # The batch script's TERM was Slurm ending the run, not a preemption. Slurm requeued the job itself: its
        # batch script records that when it outlives Slurm's kill, else the next run's prepare step does (which one
        # depends on timing); either way the node that failed is named and a retry is spent.
        assert "lmforge: TERM at " in text and "Slurm is ending this run (" in text, text[-4000:]
        assert "preemption signal" not in text, text[-4000:]
        state = json.loads((run_dir / "requeues.json").read_text())
        lost = state["history"][0]
        assert (lost["action"], lost["kind"], lost["slurm_restart"]) == ("requeue", "node_failure", 0), lost
        assert lost["recorded_at"] in ("end of run 1", "start of run 2"), lost
        assert "the job was not requeued" not in text, text[-4000:]
        assert list(lost["lost_nodes"]) == [victim] and victim in lost["nodes"], lost
        assert lost["reason"].startswith(f"node failure: {victim} is "), lost
        assert state["failures"] == 1 and len(state["history"]) == 2, state  # then the run's own "done"
        assert [e["decision"] for e in events(run_dir) if e["event"] == "requeue"] == ["node_failure"]
    finally:
        slurm_cluster.start_slurmd(victim)  # the node returns
    slurm_cluster.wait_idle(4, timeout=90)


@pytest.mark.timeout(600)
def test_submitit_job_gets_the_same_preemption_requeue_and_resume(slurm_cluster, concurrent_jobs, local_reference):
    job, root, run_dir = concurrent_jobs["submitit"]
    info = wait_completed(slurm_cluster, job, root, timeout=300, restarts=1)
    ev = events(run_dir)
    pre = [e for e in ev if e["event"] == "preemption_checkpoint"]
    assert len(pre) == 1 and pre[0]["cause"] == "SIGUSR1", ev
    assert [e["decision"] for e in ev if e["event"] == "requeue"] == ["preempted"], ev
    assert int(info["Restarts"]) == 1
    assert f"resumed from step {pre[0]['step']}" in logs(root, job)
    assert train_losses(run_dir) == local_reference


@pytest.mark.timeout(600)
def test_sweep_array_runs_each_point_with_its_overrides(slurm_cluster, concurrent_jobs):
    job, root, runs = concurrent_jobs["sweep"]
    for task, lr in ((0, 1e-3), (1, 2e-3)):
        wait_completed(slurm_cluster, f"{job}_{task}", root, timeout=400)
        run = runs / f"lr{lr:.0e}".replace("e-0", "e-")
        assert (run / "DONE").exists(), sorted(p.name for p in runs.iterdir())
        assert f"lr: {lr}" in (run / "config.yaml").read_text()
        assert sorted(train_losses(run)) == [1, 2, 3]


@pytest.mark.timeout(600)
def test_crash_beyond_torchrun_restarts_is_requeued_within_the_retry_budget(
    slurm_cluster, concurrent_jobs, local_reference
):
    job, root, run_dir = concurrent_jobs["crash"]
    info = wait_completed(slurm_cluster, job, root, timeout=400, restarts=1)
    assert int(info["Restarts"]) == 1
    state = json.loads((run_dir / "requeues.json").read_text())
    first = state["history"][0]
    assert state["failures"] == 1 and state["preemptions"] == 0, state
    assert first["action"] == "requeue" and first["kind"] == "failure" and first["exit_code"] != 0, first
    assert first["reason"].endswith("retry 1 of 1"), first
    assert [e["decision"] for e in events(run_dir) if e["event"] == "requeue"] == ["failure"]
    assert "resumed from step 10" in logs(root, job)
    assert train_losses(run_dir) == local_reference
