"""The bus-bandwidth preflight at the start of training (``comm.preflight=true``).

Runs a short ``lmforge comm bench`` sweep on the job's world before any training compute, writes
``<run>/comm_bench.json`` (+ ``.txt``), logs the summary to the metrics stream and the table to W&B, and
stops the job (every rank, same verdict) when a checked op's peak bus bandwidth is below the floor.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist

from lmforge.comm.bench import OPS, BenchResult, run_bench, size_sweep
from lmforge.comm.wandb_tables import log_bench, wandb_run_of
from lmforge.config.comm import CommConfig
from lmforge.runtime.rundir import RunPaths


class PreflightFailed(RuntimeError):
    pass


def run_preflight(
    cfg: CommConfig, device: torch.device, *, paths: RunPaths, logger: Any, step: int = 0
) -> Optional[BenchResult]:
    if not cfg.preflight:
        return None
    rank = dist.get_rank()
    if dist.get_world_size() < 2:
        logger.event("comm_preflight_skipped", step=step, cause="world size 1: no traffic to measure")
        return None
    result = run_bench(
        OPS, size_sweep(8, cfg.preflight_max_bytes, factor=8), iters=cfg.preflight_iters, warmup=1, device=device
    )
    result.check_floor(cfg.preflight_floor_gbps, [o.strip() for o in cfg.preflight_floor_ops.split(",")])
    if rank == 0:
        result.write(paths.comm_bench)
        print(result.table(), flush=True)
        logger.log({"kind": "comm_bench", "step": step, **result.summary()})
        log_bench(wandb_run_of(logger), result)
    if not result.passed:
        logger.event("comm_preflight_failed", step=step, cause="; ".join(result.failures))
        raise PreflightFailed(
            f"comm preflight failed ({cfg.name} preset, {result.backend}, {result.world_size} ranks): "
            f"{'; '.join(result.failures)}. Fix: check the fabric and the comm preset (NCCL_DEBUG=INFO prints the "
            f"transport NCCL chose; run `lmforge comm bench` alone), or lower comm.preflight_floor_gbps. "
            f"Table: {paths.comm_bench}"
        )
    return result
