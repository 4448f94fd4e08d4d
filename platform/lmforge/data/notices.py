"""What the data layer says on the console while it builds a cached file on first use (one line, rank 0)."""

from __future__ import annotations

import sys
from pathlib import Path

from lmforge.runtime.env_vars import launch_rank


def first_use_notice(what: str, where: Path) -> None:
    """One line on stderr, from rank 0 only, before a cached data file is built on first use (the build takes
    seconds to minutes and prints nothing else): what is built and where it is cached for later runs."""
    if launch_rank() == 0:
        print(f"lmforge: {what} (first use; cached for later runs in {where})", file=sys.stderr, flush=True)
