"""``python -m benchmarks.run [suite ...]``: run benchmark suites (default: the quick ones) one after another."""

from __future__ import annotations

import importlib
import sys

SUITES = {
    "step": "benchmarks.step",  # engine vs bare loop, eager/compiled, % of the same-run GEMM
    "data_loader": "benchmarks.data_loader",  # loader tokens/s vs training consumption, prepare MB/s
    "data_prepare": "benchmarks.data_prepare",  # data prepare MB/s per format vs raw encode_batch, 1/2 workers
    "checkpoint": "benchmarks.checkpoint",  # save/load time, async-save stall (gpt_125m)
    "parallel_layouts": "benchmarks.parallel_layouts",  # tokens/s of each layout vs single process
    "comm_overlap": "benchmarks.comm_overlap",  # DDP bucketed overlap vs all-reduce after backward
    "deepspeed_vs_fsdp": "benchmarks.deepspeed_vs_fsdp",  # ZeRO-3 vs FSDP2 tokens/s and memory
    "consistency": "benchmarks.consistency",  # replica consistency check vs a gpt_125m step
}
DEFAULT = ["step", "data_loader"]


def main(argv=None) -> int:
    names = list(sys.argv[1:] if argv is None else argv) or DEFAULT
    for name in names:
        if name not in SUITES:
            print(f"unknown suite '{name}'; suites: {', '.join(SUITES)}")
            return 2
        module = importlib.import_module(SUITES[name])
        sys.argv = [SUITES[name]]
        rc = module.main()
        if rc:
            return int(rc)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
