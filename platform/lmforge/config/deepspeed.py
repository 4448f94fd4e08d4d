"""The DeepSpeed JSON config, generated from the Hydra config, with an optional user JSON merged over it, and
the checks of a DeepSpeed run (``check``, run by ``validate()`` before any process group exists).

Pure functions of the config (no torch, no DeepSpeed import); ``lmforge.parallel.deepspeed_config.build_config``
gives the engine the final dict once the device (precision ``auto``, memory pinning) is known.

Every value lmforge already knows comes from its own config (one batch arithmetic, one precision, one
optimizer, one LR schedule); the generated dict maps them onto DeepSpeed's keys (see docs/deepspeed.md):

    train.micro_batch_size           -> train_micro_batch_size_per_gpu
    train.global_batch_size          -> train_batch_size
    (derived) grad_accum             -> gradient_accumulation_steps
    train.precision (bf16*)          -> bf16.enabled
    optim.grad_clip                  -> gradient_clipping
    parallelism.zero_stage           -> zero_optimization.stage
    parallelism.offload_optimizer    -> zero_optimization.offload_optimizer.device
    parallelism.offload_params       -> zero_optimization.offload_param.device
    parallelism.overlap_grad_reduce  -> zero_optimization.overlap_comm
    parallelism.ddp_bucket_cap_mb    -> zero_optimization.reduce_bucket_size / allgather_bucket_size (elements)

``parallelism.deepspeed_config`` names a user JSON merged over this dict. It may add keys lmforge does not
derive (e.g. ``zero_optimization.stage3_prefetch_bucket_size``); a key lmforge derives must either be absent,
``"auto"`` or equal to the derived value, otherwise a ConfigError names both values. ``optimizer`` and
``scheduler`` sections are refused: the optimizer is lmforge's AdamW and the LR is set by lmforge every step.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from lmforge.config.batch import BatchPlan
from lmforge.config.errors import ConfigError
from lmforge.config.schema import RootConfig

# Which lmforge key each derived DeepSpeed key comes from (for error messages and docs).
SOURCE_KEYS = {
    "train_batch_size": "train.global_batch_size",
    "train_micro_batch_size_per_gpu": "train.micro_batch_size",
    "gradient_accumulation_steps": "train.grad_accum (derived: global / (micro x dp))",
    "gradient_clipping": "optim.grad_clip",
    "bf16.enabled": "train.precision",
    "fp16.enabled": "train.precision",
    "zero_optimization.stage": "parallelism.zero_stage",
    "zero_optimization.overlap_comm": "parallelism.overlap_grad_reduce",
    "zero_optimization.contiguous_gradients": "(lmforge default: true)",
    "zero_optimization.reduce_bucket_size": "parallelism.ddp_bucket_cap_mb",
    "zero_optimization.allgather_bucket_size": "parallelism.ddp_bucket_cap_mb",
    "zero_optimization.offload_optimizer.device": "parallelism.offload_optimizer",
    "zero_optimization.offload_param.device": "parallelism.offload_params",
}
REFUSED_SECTIONS = {
    "optimizer": "optim.* (lmforge builds torch AdamW and passes it to DeepSpeed)",
    "scheduler": "optim.schedule (lmforge sets the learning rate before every step)",
}


def uses_bf16(precision: str) -> bool:
    return precision in ("bf16-mixed", "bf16")


def generate(
    cfg: RootConfig, plan: BatchPlan, precision: Optional[str], pin_memory: Optional[bool] = False
) -> Dict[str, Any]:
    """The DeepSpeed config derived from the lmforge config alone (``precision`` already resolved).

    ``validate()`` runs before the device is chosen: a ``None`` precision or pin_memory leaves out the keys
    derived from it (``bf16``/``fp16``, the offload ``pin_memory``), which ``build_config`` then checks."""
    p = cfg.parallelism
    bucket = int(p.ddp_bucket_cap_mb * 2**20 // 4)  # MB of fp32 -> elements
    zero: Dict[str, Any] = {
        "stage": p.zero_stage,
        "overlap_comm": bool(p.overlap_grad_reduce),
        "contiguous_gradients": True,
        "reduce_bucket_size": bucket,
        "allgather_bucket_size": bucket,
    }
    pinned = {} if pin_memory is None else {"pin_memory": pin_memory}
    if p.offload_optimizer != "none":
        zero["offload_optimizer"] = {"device": p.offload_optimizer, **pinned}
    if p.offload_params != "none":
        zero["offload_param"] = {"device": p.offload_params, **pinned}
    precision_keys = (
        {} if precision is None else {"bf16": {"enabled": uses_bf16(precision)}, "fp16": {"enabled": False}}
    )
    return {
        "train_batch_size": plan.global_batch_size,
        "train_micro_batch_size_per_gpu": plan.micro_batch_size,
        "gradient_accumulation_steps": plan.grad_accum,
        "gradient_clipping": float(cfg.optim.grad_clip),
        **precision_keys,
        "zero_optimization": zero,
        # lmforge's own AdamW (torch) is passed in: allow it with ZeRO and with ZeRO-Offload.
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }


def _flatten(d: Dict[str, Any], prefix: str = "") -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b or (isinstance(a, bool) and isinstance(b, bool) and a == b)
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return float(a) == float(b)
    return a == b


def merge_user(generated: Dict[str, Any], user: Dict[str, Any], source: str) -> Dict[str, Any]:
    """Merge ``user`` over ``generated``; a derived key with a different value is a ConfigError."""
    for section, owner in REFUSED_SECTIONS.items():
        if section in user:
            raise ConfigError(
                "parallelism.deepspeed_config",
                f"{source} sets '{section}', which lmforge owns through {owner}",
                f"remove the '{section}' section from {source} and set {owner.split(' ')[0]} instead",
            )
    derived = _flatten(generated)
    conflicts: List[Tuple[str, Any, Any]] = []
    for key, value in _flatten(user).items():
        if key in derived and value != "auto" and not _same(value, derived[key]):
            conflicts.append((key, value, derived[key]))
    if conflicts:
        lines = "; ".join(
            f"{k} = {json.dumps(v)} in {source} but {SOURCE_KEYS.get(k, 'the lmforge config')} gives {json.dumps(d)}"
            for k, v, d in conflicts
        )
        first = conflicts[0][0]
        raise ConfigError(
            "parallelism.deepspeed_config",
            f"conflicts with the Hydra config: {lines}",
            f"drop '{first}' from {source} (or set it to \"auto\"), or change "
            f"{SOURCE_KEYS.get(first, 'the lmforge key')} instead",
        )

    def merge(base: Dict[str, Any], over: Dict[str, Any]) -> Dict[str, Any]:
        out = dict(base)
        for k, v in over.items():
            if v == "auto" and k in out:
                continue
            out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
        return out

    return merge(generated, user)


def load_user_json(path: str) -> Dict[str, Any]:
    file = Path(path).expanduser()
    if not file.is_file():
        raise ConfigError(
            "parallelism.deepspeed_config",
            f"file {file} does not exist",
            "give the path of a DeepSpeed JSON config, or leave it empty",
        )
    try:
        data = json.loads(file.read_text())
    except ValueError as e:
        raise ConfigError(
            "parallelism.deepspeed_config", f"{file} is not valid JSON: {e}", "fix the JSON syntax"
        ) from None
    if not isinstance(data, dict):
        raise ConfigError(
            "parallelism.deepspeed_config",
            f"{file} holds a {type(data).__name__}, not an object",
            "the file must hold one JSON object",
        )
    return data


DEEPSPEED_ONLY = {"zero_stage": 0, "offload_optimizer": "none", "offload_params": "none", "deepspeed_config": ""}


def check_native(cfg: RootConfig) -> None:
    """The native engine would silently ignore DeepSpeed's own keys: a value other than its default is refused."""
    p = cfg.parallelism
    for key, default in DEEPSPEED_ONLY.items():
        if getattr(p, key) != default:
            raise ConfigError(
                f"parallelism.{key}",
                f"{getattr(p, key)!r} is a DeepSpeed setting, and parallelism.engine=native would ignore it",
                "set parallelism.engine=deepspeed (e.g. parallelism=zero3), or drop the key "
                "(native sharding: parallelism.dp_shard)",
            )


def check(cfg: RootConfig, plan: BatchPlan) -> None:
    """The checks of a DeepSpeed run (``validate()`` runs them when ``parallelism.engine=deepspeed``, after the
    layout, which ``check_parallel_layout`` restricts to dp_replicate): ZeRO stage, offload, compile, user JSON."""
    p = cfg.parallelism
    if p.zero_stage not in (0, 1, 2, 3):
        raise ConfigError(
            "parallelism.zero_stage", f"must be 0, 1, 2 or 3, got {p.zero_stage}", "e.g. parallelism=zero3"
        )
    if p.offload_optimizer != "none" and p.zero_stage == 0:
        raise ConfigError(
            "parallelism.offload_optimizer",
            "ZeRO-Offload of the optimizer needs zero_stage >= 1",
            "set parallelism.zero_stage to 1, 2 or 3, or offload_optimizer=none",
        )
    if p.offload_params != "none" and p.zero_stage != 3:
        raise ConfigError(
            "parallelism.offload_params",
            f"parameter offload needs zero_stage=3, got {p.zero_stage}",
            "use parallelism=zero3_offload or set offload_params=none",
        )
    if p.compile:
        raise ConfigError(
            "parallelism.compile",
            "the deepspeed engine runs the model eagerly (it never calls "
            "torch.compile), so compile=true would be silently ignored",
            "set parallelism.compile=false, or use parallelism.engine=native to compile",
        )
    if p.deepspeed_config:  # keys the device decides (precision auto, pinning on device auto): build_config checks
        precision = None if cfg.train.precision == "auto" else cfg.train.precision
        pin_memory = {"cuda": True, "cpu": False}.get(cfg.train.device)
        merge_user(generate(cfg, plan, precision, pin_memory), load_user_json(p.deepspeed_config), p.deepspeed_config)
