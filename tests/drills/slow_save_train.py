"""``python slow_save_train.py STEP SECONDS <train overrides...>``: ``lmforge.train`` whose save of checkpoint STEP
takes SECONDS longer (a slow file system), for the goodput drill (tests/drills/test_goodput_drill.py).

The delay is installed in this process, in Python, before the entry point runs (a commit hook of
``checkpoint.fault_injection`` that sleeps after the shards are written); production code reads no test setting.
"""

from __future__ import annotations

import sys
import time

from lmforge.checkpoint import fault_injection
from lmforge.train import main


def slow_commit(step: int, seconds: float):
    def hook(stage: str, at_step: int, _final) -> None:
        if stage == "shards" and at_step == step:
            time.sleep(seconds)

    return hook


if __name__ == "__main__":
    step, seconds, *overrides = sys.argv[1:]
    fault_injection.install_commit_hook(slow_commit(int(step), float(seconds)))
    raise SystemExit(main(overrides))
