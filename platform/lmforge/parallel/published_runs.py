"""Published large-model training runs (``published_runs.csv`` beside this module), the yardstick of the planner.

Each row is one measured run as its source reports it: the model's shape, the hardware, the layout (tp, pp, dp,
cp, ...), batch, precision, and the throughput in the source's own unit with the source's own FLOPs convention
(``flops_formula`` names one of the functions below). A field the source does not publish is empty (``None``
here); the row's ``notes`` say what was not published and where a value was taken from.

- ``load_published_runs`` parses the table into typed ``PublishedRun`` rows (a malformed cell is refused naming
  the row and the column).
- ``tokens_per_s_per_gpu`` turns a row's throughput into tokens/s per GPU with that source's FLOPs formula;
  ``source_tflops_per_gpu`` goes back.
- ``to_root_config`` maps a row to the ``RootConfig`` the planner plans, with the assumptions it had to make
  and the features lmforge does not model (``RunMapping.unsupported``; such a row is not expected to plan like
  the source).
"""

from __future__ import annotations

import csv
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Callable, Dict, List, Optional, Union

from lmforge.config.cluster import ClusterConfig
from lmforge.config.model import ModelConfig
from lmforge.config.parallelism import ParallelismConfig, suggested_pp_layers
from lmforge.config.schema import RootConfig
from lmforge.config.train import TrainConfig
from lmforge.parallel.device_table import DeviceSpec, device_spec, power_capped

PUBLISHED_RUNS_CSV = Path(__file__).with_name("published_runs.csv")

THROUGHPUT_UNITS = ("TFLOP/s/GPU", "tokens/s/GPU")
DP_SHARDING = ("none", "optimizer", "full")
PRECISIONS = ("fp16", "bf16", "fp8")
YES_NO = ("y", "n", "unknown")

# The lmforge device kind and its memory for each hardware label of the table (``None``: the table's nominal size).
HARDWARE_KINDS: Dict[str, tuple] = {
    "A100-40GB": ("a100_40gb", None),
    "A100-80GB": ("a100_80gb", None),
    "H100-80GB": ("h100_sxm", None),
    "H100-96GB (HBM2e, 500 W)": ("h100_sxm", 96.0),
    "H200-141GB": ("h200", None),
}
# Hardware run below its datasheet power, and the memory bandwidth it has: (board watts, HBM GB/s). Meta's Grand
# Teton H100s with 96 GB of HBM2e at 500 W (the torchtitan benchmarks): the clock ``device_table.power_capped`` gives
# at 500 W, and six HBM2e stacks at the per-stack rate of the H100 PCIe's five (2,000 GB/s over 80 GB): 2,400 GB/s.
HARDWARE_POWER: Dict[str, tuple] = {"H100-96GB (HBM2e, 500 W)": (500.0, 2400.0)}


@dataclass(frozen=True)
class PublishedRun:
    """One row of ``published_runs.csv``; ``None`` = not published by the source."""

    id: str
    source: str
    url: str
    model: str
    n_params: Optional[int]
    n_layers: int
    d_model: int
    n_heads: int
    n_kv_heads: Optional[int]
    ffn_hidden: Optional[int]
    vocab: int
    seq_len: Optional[int]
    mlp: Optional[str]
    hardware: str
    gpus: int
    tp: int
    pp: int
    dp: Optional[int]
    cp: int
    ep: int
    virtual_stages: Optional[int]
    sequence_parallel: str
    recompute: Optional[str]
    distributed_optimizer: str
    dp_sharding: str
    tie_embeddings: str
    micro_batch: Optional[int]
    global_batch: Optional[int]
    precision: Optional[str]
    published_memory_gib: Optional[float]
    memory_excluded: Optional[str]  # why the published memory measures what lmforge's plan does not (empty: held)
    published_throughput: Optional[float]
    throughput_unit: Optional[str]
    published_utilization_pct: Optional[float]
    flops_formula: str
    notes: str

    @property
    def recompute_mode(self) -> Optional[str]:
        """``none`` / ``selective`` / ``full`` (the first word of ``recompute``), or None when not published."""
        return self.recompute.split()[0] if self.recompute else None

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads


_INT_FIELDS = {"n_params", "n_layers", "d_model", "n_heads", "n_kv_heads", "ffn_hidden", "vocab", "seq_len", "gpus"}
_INT_FIELDS |= {"tp", "pp", "dp", "cp", "ep", "virtual_stages", "micro_batch", "global_batch"}
_FLOAT_FIELDS = {"published_memory_gib", "published_throughput", "published_utilization_pct"}
_REQUIRED = {"id", "source", "url", "model", "n_layers", "d_model", "n_heads", "vocab", "hardware", "gpus", "tp", "pp"}
_REQUIRED |= {
    "cp",
    "ep",
    "sequence_parallel",
    "distributed_optimizer",
    "dp_sharding",
    "tie_embeddings",
    "flops_formula",
}
_CHOICES = {
    "mlp": ("gelu", "swiglu"),
    "sequence_parallel": YES_NO,
    "distributed_optimizer": YES_NO,
    "tie_embeddings": YES_NO,
    "dp_sharding": DP_SHARDING,
    "precision": PRECISIONS,
    "throughput_unit": THROUGHPUT_UNITS,
}


def _cell(row_id: str, name: str, text: str) -> Union[None, int, float, str]:
    text = text.strip()
    if not text:
        if name in _REQUIRED:
            raise ValueError(f"published runs: row '{row_id}': column '{name}' is empty but required")
        return None
    try:
        if name in _INT_FIELDS:
            return int(text)
        if name in _FLOAT_FIELDS:
            return float(text)
    except ValueError:
        raise ValueError(f"published runs: row '{row_id}': column '{name}' = '{text}' is not a number") from None
    if name in _CHOICES and text not in _CHOICES[name]:
        raise ValueError(
            f"published runs: row '{row_id}': column '{name}' = '{text}', expected one of {_CHOICES[name]}"
        )
    return text


def parse_row(raw: Dict[str, str]) -> PublishedRun:
    row_id = raw.get("id", "").strip() or "?"
    names = [f.name for f in fields(PublishedRun)]
    missing = [n for n in names if n not in raw]
    if missing:
        raise ValueError(f"published runs: row '{row_id}': columns missing: {', '.join(missing)}")
    run = PublishedRun(**{n: _cell(row_id, n, raw[n] or "") for n in names})
    if run.flops_formula not in FLOPS_PER_TOKEN:
        raise ValueError(
            f"published runs: row '{row_id}': flops_formula '{run.flops_formula}' is not one of {sorted(FLOPS_PER_TOKEN)}"
        )
    if run.hardware not in HARDWARE_KINDS:
        raise ValueError(
            f"published runs: row '{row_id}': hardware '{run.hardware}' is not one of {sorted(HARDWARE_KINDS)}"
        )
    return run


def load_published_runs(path: Optional[Path] = None) -> List[PublishedRun]:
    """Every row of the table (``PUBLISHED_RUNS_CSV`` unless ``path``), in file order; ids are unique."""
    with open(path or PUBLISHED_RUNS_CSV, newline="", encoding="utf-8") as fh:
        runs = [parse_row(raw) for raw in csv.DictReader(fh)]
    seen = set()
    for run in runs:
        if run.id in seen:
            raise ValueError(f"published runs: row id '{run.id}' appears twice")
        seen.add(run.id)
    return runs


# ---- each source's own FLOPs convention, per token (training: forward + backward) -------------------------


def narayanan_eq3(run: PublishedRun) -> float:
    """Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM",
    eq. (3): F = 96 B s l h^2 (1 + s/(6h) + V/(16 l h)) per iteration of B sequences, full activation recomputation
    counted (an extra forward of every block); per token F / (B s). The Table 1 TFLOP/s use it."""
    h, s, layers = run.d_model, _seq(run), run.n_layers
    return 96 * layers * h * h * (1 + s / (6 * h) + run.vocab / (16 * layers * h))


def megatron_core_r08(run: PublishedRun) -> float:
    """Megatron-LM ``megatron/training/training.py::num_floating_point_operations`` (Megatron-Core r0.8.0):
    12 B s l h^2 ((1 + g/n + s/h) q/h + (F/h) k m + V/(2 l h)) per iteration, g KV groups, n heads, q the query
    projection width (= h here), k experts routed to (1, dense), m = 3/2 for a gated MLP; no recompute counted. Where
    the source does not publish the MLP (the weak-scaling table), F m / h = 4: its model sizes are 12 l h^2 per layer,
    which a 4h GELU MLP and an 8h/3 SwiGLU MLP both give, with the same FLOPs."""
    h, s, layers = run.d_model, _seq(run), run.n_layers
    if run.ffn_hidden is None:
        mlp_term = 4.0
    else:
        mlp_term = run.ffn_hidden / h * (1.5 if run.mlp == "swiglu" else 1.0)
    attention = 1 + run.kv_heads / run.n_heads + s / h
    return 12 * layers * h * h * (attention + mlp_term + run.vocab / (2 * layers * h))


def torchtitan_6n_attn(run: PublishedRun) -> float:
    """torchtitan ``get_num_flop_per_token`` (utils.py at 9dec370): 6 N + 12 l n_heads head_dim s, N the parameters
    without the token embedding (the output projection counted), the full attention square, no recompute counted."""
    h, f, layers = run.d_model, run.ffn_hidden, run.n_layers
    hd = h // run.n_heads
    per_layer = 2 * h * h + 2 * h * run.kv_heads * hd + 3 * h * f + 2 * h
    n = layers * per_layer + run.vocab * h + h
    return 6 * n + 12 * layers * run.n_heads * hd * _seq(run)


def mpt_6n_attn(run: PublishedRun) -> float:
    """llm-foundry ``scripts/train/benchmarking/collect_results.py``: MFU = (3 * 2 N s + 3 * 4 l d s^2) * seq/s /
    (GPUs * peak), i.e. 6 N + 12 l d s per token, N = the table's NumParams (all parameters), no recompute counted."""
    return 6 * _params(run) + 12 * run.n_layers * run.d_model * _seq(run)


def bigscience_8n(run: PublishedRun) -> float:
    """BigScience ``math/README.md`` "Calculate TFLOPs": model_size * 4 * 2 * seqlen * global_batch / (time * GPUs),
    i.e. 8 N per token (the factor 4 counts the recompute of activation checkpointing), N = the model size."""
    return 8 * _params(run)


FLOPS_PER_TOKEN: Dict[str, Callable[[PublishedRun], float]] = {
    "narayanan_eq3": narayanan_eq3,
    "megatron_core_r08": megatron_core_r08,
    "torchtitan_6n_attn": torchtitan_6n_attn,
    "mpt_6n_attn": mpt_6n_attn,
    "bigscience_8n": bigscience_8n,
}


def _seq(run: PublishedRun) -> int:
    if run.seq_len is None:
        raise ValueError(f"published runs: row '{run.id}': seq_len is not published; FLOPs need it")
    return run.seq_len


def _params(run: PublishedRun) -> int:
    if run.n_params is None:
        raise ValueError(f"published runs: row '{run.id}': n_params is not published; its FLOPs formula needs it")
    return run.n_params


def source_flops_per_token(run: PublishedRun) -> float:
    """FLOPs per training token by the row's own convention (``flops_formula``)."""
    return FLOPS_PER_TOKEN[run.flops_formula](run)


def tokens_per_s_per_gpu(run: PublishedRun) -> Optional[float]:
    """The published throughput as tokens/s per GPU (None when the row publishes none)."""
    if run.published_throughput is None:
        return None
    if run.throughput_unit == "tokens/s/GPU":
        return run.published_throughput
    return run.published_throughput * 1e12 / source_flops_per_token(run)


def source_tflops_per_gpu(run: PublishedRun, tokens_per_s: float) -> float:
    """Tokens/s per GPU back to TFLOP/s per GPU in the row's own convention."""
    return tokens_per_s * source_flops_per_token(run) / 1e12


# ---- a row as an lmforge config ---------------------------------------------------------------------------------


@dataclass
class RunMapping:
    """A row as the config the planner plans: ``assumptions`` fill fields the source does not publish;
    ``unsupported`` names what lmforge does not model (the plan then differs from the source by design)."""

    run: PublishedRun
    cfg: RootConfig
    assumptions: List[str] = field(default_factory=list)
    unsupported: List[str] = field(default_factory=list)


def device_for(run: PublishedRun) -> DeviceSpec:
    """The step model's device for the row's hardware (``HARDWARE_POWER``: at its power limit and bandwidth)."""
    kind, _ = HARDWARE_KINDS[run.hardware]
    spec = device_spec(kind)
    if run.hardware in HARDWARE_POWER:
        watts, hbm = HARDWARE_POWER[run.hardware]
        spec = power_capped(spec, watts, hbm)
    return spec


def unsupported_features(run: PublishedRun) -> List[str]:
    """What of the row lmforge cannot plan as published (empty: every feature is modelled)."""
    out = []
    if run.pp > 1 and run.virtual_stages is None:
        out.append("pipeline virtual stages not published")
    if run.pp > 1 and run.micro_batch is None:
        out.append("pipeline micro batch not published")
    if run.seq_len is None:
        out.append("seq_len not published")
    if run.tie_embeddings == "y" and run.pp > 1:
        out.append("tied embeddings with pp > 1 (planned untied)")
    if run.ep > 1:
        out.append("expert parallelism (no MoE shape in the table)")
    return out


def _torchtitan(run: PublishedRun) -> bool:
    """A torchtitan run: its ``selective`` is the op-level SAC policy that saves every second matmul's output
    (``_save_list`` and ``mm_count % 2`` in its parallelize module: lmforge's ``selective_matmuls=alternate``); with
    tp > 1 its loss is computed on vocab-sharded logits (``disable_loss_parallel`` defaults to false), as
    lmforge's default ``parallelism.loss_parallel`` does."""
    return "github.com/pytorch/torchtitan/" in run.url


def to_root_config(run: PublishedRun) -> RunMapping:
    """The row as a ``RootConfig`` (not yet validated: pass it to ``lmforge.config.validate.validate`` with
    ``world_size=run.gpus``), with the assumptions made and the unsupported features."""
    assumptions: List[str] = []
    mlp = run.mlp
    d_ff = run.ffn_hidden
    if mlp is None:
        mlp, d_ff = "gelu", 4 * run.d_model
        assumptions.append("MLP not published: 4h GELU (the same parameters and FLOPs as an 8h/3 SwiGLU)")
    pp = run.pp
    vs = run.virtual_stages or 1
    model = ModelConfig(
        name=run.id,
        vocab_size=run.vocab,
        d_model=run.d_model,
        n_layers=run.n_layers,
        n_heads=run.n_heads,
        n_kv_heads=run.n_kv_heads,
        d_ff=d_ff,
        seq_len=_seq(run),
        mlp=mlp,
        norm="rmsnorm" if mlp == "swiglu" else "layernorm",
        tie_embeddings=run.tie_embeddings == "y" and pp == 1,
    )
    dp = run.dp if run.dp is not None else run.gpus // (run.tp * run.pp * run.cp)
    shard = run.dp_sharding == "full"
    # Megatron's distributed optimizer (ZeRO-1): lmforge's distributed_optimizer preset (FSDP2 over dp, parameters
    # gathered once per step in bf16, fp32 master weights and AdamW state sharded; docs/parallelism.md).
    distributed = run.dp_sharding == "optimizer" and dp > 1
    stages = pp * vs
    pp_layers = None
    if run.n_layers % stages:
        pp_layers = suggested_pp_layers(run.n_layers, stages)
        assumptions.append(f"uneven pipeline split not published: pp_layers={pp_layers}")
    mode = run.recompute_mode
    if mode is None:
        mode = "none"
        assumptions.append("recompute not published: none")
    par = ParallelismConfig(
        name="published",
        dp_replicate=1 if (shard or distributed) else dp,
        dp_shard=dp if (shard or distributed) else 1,
        # torchtitan (parallelisms/parallelize_llama.py at 9dec370) keeps FSDP-gathered blocks from forward to
        # backward when pipelining (reshard_after_forward = not pp_enabled), as it does for Megatron's optimizer
        reshard_after_forward=not (distributed or (shard and pp > 1)),
        fsdp_grad_sync="last_microbatch" if distributed else "auto",
        pp_layers=pp_layers,
        tp=run.tp,
        pp=pp,
        cp=run.cp,
        sequence_parallel=run.sequence_parallel == "y" and run.tp > 1,
        activation_checkpointing=mode,
        selective_matmuls="alternate" if mode == "selective" and _torchtitan(run) else "all",
        pp_schedule="Interleaved1F1B" if vs > 1 else "1F1B",
        pp_virtual_stages=vs,
        param_dtype="bf16" if (shard and run.precision in ("bf16", "fp8")) or distributed else "fp32",
    )
    micro = run.micro_batch
    if micro is None:
        micro = 1
        assumptions.append("micro batch not published: 1")
    batch = run.global_batch
    if batch is None:
        batch = micro * dp
        assumptions.append(f"global batch not published: micro x dp = {batch}")
    if run.precision == "fp16":
        assumptions.append("fp16 mixed precision planned as bf16-mixed (the same bytes)")
    precision = "fp8" if run.precision == "fp8" else "bf16-mixed"
    train = TrainConfig(micro_batch_size=micro, global_batch_size=batch, precision=precision)
    kind, memory = HARDWARE_KINDS[run.hardware]
    per_node = min(8, run.gpus)
    cluster = ClusterConfig(
        name=run.id,
        nodes=max(1, run.gpus // per_node),
        gpus_per_node=per_node,
        device=kind,
        device_memory_gib=memory or 0.0,
    )
    cfg = RootConfig(model=model, parallelism=par, train=train, cluster=cluster)
    return RunMapping(run=run, cfg=cfg, assumptions=assumptions, unsupported=unsupported_features(run))
