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
    """Build lmforge's GPT tensor-parallel over 2 ranks with lmforge's TP engine and save it with the
    CheckpointManager: q/k/v and w1/w3 column-sharded, wo and w2 row-sharded, embeddings vocab-sharded."""
    from pathlib import Path

    import torch
    import torch.distributed as dist

    from lmforge.checkpoint.manager import CheckpointManager
    from lmforge.config.checkpoint import CheckpointConfig
    from lmforge.config.model import ModelConfig
    from lmforge.config.parallelism import ParallelismConfig
    from lmforge.config.schema import RootConfig
    from lmforge.config.train import TrainConfig
    from lmforge.model.gpt import GPT
    from lmforge.parallel.mesh import ParallelDims, build_mesh
    from lmforge.parallel.parallelize import parallelize

    dist.init_process_group("gloo")
    # lmforge's own tensor-parallel engine path (parallel/tensor_parallel.py), exactly as training shards the model.
    pcfg = ParallelismConfig(tp=dist.get_world_size())
    mesh = build_mesh(ParallelDims.from_config(pcfg), torch.device("cpu"))
    cfg = ModelConfig(**model)
    with torch.device("meta"):
        gpt = GPT(cfg)
    gpt = parallelize(
        gpt, RootConfig(model=cfg, parallelism=pcfg, train=TrainConfig(seed=seed)), mesh, torch.device("cpu")
    ).model
    local = tuple(gpt.layers["0"].attention.wo.weight.to_local().shape)
    CheckpointManager(Path(root) / "checkpoints", CheckpointConfig()).save(
        0, gpt, None, {"config": {"model": model}, "world_size": dist.get_world_size()}
    )
    return {"wo_local_shape": list(local)}
