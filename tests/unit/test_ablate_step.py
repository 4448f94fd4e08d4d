"""benchmarks/ablate_step.py on real engine steps of the tiny model (SwiGLU, RMSNorm, grouped-query attention)
and of its GELU/LayerNorm variant (bench_small's kinds of block): every ablation removes its part's ops and keeps
every GEMM (the same matrix multiplies, at the same shapes, in every case: that is what makes the paired
differences the parts' costs), the model code is restored after each case, and without a stand-in (the negative
control) the part's ops are there."""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.ablate_step import ALL, ablated, ablation_cases, stand_ins  # noqa: E402
from benchmarks.step import base_overrides, engine_step  # noqa: E402

GEMM_OPS = ("mm", "addmm", "bmm")


class OpLog(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter = Counter()
        self.gemms: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._overloadpacket.__name__
        self.ops[name] += 1
        if name in GEMM_OPS:
            self.gemms[(name, tuple(tuple(a.shape) for a in args if isinstance(a, torch.Tensor)))] += 1
        return func(*args, **(kwargs or {}))


def log_step(run) -> OpLog:
    with OpLog() as log:
        run()
    return log


# The ops each ablation must remove (for the block kinds of each model variant below).
REMOVED = {
    "attention": {
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_flash_attention_for_cpu_backward",
    },
    "RoPE": {"addcmul_"},
    "loss": {"_log_softmax", "_softmax"},
    "clipping": {"linalg_vector_norm", "_foreach_norm"},
    "optimizer": {"_fused_adamw_"},
}
VARIANTS = {
    # torch 2.13 runs nn.RMSNorm on the CPU as its composite (pow, mean, rsqrt, mul)
    "swiglu-rmsnorm-gqa": ([], {"activation": {"silu", "silu_backward"}, "norms": {"rsqrt"}}),
    "gelu-layernorm": (
        ["model.mlp=gelu", "model.norm=layernorm", "model.n_kv_heads=null"],
        {"activation": {"gelu", "gelu_backward"}, "norms": {"native_layer_norm", "native_layer_norm_backward"}},
    ),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_each_ablation_removes_its_part_and_keeps_every_gemm(variant):
    extra, removed_by_kind = VARIANTS[variant]
    removed = {**REMOVED, **removed_by_kind}
    was_initialized = dist.is_initialized()
    batch = 2
    try:
        step = engine_step(base_overrides("tiny", batch) + extra, batch)
        step()
        cases = ablation_cases(step)
        assert set(cases) == {"whole step", ALL, *stand_ins()} and set(removed) == set(stand_ins())
        whole = log_step(cases["whole step"])
        for part, ops in removed.items():
            present = ops & set(whole.ops)
            assert present, f"negative control: the whole step runs {part}'s ops {sorted(ops)}"
            log = log_step(cases[part])
            assert not ops & set(log.ops), f"{part}: still ran {sorted(ops & set(log.ops))}"
            assert log.gemms == whole.gemms, f"{part}: the GEMMs changed"
        rest = log_step(cases[ALL])
        assert not set().union(*removed.values()) & set(rest.ops)
        assert rest.gemms == whole.gemms and sum(whole.gemms.values()) > 0
        # The model code is itself again after every case: the whole step runs every part's ops once more.
        again = log_step(cases["whole step"])
        assert again.ops == whole.ops
    finally:
        if not was_initialized and dist.is_initialized():
            dist.destroy_process_group()


def test_ablated_restores_on_error():
    from lmforge.model import gpt

    original = gpt.Attention.__dict__["attend"]
    with pytest.raises(RuntimeError):
        with ablated(["attention", "RoPE"]):
            assert gpt.Attention.__dict__["attend"] is not original
            raise RuntimeError("step failed")
    assert gpt.Attention.__dict__["attend"] is original and gpt.apply_rope.__name__ == "apply_rope"
