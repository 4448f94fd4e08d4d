"""``python pausing_prepare.py SHARD READY <prepare args...>``: ``lmforge data prepare`` that freezes while writing
shard SHARD, right after its first document went into the shard's temporary file, and then writes the file READY,
so a test can ``kill -9`` it at a known point (tests/e2e/test_data_sharded.py) instead of racing a poll against a
build that may finish first.

The pause is installed in this process, in Python, before the entry point runs; production code reads no test
setting.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from lmforge.data import sharded_prepare
from lmforge.data.prepare import main


def install_write_pause(shard: str, ready: Path) -> None:
    real = sharded_prepare.write_shard

    def write_shard(prefix, token_docs, *args, **kwargs):
        if Path(prefix).name != shard:
            return real(prefix, token_docs, *args, **kwargs)

        def docs():
            for ids in token_docs:
                yield ids
                # write_shard asks for the next document: the first one is in the temporary file's builder.
                ready.write_text("writing\n")
                time.sleep(3600)

        return real(prefix, docs(), *args, **kwargs)

    sharded_prepare.write_shard = write_shard


if __name__ == "__main__":
    shard, ready, *argv = sys.argv[1:]
    install_write_pause(shard, Path(ready))
    raise SystemExit(main(argv))
