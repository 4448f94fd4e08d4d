"""Case builders shared by the parity harness's reference fixture (conftest.py) and test_parallel_parity.py."""

from __future__ import annotations

from collections import Counter
from typing import List

# A Mixture-of-Experts tiny model (model/moe.py): 4 experts top-2 in every other layer, one shared expert,
# aux + z losses and the bias update, capacity-limited (drops happen); the loop expert path (auto on CPU).
MOE = [
    "model.moe.experts=4",
    "model.moe.top_k=2",
    "model.moe.d_ff=64",
    "model.moe.every_n_layers=2",
    "model.moe.shared_experts=1",
    "model.moe.z_loss_coef=0.01",
    "model.moe.bias_update_rate=0.01",
    "model.moe.capacity_factor=1.0",
]

# µP (model/mup.py) at width multiplier 2 (tiny's d_model 64 over base 32): per-group lr/wd, hidden init, the
# logit multiplier and the attention scale, all of which a layout must keep.
MUP = ["model.parametrization=mup", "model.mup_base_width=32"]


def stand_in_eod(samples) -> int:
    """The document end of the data.document_masking cases: the parity samples are one continuous text (no EOD),
    so their most frequent token stands in for it and every sample holds several documents."""
    return Counter(t for sample in samples for t in sample).most_common(1)[0][0]


def docmask_case(overrides: List[str], samples) -> dict:
    return {"overrides": overrides + ["data.document_masking=true"], "eod": stand_in_eod(samples)}


def docmask_pipeline_cases(samples) -> dict:
    """data.document_masking over two pipeline stages (each stage gets its micro batch's document positions as a
    keyword stage input, parallel/pipeline.py): 1F1B with full activation checkpointing (the recompute rebuilds
    the mask) and zero bubble (InterleavedZeroBubble: 4 looped stages, split backward, its own micro-batch order);
    negative control: the later pipeline rank's stages get the positions of the previous micro batch."""
    return {
        "pp2_1f1b_ac_docmask": docmask_case(["parallelism=pp2", "parallelism.activation_checkpointing=full"], samples),
        "pp2_zero_bubble_docmask": docmask_case(["parallelism=pp2_zb"], samples),
        "pp2_docmask_wrong_micro_batch": {
            **docmask_case(["parallelism=pp2"], samples),
            "later_stage_positions_shift": 1,
        },
    }


# train.precision=fp8 (parallel/float8.py) on the tiny model: torchao's shape filter would keep every linear of it
# in bf16, so all 28 block linears are converted (the head never is).
FP8 = ["train.precision=fp8", "train.fp8.shape_filter=false"]
FP8_ALL_GATHER = FP8 + ["train.fp8.enable_fsdp_float8_all_gather=true"]


def fp8_fsdp_cases() -> dict:
    """FSDP2 over 2 ranks in fp8: the weights gathered in fp32 and cast by each Float8Linear, or gathered in float8
    (torchao's float8 all-gather, scales precomputed after each optimizer step); negative control: every rank's
    precomputed scales taken from its own shard instead of the all-reduced amax."""
    return {
        "fp8_fsdp": {"overrides": ["parallelism=fsdp"] + FP8, "fp8_probe": True},
        "fp8_fsdp_float8_gather": {"overrides": ["parallelism=fsdp"] + FP8_ALL_GATHER, "fp8_probe": True},
        "fp8_fsdp_float8_gather_shard_scales": {
            "overrides": ["parallelism=fsdp"] + FP8_ALL_GATHER,
            "fp8_local_scales": True,
        },
    }


def fp8_tp_cases() -> dict:
    """fp8 with tensor parallelism over 2 ranks: tensorwise with torchao's float8 TP styles, tensorwise under
    sequence parallelism (plain styles, bf16 all-gather), rowwise (plain styles)."""
    return {
        "fp8_tp2": {"overrides": ["parallelism=tp2"] + FP8, "fp8_probe": True},
        "fp8_tp2_sp": {"overrides": ["parallelism=tp2_sp"] + FP8, "fp8_probe": True},
        "fp8_tp2_rowwise": {"overrides": ["parallelism=tp2", "train.fp8.recipe=rowwise"] + FP8, "fp8_probe": True},
    }
