"""Rank entry points for tests/distributed/test_comm.py (started by harness.run_ranks on real gloo groups).

Several checks share one launch (a launch costs ~10 s here): after training, the same ranks can run
``lmforge comm bench`` and rank 0 can log the run's bench and overlap results to an offline W&B run.
"""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional


def _wandb_log(run_dir: Path, wandb_dir: str) -> None:
    """Log the run's preflight table and the overlap of its last profiled step (re-read from the kept traces)."""
    import wandb

    from lmforge.comm.bench import load_result
    from lmforge.comm.overlap import aggregate, analyze_trace
    from lmforge.comm.profiling import STEP_ANNOTATION
    from lmforge.comm.wandb_tables import log_bench, log_overlap

    run = wandb.init(
        project="lmforge-test",
        dir=wandb_dir,
        mode="offline",
        settings=wandb.Settings(x_disable_stats=True, console="off"),
    )
    log_bench(run, load_result(run_dir / "comm_bench.json"))
    last = sorted((run_dir / "traces").glob("step*-rank0.json"))[-1].name.split("-")[0]
    per_rank = [analyze_trace(run_dir / "traces" / f"{last}-rank{r}.json", STEP_ANNOTATION, r) for r in (0, 1)]
    step = int(last[len("step") :])
    log_overlap(run, aggregate(per_rank, step), [s.to_json() for s in per_rank], step=step)
    run.finish()


def train(runs: List[dict], bench_argv: Optional[List[str]] = None) -> dict:
    """Real training runs one after another in this process (the process group is made once and reused),
    each through the Trainer with the comm preflight and overlap probe: every entry of ``runs`` has
    ``overrides``, ``run_dir`` and optionally ``wandb_dir`` (rank 0 then logs the run to an offline W&B run).
    A run stopped by the preflight is reported in ``preflight_failed``.
    Then optionally ``lmforge comm bench BENCH_ARGV`` on the same ranks."""
    from lmforge.comm.preflight import PreflightFailed
    from lmforge.config.compose import compose
    from lmforge.trainer.startup import start

    out: dict = {"overlap": [], "preflight_failed": []}
    for run in runs:
        trainer = start(compose(run["overrides"]), Path(run["run_dir"]))
        try:
            trainer.fit()
        except PreflightFailed as e:  # expected only by runs that ask for an impossible floor
            out["preflight_failed"].append(str(e))
            continue
        out["rank"] = trainer.rank
        out["overlap"].append(trainer.overlap.last)
        if run.get("wandb_dir") and trainer.rank == 0:
            _wandb_log(Path(run["run_dir"]), run["wandb_dir"])
        del trainer
    if bench_argv is not None:
        from lmforge.comm.cli import bench_main

        out["bench_rc"] = bench_main(bench_argv)
    return out
