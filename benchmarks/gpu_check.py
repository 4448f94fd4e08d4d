"""One prepared GPU check (run by benchmarks/gpu_check.sh on a lent H200, < 8 minutes).

Needs only torch (the GPU machines have their own torch and no hydra/omegaconf/wandb/deepspeed): it imports
lmforge's model, FLOPs formula and hardware table, which import nothing else.

Checks: bf16 autocast step, flash SDPA selected and matching math SDPA, torch.compile of the blocks,
an nccl process group of world size 1 with an all-reduce, FSDP2 on one GPU. Throughput: gpt_125m and
gpt_1b training steps (bf16-mixed, fused AdamW, compiled), MFU against the H200 dense bf16 spec peak
(989.4 TFLOP/s) and against the measured bf16 matmul rate on the same GPU.
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "platform"))

from lmforge.config.model import ModelConfig  # noqa: E402
from lmforge.model.flops import flops_per_token  # noqa: E402
from lmforge.model.gpt import GPT, cross_entropy_loss, param_count_from_config  # noqa: E402
from lmforge.runtime.hardware import PEAK_TFLOPS, device_kind, measure_matmul_tflops  # noqa: E402

PRESETS = {
    "gpt_125m": ModelConfig(name="gpt_125m", vocab_size=50304, d_model=768, n_layers=12, n_heads=12, seq_len=1024),
    "gpt_1b": ModelConfig(name="gpt_1b", vocab_size=50304, d_model=2048, n_layers=24, n_heads=16, n_kv_heads=8,
                          seq_len=2048),
}
RESULTS = {}


def check(name, fn):
    t0 = time.perf_counter()
    try:
        value = fn()
        RESULTS[name] = {"ok": True, "value": value, "s": round(time.perf_counter() - t0, 2)}
        print(f"PASS {name}: {value} ({time.perf_counter() - t0:.1f}s)", flush=True)
    except Exception as e:  # noqa: BLE001 - report every failure and go on
        RESULTS[name] = {"ok": False, "error": f"{type(e).__name__}: {e}"[:500]}
        print(f"FAIL {name}: {type(e).__name__}: {e}", flush=True)


def flash_sdpa():
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v = (torch.randn(2, 16, 2048, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    with sdpa_kernel(SDPBackend.MATH):
        ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True)
    err = (out.float() - ref).abs().max().item()
    assert err < 2e-2, err
    return f"max |flash - math| = {err:.2e}"


def bf16_step():
    cfg = ModelConfig(vocab_size=4096, d_model=256, n_layers=2, n_heads=4, seq_len=256)
    model = GPT(cfg).cuda()
    model.init_weights(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    x = torch.randint(0, cfg.vocab_size, (8, cfg.seq_len), device="cuda")
    losses = []
    for _ in range(20):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = cross_entropy_loss(model(x), x)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 1.0, losses
    return f"loss {losses[0]:.3f} -> {losses[-1]:.3f}"


def nccl_world_one():
    import torch.distributed as dist

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29511")
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    t = torch.ones(1024, device="cuda")
    dist.all_reduce(t)
    assert t.sum().item() == 1024
    return f"backend={dist.get_backend()}"


def fsdp_one_gpu():
    """lmforge's own path: mesh -> parallelize (FSDP2, bf16 params) -> materialize -> train."""
    from lmforge.config.parallelism import ParallelismConfig
    from lmforge.parallel.mesh import ParallelDims, build_mesh
    from lmforge.parallel.parallelize import materialize, parallelize

    cfg = ModelConfig(vocab_size=4096, d_model=256, n_layers=2, n_heads=4, seq_len=256)
    pcfg = ParallelismConfig(dp_shard=1, param_dtype="bf16")
    mesh = build_mesh(ParallelDims.from_config(pcfg), torch.device("cuda"))
    with torch.device("meta"):
        model = GPT(cfg)
    from lmforge.parallel.data_parallel import apply_fsdp

    model = parallelize(model, mesh, pcfg)
    apply_fsdp(model, mesh, pcfg)  # FSDP2 over a mesh of one GPU
    materialize(model, torch.device("cuda"), seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, cfg.vocab_size, (8, cfg.seq_len), device="cuda")
    first = None
    for _ in range(10):
        loss = cross_entropy_loss(model(x), x)
        loss.backward()
        opt.step()
        opt.zero_grad()
        first = first if first is not None else loss.item()
    assert loss.item() < first
    return f"loss {first:.3f} -> {loss.item():.3f}"


def throughput(name: str, batch: int, compile_blocks: bool, steps: int = 12):
    cfg = PRESETS[name]
    torch.manual_seed(0)
    model = GPT(cfg).cuda()
    model.init_weights(0, device=torch.device("cuda"))
    if compile_blocks:
        for k, block in list(model.layers.items()):
            model.layers[k] = torch.compile(block)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    x = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len), device="cuda")
    times = []
    t_compile = time.perf_counter()
    for i in range(steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = cross_entropy_loss(model(x), x)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        if i == 0:
            first_step = time.perf_counter() - t_compile
        if i >= 3:
            times.append(time.perf_counter() - t0)
    step = statistics.median(times)
    tokens = batch * cfg.seq_len
    achieved = tokens / step * flops_per_token(cfg) / 1e12
    measured = RESULTS.get("matmul_tflops", {}).get("value") or 790.0
    out = {"params": param_count_from_config(cfg), "batch": batch, "step_s": round(step, 4),
           "tokens_per_s": round(tokens / step), "tflops": round(achieved, 1),
           "mfu_vs_spec_989": round(achieved / PEAK_TFLOPS["h200"]["bf16"], 4),
           "mfu_vs_measured_matmul": round(achieved / measured, 4), "first_step_s": round(first_step, 1),
           "peak_mem_gib": round(torch.cuda.max_memory_allocated() / 2**30, 1)}
    del model, opt
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    return out


def main() -> None:
    assert torch.cuda.is_available(), "no CUDA device"
    print(f"torch {torch.__version__} on {torch.cuda.get_device_name(0)} ({device_kind(torch.device('cuda'))})")
    torch.backends.cuda.matmul.allow_tf32 = True
    check("matmul_tflops", lambda: round(measure_matmul_tflops(torch.device("cuda"), torch.bfloat16, 8192), 1))
    check("flash_sdpa", flash_sdpa)
    check("bf16_step", bf16_step)
    check("nccl_world_1", nccl_world_one)
    check("fsdp_one_gpu", fsdp_one_gpu)
    check("gpt_125m_eager", lambda: throughput("gpt_125m", 16, False))
    check("gpt_125m_compiled", lambda: throughput("gpt_125m", 16, True))
    check("gpt_1b_compiled", lambda: throughput("gpt_1b", 8, True))
    out = Path(os.environ.get("OUT", ".")) / "gpu_check.json"
    out.write_text(json.dumps(RESULTS, indent=1))
    print(json.dumps(RESULTS, indent=1))


if __name__ == "__main__":
    main()
