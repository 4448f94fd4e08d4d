"""Where the benchmark suites write their results: one default for every suite.

``benchmarks/results/scratch/`` (ignored by git) gets every run's output. The results that docs/performance.md and
the reports quote are copied to ``benchmarks/results/<device-kind>/`` and committed (docs/performance.md, "Where
results go").
"""

from __future__ import annotations

from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"  # tracked: results/<device-kind>/..., the quoted figures
SCRATCH = RESULTS / "scratch"  # ignored: every suite's default output


def scratch_path(name: str) -> Path:
    """``benchmarks/results/scratch/<name>``, its folder created."""
    SCRATCH.mkdir(parents=True, exist_ok=True)
    return SCRATCH / name
