"""``python pausing_train.py STEP AFTER_SHARDS <train overrides...>``: one rank of ``lmforge.train`` whose save of
checkpoint STEP freezes after AFTER_SHARDS ranks wrote their shard (tests/distributed/test_crash_mid_save.py).

The pause is installed in this process, in Python, before the entry point runs
(``checkpoint.fault_injection.install_save_pause``); production code reads no test setting from the environment.
"""

from __future__ import annotations

import sys

from lmforge.checkpoint import fault_injection
from lmforge.train import main

if __name__ == "__main__":
    step, after_shards, *overrides = sys.argv[1:]
    fault_injection.install_save_pause(int(step), int(after_shards))
    raise SystemExit(main(overrides))
