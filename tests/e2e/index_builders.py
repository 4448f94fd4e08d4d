"""A process that builds a run's index cache with ``index_build.build_for`` (started twice at once by
tests/e2e/test_index_build_race.py); prints one JSON line: what it built, how long it waited, what it loaded."""

from __future__ import annotations

import hashlib
import json
import sys


def main(overrides, ready_file: str, go_file: str) -> None:
    import time
    from pathlib import Path

    import torch.distributed as dist

    from lmforge.config.compose import compose
    from lmforge.config.validate import validate
    from lmforge.data.index_build import build_for

    cfg = validate(compose(overrides))
    Path(ready_file).write_text("ready")
    while not Path(go_file).exists():  # both processes leave the start line together
        time.sleep(0.01)
    assert not dist.is_initialized()
    report = build_for(cfg)
    ids = [report.mixture.train_text(i)[0].tolist() for i in range(0, report.mixture.num_train_samples, 97)]
    print(
        json.dumps(
            {
                "built": report.built,
                "present": report.present,
                "lock_wait_s": report.lock_wait_s,
                "samples": hashlib.sha256(json.dumps(ids).encode()).hexdigest(),
                "process_group_after": dist.is_initialized(),
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main(json.loads(sys.argv[1]), sys.argv[2], sys.argv[3])
