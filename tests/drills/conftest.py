"""Fixtures the drills share with the multi-rank tests: the parity samples and the one-process references
(tests/distributed/conftest.py), for the scale drills' parity cases."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from distributed.conftest import parity_samples, references  # noqa: E402,F401  (fixtures, registered by import)
