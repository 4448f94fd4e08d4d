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

A start that is refused (a config error, a corpus read too often, ...) leaves no directory behind when this launch
made it: ``made_by_launch`` (before Hydra makes the directory) names the outermost directory the launch creates,
``remove_refused`` removes it again when it holds nothing but what a refused start writes (``REFUSED_START``).
"""

from __future__ import annotations

import os
import secrets
import shutil
import time
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Mapping, Optional, Tuple

from lmforge.runtime.env_vars import environment
from lmforge.runtime.file_modes import DIR_MODE

_FRESH_ID: Optional[str] = None
_FRESH_MADE: Optional[Tuple[Path, Path]] = None  # (the fresh run dir, the outermost directory _fresh_id created)
RUN_DIR_MODE = DIR_MODE  # 0o750 (runtime/file_modes.py)
HYDRA_DIR = ".hydra"  # conf/config.yaml's hydra.output_subdir: Hydra's record of the composition
JOB_LOG = "train.log"  # Hydra's job log (<hydra.job.name>.log; the job is named "train")
VERDICTS_DIR = "verdicts"
# What a start that is refused before training writes into its run directory: Hydra's record and job log, the
# refusal's verdict (lmforge.fault.verdict); besides these, only empty directories.
REFUSED_START = frozenset({HYDRA_DIR, JOB_LOG, VERDICTS_DIR})


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


def outermost_missing(path: Path) -> Optional[Path]:
    """The outermost of ``path`` and its parents that does not exist (what ``mkdir(parents=True)`` would create
    first), or None when ``path`` exists."""
    missing = None
    for p in (path, *path.parents):
        if p.exists():
            break
        missing = p
    return missing


def _fresh_id(root: Path) -> str:
    global _FRESH_ID, _FRESH_MADE
    if _FRESH_ID is None:
        root_made = outermost_missing(root)
        root.mkdir(parents=True, exist_ok=True)
        while True:
            candidate = f"{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}-{secrets.token_hex(3)}"
            try:
                (root / candidate).mkdir()  # exclusive: two runs in the same second get two directories
                break
            except FileExistsError:
                continue
        _FRESH_ID = candidate
        _FRESH_MADE = (root.absolute() / candidate, (root_made or root / candidate).absolute())
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


def made_by_launch(run_dir: Path) -> Optional[Path]:
    """Called before the run directory is created: the outermost directory this launch creates for ``run_dir``
    (``run_dir`` itself or a missing parent), or None when ``run_dir`` is there already (an earlier run's, a
    requeue's). A fresh id's directory, made exclusively by this process when its name was resolved, counts as this
    launch's."""
    run_dir = Path(run_dir).absolute()
    if _FRESH_MADE is not None and run_dir == _FRESH_MADE[0]:
        return _FRESH_MADE[1]
    return outermost_missing(run_dir)


def _only_refused_start(run_dir: Path) -> bool:
    """``run_dir`` holds nothing but ``REFUSED_START`` entries and empty directories."""
    for entry in run_dir.iterdir():
        if entry.is_symlink() or not (entry.name in REFUSED_START or (entry.is_dir() and not any(entry.iterdir()))):
            return False
    return True


def remove_refused(run_dir: Path, made: Optional[Path]) -> bool:
    """After a refused start: remove ``run_dir`` (and the parents up to ``made``, when empty) if this launch made it
    (``made``: ``made_by_launch``'s answer) and it holds only what a refused start writes. Returns whether it was
    removed; a directory that was there before, or that holds anything else, is kept as it is."""
    run_dir = Path(run_dir).absolute()
    if made is None or not run_dir.is_dir() or not (run_dir == made or made in run_dir.parents):
        return False
    if not _only_refused_start(run_dir):
        return False
    shutil.rmtree(run_dir)
    for parent in run_dir.parents:
        if parent == made.parent or not parent.is_dir() or any(parent.iterdir()):
            break
        parent.rmdir()
    return True


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

    def launch_record(self, number: int) -> Path:
        """The record of launch ``number`` (0: the run's first launch)."""
        return self.launches / f"launch-{number:03d}.yaml"

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
    def tensorboard(self) -> Path:
        """TensorBoard event files (``logging.tensorboard=true``; metrics/tensorboard_sink.py)."""
        return self.root / "tensorboard"

    @property
    def heartbeats(self) -> Path:
        return self.root / "heartbeats"

    @property
    def verdicts(self) -> Path:
        """``rank<r>.json`` per rank of the current attempt, ``history.jsonl`` (lmforge.fault.verdict)."""
        return self.root / VERDICTS_DIR

    @property
    def hydra(self) -> Path:
        """Hydra's record of the composition: config.yaml, hydra.yaml, overrides.yaml."""
        return self.root / HYDRA_DIR

    @property
    def job_log(self) -> Path:
        """Hydra's job log (what the run logged through Python's ``logging``)."""
        return self.root / JOB_LOG

    @property
    def evals(self) -> Path:
        """Per-document scores of the eval tasks, ``<task>-step-<N>.jsonl`` (when ``eval.tasks`` is set)."""
        return self.root / "evals"

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
    def goodput_ledgers(self) -> Path:
        """``launch-NNN.jsonl`` per launch: its start-up, steps, evaluation and save seconds (lmforge.fault.goodput_ledger)."""
        return self.root / "goodput"

    @property
    def goodput(self) -> Path:
        """The run's time accounting over all its launches (lmforge.fault.goodput; ``lmforge goodput RUN``)."""
        return self.root / "goodput.json"

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
