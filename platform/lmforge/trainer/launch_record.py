"""One record per launch of a run: ``<run>/launches/launch-NNN.yaml`` (NNN from 000, the run's first launch).

``config.yaml`` is the config of the launch that started the run at step 0 and a checkpoint's ``state.json`` the
config of the launch that saved it; neither is rewritten by a later launch. What each launch ran with is written
here instead, once, by rank 0 before its first step::

    launch: 1                       # this run's second launch
    start_step: 300                 # the step it started from (0: a fresh start)
    resumed_from: /.../checkpoints/step-00000300   # null: a fresh start
    argv: [...]                     # the command line (secrets redacted)
    changed:                        # the keys whose value differs from the resumed checkpoint's config
      train.max_steps: {checkpoint: 300, launch: 600}
    config: {...}                   # this launch's whole config (as config.yaml holds it)
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from omegaconf import OmegaConf

from lmforge.config.record import config_changes
from lmforge.runtime.file_modes import make_dir, open_exclusive
from lmforge.runtime.rundir import RunPaths
from lmforge.runtime.secrets import redact

if TYPE_CHECKING:
    from lmforge.checkpoint.manager import ResumePoint

PREFIX = "launch-"


def launch_number(path: Path) -> int:
    """The launch number of a record's path (``launch-007.yaml`` -> 7)."""
    return int(path.stem[len(PREFIX) :])


def write_launch_record(paths: RunPaths, config: dict, step: int, resumed: Optional["ResumePoint"]) -> Path:
    """Write this launch's record (the next free number) and return its path."""
    make_dir(paths.launches)
    recorded = (resumed.sidecar.get("config") or {}) if resumed is not None else {}
    changed = config_changes(recorded, config) if resumed is not None else {}
    record = {
        "start_step": step,
        "resumed_from": None if resumed is None else str(resumed.path),
        "argv": redact(list(sys.argv)),
        "changed": {k: {"checkpoint": a, "launch": b} for k, (a, b) in changed.items()},
        "config": config,
    }
    number = len(list(paths.launches.glob(f"{PREFIX}*.yaml")))
    while True:  # exclusive: a number is never reused
        path = paths.launch_record(number)
        try:
            with open_exclusive(path) as fh:
                fh.write(OmegaConf.to_yaml(OmegaConf.create({"launch": number, **record})))
            return path
        except FileExistsError:
            number += 1
