"""Where one training step's time goes: torch.profiler over a few engine steps, every op's own (self) time
put into one category, each category's share of the step and, for GEMMs and attention, its achieved FLOP/s
against an fp32 GEMM probe measured in the same run. Two *ceiling* rows say how far the step could go if every
other category took no time (GEMMs at the probe's rate or at their own, attention at its own): a goal above them
needs faster GEMM or attention kernels, not less work around them.

The profiler disturbs a CPU step: op times it reports for memory-bound kernels can be 2-3x their unprofiled
time, and its own allocations defeat ``train.host_malloc=retain``'s page reuse
(benchmarks/reports/2026-12-step-speed.md).
``benchmarks/ablate_step.py`` measures the parts' costs without it; read the shares here as where to look, and
its figures as what a part costs.

    python -m benchmarks.profile_step [--model bench_small smoke gpt_125m] [--steps 3] [--batch 8] [--repeats 3]
                                      [--threads N] [--no-compile] [--host-malloc retain|system]

Categories: GEMM, attention, norms, activations, RoPE, loss, optimizer (AdamW, zero_grad, clipping),
copies/layout (copies, casts, concatenations, repeats; views count with the op they feed), other ops
(embedding lookup, residual adds, anything not named above: listed by op so nothing hides), framework
overhead (the step's time outside every op: Python, autograd engine bookkeeping, the engine's own code).

How an op is placed: its *context* first (the model function it was called from, read from the Python
stack: ``apply_rope`` is RoPE, ``cross_entropy_loss`` loss; the optimizer's and clipping's own scopes), then
its name. A backward op inherits the context of the forward op that recorded its autograd node (the two
share a sequence number), so RoPE's backward multiplications count as RoPE, not as "other". Compiled
blocks run inductor's fused C++ kernels, named after the ops they fuse (``cpp_fused_native_layer_norm_..``):
a fused kernel goes to the first category of ``FUSED_TOKENS`` whose token its name contains (best effort:
a kernel fusing a residual add into a norm counts as norms).
"""

from __future__ import annotations

import argparse
import re
import statistics
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.harness import add_host_malloc_flag
from lmforge.runtime import host_memory

CATEGORIES = (
    "GEMM",
    "attention",
    "norms",
    "activations",
    "RoPE",
    "loss",
    "optimizer",
    "copies/layout",
    "other ops",
    "framework overhead",
)

STEP_MARK = "lmforge_step#"  # the profiler keeps "ProfilerStep#" for itself
# The function names (innermost frame first wins) whose ops belong to a category whatever the op.
CONTEXT_FUNCTIONS = {
    "apply_rope": "RoPE",
    "rope_tables": "RoPE",
    "cross_entropy_loss": "loss",
    "clip_grad_norm": "optimizer",
    "global_grad_norm": "optimizer",
}
CONTEXT_SCOPES = (("Optimizer.step", "optimizer"), ("Optimizer.zero_grad", "optimizer"))
# Backward nodes of custom autograd Functions: their backward ops belong here whatever the op.
NODE_CONTEXT = {"ChunkedCrossEntropyBackward": "loss", "RotateHalfBackward": "RoPE"}  # model/loss.py, model/rope.py

GEMM_OPS = {
    "aten::mm",
    "aten::addmm",
    "aten::bmm",
    "aten::baddbmm",
    "aten::matmul",
    "aten::linear",
    "aten::addmm_",
    "mkldnn::_linear_pointwise",
}
ATTENTION_PREFIX = "aten::_scaled_dot_product"
ATTENTION_OPS = {"aten::scaled_dot_product_attention", "aten::_softmax", "aten::_softmax_backward_data"}
NORM_OPS = {
    "aten::layer_norm",
    "aten::native_layer_norm",
    "aten::native_layer_norm_backward",
    "aten::rms_norm",
    "aten::_fused_rms_norm",
    "aten::_fused_rms_norm_backward",
}
ACTIVATION_OPS = {
    "aten::gelu",
    "aten::gelu_backward",
    "aten::silu",
    "aten::silu_backward",
    "aten::sigmoid",
    "aten::tanh",
    "aten::tanh_backward",
    "aten::relu",
    "aten::threshold_backward",
}
LOSS_OPS = {
    "aten::cross_entropy_loss",
    "aten::log_softmax",
    "aten::_log_softmax",
    "aten::nll_loss",
    "aten::nll_loss_nd",
    "aten::nll_loss_forward",
    "aten::nll_loss_backward",
    "aten::_log_softmax_backward_data",
}
COPY_OPS = {
    "aten::copy_",
    "aten::clone",
    "aten::contiguous",
    "aten::_to_copy",
    "aten::to",
    "aten::cat",
    "aten::repeat_interleave",
    "aten::index_select",
    "aten::stack",
    "aten::repeat",
    "aten::_unsafe_index",
    "aten::type_as",
}
# Ops that only make views or allocate: their time belongs to whatever op called them.
VIEW_OPS = {
    "aten::view",
    "aten::t",
    "aten::transpose",
    "aten::reshape",
    "aten::_reshape_alias",
    "aten::as_strided",
    "aten::slice",
    "aten::select",
    "aten::expand",
    "aten::unsqueeze",
    "aten::squeeze",
    "aten::permute",
    "aten::_unsafe_view",
    "aten::detach",
    "aten::alias",
    "aten::flatten",
    "aten::unflatten",
    "aten::split",
    "aten::narrow",
    "aten::empty",
    "aten::empty_like",
    "aten::empty_strided",
    "aten::resize_",
    "aten::lift_fresh",
    "aten::result_type",
    "aten::view_as",
    "aten::numpy_T",
    "detach",
}
FUSED_TOKENS = (
    ("scaled_dot_product", "attention"),
    ("flip", "RoPE"),
    ("layer_norm", "norms"),
    ("rms_norm", "norms"),
    ("rsqrt", "norms"),
    ("gelu", "activations"),
    ("silu", "activations"),
    ("tanh", "activations"),
    ("sigmoid", "activations"),
    ("neg", "RoPE"),
    ("cos", "RoPE"),
    ("softmax", "attention"),
    ("nll", "loss"),
    ("cat", "copies/layout"),
    ("clone", "copies/layout"),
)


def op_category(name: str) -> Optional[str]:
    """The category an op's name decides, None for view/allocation ops and unknown scopes."""
    if name in GEMM_OPS:
        return "GEMM"
    if name.startswith(ATTENTION_PREFIX) or name in ATTENTION_OPS:
        return "attention"
    if name in NORM_OPS:
        return "norms"
    if name in ACTIVATION_OPS:
        return "activations"
    if name in LOSS_OPS:
        return "loss"
    if name in COPY_OPS:
        return "copies/layout"
    if "cpp_fused" in name or "triton_" in name:
        for token, category in FUSED_TOKENS:
            if token in name:
                return category
        return "other ops"
    if name in VIEW_OPS or not name.startswith(("aten::", "mkldnn::")):
        return None
    return "other ops"


PYTHON_FRAME = re.compile(r"\.py\(\d+\): (\S+)$")


def is_python_event(name: str) -> bool:
    """An event of the profiler's Python tracer (a function call), not an op."""
    return bool(PYTHON_FRAME.search(name)) or name.startswith("<built-in")


def frame_context(name: str) -> Optional[str]:
    """The category of a Python-tracer event that is one of the context functions."""
    m = PYTHON_FRAME.search(name)
    return CONTEXT_FUNCTIONS.get(m.group(1)) if m else None


def scope_context(name: str) -> Optional[str]:
    for prefix, category in CONTEXT_SCOPES:
        if name.startswith(prefix):
            return category
    return None


@dataclass
class Breakdown:
    wall_us: float  # unprofiled step time x profiled steps (the tracer slows Python, not the ops)
    steps: int
    self_us: Dict[str, float]  # category -> self time summed over the steps
    flops: Dict[str, float]  # category -> FLOPs done (GEMM, attention)
    other_ops: Dict[str, float] = field(default_factory=dict)  # "other ops" by op name (nothing hides)

    def share(self, category: str) -> float:
        """Fraction of the step; when the profiled ops alone outlast the unprofiled step (a noisy machine),
        fractions of the ops' total, so the shares always sum to 1."""
        return self.self_us.get(category, 0.0) / max(self.wall_us, sum(self.self_us.values()))

    def rate(self, category: str) -> float:
        """Achieved FLOP/s of a category (0 where it does no counted FLOPs)."""
        t = self.self_us.get(category, 0.0)
        return self.flops.get(category, 0.0) / (t * 1e-6) if t else 0.0


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def op_flops(name: str, shapes) -> float:
    """FLOPs of a GEMM or attention op from its input shapes (attention: full T x S square, as model/flops.py)."""
    try:
        if name == "aten::mm":
            (m, k), (_, n) = shapes[0], shapes[1]
            return 2.0 * m * k * n
        if name in ("aten::addmm", "aten::addmm_"):
            (m, k), (_, n) = shapes[1], shapes[2]
            return 2.0 * m * k * n
        if name == "aten::bmm":
            (b, m, k), (_, _, n) = shapes[0], shapes[1]
            return 2.0 * b * m * k * n
        if name.startswith(ATTENTION_PREFIX):
            backward = name.endswith("_backward")
            q, k = (shapes[1], shapes[2]) if backward else (shapes[0], shapes[1])
            b, h, t, d = q
            return (8.0 if backward else 4.0) * b * h * t * k[-2] * d
    except (IndexError, TypeError, ValueError):
        return 0.0
    return 0.0


def bucket(events, step_s: float, use_context: bool = True) -> Breakdown:
    """Put every profiled op's self time into a category (see the module docstring). ``step_s`` is the
    unprofiled step time: the Python tracer slows the Python between ops, so the framework overhead is the
    unprofiled step time less the ops' time, not the profiled one."""
    events = list(events)
    context: Dict[int, Optional[str]] = {}  # id(event) -> inherited context
    forward_context: Dict[int, str] = {}  # sequence_nr -> context of the forward op that recorded that node

    def ctx_of(e) -> Optional[str]:
        key = id(e)
        if key in context:
            return context[key]
        c = (scope_context(e.name) or frame_context(e.name)) if use_context else None
        if c is None and use_context and e.cpu_parent is not None:
            c = ctx_of(e.cpu_parent)
        context[key] = c
        return c

    def cat_of(e) -> Optional[str]:
        """The outermost op's decisive category (an ``aten::rms_norm``'s inner ``mul`` is norms, a
        ``linear``'s ``mm`` GEMM); "other ops" only when no enclosing op names a category."""
        strong, weak = None, None
        while e is not None:
            own = op_category(e.name)
            if own == "other ops":
                weak = weak or own
            elif own is not None:
                strong = own
            e = e.cpu_parent
        return strong or weak

    # Forward ops first, so their backward partners can inherit their context.
    for e in events:
        c = ctx_of(e)
        if c is not None and getattr(e, "sequence_nr", -1) >= 0 and not e.name.startswith("autograd::"):
            forward_context.setdefault(e.sequence_nr, c)
    self_us: Dict[str, float] = defaultdict(float)
    flops: Dict[str, float] = defaultdict(float)
    other: Dict[str, float] = defaultdict(float)
    steps = sum(e.name.startswith(STEP_MARK) for e in events)
    wall = step_s * 1e6 * steps
    for e in events:
        if e.name.startswith(STEP_MARK) or is_python_event(e.name):
            continue
        category = None
        if use_context:
            c = ctx_of(e)
            anc = e
            while c is None and anc is not None:  # a backward op: the context of its node's forward op
                if anc.name.startswith("autograd::engine::evaluate_function"):
                    c = NODE_CONTEXT.get(anc.name.rsplit(": ", 1)[-1])
                    if c is None and anc.sequence_nr >= 0:
                        c = forward_context.get(anc.sequence_nr)
                anc = anc.cpu_parent
            if c in ("RoPE", "loss", "optimizer"):
                category = c
        category = category or cat_of(e) or "framework overhead"
        self_us[category] += e.self_cpu_time_total
        if category in ("GEMM", "attention"):
            flops[category] += op_flops(e.name, e.input_shapes)
        if category == "other ops":
            other[e.name] += e.self_cpu_time_total
    accounted = sum(self_us.values())
    self_us["framework overhead"] += max(0.0, wall - accounted)  # time outside every op
    return Breakdown(wall, steps, dict(self_us), dict(flops), dict(other))


def profile_steps(step, steps: int) -> profile:
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True, with_stack=True) as prof:
        for i in range(steps):
            with torch.profiler.record_function(f"{STEP_MARK}{i}"):
                step()
    return prof


@dataclass
class ProfileRun:
    model: str
    mode: str
    breakdown: Breakdown
    step_s: float  # unprofiled step, median
    gemm_rate: float  # same-run fp32 GEMM FLOP/s (median of probes around the steps)
    model_flops: float  # per step, by the project's one FLOPs function

    def ceiling(self, gemm_at_probe: bool = True) -> float:
        """The fraction of the same-run GEMM rate the step would reach if every category but GEMM and attention
        took no time: attention at its measured rate, GEMMs at the probe's rate (``gemm_at_probe``) or at their
        own measured rate. No change outside those two kernels can take the step past it."""
        b = self.breakdown
        gemm_s = b.flops.get("GEMM", 0.0) / self.gemm_rate if gemm_at_probe else b.self_us.get("GEMM", 0.0) * 1e-6
        seconds = (gemm_s + b.self_us.get("attention", 0.0) * 1e-6) / b.steps
        return self.model_flops / seconds / self.gemm_rate


def run_profile(model: str, batch: int, steps: int, compiled: bool, repeats: int = 3) -> ProfileRun:
    from benchmarks.step import base_overrides, engine_step, gemm
    from lmforge.config.compose import compose
    from lmforge.config.validate import validate
    from lmforge.model.flops import flops_per_token

    base = base_overrides(model, batch)
    if compiled:
        import torch._inductor.config as inductor_config

        inductor_config.cpp.enable_kernel_profile = True  # fused kernels appear in the profile by name
        base = base + ["parallelism.compile=true"]
    cfg = validate(compose(base), world_size=1).cfg
    step = engine_step(base, batch)
    step()  # warm-up (compiles)
    probe = gemm()
    rates, times = [], []
    for _ in range(repeats):  # interleaved: probe, step, probe, step, ...
        t0 = time.perf_counter()
        probe.fn()
        rates.append(probe.units / (time.perf_counter() - t0))
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    prof = profile_steps(step, steps)
    return ProfileRun(
        model,
        "compiled" if compiled else "eager",
        bucket(prof.events(), statistics.median(times)),
        statistics.median(times),
        statistics.median(rates),
        flops_per_token(cfg.model) * batch * cfg.model.seq_len,
    )


def table(runs: List[ProfileRun]) -> str:
    """A markdown table: one row per category, per run its share of the step and (GEMM, attention) its
    achieved rate as a fraction of the same-run GEMM rate."""
    head = "| category | " + " | ".join(f"{r.model} {r.mode}" for r in runs) + " |"
    lines = [head, "|" + "---|" * (len(runs) + 1)]
    for c in CATEGORIES:
        cells = []
        for r in runs:
            b = r.breakdown
            cell = f"{b.share(c):.1%}"
            if b.rate(c):
                cell += f" ({b.rate(c) / r.gemm_rate:.0%} of GEMM)"
            cells.append(cell)
        lines.append(f"| {c} | " + " | ".join(cells) + " |")
    lines.append(
        "| step (unprofiled) | "
        + " | ".join(f"{r.step_s * 1e3:.0f} ms, {r.model_flops / r.step_s / r.gemm_rate:.0%} of GEMM" for r in runs)
        + " |"
    )
    lines.append(
        "| ceiling: GEMM at the probe rate, attention as measured, the rest 0 | "
        + " | ".join(f"{r.ceiling():.0%} of GEMM" for r in runs)
        + " |"
    )
    lines.append(
        "| ceiling: GEMM and attention as measured, the rest 0 | "
        + " | ".join(f"{r.ceiling(gemm_at_probe=False):.0%} of GEMM" for r in runs)
        + " |"
    )
    lines.append("| same-run fp32 GEMM | " + " | ".join(f"{r.gemm_rate / 1e12:.3f} TFLOP/s" for r in runs) + " |")
    return "\n".join(lines)


def main() -> None:
    from lmforge.runtime.hardware import pin_threads

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", nargs="+", default=["bench_small", "smoke", "gpt_125m"])
    ap.add_argument("--batch", type=int, default=8, help="micro batch (gpt_125m always uses 1)")
    ap.add_argument("--steps", type=int, default=3, help="profiled steps (gpt_125m: at most 2)")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=3, help="unprofiled steps (and GEMM probes), interleaved")
    ap.add_argument("--no-compile", action="store_true")
    add_host_malloc_flag(ap)
    args = ap.parse_args()
    threads = pin_threads(args.threads)
    malloc = host_memory.apply(args.host_malloc)
    runs = []
    for model in args.model:
        big = model == "gpt_125m"
        batch, steps = (1, min(args.steps, 2)) if big else (args.batch, args.steps)
        for compiled in (False,) if args.no_compile else (False, True):
            run = run_profile(model, batch, steps, compiled, repeats=1 if big else args.repeats)
            runs.append(run)
            other = sorted(run.breakdown.other_ops.items(), key=lambda kv: -kv[1])[:6]
            print(
                f"{model} {run.mode}: step {run.step_s * 1e3:.1f} ms; other ops: "
                + ", ".join(f"{k} {v / run.breakdown.wall_us:.1%}" for k, v in other),
                flush=True,
            )
            print(table([run]), flush=True)  # each run's column as soon as it is measured (slow machines)
    print(f"\nthreads={threads}, host malloc {malloc}, torch {torch.__version__}\n")
    print(table(runs))


if __name__ == "__main__":
    main()
