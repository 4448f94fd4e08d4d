"""The checks a start runs after ``validate()`` and before any work, once, shared by every entry point.

``entry_checks(cfg, prepare, run_dir, epochs)`` runs, in this order and each at most once:

1. the eval section (``evaluation.tasks.check_eval_config``: the task files parse and their data is there);
2. the tokenizer (``data.tokenizer.load_tokenizer``): loaded here when ``prepare`` (a training start needs it), else
   only when a later check asks for it (an embedded tokenizer already built, a checkpoint to check), so a check
   that writes nothing (``lmforge plan``, the Slurm prepare step) trains no tokenizer;
3. the resume target, when ``run_dir`` is given (``checkpoint.manager.find_resume``: the checkpoint resolved and
   checked against this model and tokenizer, its sidecar read once), and the launch against what produced it
   (``checkpoint.relaunch_check.check_relaunch``: a launch that would train nothing, e.g. a finished run launched
   again, or that would train a finished run further under another optimizer, is refused);
4. the data epochs, when ``epochs`` (a training start or a job's prepare step first refuses a non-embedded source
   with no shards at its path, ``data.sources.check_sources_present``) (``data.epochs.check_run``, ``prepare``: the embedded corpora prepared first).

``timeout_lines(cfg, world_size, checks)`` (called by ``trainer.startup.check_start`` after them) orders the run's
timeouts (``config.timeouts``): the watchdog against the collective timeout and, for a resumed run, the newest
checkpoint save it recorded (``newest_save``: its ``checkpoint_save``/``checkpoint_commit`` events in
``<run>/metrics.jsonl``, read from the end) against the watchdog and Slurm's signal lead.

The result (``EntryChecks``) carries what the checks resolved: ``trainer.startup.start`` hands it to the
``Trainer``, which loads, resolves and parses none of it again. Who calls it: ``trainer.startup.check_start``, the
one start-up path (``lmforge.train`` and sweep points: ``prepare=True, run_dir``; the Slurm prepare step,
``launch.jobctl.check_job``, with the job's run dir; ``lmforge launch`` local and ``--slurm``, ``epochs=False``: the
data epochs are the job's prepare step's and the workers' check), and ``lmforge plan`` (``plan_lines``). Every
check raises ConfigError (one line, exit 2 at the entry point).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Iterator, List, Optional

from lmforge.checkpoint.relaunch_check import check_relaunch
from lmforge.config.record import config_dict
from lmforge.config.timeouts import MeasuredSave, timeout_warnings
from lmforge.config.validated import Validated
from lmforge.data.epochs import SourceEpochs, check_run, describe
from lmforge.data.sources import check_sources_present, default_cache_dir, unprepared_sources
from lmforge.data.tokenizer import Tokenizer, load_tokenizer
from lmforge.evaluation.tasks import Task, check_eval_config
from lmforge.evaluation.tasks import describe as describe_tasks
from lmforge.runtime.env_vars import slurm_job_id, slurm_restart_count, torchrun_restart_count
from lmforge.runtime.rundir import RunPaths

if TYPE_CHECKING:
    from lmforge.checkpoint.manager import ResumePoint


@dataclass
class EntryChecks:
    """What ``entry_checks`` resolved. ``tokenizer`` is None when no check needed it (``prepare=False``)."""

    eval_tasks: Optional[List[Task]]  # check_eval_config's parsed tasks (None: eval.tasks is empty)
    epochs: Optional[List[SourceEpochs]]  # check_run's verdict per source; None when not checked (epochs=False)
    run_dir: Optional[Path]  # the run directory the resume point was resolved in (None: not resolved)
    resume_point: Optional[ResumePoint]  # None: a fresh start (or not resolved, run_dir None)
    tokenizer: Optional[Tokenizer]


class _TokenizerOnce:
    """``load_tokenizer(data.tokenizer)`` on the first call, the same object on every later one."""

    def __init__(self, cfg) -> None:
        self.spec, self.cache = cfg.data.tokenizer, default_cache_dir(cfg.data, cfg.run.root)
        self.loaded: Optional[Tokenizer] = None

    def __call__(self) -> Tokenizer:
        if self.loaded is None:
            self.loaded = load_tokenizer(self.spec, self.cache)
        return self.loaded


def entry_checks(cfg, prepare: bool = False, run_dir: Optional[Path] = None, epochs: bool = True) -> EntryChecks:
    """The checks above on ``cfg`` (``validate()``'s result). ``prepare``: a training start (the tokenizer loaded,
    the embedded corpora prepared for the epochs check); ``run_dir``: resolve ``train.resume`` there."""
    eval_tasks = check_eval_config(cfg.eval)  # a bad task file is refused before the data is prepared
    if epochs and (prepare or run_dir is not None):  # a start (or a job's prepare step) needs its corpus there
        check_sources_present(cfg.data)
    tokenizer = _TokenizerOnce(cfg)
    if prepare:
        tokenizer()
    # A resume target that does not fit this model or tokenizer is refused before any corpus is tokenized for it.
    resume_point = None
    if run_dir is not None:
        from lmforge.checkpoint.manager import find_resume  # deferred: imports torch: only where a run dir is checked

        resume_point = find_resume(
            RunPaths(Path(run_dir)).checkpoints, cfg.train.resume, cfg.model, lambda: tokenizer().identity
        )
        if resume_point is not None:  # nothing rewritten: a launch that would not train is refused here
            root = cfg.cfg if isinstance(cfg, Validated) else cfg
            restarted = torchrun_restart_count() > 0 or slurm_restart_count() > 0
            check_relaunch(resume_point.path, resume_point.sidecar, config_dict(root), restarted=restarted)
    # A corpus repeated past data.max_epochs is refused before any process group exists (with prepare: on a fresh
    # cache too, the embedded corpora prepared here, under their locks, instead of by the trainer's mixture builder).
    found = check_run(cfg, prepare=prepare, tokenizer=tokenizer) if epochs else None
    return EntryChecks(eval_tasks, found, None if run_dir is None else Path(run_dir), resume_point, tokenizer.loaded)


def plan_lines(cfg) -> List[str]:
    """``lmforge plan``'s eval and data lines, from one ``entry_checks`` pass (nothing prepared or written)."""
    checks = entry_checks(cfg)
    return [
        describe_tasks(checks.eval_tasks),
        describe(checks.epochs, cfg.data.max_epochs, unprepared_sources(cfg.data)),
    ]


def lines_from_end(path: Path, block: int = 1 << 20) -> Iterator[str]:
    """The lines of ``path``, last first, read in blocks from the end (a long run's metrics file is never read
    whole to find its newest events)."""
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        end, rest = f.tell(), b""
        while end > 0:
            start = max(0, end - block)
            f.seek(start)
            chunk = f.read(end - start) + rest
            end = start
            lines = chunk.split(b"\n")
            rest = lines.pop(0) if start > 0 else b""
            for line in reversed(lines):
                if line.strip():
                    yield line.decode("utf-8", "replace")
        if rest.strip():
            yield rest.decode("utf-8", "replace")


def newest_save(metrics: Path) -> Optional[MeasuredSave]:
    """The newest committed checkpoint save in a run's ``metrics.jsonl``: from its ``checkpoint_commit`` event
    (``write_s``: from the save's start, or an async write's, to the commit) and the ``checkpoint_save`` event of the
    same step (``stall_s``, ``async_mode``: an async save's staging comes before its write). None when the file is
    missing or holds no commit."""
    if not metrics.is_file():
        return None
    commit = None
    for line in lines_from_end(metrics):
        try:
            record = json.loads(line)
        except ValueError:
            continue  # a torn last line of a killed run
        if not isinstance(record, dict) or record.get("kind") != "event":
            continue
        if commit is None and record.get("event") == "checkpoint_commit":
            commit = record
        elif commit is not None and record.get("event") == "checkpoint_save" and record.get("step") == commit["step"]:
            staged = float(record.get("stall_s", 0.0)) if record.get("async_mode", "none") != "none" else 0.0
            return MeasuredSave(int(commit["step"]), staged + float(commit.get("write_s", 0.0)), str(metrics))
    if commit is None:
        return None
    return MeasuredSave(int(commit["step"]), float(commit.get("write_s", 0.0)), str(metrics))


def timeout_lines(cfg, world_size: Optional[int], checks: EntryChecks) -> List[str]:
    """The warning lines of ``config.timeouts`` for this start: ``world_size`` processes; a resumed run's newest
    save, read from its metrics file (a fresh start knows none and says nothing about saves)."""
    root = cfg.cfg if isinstance(cfg, Validated) else cfg
    save = None
    if checks.run_dir is not None and checks.resume_point is not None:
        save = newest_save(RunPaths(checks.run_dir).metrics)
    return timeout_warnings(root, world_size, save, under_slurm=slurm_job_id() is not None)
