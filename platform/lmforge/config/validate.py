"""Turn a composed Hydra config into a checked ``RootConfig``, or fail naming key, reason and fix.

Hydra's structured configs already reject typos in YAML files and on the command line, but a key added
with ``+`` bypasses the schema. Re-merging the composed config *as a plain container* into the schema
catches it. Cross-field checks (batch arithmetic, head divisibility, ...)
live here too, so ``lmforge train``, ``lmforge plan`` and ``jobctl prepare`` run exactly the same checks:
``validate()`` runs every check that needs no process group, including DeepSpeed's (``config/deepspeed.py``)
and the tokenizer's vocabulary (``config/tokenizer_files.py``), and returns the batch plan with the config.
"""

from __future__ import annotations

from dataclasses import fields, is_dataclass
from typing import Any, List, Optional

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, ValidationError

from lmforge.config.batch import BatchPlan, batch_plan
from lmforge.config.batch_ramp import check_batch_ramp
from lmforge.config.choices import check_choices, closest
from lmforge.config.cluster import check_retired
from lmforge.config.combinations import check_combinations
from lmforge.config.comm_checks import check_comm
from lmforge.config.context_parallel import check_context_parallel
from lmforge.config.deepspeed import check as check_deepspeed
from lmforge.config.deepspeed import check_native
from lmforge.config.document_masking import check_document_masking
from lmforge.config.errors import ConfigError
from lmforge.config.logging import check_sink_packages
from lmforge.config.moe_checks import check_moe
from lmforge.config.parallelism import pipeline_chunks, pp_layers_override, suggested_pp_layers
from lmforge.config.paths import check_paths
from lmforge.config.ranges import check_ranges
from lmforge.config.schema import RootConfig
from lmforge.config.seq_len_warmup import check_seq_len_warmup
from lmforge.config.tokenizer_files import vocab_size_of
from lmforge.config.validated import Validated
from lmforge.runtime.env_vars import launch_world_size


def _valid_keys(schema_cls: Any) -> List[str]:
    return [f.name for f in fields(schema_cls)] if is_dataclass(schema_cls) else []


def _schema_at(path: List[str]) -> Any:
    node: Any = RootConfig
    for part in path:
        if not is_dataclass(node):
            return None
        hit = [f for f in fields(node) if f.name == part]
        if not hit:
            return None
        node = hit[0].type if not isinstance(hit[0].type, str) else _resolve_type(node, part)
    return node


def _resolve_type(owner: Any, name: str) -> Any:
    import typing

    hints = typing.get_type_hints(owner)
    return hints.get(name)


_closest = closest  # compose.py and the key checks below: the nearest valid name


def check_structure(cfg: DictConfig) -> None:
    """Raise ConfigError for unknown keys (also ``+``-added ones) and values of the wrong type."""
    container = OmegaConf.to_container(cfg, resolve=False)
    if isinstance(container, dict):
        container.pop("hydra", None)
    try:
        OmegaConf.merge(OmegaConf.structured(RootConfig), container)
    except (ConfigKeyError, ConfigAttributeError) as e:
        full_key = str(getattr(e, "full_key", "") or "")
        key = str(getattr(e, "key", "") or full_key.rsplit(".", 1)[-1])
        parent = full_key.rsplit(".", 1)[0].split(".") if "." in full_key else []
        owner = _schema_at(parent) if parent else RootConfig
        near = _closest(key, _valid_keys(owner))
        shown = full_key or key
        fix = (
            f"did you mean '{'.'.join(parent + [near])}'?"
            if near
            else f"valid keys here: {', '.join(_valid_keys(owner))}"
        )
        raise ConfigError(shown, "is not a known key", fix) from None
    except ValidationError as e:
        full_key = str(getattr(e, "full_key", "") or "?")
        raise ConfigError(full_key, str(e).splitlines()[0], "give a value of the schema's type") from None


def check_values(cfg: RootConfig) -> None:
    """Choices and ranges: each field's annotation states its own (``config/choices.py``, ``config/ranges.py``)."""
    check_choices(cfg)  # every Annotated[str, Literal[...]] field of the schema
    check_ranges(cfg)  # every Annotated[int | float, Range(...)] field of the schema
    check_retired(cfg.cluster)  # cluster.assumed_mfu: replaced by the step model
    check_sink_packages(cfg.logging)  # logging.tensorboard needs the tensorboard package


def check_model(cfg: RootConfig) -> None:
    m = cfg.model
    if m.d_model % m.n_heads:
        raise ConfigError(
            "model.n_heads",
            f"d_model ({m.d_model}) is not divisible by n_heads ({m.n_heads})",
            "choose n_heads dividing d_model",
        )
    if (m.d_model // m.n_heads) % 2:
        raise ConfigError(
            "model.n_heads",
            f"head dim d_model/n_heads = {m.d_model // m.n_heads} is odd; RoPE needs it even",
            "choose n_heads so the head dim is even",
        )
    kv = m.n_kv_heads if m.n_kv_heads is not None else m.n_heads
    if kv < 1 or m.n_heads % kv:
        raise ConfigError(
            "model.n_kv_heads",
            f"n_heads ({m.n_heads}) is not divisible by n_kv_heads ({kv})",
            "use a divisor of n_heads (1 = multi-query, n_heads = multi-head)",
        )
    if m.d_ff is not None and m.d_ff < 1:
        raise ConfigError("model.d_ff", f"must be >= 1 or null, got {m.d_ff}", "set null for the default width")


def check_parallel_layout(cfg: RootConfig, world_size: Optional[int] = None) -> None:
    p, m = cfg.parallelism, cfg.model
    kv = m.n_kv_heads if m.n_kv_heads is not None else m.n_heads
    layout = p.dp_replicate * p.dp_shard * p.cp * p.tp * p.pp
    # The cp term is named only when used, so the cp=1 message stays the one users and docs know.
    names, sizes = (
        (("dp_replicate", "dp_shard", "cp", "tp", "pp"), (p.dp_replicate, p.dp_shard, p.cp, p.tp, p.pp))
        if p.cp > 1
        else (("dp_replicate", "dp_shard", "tp", "pp"), (p.dp_replicate, p.dp_shard, p.tp, p.pp))
    )
    product = f"{'*'.join(names)} = {'*'.join(str(n) for n in sizes)} = {layout}"
    if world_size is not None and layout > world_size:
        raise ConfigError(
            "parallelism",
            f"{product} but the job has world size {world_size}",
            f"start {layout} processes: lmforge launch --nproc {layout} <same overrides> (torchrun --nproc_per_node={layout} -m "
            f"lmforge.train <same overrides>), or choose a layout of {world_size}"
            + (" (parallelism=single)" if world_size == 1 else ""),
        )
    if world_size is not None and layout != world_size:
        raise ConfigError(
            "parallelism",
            f"{product} but the job has world size {world_size}",
            f"make the product equal {world_size} (e.g. parallelism.dp_shard={max(1, world_size // (p.dp_replicate * p.cp * p.tp * p.pp))})",
        )
    if m.n_heads % p.tp or kv % p.tp:
        raise ConfigError(
            "parallelism.tp",
            f"n_heads ({m.n_heads}) and n_kv_heads ({kv}) must both be divisible by tp ({p.tp})",
            "choose tp dividing both head counts",
        )
    if p.sequence_parallel and m.seq_len % p.tp:
        raise ConfigError(
            "parallelism.sequence_parallel",
            f"seq_len ({m.seq_len}) is not divisible by tp ({p.tp})",
            "choose a seq_len divisible by tp",
        )
    check_stage_map(cfg)
    check_combinations(cfg)  # the refused feature combinations (config/combinations.py)


def check_stage_map(cfg: RootConfig) -> None:
    """The blocks per pipeline chunk: ``parallelism.pp_layers`` (one count >= 1 per chunk, summing to n_layers)
    or, unset, an even split. An uneven split is never picked silently: the refusal suggests a map."""
    p, n = cfg.parallelism, cfg.model.n_layers
    chunks = pipeline_chunks(p)
    if n < chunks:
        raise ConfigError(
            "parallelism.pp",
            f"n_layers ({n}) is fewer than pp*pp_virtual_stages ({chunks}) pipeline chunks",
            "choose pp and pp_virtual_stages with at most one chunk per layer",
        )
    suggestion = pp_layers_override(suggested_pp_layers(n, chunks))
    if p.pp_layers is None:
        if n % chunks:
            raise ConfigError(
                "parallelism.pp_layers",
                f"n_layers ({n}) is not divisible by pp*pp_virtual_stages ({chunks}) and no stage map is set",
                f"set {suggestion} (blocks per pipeline chunk, fewer on the chunks holding the embedding and the "
                "output head), or choose pp and pp_virtual_stages whose product divides n_layers",
            )
        return
    given = list(p.pp_layers)
    shown = f"[{', '.join(str(x) for x in given)}]"
    if len(given) != chunks:
        raise ConfigError(
            "parallelism.pp_layers",
            f"{shown} has {len(given)} entries but pp*pp_virtual_stages = {chunks} pipeline chunks",
            f"give one block count per chunk, in chunk order, e.g. {suggestion}",
        )
    if min(given) < 1:
        raise ConfigError(
            "parallelism.pp_layers",
            f"{shown} gives a pipeline chunk no block",
            f"give every chunk at least one block, e.g. {suggestion}",
        )
    if sum(given) != n:
        raise ConfigError(
            "parallelism.pp_layers",
            f"{shown} sums to {sum(given)} but model.n_layers is {n}",
            f"give block counts summing to {n}, e.g. {suggestion}",
        )


def dp_size(cfg: RootConfig) -> int:
    return cfg.parallelism.dp_replicate * cfg.parallelism.dp_shard


def check_batch(cfg: RootConfig) -> BatchPlan:
    t = cfg.train
    plan = batch_plan(t.micro_batch_size, t.global_batch_size, dp_size(cfg), cfg.model.seq_len, t.grad_accum)
    check_batch_ramp(t, dp_size(cfg))  # train.batch_size_schedule: every stage a multiple of micro x dp
    p = cfg.parallelism
    if p.pp > 1:
        n_micro = p.pp_microbatches or plan.grad_accum
        if n_micro < p.pp:
            raise ConfigError(
                "parallelism.pp_microbatches",
                f"{n_micro} microbatches cannot fill {p.pp} pipeline stages",
                f"use at least {p.pp} microbatches (raise train.global_batch_size or pp_microbatches)",
            )
        rows = plan.grad_accum * plan.micro_batch_size
        if rows % n_micro:
            raise ConfigError(
                "parallelism.pp_microbatches",
                f"{rows} sequences per data-parallel rank and step "
                f"(micro_batch_size x grad_accum) do not split into {n_micro} pipeline microbatches",
                f"choose pp_microbatches dividing {rows} (0 = grad_accum = {plan.grad_accum})",
            )
    return plan


def check_vocabulary(cfg: RootConfig) -> None:
    """``model.vocab_size`` holds every id of ``data.tokenizer`` (read from the tokenizer file, no data built)."""
    vocab = vocab_size_of(cfg.data.tokenizer)
    if vocab > cfg.model.vocab_size:
        raise ConfigError(
            "model.vocab_size",
            f"{cfg.model.vocab_size} is smaller than the tokenizer's vocabulary ({vocab}, {cfg.data.tokenizer})",
            f"set model.vocab_size >= {vocab}",
        )


def planned_world_size(cfg: DictConfig) -> Optional[int]:
    """``cluster.nodes * cluster.gpus_per_node`` of a composed config (``lmforge plan``, ``jobctl prepare``);
    None when either is not a number (``validate()`` then names the bad key)."""
    try:
        return int(OmegaConf.select(cfg, "cluster.nodes")) * int(OmegaConf.select(cfg, "cluster.gpus_per_node"))
    except (TypeError, ValueError):
        return None


def validate(cfg: DictConfig | RootConfig, world_size: Optional[int] = None) -> Validated:
    """Every check that needs no process group, in order; returns the typed config and its batch plan.

    ``world_size`` defaults to $WORLD_SIZE when set (the layout is checked against it when known). ``lmforge
    train`` (every rank), ``lmforge plan`` and ``jobctl prepare`` all run exactly this function."""
    if isinstance(cfg, Validated):
        cfg = cfg.cfg
    if isinstance(cfg, DictConfig):
        check_structure(cfg)
        container = OmegaConf.to_container(cfg, resolve=True)
        container.pop("hydra", None)
        typed: RootConfig = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(RootConfig), container))
    else:
        typed = cfg
    if world_size is None:
        world_size = launch_world_size()
    check_values(typed)
    check_paths(typed)
    check_model(typed)
    check_moe(typed)  # model.moe.* (config/moe_checks.py)
    check_comm(typed.comm, typed.train.device)
    check_parallel_layout(typed, world_size)
    check_document_masking(typed)  # data.document_masking with this layout and device
    check_context_parallel(typed)
    check_seq_len_warmup(typed)  # train.seq_len_schedule: pieces of seq_len / 2^k that context parallelism can cut
    plan = check_batch(typed)
    if typed.parallelism.engine == "deepspeed":
        check_deepspeed(typed, plan)
    else:
        check_native(typed)
    check_vocabulary(typed)
    return Validated(typed, plan)


def check_override_keys(overrides) -> None:
    """Catch typo'd keys in command-line overrides before Hydra composes (Hydra's own error for
    ``model.n_layr=3`` suggests adding the key with ``+``, which would silently be ignored)."""
    import typing

    for item in overrides:
        if "=" not in item or item.startswith(("+", "~", "hydra.", "hydra/")):
            continue
        key = item.split("=", 1)[0].strip()
        if "@" in key or "/" in key:
            continue
        parts = key.split(".")
        node: Any = RootConfig
        for i, part in enumerate(parts):
            if not is_dataclass(node):
                break  # a Dict/List field (data.sources.NAME, comm.env.VAR): free-form below here
            names = _valid_keys(node)
            if part not in names:
                if i == 0 and len(parts) == 1:
                    break  # a group selection such as model=tiny: Hydra checks the option name
                near = _closest(part, names)
                full = ".".join(parts[: i + 1])
                fix = (
                    f"did you mean '{'.'.join(parts[:i] + [near])}'?"
                    if near
                    else f"valid keys here: {', '.join(names)}"
                )
                raise ConfigError(full, "is not a known key", fix)
            node = typing.get_type_hints(node).get(part)
            origin = typing.get_origin(node)
            if origin is typing.Union:
                args = [a for a in typing.get_args(node) if a is not type(None)]
                node = args[0] if args else None
