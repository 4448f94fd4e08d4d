"""Log collective results to a Weights & Biases run as tables plus scalars.

These take the W&B run object (or None, then they do nothing), so they work with whichever W&B sink the
metrics layer builds: ``wandb_run_of(logger)`` finds a run on any sink exposing a ``run`` attribute.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

BENCH_COLUMNS = ["op", "size_bytes", "time_us", "algbw_gbps", "busbw_gbps"]
OVERLAP_COLUMNS = ["rank", "collective", "total_ms", "exposed_ms", "overlap_fraction"]


def wandb_run_of(logger: Any) -> Optional[Any]:
    """The W&B run behind a MetricsLogger's sinks, if one has it (``sink.run``), else None."""
    for sink in getattr(logger, "sinks", []) or []:
        run = getattr(sink, "run", None)
        if run is not None and hasattr(run, "log"):
            return run
    return None


def _log(run: Any, payload: Dict[str, Any], step: Optional[int]) -> None:
    """One row at trainer step ``step`` (the ``trainer/step`` x-axis); W&B numbers rows itself, never ``step=``
    (a step below one already logged, as after a resume, would be dropped)."""
    run.log({**payload, "trainer/step": step} if step is not None else payload)


def log_bench(run: Optional[Any], result: Any, step: Optional[int] = None) -> None:
    """One table row per (op, size) and the summary scalars (peak bus bandwidth, latency per op)."""
    if run is None:
        return
    import wandb

    table = wandb.Table(
        columns=BENCH_COLUMNS, data=[[r.op, r.size_bytes, r.time_us, r.algbw_gbps, r.busbw_gbps] for r in result.rows]
    )
    payload: Dict[str, Any] = {"comm_bench/table": table, **result.summary()}
    _log(run, payload, step)


def log_overlap(
    run: Optional[Any], record: Dict[str, Any], per_rank: List[Dict[str, Any]], step: Optional[int] = None
) -> None:
    """One table row per (rank, collective type) and the aggregate overlap scalars of ``record``."""
    if run is None:
        return
    import wandb

    rows = []
    for stats in per_rank:
        for kind, k in sorted(stats["per_kind"].items()):
            rows.append([stats["rank"], kind, k["total_us"] / 1e3, k["exposed_us"] / 1e3, k["overlap_fraction"]])
        rows.append(
            [stats["rank"], "all", stats["total_us"] / 1e3, stats["exposed_us"] / 1e3, stats["overlap_fraction"]]
        )
    scalars = {k: v for k, v in record.items() if k.startswith("comm/") and isinstance(v, (int, float))}
    payload = {"comm/overlap_table": wandb.Table(columns=OVERLAP_COLUMNS, data=rows), **scalars}
    _log(run, payload, step)
