"""A tensor-parallel (TP=2, torch DTensor plan) checkpoint exports to the same HF tensors as a single-process one.

lmforge's TP engine is built elsewhere; this uses torch's ColwiseParallel/RowwiseParallel plan directly on
lmforge's GPT, which is the layout (DTensor Shard(0)/Shard(1) slices in DCP) such checkpoints have. The
name-keyed init gives both layouts identical full weights, so the exports must be equal bit for bit.
"""

from __future__ import annotations

from dataclasses import asdict

import pytest
import torch
from harness import run_ranks

from lmforge.checkpoint.manager import CheckpointManager
from lmforge.checkpoint.weights import read_metadata_safely
from lmforge.config.checkpoint import CheckpointConfig
from lmforge.config.model import ModelConfig
from lmforge.interop.export import export_hf
from lmforge.model.gpt import GPT


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_tp2_checkpoint_exports_like_single_process(tmp_path):
    cfg = ModelConfig(
        name="tp", vocab_size=256, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, seq_len=32, tie_embeddings=False
    )
    results = run_ranks(
        "e2e.interop_ranks:save_tensor_parallel_checkpoint",
        2,
        {"root": str(tmp_path / "tp"), "model": asdict(cfg), "seed": 7},
        timeout=180,
    )
    assert results[0].value["wo_local_shape"] == [64, 32]  # row-sharded: half the input columns per rank
    ckpt = tmp_path / "tp" / "checkpoints" / "step-00000000"
    meta = read_metadata_safely(ckpt).state_dict_metadata
    assert [c.offsets for c in meta["model.layers.0.attention.wq.weight"].chunks] == [
        torch.Size([0, 0]),
        torch.Size([32, 0]),
    ]
    assert [c.offsets for c in meta["model.layers.0.attention.wo.weight"].chunks] == [
        torch.Size([0, 0]),
        torch.Size([0, 32]),
    ]

    single = GPT(cfg)
    single.init_weights(7)
    CheckpointManager(tmp_path / "single" / "checkpoints", CheckpointConfig()).save(
        0, single, None, {"config": {"model": asdict(cfg)}, "world_size": 1}
    )
    export_hf(tmp_path / "tp", tmp_path / "hf-tp", with_tokenizer=False)
    export_hf(tmp_path / "single", tmp_path / "hf-single", with_tokenizer=False)
    from safetensors.torch import load_file

    a = load_file(str(tmp_path / "hf-tp" / "model.safetensors"))
    b = load_file(str(tmp_path / "hf-single" / "model.safetensors"))
    assert set(a) == set(b) and len(a) == 2 + 2 * 9 + 1
    for name in a:
        assert torch.equal(a[name], b[name]), name
