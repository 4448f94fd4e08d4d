"""Rank entry points for tests/e2e/test_interop_hf_e2e.py (started by harness.run_ranks)."""
from __future__ import annotations

import os
from typing import List


def train(argv: List[str]) -> dict:
    """``lmforge train ARGV`` on this rank, exactly as the command line would run it (Hydra included)."""
    from lmforge.train import main

    main(list(argv))
    return {"rank": int(os.environ["RANK"])}


def save_tensor_parallel_checkpoint(root: str, model: dict, seed: int) -> dict:
    """Build lmforge's GPT tensor-parallel over 2 ranks with torch's own TP plan and save it with the
    CheckpointManager: q/k/v and w1/w3 column-sharded, wo and w2 row-sharded (DTensor slices in DCP)."""
    from pathlib import Path

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from lmforge.checkpoint.manager import CheckpointManager
    from lmforge.config.checkpoint import CheckpointConfig
    from lmforge.config.model import ModelConfig
    from lmforge.model.gpt import GPT

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    cfg = ModelConfig(**model)
    with torch.device("meta"):
        gpt = GPT(cfg)
    plan = {}
    for i in gpt.layers:
        plan.update({f"layers.{i}.attention.{n}": ColwiseParallel() for n in ("wq", "wk", "wv")})
        plan.update({f"layers.{i}.feed_forward.{n}": ColwiseParallel() for n in ("w1", "w3")})
        plan[f"layers.{i}.attention.wo"] = RowwiseParallel()
        plan[f"layers.{i}.feed_forward.w2"] = RowwiseParallel()
    parallelize_module(gpt, mesh, plan)
    gpt.to_empty(device="cpu")
    gpt.init_weights(seed)
    local = tuple(gpt.layers["0"].attention.wo.weight.to_local().shape)
    CheckpointManager(Path(root) / "checkpoints", CheckpointConfig()).save(
        0, gpt, None, {"config": {"model": model}, "world_size": dist.get_world_size()})
    return {"wo_local_shape": list(local)}
