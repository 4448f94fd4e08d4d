"""The MoE compile boundary is applied at compile time: an eager training process never imports dynamo (a fresh
process, so nothing imported earlier in the test session hides it)."""

from __future__ import annotations

import pytest

EAGER_PROCESS = """
import sys
import torch
import lmforge.train, lmforge.trainer.trainer, lmforge.parallel.native_engine  # a training process's imports
from lmforge.config.model import ModelConfig, MoEConfig
from lmforge.model.gpt import GPT
from lmforge.model.moe import Experts
cfg = ModelConfig(vocab_size=97, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, seq_len=16,
                  moe=MoEConfig(experts=4, top_k=2, d_ff=48, compute="loop"))
model = GPT(cfg)
model.init_weights(0)
model(torch.randint(0, 97, (2, 16))).float().sum().backward()
print("eager", "torch._dynamo" in sys.modules, getattr(Experts.forward, "_torchdynamo_disable", False))
from lmforge.parallel.compile import apply_compile
apply_compile(model)
print("compiled", "torch._dynamo" in sys.modules, getattr(Experts.forward, "_torchdynamo_disable", False))
"""


@pytest.mark.timeout(180)
def test_the_boundary_is_applied_at_compile_so_an_eager_process_never_imports_dynamo():
    """torch.compiler.disable imports torch._dynamo (2.3 CPU-s measured): applied by apply_compile, not as a
    decorator at import, a process that imports the trainer and runs an MoE model eagerly never pays it.
    Control: compiling the same model imports it and marks Experts.forward as the boundary."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", EAGER_PROCESS], capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines() == ["eager False False", "compiled True True"], proc.stdout
