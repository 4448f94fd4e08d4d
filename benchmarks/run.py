"""``python -m benchmarks.run [suite ...]``: run benchmark suites (default: the quick ones) one after another."""
from __future__ import annotations

import importlib
import sys

SUITES = {"step": "benchmarks.step"}
DEFAULT = ["step"]


def main(argv=None) -> int:
    names = list(sys.argv[1:] if argv is None else argv) or DEFAULT
    for name in names:
        if name not in SUITES:
            print(f"unknown suite '{name}'; suites: {', '.join(SUITES)}")
            return 2
        module = importlib.import_module(SUITES[name])
        sys.argv = [SUITES[name]]
        module.main()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
