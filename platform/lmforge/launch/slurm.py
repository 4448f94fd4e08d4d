"""Slurm submission from Python: the same slurm/train.sh, so signals, requeue and retries have one code path.

    lmforge launch --slurm --nodes 2 +exp=gpt_1b           # sbatch slurm/train.sh +exp=gpt_1b
    lmforge launch --slurm --dry-run +exp=gpt_1b           # print the script and the sbatch command
    lmforge launch --slurm --submitit +exp=gpt_1b          # the same script, submitted through submitit

Resources come from the ``cluster`` config (nodes, gpus_per_node, cpus_per_task, exclusive, time_limit_min,
signal_lead_s, partition, account; lmforge.launch.allocation) and can be overridden by flags. The job's
prepare step checks the allocation it got against the same config.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional, Sequence

from lmforge.launch.allocation import Resources, resources


def repo_root() -> Path:
    return Path(__file__).resolve().parents[3]


def train_script() -> Path:
    return repo_root() / "slurm" / "train.sh"


@dataclass
class SlurmLaunch:
    overrides: List[str]
    nodes: int
    gpus_per_node: int  # 0: no GPU request (the config trains on CPU processes)
    time_min: int
    signal_lead_s: int
    partition: str = ""
    account: str = ""
    extra: List[str] = field(default_factory=list)
    cpus_per_task: int = 1
    exclusive: bool = False

    def sbatch_args(self) -> List[str]:
        args = [
            f"--nodes={self.nodes}",
            "--ntasks-per-node=1",
            f"--time={self.time_min}",
            f"--signal=B:USR1@{self.signal_lead_s}",
            "--requeue",
            "--open-mode=append",
        ]
        args += Resources(self.nodes, self.gpus_per_node, self.cpus_per_task, self.exclusive).sbatch_args()
        if self.partition:
            args.append(f"--partition={self.partition}")
        if self.account:
            args.append(f"--account={self.account}")
        return args + list(self.extra)

    def command(self) -> List[str]:
        return ["sbatch", *self.sbatch_args(), str(train_script()), *self.overrides]


def plan(
    overrides: Sequence[str], nodes: Optional[int] = None, time_min: Optional[int] = None, extra: Sequence[str] = ()
) -> SlurmLaunch:
    from lmforge.config.compose import compose  # deferred: imports omegaconf; this module imports without it
    from lmforge.trainer.startup import check_start  # deferred: imports torch; this module imports without it

    # A bad task file is refused before sbatch (the epochs: the job's prepare step)
    cfg = check_start(compose(list(overrides)), epochs=False).validated
    c = cfg.cluster
    need = resources(cfg, nodes)  # the node count travels as --nodes only: the job's SLURM_NNODES sets cluster.nodes
    return SlurmLaunch(
        list(overrides),
        need.nodes,
        need.gpus_per_node,
        time_min or c.time_limit_min,
        c.signal_lead_s,
        c.partition,
        c.account,
        list(extra),
        need.cpus_per_task,
        need.exclusive,
    )


def dry_run_text(launch: SlurmLaunch) -> str:
    import shlex

    return (
        f"# sbatch script: {train_script()}\n{train_script().read_text()}\n# command:\n{shlex.join(launch.command())}\n"
    )


def submit(launch: SlurmLaunch) -> str:
    out = subprocess.run(launch.command(), capture_output=True, text=True, check=True)
    return out.stdout.strip()


class TrainScriptJob:
    """The function a submitit job runs: slurm/train.sh inside the allocation (``use_srun=False``).

    train.sh does the rest exactly as for ``sbatch`` (srun torchrun per node, signal forwarding, retry
    budget, ``scontrol requeue``), so a submitit job has the same fault handling. The time-limit signal is
    ``USR1`` to the job *steps* (no ``B:``): the torchrun agents ignore it, the workers checkpoint and exit
    0 without ``DONE``, and train.sh's ``jobctl after`` classifies that as a preemption and requeues.
    """

    def __init__(self, overrides: Sequence[str]):
        self.overrides = list(overrides)

    def __call__(self) -> int:
        import os

        proc = subprocess.run(["bash", str(train_script()), *self.overrides], env=dict(os.environ))
        if proc.returncode != 0:
            raise RuntimeError(f"slurm/train.sh exited {proc.returncode}; see the job's log and <run>/requeues.json")
        return 0


def submit_submitit(launch: SlurmLaunch, folder: Path) -> str:
    import submitit

    executor = submitit.SlurmExecutor(folder=str(folder))
    params = dict(
        nodes=launch.nodes,
        ntasks_per_node=1,
        time=launch.time_min,
        use_srun=False,
        additional_parameters={"requeue": True, "signal": f"USR1@{launch.signal_lead_s}"},
    )
    if launch.partition:
        params["partition"] = launch.partition
    if launch.account:
        params["account"] = launch.account
    if launch.gpus_per_node > 0:
        params["gpus_per_node"] = launch.gpus_per_node
    params["cpus_per_task"] = launch.cpus_per_task
    if launch.exclusive:
        params["additional_parameters"]["exclusive"] = True
    for arg in launch.extra:  # --sbatch-arg=--key=value -> an extra #SBATCH line
        key, _, value = arg.lstrip("-").partition("=")
        params["additional_parameters"][key.replace("-", "_")] = value or True
    executor.update_parameters(**params)
    job = executor.submit(TrainScriptJob(launch.overrides))
    return str(job.job_id)
