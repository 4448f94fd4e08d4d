"""``lmforge plan --search``: the feasible layouts of a model on a cluster, ranked by predicted throughput.

``search_layouts`` enumerates, for the config's model, global batch and cluster (world size
``cluster.nodes * cluster.gpus_per_node``):

- tp (powers of two up to a node, dividing the head counts; sequence parallelism on with tp > 1),
- pp (powers of two up to the layers, an uneven split by ``suggested_pp_layers`` where they do not divide; only
  for an untied model, as lmforge's pipeline requires) with the schedules 1F1B, Interleaved1F1B (2 virtual
  stages) and ZBVZeroBubble,
- cp (1, and from 8k-token sequences the powers of two up to a node),
- the data-parallel rest as FSDP (``dp_shard``), HSDP (FSDP within a node, replicas across) or DDP replicas,
- activation checkpointing none / selective / full,
- micro batch sizes (powers of two dividing the per-replica batch).

A candidate is feasible when ``validate()``'s layout and batch checks accept it (``validate_layout``: the
trainer's own checks; the rest of the config passed ``validate()`` once) and the memory estimate
(``memory_estimate.estimate_memory``, through ``planner.make_plan``) fits the usable device memory. Feasible
candidates are ranked by the step model's tokens/s. Candidates are pruned cheaply first: for one structural
layout (tp, pp, cp, sharding, schedule) the four largest micro batches are tried from the largest down under
each checkpointing mode, and without a pipeline only the largest that fits is kept (a smaller one only adds
kernel launches; with a pipeline it shrinks the bubble, so each is kept).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Iterator, List, Optional, Tuple

from lmforge.config.context_parallel import check_context_parallel
from lmforge.config.deepspeed import check as check_deepspeed
from lmforge.config.deepspeed import check_native
from lmforge.config.document_masking import check_document_masking
from lmforge.config.errors import ConfigError
from lmforge.config.moe_checks import check_moe
from lmforge.config.parallelism import pp_layers_override, suggested_pp_layers
from lmforge.config.schema import RootConfig
from lmforge.config.validate import check_batch, check_parallel_layout
from lmforge.config.validated import Validated
from lmforge.model.gpt import kv_heads
from lmforge.parallel.memory_estimate import estimate_memory, resolve_precision
from lmforge.parallel.planner import Plan, device_kind, device_memory_bytes, make_plan, usable_bytes

AC_ORDER = ("none", "selective", "full")


@dataclass
class Candidate:
    overrides: str  # the layout as `lmforge plan` / `lmforge train` overrides
    plan: Plan


def _powers(limit: int) -> List[int]:
    out, x = [], 1
    while x <= limit:
        out.append(x)
        x *= 2
    return out


def tp_choices(cfg: RootConfig, world: int) -> List[int]:
    """Powers of two up to a node that divide the query and key/value heads."""
    m, kv = cfg.model, kv_heads(cfg.model)
    return [tp for tp in _powers(min(cfg.cluster.gpus_per_node, world)) if not (m.n_heads % tp or kv % tp)]


def cp_choices(cfg: RootConfig) -> List[int]:
    """1, and from 8k-token sequences the powers of two up to a node that split the sequence into 2 x cp equal
    chunks (the load-balanced causal split)."""
    seq = cfg.model.seq_len
    if seq < 8192:
        return [1]
    return [cp for cp in _powers(cfg.cluster.gpus_per_node) if seq % (2 * cp) == 0]


def pp_choices(cfg: RootConfig, world: int) -> List[int]:
    """Powers of two with at least one block per stage (an uneven split gets ``suggested_pp_layers``); only for an
    untied model, as lmforge's pipeline requires."""
    m = cfg.model
    return [pp for pp in _powers(world) if pp <= m.n_layers and (pp == 1 or not m.tie_embeddings)]


def schedule_choices(cfg: RootConfig, pp: int) -> List[tuple]:
    """(schedule, virtual stages, reshard after forward): 1F1B; with pp > 1 also Interleaved1F1B and ZBVZeroBubble
    at 2 chunks per rank when every chunk keeps a block."""
    out = [("1F1B", 1, True)]
    if pp > 1 and cfg.model.n_layers >= 2 * pp:
        out += [("Interleaved1F1B", 2, True), ("ZBVZeroBubble", 2, False)]
    return out


def _structures(cfg: RootConfig, world: int) -> Iterator[dict]:
    """Layout fields without micro batch or checkpointing."""
    per_node = cfg.cluster.gpus_per_node
    for tp in tp_choices(cfg, world):
        for cp in cp_choices(cfg):
            for pp in pp_choices(cfg, world // (tp * cp)):
                dp = world // (tp * cp * pp)
                if dp * tp * cp * pp != world:
                    continue
                inner = max(1, per_node // (tp * cp))
                shardings = [("fsdp", 1, dp)]
                if 1 < inner < dp and dp % inner == 0:
                    shardings.append(("hsdp", dp // inner, inner))
                if dp > 1 and cp == 1:
                    shardings.append(("ddp", dp, 1))
                for sched, v, reshard in schedule_choices(cfg, pp):
                    chunks = pp * v
                    uneven = cfg.model.n_layers % chunks != 0
                    for _, rep, shard in shardings:
                        yield dict(
                            tp=tp,
                            cp=cp,
                            pp=pp,
                            dp_replicate=rep,
                            dp_shard=shard,
                            pp_schedule=sched,
                            pp_virtual_stages=v,
                            pp_layers=suggested_pp_layers(cfg.model.n_layers, chunks) if uneven else None,
                            reshard_after_forward=reshard or shard * cp == 1,
                            sequence_parallel=tp > 1,
                        )


def micro_choices(batch: int, dp: int) -> List[int]:
    """The four largest powers of two that divide the per-replica batch."""
    return [mb for mb in _powers(batch // dp) if (batch // dp) % mb == 0][::-1][:4]


LAYOUT_KEYS = ("tp", "cp", "pp", "dp_replicate", "dp_shard", "pp_schedule", "pp_virtual_stages")


def in_search_space(cfg: RootConfig, world: int) -> bool:
    """Whether ``search_layouts`` enumerates ``cfg``'s layout (its degrees, schedule and virtual stages, its
    checkpointing mode and micro batch) for its model, global batch and cluster."""
    p = cfg.parallelism
    own = {k: getattr(p, k) for k in LAYOUT_KEYS}
    for par in _structures(cfg, world):
        if {k: par[k] for k in LAYOUT_KEYS} != own:
            continue
        dp = par["dp_replicate"] * par["dp_shard"]
        micros = micro_choices(cfg.train.global_batch_size, dp)
        return p.activation_checkpointing in AC_ORDER and cfg.train.micro_batch_size in micros
    return False


def overrides_text(par: dict, micro: int, ac: str) -> str:
    keys = ("tp", "pp", "cp", "dp_replicate", "dp_shard")
    text = [f"parallelism.{k}={par[k]}" for k in keys]
    if par["pp"] > 1:
        text += [
            f"parallelism.pp_schedule={par['pp_schedule']}",
            f"parallelism.pp_virtual_stages={par['pp_virtual_stages']}",
        ]
    if par.get("pp_layers"):
        text.append(pp_layers_override(par["pp_layers"]))
    if par["tp"] > 1:
        text.append("parallelism.sequence_parallel=true")
    if not par["reshard_after_forward"]:
        text.append("parallelism.reshard_after_forward=false")
    text += [f"parallelism.activation_checkpointing={ac}", f"train.micro_batch_size={micro}"]
    return " ".join(text)


def validate_layout(cfg: RootConfig, world: int) -> Validated:
    """The checks of ``validate()`` that read the layout and the batch, in its order (the config they vary from
    already passed ``validate()`` whole: its other sections, and the choices and ranges of the fields set here,
    which the enumeration keeps to valid values)."""
    check_moe(cfg)
    check_parallel_layout(cfg, world)
    check_document_masking(cfg)
    check_context_parallel(cfg)
    plan = check_batch(cfg)
    if cfg.parallelism.engine == "deepspeed":
        check_deepspeed(cfg, plan)
    else:
        check_native(cfg)
    return Validated(cfg, plan)


def _try(cfg: RootConfig, world: int, par: dict, micro: int, ac: str, usable: int) -> Optional[Plan]:
    """The plan of one candidate, or None when ``validate()`` refuses it or its memory estimate exceeds ``usable``
    (checked before the step is predicted)."""
    p = replace(cfg.parallelism, activation_checkpointing=ac, fsdp_grad_sync="auto", pp_microbatches=0, **par)
    t = replace(cfg.train, micro_batch_size=micro, grad_accum=None)
    try:
        validated = validate_layout(replace(cfg, parallelism=p, train=t), world)
    except ConfigError:
        return None
    precision = resolve_precision(validated.cfg.train.precision, device_kind(validated.cfg))
    if estimate_memory(validated.cfg, validated.plan, precision).total > usable:
        return None
    return make_plan(validated, world)


def search_layouts(cfg: RootConfig, world: Optional[int] = None, top: int = 5) -> Tuple[List[Candidate], int]:
    """The ``top`` feasible layouts by predicted tokens/s, and how many feasible ones were found."""
    cfg = getattr(cfg, "cfg", cfg)  # a Validated config: its RootConfig
    world = world or cfg.cluster.nodes * cfg.cluster.gpus_per_node
    found: List[Candidate] = []
    kind = device_kind(cfg)
    usable = usable_bytes(device_memory_bytes(cfg, kind), kind)
    batch = cfg.train.global_batch_size
    for par in _structures(cfg, world):
        dp = par["dp_replicate"] * par["dp_shard"]
        if batch % dp:
            continue
        micros = micro_choices(batch, dp)
        for ac in AC_ORDER:
            for micro in micros:
                plan = _try(cfg, world, par, micro, ac, usable)
                if plan is None or not plan.fits:
                    continue
                found.append(Candidate(overrides_text(par, micro, ac), plan))
                if par["pp"] == 1:
                    break  # without a pipeline the largest micro batch that fits is the fastest of this mode
    found.sort(key=lambda c: -c.plan.tokens_per_s)
    return found[:top], len(found)


def format_search(cands: List[Candidate], feasible: int) -> str:
    if not cands:
        return "search     no feasible layout: add nodes (cluster.nodes) or use larger devices"
    lines = [f"search     {feasible} feasible layouts; the best {len(cands)} by predicted tokens/s:"]
    for i, c in enumerate(cands, 1):
        pl, st = c.plan, c.plan.step
        where = ", ".join(f"{name} {s / pl.step_time_s:.0%}" for name, s in st.rows() if s / pl.step_time_s >= 0.005)
        lines.append(
            f"{i:>2}. {pl.tokens_per_s:>12,.0f} tokens/s  step {pl.step_time_s:.3f} s  MFU {pl.expected_mfu:.1%}  "
            f"{pl.memory.total / 2**30:.1f} GiB/device"
        )
        lines.append(f"    {c.overrides}")
        lines.append(f"    {where}")
    return "\n".join(lines)
