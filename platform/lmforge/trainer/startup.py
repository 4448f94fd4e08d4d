"""The one start-up path of a training: every start and every check of one goes through ``check_start``.

``check_start(cfg, world_size, run_dir, prepare, epochs, job_checks)`` runs, each once and in this order:

1. ``config.validate.validate`` (every check that needs no process group, against ``world_size``);
2. the caller's ``job_checks(validated)``, if any (the Slurm prepare step: the device contract, the memory fit and
   the job's allocation);
3. ``trainer.entry_checks.entry_checks`` (the eval tasks, the tokenizer, the resume point in ``run_dir``, the data
   epochs);
4. ``trainer.entry_checks.timeout_lines``: the order of the run's timeouts (``config.timeouts``), each line that is
   off printed once as a warning on stderr (rank 0 of a launched job; stdout stays the Slurm prepare step's).

It returns ``Checked`` (the validated config and what the entry checks resolved). Who calls it: ``start`` (below),
the Slurm prepare step (``launch.jobctl.check_job``, writing nothing, in the job's run dir) and ``lmforge launch``
(local and ``--slurm``, ``epochs=False``: the data epochs are the workers' and the job's prepare step's check).

``start(cfg, run_dir)`` is the only way a ``Trainer`` is built: ``check_start`` on the processes actually started
(``prepare=True``: the tokenizer loaded, the embedded corpora prepared, the resume point resolved in ``run_dir``),
then the Trainer from its result. ``train(cfg, run_dir)`` is ``start`` and ``Trainer.fit`` inside the run's
``fault.verdict.VerdictRecorder``: what ``lmforge train`` runs on every rank (``lmforge.train``), a sweep point
(``scaling.worker``) and the test harnesses (``tests/distributed/train_entries.py``; ``tests/sync_probe.py`` and the
others that need the Trainer itself call ``start``). A check added to ``check_start`` or to ``entry_checks``
therefore refuses every one of them (``tests/e2e/test_start_work_once.py``).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Optional, Union

from lmforge.config.validate import validate
from lmforge.config.validated import Validated
from lmforge.fault.goodput_ledger import begin_run
from lmforge.fault.verdict import VerdictRecorder
from lmforge.runtime.env_vars import launch_rank, launch_world_size
from lmforge.trainer.entry_checks import EntryChecks, entry_checks, timeout_lines

if TYPE_CHECKING:
    from lmforge.trainer.trainer import Trainer

# Where train.resume is resolved: a path, or how to get it from the validated config (the run names checked first).
RunDir = Union[Path, Callable[[Validated], Path], None]


@dataclass(frozen=True)
class Checked:
    """What ``check_start`` resolved: ``validate()``'s result and ``entry_checks()``'s."""

    validated: Validated
    entry: EntryChecks


def check_start(
    cfg,
    *,
    world_size: Optional[int] = None,
    run_dir: RunDir = None,
    prepare: bool = False,
    epochs: bool = True,
    job_checks: Optional[Callable[[Validated], None]] = None,
) -> Checked:
    """Every check of a start, once each (the module docstring). ``cfg``: a composed config; ``world_size``: the
    processes the layout is checked against (None: ``validate``'s default, $WORLD_SIZE when set); ``prepare``,
    ``epochs``: as ``entry_checks`` takes them. Raises ConfigError / DeviceContractError (exit 2 at the entry
    point). Prints the timeout warnings (step 4)."""
    validated = validate(cfg, world_size=world_size)
    if job_checks is not None:
        job_checks(validated)
    where = run_dir(validated) if callable(run_dir) else run_dir
    entry = entry_checks(validated, prepare=prepare, run_dir=where, epochs=epochs)
    world = world_size if world_size is not None else launch_world_size()
    if launch_rank() == 0:
        for line in timeout_lines(validated, world, entry):
            print(line, file=sys.stderr, flush=True)
        if entry.resume_point is not None and entry.resume_point.named is not None:
            print(continued_line(entry.resume_point), flush=True)
    return Checked(validated, entry)


def continued_line(point) -> str:
    """The line of a launch whose ``train.resume`` names another run's checkpoint while this run has its own."""
    return (
        f"lmforge: train.resume={point.named} is where this run started; it continues from its own newest "
        f"checkpoint {point.path} (a new run.name starts from {point.named} again)"
    )


def start(cfg, run_dir: Path) -> "Trainer":
    """Check a training start in ``run_dir`` on the processes actually started, then build its Trainer."""
    checked = check_start(cfg, world_size=launch_world_size() or 1, run_dir=Path(run_dir), prepare=True)
    from lmforge.trainer.trainer import Trainer  # deferred: torch and the engines, only once the checks passed

    return Trainer(checked.validated, Path(run_dir), checked.entry)


def train(cfg, run_dir: Path) -> "Trainer":
    """``start`` and ``fit``; an error leaving either is recorded as this rank's verdict (``<run>/verdicts/``,
    read by the launchers). ``cfg``: the composed config, or how to compose it (a sweep point, whose run directory
    exists before its composition: an error composing it is its verdict too). Returns the Trainer after its loop."""
    begin_run()
    with VerdictRecorder(Path(run_dir)) as verdict:
        trainer = start(cfg() if callable(cfg) else cfg, run_dir)
        verdict.step = lambda: trainer.step
        trainer.fit()
    return trainer
