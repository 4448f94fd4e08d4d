"""One prepared GPU check (run by benchmarks/gpu_check.sh on a lent H200 in one shot, < 9 minutes), and its
CPU dry run (``--dry-run``: the same checks and code paths with tiny shapes on CPU/gloo, run by the tests).

    python benchmarks/gpu_check.py              # on the GPU machine (writes $OUT/gpu_check.json, without $OUT
                                                # benchmarks/results/scratch/gpu_check.json)
    python benchmarks/gpu_check.py --dry-run    # anywhere, ~1 minute on 2 cores

Needs only torch: the GPU machines have their own torch and no hydra/omegaconf/wandb/deepspeed. It imports
lmforge's model, FLOPs formula, hardware table, process group, parallel engine and optimizer, and builds the
engine's ``RootConfig`` by plain dataclass construction (no Hydra).

Checks, in order (each has a time estimate; a check that would overrun the budget is recorded as skipped,
and the JSON is rewritten after every check so a timeout still leaves data):
  matmul_tflops          bf16 square matmul rate (the "measured peak" for MFU)
  flash_sdpa             the flash SDPA kernel is selected (op seen by a dispatch mode) and matches math SDPA
  bf16_step              bf16 autocast training steps reduce the loss
  process_group_world_1  lmforge's init_process_group (nccl on GPU, gloo on CPU), world of one, all-reduce
  fsdp2_one_device       lmforge's path: mesh -> parallelize (FSDP2 over one device, materialize) -> train
  compile_block          torch.compile of one transformer block matches eager (forward and gradients)
  gpt_1b_compiled        bare loop: GPT + fused AdamW under bf16 autocast, blocks compiled
  <model>_engine         the trainer's path: NativeEngine.train_step (bf16-mixed, fused AdamW, compile on;
                         gpt_125m, gpt_1b), gpt_1b with the platform-overhead ratio engine step / bare compiled
                         step and the planner's prediction for the same config on one device beside the
                         measurement (``plan``: peak memory and step time; needs omegaconf, carried as a wheel)
  document_attention_varlen  data.document_attention=varlen vs sdpa: a tiny document-masked GPT, a few bf16
                         steps each from the same init; the loss difference and the step-time ratio (the dry run
                         puts an SDPA loop over the same cu_seqlens in place of the CUDA-only varlen_attn)
  gpt_1b_fp8_engine      train.precision=fp8 (torchao float8 linears, tensorwise, compiled) vs gpt_1b_engine: step
                         time, speed-up and the first two steps' loss gap from the same init and batch (needs
                         torchao==0.18.0 on the machine; without it the check fails naming it)
  engine_no_host_sync    one non-logging engine step (after warm-up): on GPU under
                         torch.cuda.set_sync_debug_mode("error") (a host sync fails the check); on CPU the
                         aten._local_scalar_dense calls are counted and reported (no failure)

The exit status is non-zero if any check failed or was skipped.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import signal
import statistics
import sys
import time
import traceback
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, Optional, Tuple

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "platform"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks.paths

from benchmarks.paths import scratch_path  # noqa: E402
from lmforge.config.model import ModelConfig  # noqa: E402
from lmforge.model.flops import flops_per_token  # noqa: E402
from lmforge.model.gpt import GPT, cross_entropy_loss, param_count_from_config  # noqa: E402
from lmforge.runtime.hardware import PEAK_TFLOPS, device_kind, measure_matmul_tflops  # noqa: E402

H200_SPEC_BF16 = PEAK_TFLOPS["h200"]["bf16"]  # 989.4 dense TFLOP/s


@dataclass(frozen=True)
class Sizes:
    """Everything that differs between the GPU run and the CPU dry run (the code paths do not)."""

    device: torch.device
    matmul_n: int
    sdpa_shape: Tuple[int, int, int, int]  # B, H, T, head_dim
    tiny: ModelConfig  # bf16 step, FSDP, compile check
    tiny_batch: int
    tiny_steps: int
    min_loss_drop: float  # bf16_step: the loss must fall by at least this much
    presets: Dict[str, Tuple[ModelConfig, int]]  # throughput models and their batch (sequences)
    steps: int  # timed throughput steps, after `warmup` untimed ones
    warmup: int
    budget_s: float  # the whole script, from start
    est_s: Dict[str, float] = field(default_factory=dict)  # per-check estimate for the budget


GPU_PRESETS = {
    "gpt_125m": (
        ModelConfig(name="gpt_125m", vocab_size=50304, d_model=768, n_layers=12, n_heads=12, seq_len=1024),
        16,
    ),
    "gpt_1b": (
        ModelConfig(name="gpt_1b", vocab_size=50304, d_model=2048, n_layers=24, n_heads=16, n_kv_heads=8, seq_len=2048),
        8,
    ),
}
# Dry-run stand-ins (named like the GPU models so the JSON keys match): the block shape and batch equal the
# compile check's, so every compiled block of the dry run reuses that one compile (a CPU compile costs ~30-50 s).
CPU_TINY = ModelConfig(name="tiny", vocab_size=512, d_model=64, n_layers=2, n_heads=4, seq_len=64)
CPU_PRESETS = {
    "gpt_125m": (ModelConfig(name="gpt_125m-dry", vocab_size=512, d_model=64, n_layers=2, n_heads=4, seq_len=64), 4),
    "gpt_1b": (ModelConfig(name="gpt_1b-dry", vocab_size=512, d_model=64, n_layers=3, n_heads=4, seq_len=64), 4),
}


def gpu_sizes() -> Sizes:
    est = {
        "matmul_tflops": 5,
        "flash_sdpa": 5,
        "bf16_step": 10,
        "process_group_world_1": 10,
        "fsdp2_one_device": 15,
        "compile_block": 40,
        "gpt_125m_engine": 35,
        "engine_no_host_sync": 5,
        "document_attention_varlen": 20,
        "gpt_1b_compiled": 120,
        "gpt_1b_engine": 80,
        "gpt_1b_fp8_engine": 85,
    }
    tiny = ModelConfig(name="tiny", vocab_size=4096, d_model=256, n_layers=2, n_heads=4, seq_len=256)
    return Sizes(torch.device("cuda", 0), 8192, (2, 16, 2048, 128), tiny, 8, 20, 1.0, GPU_PRESETS, 9, 3, 440.0, est)


def cpu_sizes() -> Sizes:
    est = {"compile_block": 40}  # everything else: a few seconds
    return Sizes(torch.device("cpu"), 256, (1, 2, 128, 32), CPU_TINY, 4, 10, 0.5, CPU_PRESETS, 2, 1, 600.0, est)


S: Sizes  # set by main()
STATE: dict = {}  # objects handed from one check to the next (the gpt_125m engine for the sync check)


# ----------------------------------------------------------------------------------------------- reporting
class Report:
    """Results of every check, rewritten to ``path`` (atomically) after each one."""

    def __init__(self, path: Path, env: dict, budget_s: float):
        self.path, self.budget_s, self.t0 = path, budget_s, time.perf_counter()
        self.data = {"env": env, "checks": {}, "summary": {}}
        self.current: Optional[str] = None
        self.write()
        signal.signal(signal.SIGTERM, self._on_sigterm)  # `timeout` in gpu_check.sh: record where it stopped

    def _on_sigterm(self, signum, frame) -> None:
        if self.current:
            self.data["checks"][self.current] = {
                "ok": False,
                "status": "fail",
                "error": f"killed by SIGTERM (timeout) after {self.elapsed():.0f}s of the run",
                "est_s": None,
            }
        self.data["summary"] = {"killed_during": self.current, "wall_s": round(self.elapsed(), 1)}
        self.write()
        print(f"KILLED during {self.current} after {self.elapsed():.0f}s; partial results in {self.path}", flush=True)
        os._exit(124)

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def write(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=str))
        os.replace(tmp, self.path)

    def check(self, name: str, fn: Callable[[], object], est_s: float) -> None:
        left = self.budget_s - self.elapsed()
        if est_s > left:
            self.data["checks"][name] = {
                "ok": False,
                "status": "skipped",
                "est_s": est_s,
                "error": f"skipped: estimate {est_s:.0f}s > {left:.0f}s left of the budget",
            }
            print(f"SKIP {name}: estimate {est_s:.0f}s > {left:.0f}s left", flush=True)
            self.write()
            return
        print(f"---- {name} (estimate {est_s:.0f}s, {self.elapsed():.0f}s elapsed)", flush=True)
        t0 = time.perf_counter()
        self.current = name
        try:
            value = fn()
            entry = {"ok": True, "status": "pass", "value": value}
            print(f"PASS {name}: {value} ({time.perf_counter() - t0:.1f}s)", flush=True)
        except Exception as e:  # noqa: BLE001 - report every failure and go on with the next check
            entry = {
                "ok": False,
                "status": "fail",
                "error": f"{type(e).__name__}: {e}"[:800],
                "trace": traceback.format_exc()[-2000:],
            }
            print(f"FAIL {name}: {type(e).__name__}: {e}\n{traceback.format_exc()[-2000:]}", flush=True)
        entry.update(est_s=est_s, s=round(time.perf_counter() - t0, 2))
        self.data["checks"][name] = entry
        self.current = None
        self.write()

    def value(self, name: str):
        entry = self.data["checks"].get(name, {})
        return entry.get("value") if entry.get("ok") else None


R: Report  # set by main()


# ----------------------------------------------------------------------------------------------- helpers
def sync() -> None:
    if S.device.type == "cuda":
        torch.cuda.synchronize(S.device)


def free_memory() -> None:
    gc.collect()
    if S.device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(S.device)


def peak_mem_gib() -> Optional[float]:
    return round(torch.cuda.max_memory_allocated(S.device) / 2**30, 1) if S.device.type == "cuda" else None


def autocast():
    return torch.autocast(S.device.type, dtype=torch.bfloat16)


def sdpa_kernel_ctx(backend_name: str):
    """``torch.nn.attention.sdpa_kernel`` (torch >= 2.3), else the older ``torch.backends.cuda.sdp_kernel``."""
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        return sdpa_kernel(getattr(SDPBackend, backend_name))
    except ImportError:  # pragma: no cover - old torch
        flags = {
            "FLASH_ATTENTION": dict(enable_flash=True, enable_math=False, enable_mem_efficient=False),
            "MATH": dict(enable_flash=False, enable_math=True, enable_mem_efficient=False),
        }[backend_name]
        return torch.backends.cuda.sdp_kernel(**flags)


def op_counter():
    """A TorchDispatchMode counting every aten op that reaches the dispatcher (by overload packet name)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class OpCounter(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.counts: Counter = Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.counts[func.overloadpacket.__name__] += 1
            return func(*args, **(kwargs or {}))

    return OpCounter()


def tokens_batch(cfg: ModelConfig, batch: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len), generator=g).to(S.device)


def ensure_process_group() -> str:
    """The trainer's own process-group setup (lmforge.comm.process_group): a world of one on a file store."""
    import torch.distributed as dist

    from lmforge.comm.process_group import init_process_group
    from lmforge.config.comm import CommConfig

    if not dist.is_initialized():
        init_process_group(CommConfig(), S.device)
    return dist.get_backend()


def mfu(tflops: float) -> dict:
    measured = R.value("matmul_tflops")
    out = {"mfu_vs_spec_989": round(tflops / H200_SPEC_BF16, 4)}
    if measured:
        out["mfu_vs_measured_matmul"] = round(tflops / measured, 4)
    return out


# ----------------------------------------------------------------------------------------------- checks
def check_matmul() -> float:
    # 4 significant digits: a dry run's CPU rate (~1e-3 TFLOP/s, less under load) must not round to 0
    return float(f"{measure_matmul_tflops(S.device, torch.bfloat16, S.matmul_n, best=S.device.type == 'cpu'):.4g}")


def check_flash_sdpa() -> dict:
    b, h, t, d = S.sdpa_shape
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(b, h, t, d, generator=g).to(S.device, torch.bfloat16) for _ in range(3))
    counter = op_counter()
    try:
        with sdpa_kernel_ctx("FLASH_ATTENTION"), counter:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    except RuntimeError as e:
        raise RuntimeError(
            f"torch {torch.__version__} did not select the flash SDPA kernel on {S.device.type} "
            f"for bf16 {tuple(q.shape)}: {e}"
        ) from e
    flash_ops = sorted(op for op in counter.counts if "flash" in op)
    if not flash_ops:
        raise AssertionError(
            f"flash SDPA was requested but the ops run were {sorted(counter.counts)} "
            f"(no flash kernel on {S.device.type})"
        )
    with sdpa_kernel_ctx("MATH"):
        ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True)
    err = (out.float() - ref).abs().max().item()
    assert err < 2e-2, f"max |flash - math| = {err:.3e} >= 2e-2"
    return {"kernel": flash_ops[0], "max_abs_err_vs_math": float(f"{err:.2e}")}


def check_bf16_step() -> str:
    cfg = S.tiny
    torch.manual_seed(0)
    model = GPT(cfg).to(S.device)
    model.init_weights(0, device=S.device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, fused=True)
    x = tokens_batch(cfg, S.tiny_batch)
    losses = []
    for _ in range(S.tiny_steps):
        with autocast():
            loss = cross_entropy_loss(model(x), x)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    assert losses[-1] < losses[0] - S.min_loss_drop, f"loss did not fall by {S.min_loss_drop}: {losses}"
    return f"loss {losses[0]:.3f} -> {losses[-1]:.3f} in {len(losses)} steps"


def check_process_group() -> dict:
    import torch.distributed as dist

    backend = ensure_process_group()
    expected = "nccl" if S.device.type == "cuda" else "gloo"
    assert backend == expected, f"backend {backend}, expected {expected}"
    t = torch.ones(1024, device=S.device)
    dist.all_reduce(t)
    assert t.sum().item() == 1024
    return {"backend": backend, "world_size": dist.get_world_size()}


def check_fsdp2_one_device() -> str:
    """The trainer's path (parallel/parallelize.py): build_mesh -> parallelize. The trainer applies FSDP2 for
    dp_shard > 1, which one device cannot have, so ``fsdp=True`` asks parallelize for it over the one-device
    dp_shard mesh."""
    from torch.distributed.tensor import DTensor

    from lmforge.config.parallelism import ParallelismConfig
    from lmforge.config.schema import RootConfig
    from lmforge.config.train import TrainConfig
    from lmforge.parallel.mesh import ParallelDims, build_mesh
    from lmforge.parallel.parallelize import parallelize

    ensure_process_group()
    cfg = S.tiny
    pcfg = ParallelismConfig(dp_shard=1, param_dtype="bf16")
    mesh = build_mesh(ParallelDims.from_config(pcfg), S.device)
    with torch.device("meta"):
        model = GPT(cfg)
    par = parallelize(
        model,
        RootConfig(model=cfg, parallelism=pcfg, train=TrainConfig(precision="fp32", seed=0)),
        mesh,
        S.device,
        fsdp=True,
    )
    model = par.module
    n_dtensor = sum(isinstance(p, DTensor) for p in par.model.parameters())
    assert n_dtensor == len(list(par.model.parameters())), "FSDP2 did not turn every parameter into a DTensor"
    opt = torch.optim.AdamW(par.model.parameters(), lr=3e-3)
    x = tokens_batch(cfg, S.tiny_batch)
    losses = []
    for _ in range(S.tiny_steps):
        loss = cross_entropy_loss(model(x), x)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    assert losses[-1] < losses[0], losses
    return f"{n_dtensor} DTensor params, bf16 compute; loss {losses[0]:.3f} -> {losses[-1]:.3f}"


def check_compile_block() -> dict:
    cfg = S.tiny
    torch.manual_seed(0)
    model = GPT(cfg).to(S.device)
    model.init_weights(0, device=S.device)
    block = model.layers["0"]
    compiled = torch.compile(block)
    x = torch.randn(S.tiny_batch, cfg.seq_len, cfg.d_model, device=S.device)
    cos, sin = model.rope_cos, model.rope_sin

    def run(fn):
        block.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_(True)
        with autocast():
            out = fn(xi, cos, sin)
        out.float().square().mean().backward()
        return out.detach().float(), [p.grad.detach().float().clone() for p in block.parameters()], xi.grad

    t0 = time.perf_counter()
    out_c, grads_c, xg_c = run(compiled)
    first_s = time.perf_counter() - t0
    out_e, grads_e, xg_e = run(block)
    out_err = (out_c - out_e).abs().max().item() / max(out_e.abs().max().item(), 1e-6)
    grad_err = max((a - b).abs().max().item() / max(b.abs().max().item(), 1e-12) for a, b in zip(grads_c, grads_e))
    assert out_err < 5e-2 and grad_err < 1e-1, f"compiled vs eager: out rel err {out_err:.2e}, grad {grad_err:.2e}"
    return {
        "first_call_s": round(first_s, 1),
        "out_rel_err": float(f"{out_err:.2e}"),
        "grad_rel_err": float(f"{grad_err:.2e}"),
    }


@torch.no_grad()
def sdpa_ops_of(model, x: torch.Tensor) -> list:
    """The attention kernels one eager bf16-autocast forward of ``model`` dispatches to (flash expected on GPU;
    in the model, RoPE can hand SDPA fp32 q/k, which rules flash out)."""
    counter = op_counter()
    with autocast(), counter:
        model(x)
    return sorted(op for op in counter.counts if "attention" in op or "scaled_dot_product" in op)


def time_steps(step: Callable[[], None]) -> Tuple[float, float]:
    """(first step incl. compile, median of the timed steps) in seconds."""
    sync()
    t0 = time.perf_counter()
    step()
    sync()
    first = time.perf_counter() - t0
    for _ in range(S.warmup - 1):
        step()
    times = []
    for _ in range(S.steps):
        sync()
        t0 = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - t0)
    return first, statistics.median(times)


def rates(cfg: ModelConfig, batch: int, step_s: float, first_s: float) -> dict:
    tokens = batch * cfg.seq_len
    achieved = tokens / step_s * flops_per_token(cfg) / 1e12
    out = {
        "model": cfg.name,
        "params": param_count_from_config(cfg),
        "batch": batch,
        "seq_len": cfg.seq_len,
        "step_s": round(step_s, 4),
        "tokens_per_s": round(tokens / step_s),
        "tflops": round(achieved, 3),
        **mfu(achieved),
        "first_step_s": round(first_s, 1),
        "timed_steps": S.steps,
    }
    if S.device.type == "cuda":
        out["peak_mem_gib"] = peak_mem_gib()
    return out


def check_bare(name: str, compile_blocks: bool) -> dict:
    """The bare loop: GPT + fused AdamW under bf16 autocast, blocks optionally compiled one by one."""
    cfg, batch = S.presets[name]
    free_memory()
    torch.manual_seed(0)
    model = GPT(cfg).to(S.device)
    model.init_weights(0, device=S.device)
    x = tokens_batch(cfg, batch)
    attention_ops = sdpa_ops_of(model, x[:1])
    if compile_blocks:
        for k, block in list(model.layers.items()):
            model.layers[k] = torch.compile(block)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)

    def step():
        with autocast():
            loss = cross_entropy_loss(model(x), x)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    first, step_s = time_steps(step)
    out = rates(cfg, batch, step_s, first)
    out["attention_ops"] = attention_ops
    model = opt = None  # free the device memory before the next check
    free_memory()
    return out


@dataclass
class _MicroBatch:  # the fields NativeEngine.train_step reads (lmforge.data.loader.MicroBatch has source ids too)
    tokens: torch.Tensor
    targets: torch.Tensor
    positions: None = None  # no document masking


def build_engine(name: str, precision: str = "bf16-mixed"):
    """NativeEngine exactly as the trainer builds it, from a plain RootConfig (bf16-mixed, fused AdamW, compile).
    ``precision="fp8"``: torchao float8 linears (tensorwise, torchao's shape filter on the GPU; every linear of the
    dry run's tiny shapes, eager there: a CPU compile of the float8 casts is not what the check measures)."""
    from lmforge.config.batch import batch_plan
    from lmforge.config.optim import OptimConfig
    from lmforge.config.parallelism import ParallelismConfig
    from lmforge.config.schema import RootConfig
    from lmforge.config.train import Float8Config, TrainConfig
    from lmforge.config.validated import Validated
    from lmforge.fault.loss_guard import LossGuard
    from lmforge.parallel.native_engine import NativeEngine

    cfg, batch = S.presets[name]
    gpu = S.device.type == "cuda"
    root = RootConfig(
        model=cfg,
        parallelism=ParallelismConfig(compile=gpu or precision != "fp8"),
        train=TrainConfig(
            precision=precision,
            micro_batch_size=batch,
            global_batch_size=batch,
            seed=0,
            fp8=Float8Config(shape_filter=gpu),
        ),
        optim=OptimConfig(lr=1e-4, fused=True),
    )
    ensure_process_group()
    engine = NativeEngine(Validated(root, batch_plan(batch, batch, 1, cfg.seq_len)), S.device)
    assert engine.precision == precision, engine.precision
    fused = all(g.get("fused") for g in engine.optimizer.param_groups)
    assert fused, "the engine's AdamW is not fused"
    x = tokens_batch(cfg, batch)
    engine.guard = LossGuard()  # on by default in training (fault.loss_guard): skips through fused found_inf
    return engine, [_MicroBatch(x, x)], root


def check_engine(name: str) -> dict:
    free_memory()
    engine, batches, root = build_engine(name)
    cfg, batch = S.presets[name]
    if name == "gpt_1b":  # the fp8 check compares its first losses with these (same init, same batch)
        STATE["gpt_1b_bf16_losses"] = [
            float(engine.train_step(batches, root.optim.lr, guard=engine.guard).loss) for _ in range(2)
        ]
    first, step_s = time_steps(lambda: engine.train_step(batches, root.optim.lr, guard=engine.guard))
    out = rates(cfg, batch, step_s, first)
    bare = R.value(f"{name}_compiled")
    if bare:
        out["platform_overhead"] = round(step_s / bare["step_s"], 3)  # engine step / bare compiled step
    if name == "gpt_1b":
        out["plan"] = planned(root, measured_step_s=step_s, measured_peak_gib=out.get("peak_mem_gib"))
    if name == "gpt_125m":
        STATE["engine"] = (engine, batches, root)  # warmed up: the sync check uses it
    else:
        del engine
    free_memory()
    return out


def planned(root, measured_step_s: float, measured_peak_gib) -> dict:
    """``lmforge plan``'s prediction for the engine's config on one device of this kind (the planner validates
    through omegaconf: without it, the reason instead), beside what the check measured."""
    from dataclasses import replace

    try:
        from lmforge.config.cluster import ClusterConfig
        from lmforge.parallel.planner import make_plan
        from lmforge.runtime.hardware import device_kind
    except ImportError as e:
        return {"unavailable": f"{type(e).__name__}: {e}"}
    kind = device_kind(S.device)
    cfg = replace(root, cluster=ClusterConfig(name="gpu_check", nodes=1, gpus_per_node=1, device=kind))
    plan = make_plan(cfg, world_size=1)
    total = plan.memory.total / 2**30
    out = {"device_kind": plan.device_kind, "peak_gib": round(total, 2), "step_s": round(plan.step_time_s, 4)}
    if measured_peak_gib:
        out["peak_ratio_measured_to_plan"] = round(measured_peak_gib / total, 3)
    out["step_ratio_measured_to_plan"] = round(measured_step_s / plan.step_time_s, 3)
    return out


def check_no_host_sync() -> dict:
    """One non-logging engine step after warm-up. It counts aten._local_scalar_dense (a tensor read on the host:
    .item(), float(tensor), a Python branch on a tensor) with a dispatch mode; on GPU it then runs one more step
    under torch.cuda.set_sync_debug_mode("error"), where any host sync raises (the check fails)."""
    engine, batches, root = STATE.pop("engine", (None, None, None))
    if engine is None:
        engine, batches, root = build_engine("gpt_125m")
        for _ in range(2):
            engine.train_step(batches, root.optim.lr, guard=engine.guard)
    sync()
    counter = op_counter()
    with counter:
        engine.train_step(batches, root.optim.lr, guard=engine.guard)
    sync()
    assert not any(v.skipped for v in engine.guard.resolve(force=True)), "the loss guard skipped a healthy step"
    out = {"local_scalar_dense": counter.counts.get("_local_scalar_dense", 0), "device": S.device.type}
    if S.device.type == "cuda":
        torch.cuda.set_sync_debug_mode("error")
        try:
            engine.train_step(batches, root.optim.lr, guard=engine.guard)
        except RuntimeError as e:
            raise RuntimeError(f"host sync in a non-logging engine step ({out}): {e}") from e
        finally:
            torch.cuda.set_sync_debug_mode("default")
            engine.optimizer.zero_grad(set_to_none=True)
        out["sync_debug_mode_error"] = "no sync"
    del engine
    free_memory()
    return out


def check_document_attention_varlen() -> dict:
    """data.document_attention=varlen (model/document_mask.py: positions -> cu_seqlens, the batch packed into
    one stream, torch's varlen_attn) against the sdpa reference: the same tiny GPT, init, documents (an EOD
    every ~32 tokens) and bf16-autocast steps with each backend. Records the per-step loss difference and the
    step-time ratio varlen / sdpa; fails if the first losses differ by more than bf16 noise (2e-2)."""
    import torch.nn.attention.varlen as varlen_module

    from lmforge.model.document_mask import document_positions, segment_sdpa

    cfg, eod = S.tiny, 0
    g = torch.Generator().manual_seed(1)
    x = tokens_batch(cfg, S.tiny_batch)
    x[(torch.rand(x.shape, generator=g) < 1 / 32).to(S.device)] = eod
    positions = document_positions(x, eod)
    runs = {}
    stand_in = S.device.type == "cpu"
    kernel = varlen_module.varlen_attn
    if stand_in:
        varlen_module.varlen_attn = segment_sdpa
    try:
        for backend in ("sdpa", "varlen"):
            free_memory()
            model = GPT(cfg).to(S.device)
            model.init_weights(0, device=S.device)
            model.document_attention = backend
            opt = torch.optim.AdamW(model.parameters(), lr=3e-3, fused=True)
            counter, losses = op_counter(), []
            with torch.no_grad(), autocast(), counter:
                model(x[:1], positions=positions[:1])
            ops = sorted(op for op in counter.counts if any(w in op for w in ("attention", "varlen", "flash")))

            def step():
                with autocast():
                    loss = cross_entropy_loss(model(x, positions=positions), x)
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                losses.append(loss.detach().float())

            first, step_s = time_steps(step)
            runs[backend] = {
                "losses": [float(v) for v in losses],
                "step_s": step_s,
                "ops": ops,
                "peak_mem_gib": peak_mem_gib(),
            }
            model = opt = None  # free the device memory before the next check
    finally:
        varlen_module.varlen_attn = kernel
    sdpa, varlen = runs["sdpa"], runs["varlen"]
    diffs = [abs(a - b) for a, b in zip(varlen["losses"], sdpa["losses"])]
    if not stand_in:
        assert any("varlen" in op for op in varlen["ops"]), f"varlen_attn did not run: {varlen['ops']}"
    assert diffs[0] < 2e-2, f"first-step loss varlen {varlen['losses'][0]} vs sdpa {sdpa['losses'][0]}"
    assert varlen["losses"][-1] < varlen["losses"][0], f"varlen training did not lower the loss: {varlen['losses']}"
    return {
        "kernel": "cpu stand-in: segment SDPA" if stand_in else "torch varlen_attn",
        "documents": int((positions == 0).sum()),
        "tokens": x.numel(),
        "steps": len(diffs),
        "first_loss_diff": float(f"{diffs[0]:.2e}"),
        "max_loss_diff": float(f"{max(diffs):.2e}"),
        "step_s_sdpa": round(sdpa["step_s"], 5),
        "step_s_varlen": round(varlen["step_s"], 5),
        "step_time_ratio_varlen_vs_sdpa": round(varlen["step_s"] / sdpa["step_s"], 3),
        "ops_sdpa": sdpa["ops"],
        "ops_varlen": varlen["ops"],
        "peak_mem_gib_sdpa": sdpa["peak_mem_gib"],
        "peak_mem_gib_varlen": varlen["peak_mem_gib"],
    }


# ----------------------------------------------------------------------------------------------- main
def environment() -> dict:
    env = {
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "device": str(S.device),
        "dry_run": S.device.type == "cpu",
        "cuda": torch.version.cuda,
        "h200_spec_bf16_tflops": H200_SPEC_BF16,
    }
    if S.device.type == "cuda":
        env.update(
            gpu=torch.cuda.get_device_name(S.device),
            kind=device_kind(S.device),
            capability=".".join(map(str, torch.cuda.get_device_capability(S.device))),
        )
    else:
        env.update(threads=torch.get_num_threads())
    env["not_importable"] = [mod for mod in ("hydra", "omegaconf", "wandb", "deepspeed") if not importable(mod)]
    env["api"] = api_probe()
    return env


def importable(module: str) -> bool:
    """Without importing it (deepspeed's import alone takes seconds and probes accelerators)."""
    import importlib.util

    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def api_probe() -> dict:
    """The torch APIs lmforge relies on whose presence or signature changed across releases (the GPU machine's
    torch is older than ours): True where present, else what is missing."""
    import inspect

    probes = {}

    def probe(name, fn):
        try:
            probes[name] = bool(fn())
        except Exception as e:  # noqa: BLE001 - a probe records, it never fails the run
            probes[name] = f"{type(e).__name__}: {e}"[:200]

    def fully_shard():
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # noqa: F401  (public since 2.6)

        return True

    def sdpa_kernel():
        from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: F401

        return True

    def mesh_flatten():
        from torch.distributed.device_mesh import DeviceMesh

        return hasattr(DeviceMesh, "_flatten")

    def distribute_src_rank():
        from torch.distributed.tensor import distribute_tensor

        return "src_data_rank" in inspect.signature(distribute_tensor).parameters

    def init_pg_device_id():
        import torch.distributed as dist

        return "device_id" in inspect.signature(dist.init_process_group).parameters

    def selective_ac():
        from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts  # noqa: F401

        return True

    def pipelining_schedules():
        from torch.distributed.pipelining import schedules

        return all(
            hasattr(schedules, n)
            for n in (
                "Schedule1F1B",
                "ScheduleInterleaved1F1B",
                "ScheduleInterleavedZeroBubble",
                "ScheduleZBVZeroBubble",
            )
        )

    probe("fsdp_fully_shard", fully_shard)
    probe("nn_attention_sdpa_kernel", sdpa_kernel)
    probe("device_mesh_flatten", mesh_flatten)
    probe("distribute_tensor_src_data_rank", distribute_src_rank)
    probe("init_process_group_device_id", init_pg_device_id)
    probe("selective_activation_checkpointing", selective_ac)
    probe("pipelining_schedules", pipelining_schedules)
    probe("nn_rmsnorm", lambda: hasattr(torch.nn, "RMSNorm"))
    probe("adamw_fused_cpu_or_cuda", lambda: "fused" in inspect.signature(torch.optim.AdamW).parameters)
    probe("cuda_set_sync_debug_mode", lambda: hasattr(torch.cuda, "set_sync_debug_mode"))
    return probes


def summarize() -> dict:
    checks = R.data["checks"]
    out = {
        "passed": sum(c["status"] == "pass" for c in checks.values()),
        "failed": sorted(k for k, c in checks.items() if c["status"] == "fail"),
        "skipped": sorted(k for k, c in checks.items() if c["status"] == "skipped"),
        "wall_s": round(R.elapsed(), 1),
    }
    for name in S.presets:
        engine = R.value(f"{name}_engine")
        if engine and "platform_overhead" in engine:
            out[f"{name}_platform_overhead"] = engine["platform_overhead"]
    return out


def gpu_check_out() -> Path:
    """$OUT/gpu_check.json (the device machine's return folder) when $OUT is set, else the benchmarks' scratch."""
    out = os.environ.get("OUT")
    return Path(out) / "gpu_check.json" if out else scratch_path("gpu_check.json")


def check_fp8_engine(name: str) -> dict:
    """train.precision=fp8 (torchao tensorwise, compiled) against the bf16-mixed engine check of the same model:
    step time and speed-up, and the first steps' losses from the same init and batch."""
    free_memory()
    engine, batches, root = build_engine(name, precision="fp8")
    losses = [float(engine.train_step(batches, root.optim.lr, guard=engine.guard).loss) for _ in range(2)]
    cfg, batch = S.presets[name]
    first, step_s = time_steps(lambda: engine.train_step(batches, root.optim.lr, guard=engine.guard))
    out = rates(cfg, batch, step_s, first)
    out["fp8_linears"] = sum(1 for m in engine.inner.modules() if type(m).__name__ == "Float8Linear")
    out["first_losses"] = [round(x, 4) for x in losses]
    bf16 = STATE.get(f"{name}_bf16_losses")
    if bf16:
        out["first_loss_gap_vs_bf16"] = round(max(abs(a - b) for a, b in zip(losses, bf16)), 4)
    bare = R.value(f"{name}_engine")
    if bare:
        out["speedup_vs_bf16_engine"] = round(bare["step_s"] / step_s, 3)
    engine = None  # free the device memory before the next check
    free_memory()
    return out


def main(argv=None) -> int:
    global S, R
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="run every check on CPU with tiny shapes")
    ap.add_argument(
        "--out",
        default=None,
        help="JSON path (default $OUT/gpu_check.json, else benchmarks/results/scratch/gpu_check.json)",
    )
    ap.add_argument("--budget-s", type=float, default=None, help="time budget of the whole script")
    args = ap.parse_args(argv)
    if args.dry_run:
        S = cpu_sizes()
    else:
        if not torch.cuda.is_available():
            print("no CUDA device: run with --dry-run for the CPU rehearsal", file=sys.stderr)
            return 2
        S = gpu_sizes()
        torch.cuda.set_device(S.device)
        torch.backends.cuda.matmul.allow_tf32 = True
    # Every model compiles as in a trainer that only ever sees one shape: static shapes, never the dynamic-shape
    # graphs dynamo switches to after a recompile with other sizes (which would distort the throughput numbers).
    import torch._dynamo as dynamo  # binds `dynamo` only: `import torch._dynamo` would make `torch` local

    dynamo.config.automatic_dynamic_shapes = False
    out_path = Path(args.out) if args.out else gpu_check_out()
    R = Report(out_path, environment(), args.budget_s or S.budget_s)
    env = R.data["env"]
    print(
        f"torch {env['torch']} on {env.get('gpu', 'cpu')} ({env.get('kind', 'dry run')}); "
        f"not importable: {env['not_importable']}; json -> {out_path}",
        flush=True,
    )

    checks = [
        ("matmul_tflops", check_matmul),
        ("flash_sdpa", check_flash_sdpa),
        ("bf16_step", check_bf16_step),
        ("process_group_world_1", check_process_group),
        ("fsdp2_one_device", check_fsdp2_one_device),
        ("compile_block", check_compile_block),
        ("gpt_125m_engine", lambda: check_engine("gpt_125m")),
        ("engine_no_host_sync", check_no_host_sync),
        ("document_attention_varlen", check_document_attention_varlen),
        ("gpt_1b_compiled", lambda: check_bare("gpt_1b", True)),
        ("gpt_1b_engine", lambda: check_engine("gpt_1b")),
        ("gpt_1b_fp8_engine", lambda: check_fp8_engine("gpt_1b")),
    ]
    R.data["env"].update(budget_s=R.budget_s, est_total_s=sum(S.est_s.get(name, 3.0) for name, _ in checks))
    for name, fn in checks:
        R.check(name, fn, S.est_s.get(name, 3.0))
    R.data["summary"] = summarize()
    R.write()

    print("\n" + "=" * 100)
    print(f"{'check':24} {'status':8} {'s':>7}  value")
    for name, c in R.data["checks"].items():
        shown = c.get("value") if c["ok"] else c.get("error")
        print(f"{name:24} {c['status']:8} {c.get('s', 0):7.1f}  {json.dumps(shown, default=str)[:160]}")
    mm = R.value("matmul_tflops")
    if mm:
        print(
            f"\nmeasured bf16 matmul {mm} TFLOP/s = {mm / H200_SPEC_BF16:.3f} of the H200 spec {H200_SPEC_BF16}; "
            "MFU/989 = achieved / spec, MFU/mm = achieved / measured matmul, overhead = engine / bare compiled step"
        )
    print(
        f"\n{'model':10} {'path':9} {'step_s':>9} {'tok/s':>10} {'TFLOP/s':>9} {'MFU/989':>8} {'MFU/mm':>7} "
        f"{'overhead':>8}"
    )
    for name in S.presets:
        for path in ("eager", "compiled", "engine"):
            v = R.value(f"{name}_{path}")
            if v:
                print(
                    f"{name:10} {path:9} {v['step_s']:9.4f} {v['tokens_per_s']:10d} {v['tflops']:9.3f} "
                    f"{v['mfu_vs_spec_989']:8.4f} {v.get('mfu_vs_measured_matmul', float('nan')):7.4f} "
                    f"{v.get('platform_overhead', float('nan')):8.3f}"
                )
    print(json.dumps(R.data["summary"]))
    with contextlib.suppress(Exception):
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    s = R.data["summary"]
    return 1 if s["failed"] or s["skipped"] else 0


if __name__ == "__main__":
    sys.exit(main())
