"""Checks on a launch that resumes a checkpoint, against what produced it (the config in its ``state.json``).

Run once per start by ``trainer.entry_checks`` on the resume point ``find_resume`` resolved, before any data or
model work. A launch is refused, in one ConfigError line (exit 2) that names the fix, when

* it would train nothing: the checkpoint is at or past this launch's ``train.max_steps`` (a finished run launched
  again, with or without other keys) or its ``train.stop_at_step``;
* it would train a finished run (its checkpoint at its own ``train.max_steps``) further under another optimizer
  or LR schedule: an ``optim.*`` key changed.

A restart of the same job (torchrun's restart count or Slurm's requeue count above 0) with the config that produced
the checkpoint is not refused: a job that failed after its final save and before it was marked done finishes.
So a finished run is never resumed to be re-saved under a config that did not produce it. Training a finished run
further with its own config (``train.max_steps`` raised) is a continuation and passes, and so does any resume of
an unfinished run (a changed LR schedule is announced as a warning by ``Trainer.maybe_resume``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, Optional, Tuple

from lmforge.config.batch_ramp import run_steps_of
from lmforge.config.errors import ConfigError
from lmforge.config.record import config_changes

OPTIMIZER = "optim."  # the keys a finished run keeps when it is trained further
SHOWN = 4  # changed keys a refusal names


def check_relaunch(path: Path, sidecar: dict, now: dict, restarted: bool = False) -> None:
    """Refuse resuming checkpoint ``path`` (its ``sidecar``) under ``now`` (this launch's ``config_dict``) in the
    cases above; return None when the launch trains. ``restarted``: this process is a restart of the same job (a
    torchrun restart or a Slurm requeue) — one that failed after its final save, before the run was marked done,
    finds that save and finishes without training (exit 0), as long as the config is the one that produced it."""
    step = int(sidecar.get("step", 0))
    recorded = sidecar.get("config") or {}
    changes = config_changes(recorded, now) if recorded else {}
    if restarted and recorded and not changes:
        return
    planned = recorded_max_steps(sidecar)
    finished = planned is not None and step >= planned
    max_steps, stop_at = run_steps_of(now["train"]), now["train"].get("stop_at_step") or 0  # a ramp's: more steps
    until = f"train.max_steps={now['train']['max_steps']}"
    if max_steps != now["train"]["max_steps"]:
        until += f" ({max_steps} optimizer steps under train.batch_size_schedule)"
    optim = {k: v for k, v in changes.items() if k.startswith(OPTIMIZER)}
    state = (
        f"the run is finished: checkpoint {path} is at step {step}"
        if finished
        else f"checkpoint {path} is at step {step}"
    )
    if step >= max_steps:
        raise ConfigError(
            "train.max_steps",
            f"{state}, and {until} leaves nothing to train{_changed(changes)}",
            _nothing_to_train_fix(path, step, now, optim, changes),
        )
    if stop_at and step >= stop_at:
        raise ConfigError(
            "train.stop_at_step",
            f"{state}, and train.stop_at_step={stop_at} leaves nothing to train",
            f"raise train.stop_at_step above {step}, or leave it out to train to {until}",
        )
    if finished and optim:
        key = next(iter(optim))
        raise ConfigError(
            key,
            f"{state} (its train.max_steps={planned}), and this launch would train it further to "
            f"{until} under another optimizer or LR schedule{_changed(optim)}",
            f"train it further with its own settings ({' '.join(f'{k}={_show(v[0])}' for k, v in optim.items())}), "
            f"or {_new_run(path, now)}",
        )


def recorded_max_steps(sidecar: dict) -> Optional[int]:
    """The ``train.max_steps`` the checkpoint was trained towards (its config, else its LR schedule); None: unknown.
    Under a batch ramp: the optimizer steps that reach it (config/batch_ramp.py)."""
    train = (sidecar.get("config") or {}).get("train") or {}
    planned = run_steps_of(train) if "max_steps" in train else None
    if planned is None:
        planned = (sidecar.get("scheduler") or {}).get("max_steps")
    return None if planned is None else int(planned)


def _nothing_to_train_fix(path: Path, step: int, now: dict, optim: dict, changes: dict) -> str:
    if optim:
        return _new_run(path, now)
    if any(k.startswith("eval.") for k in changes):
        return f"score the checkpoint without training: {offline_eval_command(path, now)}"
    return (
        f"train it further with train.max_steps above {step}, {_new_run(path, now)}, or score it: "
        f"{offline_eval_command(path, now)}"
    )


def _new_run(path: Path, now: dict) -> str:
    name = (now.get("run") or {}).get("name")
    new = f"{name}-2" if name else "NAME"
    return f"start a new run with run.name={new} (add train.init_from={path} to start from its weights)"


def offline_eval_command(path: Path, now: dict) -> str:
    """The command that scores checkpoint ``path`` on this launch's ``eval`` tasks (``evaluation.offline``)."""
    ev = now.get("eval") or {}
    cmd = f"python -m lmforge.evaluation.offline {path}"
    if ev.get("tasks"):
        cmd += f" --tasks {','.join(map(str, ev['tasks']))}"
    if ev.get("limit"):
        cmd += f" --limit {ev['limit']}"
    return cmd


def _changed(changes: Dict[str, Tuple[Any, Any]]) -> str:
    if not changes:
        return ""
    shown = [f"{k} {_show(a)} -> {_show(b)}" for k, (a, b) in list(changes.items())[:SHOWN]]
    more = f" and {len(changes) - SHOWN} more" if len(changes) > SHOWN else ""
    return f" (this launch changes {', '.join(shown)}{more})"


def _show(value: Any) -> str:
    return json.dumps(value) if isinstance(value, (list, dict)) else str(value)
