"""Run benchmark suites (default: the quick ones) one after another, each printing its table and writing its JSON.

python benchmarks/run.py [suite ...]      # from any directory
python -m benchmarks.run [suite ...]      # from the checkout root
python benchmarks/run.py --help           # the suites and what each measures
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a file from another directory: the suites import benchmarks.*
    sys.path.insert(0, str(REPO))

SUITES = {
    "step": "benchmarks.step",
    "data_loader": "benchmarks.data_loader",
    "data_prepare": "benchmarks.data_prepare",
    "checkpoint": "benchmarks.checkpoint",
    "parallel_layouts": "benchmarks.parallel_layouts",
    "comm_overlap": "benchmarks.comm_overlap",
    "deepspeed_vs_fsdp": "benchmarks.deepspeed_vs_fsdp",
    "consistency": "benchmarks.consistency",
    "scale_growth": "benchmarks.scale_growth",
    "scale_data": "benchmarks.scale_data",
}
SUITE_HELP = {
    "step": "engine vs bare loop, eager/compiled, % of the same-run GEMM",
    "data_loader": "loader tokens/s vs training consumption, prepare MB/s",
    "data_prepare": "data prepare MB/s per format vs raw encode_batch, 1/2 workers",
    "checkpoint": "save/load time, async-save stall (gpt_125m)",
    "parallel_layouts": "tokens/s of each layout vs single process",
    "comm_overlap": "DDP bucketed overlap vs all-reduce after backward",
    "deepspeed_vs_fsdp": "ZeRO-3 vs FSDP2 tokens/s and memory",
    "consistency": "replica consistency check vs a gpt_125m step",
    "scale_growth": "checkpoint, store, gather, memory, collective costs at world 1-32",
    "scale_data": "data prepare, index build, loader start-up CPU-s by corpus size",
}
DEFAULT = ["step", "data_loader"]


def parse_args(argv):
    lines = [f"  {name:<18} {SUITE_HELP[name]}" for name in SUITES]
    ap = argparse.ArgumentParser(
        prog="python benchmarks/run.py",
        description="Run benchmark suites one after another (default: " + " ".join(DEFAULT) + ").",
        epilog="suites:\n" + "\n".join(lines),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("suites", nargs="*", metavar="suite", help="suite names (see below)")
    args = ap.parse_args(argv)
    for name in args.suites:
        if name not in SUITES:
            ap.exit(2, f"benchmarks: unknown suite '{name}'. Fix: choose from {', '.join(SUITES)}\n")
    return args.suites or DEFAULT


def main(argv=None) -> int:
    names = parse_args(list(sys.argv[1:] if argv is None else argv))
    for name in names:
        module = importlib.import_module(SUITES[name])
        sys.argv = [SUITES[name]]
        rc = module.main()
        if rc:
            return int(rc)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
