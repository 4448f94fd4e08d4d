"""Slurm submission from Python: the same slurm/train.sh, so signals, requeue and retries have one code path.

    lmforge launch --slurm --nodes 2 +exp=gpt_1b           # sbatch slurm/train.sh +exp=gpt_1b
    lmforge launch --slurm --dry-run +exp=gpt_1b           # print the script and the sbatch command

Resources come from the ``cluster`` config (nodes, gpus_per_node, time_limit_min, signal_lead_s,
partition, account) and can be overridden by flags.
"""
from __future__ import annotations

import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional, Sequence


def repo_root() -> Path:
    return Path(__file__).resolve().parents[3]


def train_script() -> Path:
    return repo_root() / "slurm" / "train.sh"


@dataclass
class SlurmLaunch:
    overrides: List[str]
    nodes: int
    gpus_per_node: int
    time_min: int
    signal_lead_s: int
    partition: str = ""
    account: str = ""
    extra: List[str] = field(default_factory=list)

    def sbatch_args(self) -> List[str]:
        args = [f"--nodes={self.nodes}", "--ntasks-per-node=1", f"--time={self.time_min}",
                f"--signal=B:USR1@{self.signal_lead_s}", "--requeue", "--open-mode=append"]
        if self.gpus_per_node > 0 and self.partition:
            args.append(f"--gpus-per-node={self.gpus_per_node}")
        if self.partition:
            args.append(f"--partition={self.partition}")
        if self.account:
            args.append(f"--account={self.account}")
        return args + list(self.extra)

    def command(self) -> List[str]:
        return ["sbatch", *self.sbatch_args(), str(train_script()), *self.overrides]


def plan(overrides: Sequence[str], nodes: Optional[int] = None, time_min: Optional[int] = None,
         extra: Sequence[str] = ()) -> SlurmLaunch:
    from lmforge.config.compose import compose
    from lmforge.config.validate import validate

    cfg = validate(compose(list(overrides)))
    c = cfg.cluster
    return SlurmLaunch(list(overrides), nodes or c.nodes, c.gpus_per_node, time_min or c.time_limit_min,
                       c.signal_lead_s, c.partition, c.account, list(extra))


def dry_run_text(launch: SlurmLaunch) -> str:
    import shlex

    return (f"# sbatch script: {train_script()}\n{train_script().read_text()}\n"
            f"# command:\n{shlex.join(launch.command())}\n")


def submit(launch: SlurmLaunch) -> str:
    out = subprocess.run(launch.command(), capture_output=True, text=True, check=True)
    return out.stdout.strip()
