"""``lmforge plan --search``: the feasible layouts of a model on a cluster, ranked by predicted throughput.

``search_layouts`` enumerates, for the config's model, global batch and cluster (world size
``cluster.nodes * cluster.gpus_per_node``):

- tp (divisors of the GPUs of a node dividing the head counts; sequence parallelism on with tp > 1: the same
  communication volume as without it, less activation memory),
- cp (1, and from 8k-token sequences the divisors of a node's GPUs that split the sequence evenly),
- pp (every divisor of the remaining ranks up to the layers, an uneven split by ``suggested_pp_layers`` where it
  does not divide them; only for an untied model, as lmforge's pipeline requires) with the schedules 1F1B,
  Interleaved1F1B (2 virtual stages, and 3 to 8 where they split the layers evenly) and ZBVZeroBubble,
- the data-parallel rest as FSDP (``dp_shard``), FSDP keeping the gathered parameters through the step with one
  gradient reduce-scatter per step (the distributed_optimizer preset), HSDP (FSDP within a node, replicas
  across) or DDP replicas,
- activation checkpointing none / selective / full,
- every micro batch size dividing the per-replica batch (with a pipeline, those leaving at least pp micro
  batches).

A candidate is feasible when ``validate()``'s layout and batch checks accept it (``validate_layout``: the
trainer's own checks; the rest of the config passed ``validate()`` once) and the memory estimate
(``memory_estimate.estimate_memory``, through ``planner.make_plan``) fits the usable device memory. Feasible
candidates are ranked by the step model's tokens/s. Pruning: a structural layout (tp, cp, pp, schedule,
sharding) whose least memory over its micro batches and checkpointing modes (``may_fit``, two estimates) is over
the device's is skipped whole; of the rest, without a pipeline each checkpointing mode's largest micro batch that
fits is kept (a smaller one only adds kernel launches), with one each micro batch under the lightest mode that
fits (a smaller micro batch shrinks the bubble; a heavier mode only adds recompute). ``prune=False`` ranks every
feasible layout; the best are the same (``tests/unit/test_layout_search_space.py``).

``search_space_miss`` names the field of a given layout (a published run's, ``published_runs.csv``) that the
search does not enumerate, or None when it does.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from types import SimpleNamespace
from typing import Iterator, List, Optional, Tuple

from lmforge.config.context_parallel import check_context_parallel
from lmforge.config.deepspeed import check as check_deepspeed
from lmforge.config.deepspeed import check_native
from lmforge.config.document_masking import check_document_masking
from lmforge.config.errors import ConfigError
from lmforge.config.moe_checks import check_moe
from lmforge.config.parallelism import fsdp_grad_sync_mode, pp_layers_override, suggested_pp_layers
from lmforge.config.schema import RootConfig
from lmforge.config.validate import check_batch, check_parallel_layout
from lmforge.config.validated import Validated
from lmforge.model.gpt import kv_heads
from lmforge.parallel.memory_estimate import MemoryEstimate, estimate_memory, resolve_precision
from lmforge.parallel.planner import Plan, device_kind, device_memory_bytes, make_plan, usable_bytes

AC_ORDER = ("none", "selective", "full")
MAX_VIRTUAL_STAGES = 8  # Interleaved1F1B chunks per pipeline rank the search tries beyond 2 (even splits only)


@dataclass
class Candidate:
    overrides: str  # the layout as `lmforge plan` / `lmforge train` overrides
    plan: Plan


def divisors(n: int) -> List[int]:
    """The divisors of ``n``, ascending."""
    small = [d for d in range(1, int(n**0.5) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def tp_choices(cfg: RootConfig, world: int) -> List[int]:
    """Divisors of the GPUs of a node (tensor parallelism within a node) that divide the world size and the query
    and key/value heads."""
    m, kv = cfg.model, kv_heads(cfg.model)
    limit = min(cfg.cluster.gpus_per_node, world)
    return [tp for tp in divisors(limit) if not (world % tp or m.n_heads % tp or kv % tp)]


def cp_choices(cfg: RootConfig) -> List[int]:
    """1, and from 8k-token sequences the divisors of the GPUs of a node that split the sequence into 2 x cp equal
    chunks (the load-balanced causal split)."""
    seq = cfg.model.seq_len
    if seq < 8192:
        return [1]
    return [cp for cp in divisors(cfg.cluster.gpus_per_node) if seq % (2 * cp) == 0]


def pp_choices(cfg: RootConfig, world: int) -> List[int]:
    """Divisors of ``world`` (the ranks left by tp x cp) with at least one block per stage; where they do not divide
    the layers the split is uneven (``suggested_pp_layers``). Only for an untied model, as lmforge's pipeline
    requires."""
    m = cfg.model
    return [pp for pp in divisors(world) if pp <= m.n_layers and (pp == 1 or not m.tie_embeddings)]


def virtual_choices(n_layers: int, pp: int) -> List[int]:
    """Interleaved1F1B chunks per rank: 2 when every chunk keeps a block (uneven where needed), and 3 to
    ``MAX_VIRTUAL_STAGES`` where pp x v chunks split the layers evenly."""
    out = [2] if n_layers >= 2 * pp else []
    return out + [v for v in range(3, MAX_VIRTUAL_STAGES + 1) if n_layers % (pp * v) == 0]


def schedule_choices(cfg: RootConfig, pp: int) -> List[tuple]:
    """(schedule, virtual stages, reshard after forward): 1F1B; with pp > 1 also Interleaved1F1B at each of
    ``virtual_choices`` and ZBVZeroBubble at 2 chunks per rank when every chunk keeps a block."""
    out = [("1F1B", 1, True)]
    if pp > 1:
        out += [("Interleaved1F1B", v, True) for v in virtual_choices(cfg.model.n_layers, pp)]
        if cfg.model.n_layers >= 2 * pp:
            out.append(("ZBVZeroBubble", 2, False))
    return out


def sharding_choices(dp: int, cp: int, per_node: int, tp: int) -> List[tuple]:
    """(dp_replicate, dp_shard, reshard_after_forward, fsdp_grad_sync) for ``dp`` data-parallel ranks: FSDP;
    FSDP keeping the gathered parameters from the first forward to the last backward with one gradient
    reduce-scatter per step (the distributed_optimizer preset, Megatron's distributed optimizer); HSDP (FSDP within
    a node, replicas across); DDP replicas (without cp)."""
    out = [(1, dp, True, "auto")]
    if dp * cp > 1:
        out.append((1, dp, False, "last_microbatch"))
    inner = max(1, per_node // (tp * cp))
    if 1 < inner < dp and dp % inner == 0:
        out.append((dp // inner, inner, True, "auto"))
    if dp > 1 and cp == 1:
        out.append((dp, 1, True, "auto"))
    return out


def _structures(cfg: RootConfig, world: int) -> Iterator[dict]:
    """Layout fields without micro batch or checkpointing (each distinct layout once)."""
    per_node, n_layers = cfg.cluster.gpus_per_node, cfg.model.n_layers
    seen = set()
    for tp in tp_choices(cfg, world):
        for cp in cp_choices(cfg):
            if world % (tp * cp):
                continue
            for pp in pp_choices(cfg, world // (tp * cp)):
                dp = world // (tp * cp * pp)
                for sched, v, sched_reshard in schedule_choices(cfg, pp):
                    chunks = pp * v
                    for rep, shard, reshard, sync in sharding_choices(dp, cp, per_node, tp):
                        par = dict(
                            tp=tp,
                            cp=cp,
                            pp=pp,
                            dp_replicate=rep,
                            dp_shard=shard,
                            pp_schedule=sched,
                            pp_virtual_stages=v,
                            pp_layers=suggested_pp_layers(n_layers, chunks) if n_layers % chunks else None,
                            reshard_after_forward=(reshard and sched_reshard) or shard * cp == 1,
                            fsdp_grad_sync=sync,
                            sequence_parallel=tp > 1,
                        )
                        key = tuple(par[k] for k in LAYOUT_KEYS) + (par["reshard_after_forward"], _sync_of(par))
                        if key not in seen:
                            seen.add(key)
                            yield par


def micro_choices(batch: int, dp: int, pp: int = 1) -> List[int]:
    """Every micro batch size dividing the per-replica batch, largest first; with a pipeline only those leaving at
    least ``pp`` micro batches to fill it."""
    per = batch // dp
    return [mb for mb in divisors(per)[::-1] if pp == 1 or per // mb >= pp]


LAYOUT_KEYS = ("tp", "cp", "pp", "dp_replicate", "dp_shard", "pp_schedule", "pp_virtual_stages")
STRUCTURE_KEYS = LAYOUT_KEYS + ("reshard_after_forward", "fsdp_grad_sync")


def _layout_of(cfg: RootConfig) -> dict:
    """``cfg``'s layout in the search's terms: reshard_after_forward and the resolved gradient sync only where
    parameters are sharded (fsdp_degree > 1), as the search sets them."""
    p = cfg.parallelism
    own = {k: getattr(p, k) for k in LAYOUT_KEYS}
    sharded = p.dp_shard * p.cp > 1
    own["reshard_after_forward"] = p.reshard_after_forward or not sharded
    own["fsdp_grad_sync"] = fsdp_grad_sync_mode(p) if sharded else "last_microbatch"
    return own


def _sync_of(par: dict) -> str:
    p = SimpleNamespace(**par)
    return fsdp_grad_sync_mode(p) if p.dp_shard * p.cp > 1 else "last_microbatch"


def search_space_miss(cfg: RootConfig, world: int) -> Optional[str]:
    """None when ``search_layouts`` enumerates ``cfg``'s layout (degrees, schedule and virtual stages, sharding,
    checkpointing mode and micro batch) for its model, global batch and cluster; else the first field, in the
    order of ``STRUCTURE_KEYS``, whose value the search does not try with the fields before it, and what it tries."""
    own = _layout_of(cfg)
    own_ac, own_micro = cfg.parallelism.activation_checkpointing, cfg.train.micro_batch_size
    structures = [dict(par, fsdp_grad_sync=_sync_of(par)) for par in _structures(cfg, world)]
    for key in STRUCTURE_KEYS:
        offered = sorted({par[key] for par in structures}, key=lambda v: (str(type(v)), v))
        structures = [par for par in structures if par[key] == own[key]]
        if not structures:
            return f"{key}={own[key]} (the search tries {', '.join(str(v) for v in offered)})"
    if own_ac not in AC_ORDER:
        return f"activation_checkpointing={own_ac} (the search tries {', '.join(AC_ORDER)})"
    micros = micro_choices(cfg.train.global_batch_size, own["dp_replicate"] * own["dp_shard"], own["pp"])
    if own_micro not in micros:
        return f"micro_batch_size={own_micro} (the search tries {', '.join(str(m) for m in micros) or 'none'})"
    return None


def in_search_space(cfg: RootConfig, world: int) -> bool:
    """Whether ``search_layouts`` enumerates ``cfg``'s layout (``search_space_miss`` is None)."""
    return search_space_miss(cfg, world) is None


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
    if par["fsdp_grad_sync"] != "auto":
        text.append(f"parallelism.fsdp_grad_sync={par['fsdp_grad_sync']}")
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


def _validated(cfg: RootConfig, world: int, par: dict, micro: int, ac: str) -> Optional[Validated]:
    """One candidate as a validated config, or None when ``validate()`` refuses it."""
    p = replace(cfg.parallelism, activation_checkpointing=ac, pp_microbatches=0, **par)
    t = replace(cfg.train, micro_batch_size=micro, grad_accum=None)
    try:
        return validate_layout(replace(cfg, parallelism=p, train=t), world)
    except ConfigError:
        return None


def _memory(validated: Validated) -> MemoryEstimate:
    precision = resolve_precision(validated.cfg.train.precision, device_kind(validated.cfg))
    return estimate_memory(validated.cfg, validated.plan, precision)


def _try(cfg: RootConfig, world: int, par: dict, micro: int, ac: str, usable: int) -> Optional[Plan]:
    """The plan of one candidate, or None when ``validate()`` refuses it or its memory estimate exceeds ``usable``
    (checked before the step is predicted)."""
    validated = _validated(cfg, world, par, micro, ac)
    if validated is None or _memory(validated).total > usable:
        return None
    return make_plan(validated, world)


def may_fit(cfg: RootConfig, world: int, par: dict, micros: List[int], usable: int) -> bool:
    """False when no micro batch and checkpointing mode of the structure ``par`` can fit: its least memory is
    over ``usable``. The memory of a layout grows with the micro batch (the activations, the logits, the cp
    buffers), except that a single micro batch per step keeps no gradient waiting for a later one, so the least is
    at the smallest or the largest micro batch, under the mode that keeps the fewest bytes (one estimate gives
    every mode). A structure ``validate()`` refuses at either end is kept for the full walk to judge."""
    for micro in {micros[0], micros[-1]}:
        validated = _validated(cfg, world, par, micro, "full")
        if validated is None:
            return True
        est = _memory(validated)
        if min(est.total_with(mode) for mode in AC_ORDER) <= usable:
            return True
    return False


def _candidates(cfg: RootConfig, world: int, par: dict, micros: List[int], usable: int, prune: bool) -> List[Candidate]:
    """The feasible (micro batch, checkpointing) choices of one structure, less those ``prune`` drops as dominated:
    without a pipeline, each mode's largest micro batch that fits (a smaller one only adds kernel launches); with
    one, each micro batch under the lightest mode that fits (a heavier one only adds recompute)."""
    out: List[Candidate] = []
    pipelined = par["pp"] > 1
    pairs = [(m, ac) for m in micros for ac in AC_ORDER] if pipelined else [(m, ac) for ac in AC_ORDER for m in micros]
    done = set()  # pipelined: micro batches already taken; else modes already taken
    for micro, ac in pairs:
        if prune and (micro if pipelined else ac) in done:
            continue
        plan = _try(cfg, world, par, micro, ac, usable)
        if plan is None or not plan.fits:
            continue
        out.append(Candidate(overrides_text(par, micro, ac), plan))
        done.add(micro if pipelined else ac)
    return out


def search_layouts(
    cfg: RootConfig, world: Optional[int] = None, top: int = 5, prune: bool = True
) -> Tuple[List[Candidate], int]:
    """The ``top`` feasible layouts by predicted tokens/s, and how many feasible ones were found. ``prune``
    skips a structure whose least memory (``may_fit``) is over the device's before trying its micro batches and
    checkpointing modes one by one; the feasible layouts are the same without it."""
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
        micros = micro_choices(batch, dp, par["pp"])
        if not micros or (prune and not may_fit(cfg, world, par, micros, usable)):
            continue
        found += _candidates(cfg, world, par, micros, usable, prune)
    found.sort(key=lambda c: (-c.plan.tokens_per_s, c.plan.memory.total))  # a tie: the one needing less memory
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
