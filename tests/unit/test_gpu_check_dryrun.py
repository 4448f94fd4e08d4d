"""The prepared GPU check (benchmarks/gpu_check.py) rehearsed on CPU, in the GPU machine's environment.

The GPU machine has only torch: no hydra, omegaconf, wandb or deepspeed. The dry run runs here in a subprocess
whose ``sitecustomize`` installs an import blocker for exactly those packages, so a Hydra (or W&B, ...) import
creeping into the model, parallel engine, process-group or optimizer code fails this test before the one-shot
GPU run would.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def load_gpu_check():
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import gpu_check
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    return gpu_check


def test_sync_counter_sees_host_reads_only():
    """The CPU stand-in of the GPU sync check counts exactly the tensor reads on the host."""
    import torch

    counter = load_gpu_check().op_counter()
    t = torch.arange(4.0)
    with counter:
        u = (t * 2).sum()
        assert counter.counts.get("_local_scalar_dense", 0) == 0
        float(u)
        u.item()
        if u > 1:  # a Python branch on a tensor reads it too
            pass
    assert counter.counts["_local_scalar_dense"] == 3


def test_gpu_presets_match_conf_model():
    """The GPU check hard-codes gpt_125m / gpt_1b (the GPU machine has no omegaconf): they must equal conf/model."""
    from omegaconf import OmegaConf

    gpu_check = load_gpu_check()
    from lmforge.config.model import ModelConfig

    for name, (cfg, _batch) in gpu_check.GPU_PRESETS.items():
        conf = OmegaConf.to_container(OmegaConf.load(REPO / "conf" / "model" / f"{name}.yaml"))
        assert cfg == ModelConfig(**conf), name
