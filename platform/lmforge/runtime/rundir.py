"""The run contract: one run directory per run, the same on every rank, across restarts and requeues.

Resolution order (first that applies wins):

1. ``run.name`` (explicit)                      -> <root>/<name>
2. ``run.sweep_point`` (set by sweeps)           -> <root>/<sweep_point>
3. Slurm job (array task included)              -> <root>/slurm-<jobid>[_<task>]
4. torchrun elastic run id (``--rdzv-id``)       -> <root>/torchrun-<run id>
5. ``$LMFORGE_RUN_ID`` (inherited from a parent) -> <root>/<id>
6. a fresh id ``<UTC time>-<random hex>``, created exclusively (never shared), then exported as
   ``$LMFORGE_RUN_ID`` so child processes and later evaluations in this process agree.

Slurm keeps the job id across requeues and torchrun keeps the run id across elastic restarts, so a
restarted job lands in the same directory and ``train.resume=auto`` finds its checkpoints. Every path
inside a run directory is named here (``RunPaths``), nowhere else.

``run.root`` may be any directory; a name or sweep point never leaves it (``escape_reason``: no absolute path,
no ``..`` component). Run directories are made ``RUN_DIR_MODE`` (0o750: group may read, others nothing).
"""

from __future__ import annotations

import os
import secrets
import time
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Mapping, Optional

from lmforge.runtime.env import environment

_FRESH_ID: Optional[str] = None
RUN_DIR_MODE = 0o750


class RunPathError(ValueError):
    """A run name or sweep point that would put the run directory outside ``run.root``."""


def escape_reason(value: str) -> Optional[str]:
    """Why ``value`` cannot name a directory inside a root (absolute, ``~``, a ``..`` component, the root
    itself), or None when ``root / value`` stays inside the root."""
    path = PurePosixPath(value)
    if path.is_absolute() or value.startswith("~"):
        return "is an absolute path"
    if ".." in path.parts:
        return "climbs out with a '..' component"
    if not path.parts:
        return "names the root itself"
    return None


def run_id_from_env(env: Mapping[str, str]) -> Optional[str]:
    if env.get("SLURM_ARRAY_JOB_ID") and env.get("SLURM_ARRAY_TASK_ID"):
        return f"slurm-{env['SLURM_ARRAY_JOB_ID']}_{env['SLURM_ARRAY_TASK_ID']}"
    if env.get("SLURM_JOB_ID"):
        return f"slurm-{env['SLURM_JOB_ID']}"
    rid = env.get("TORCHELASTIC_RUN_ID")
    if rid and rid != "none":
        return f"torchrun-{rid}"
    if env.get("LMFORGE_RUN_ID"):
        return env["LMFORGE_RUN_ID"]
    return None


def _fresh_id(root: Path) -> str:
    global _FRESH_ID
    if _FRESH_ID is None:
        root.mkdir(parents=True, exist_ok=True)
        while True:
            candidate = f"{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}-{secrets.token_hex(3)}"
            try:
                (root / candidate).mkdir()  # exclusive: two runs in the same second get two directories
                break
            except FileExistsError:
                continue
        _FRESH_ID = candidate
        os.environ["LMFORGE_RUN_ID"] = candidate
    return _FRESH_ID


def resolve_run_dir(
    root: str | os.PathLike,
    name: Optional[str] = None,
    sweep_point: Optional[str] = None,
    env: Optional[Mapping[str, str]] = None,
) -> Path:
    env = environment() if env is None else env
    root_path = Path(root).expanduser().absolute()
    for key, candidate in (("run.name", name), ("run.sweep_point", sweep_point)):
        if candidate not in (None, "", "null", "None"):
            reason = escape_reason(str(candidate))
            if reason is not None:
                raise RunPathError(f"{key}={candidate} {reason}: the run directory would leave run.root={root}")
            return root_path / str(candidate)
    rid = run_id_from_env(env)
    if rid is not None:
        return root_path / rid
    return root_path / _fresh_id(root_path)


def register_resolvers() -> None:
    """``${lmforge_run_dir:root,name,sweep_point}`` for ``hydra.run.dir`` in conf/config.yaml."""
    from omegaconf import OmegaConf

    if not OmegaConf.has_resolver("lmforge_run_dir"):
        OmegaConf.register_new_resolver(
            "lmforge_run_dir",
            lambda root, name=None, point=None: str(resolve_run_dir(root, name, point)),
            use_cache=True,
        )


@dataclass(frozen=True)
class RunPaths:
    """Every file and folder a run directory holds."""

    root: Path

    @property
    def config(self) -> Path:
        return self.root / "config.yaml"

    @property
    def launches(self) -> Path:
        """``launch-NNN.yaml`` per launch (lmforge.trainer.launch_record): its config, start step, what changed."""
        return self.root / "launches"

    @property
    def provenance(self) -> Path:
        return self.root / "provenance.json"

    @property
    def metrics(self) -> Path:
        return self.root / "metrics.jsonl"

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def traces(self) -> Path:
        return self.root / "traces"

    @property
    def comm_env(self) -> Path:
        return self.root / "comm_env.json"

    @property
    def comm_bench(self) -> Path:
        return self.root / "comm_bench.json"

    @property
    def dumps(self) -> Path:
        return self.root / "dumps"

    @property
    def wandb(self) -> Path:
        return self.root / "wandb"

    @property
    def heartbeats(self) -> Path:
        return self.root / "heartbeats"

    @property
    def verdicts(self) -> Path:
        """``rank<r>.json`` per rank of the current attempt, ``history.jsonl`` (lmforge.fault.verdict)."""
        return self.root / "verdicts"

    @property
    def crashes(self) -> Path:
        """Crash tracebacks of every attempt (the repeated-crash rule, lmforge.fault.verdict)."""
        return self.root / "crashes"

    @property
    def torchelastic(self) -> Path:
        """torchrun's own per-attempt worker logs and error files (lmforge.launch.agent; torch's default is a new
        ``/tmp/torchelastic_*`` folder per launch, never removed)."""
        return self.root / "torchelastic"

    @property
    def done_marker(self) -> Path:
        return self.root / "DONE"

    def make(self) -> "RunPaths":
        """Create the run directory and its checkpoint and log folders, each ``RUN_DIR_MODE`` whatever the umask
        (the run root's parents are the user's and keep their modes)."""
        for p in (self.root, self.checkpoints, self.logs):
            p.mkdir(parents=True, exist_ok=True)
            os.chmod(p, RUN_DIR_MODE)
        return self
