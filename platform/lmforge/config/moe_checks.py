"""``model.moe.*`` checks (called by ``config.validate.validate``): each failure names the key, the reason and
the fix."""

from __future__ import annotations

from lmforge.config.errors import ConfigError
from lmforge.config.schema import RootConfig


def check_expert_parallel(cfg: RootConfig) -> None:
    """``parallelism.ep`` (parallel/expert_parallel.py): ep ranks are borrowed from dp_shard and split the experts."""
    m, p = cfg.model.moe, cfg.parallelism
    if p.ep == 1:
        return
    if m.experts == 0:
        raise ConfigError(
            "parallelism.ep",
            f"ep={p.ep} needs a Mixture-of-Experts model (model.moe.experts=0)",
            "set parallelism.ep=1 for the dense model, or model.moe.experts to a multiple of ep",
        )
    if p.engine == "deepspeed":
        raise ConfigError(
            "parallelism.ep",
            "expert parallelism is a native-engine layout",
            "set parallelism.engine=native or parallelism.ep=1",
        )
    if p.dp_shard % p.ep:
        raise ConfigError(
            "parallelism.ep",
            f"ep ({p.ep}) must divide parallelism.dp_shard ({p.dp_shard}): ep ranks are borrowed from the FSDP ranks",
            f"set parallelism.dp_shard to a multiple of {p.ep} "
            "(the dense part is sharded over all of them) or lower parallelism.ep",
        )
    if m.experts % p.ep:
        raise ConfigError(
            "parallelism.ep",
            f"model.moe.experts ({m.experts}) is not divisible by ep ({p.ep}): each ep rank holds experts/ep experts",
            "choose ep dividing model.moe.experts",
        )
    if p.tp > 1 and p.pp > 1:
        raise ConfigError(
            "parallelism.ep",
            f"ep={p.ep} with both tp ({p.tp}) and pp ({p.pp}) is not verified (ep x tp "
            "and ep x pp are, each on 4 ranks)",
            "set parallelism.tp=1 or parallelism.pp=1 with ep > 1",
        )
    # Not verified with expert parallelism: cp (ep x tp and ep x pp compose: parallel/expert_parallel.py; compile
    # composes: the dispatch runs eagerly (model/moe.py Experts.forward), ep2 compiled parity in
    # tests/distributed/test_compile_layouts.py). ep with cp stays refused until its parity is shown.
    if p.cp > 1:
        raise ConfigError(
            "parallelism.cp",
            f"not supported with parallelism.ep > 1 (ep={p.ep}): not verified",
            "set parallelism.cp=1, or parallelism.ep=1",
        )


def check_moe(cfg: RootConfig) -> None:
    check_expert_parallel(cfg)
    m, p = cfg.model.moe, cfg.parallelism
    if m.experts < 0 or m.experts == 1:
        raise ConfigError(
            "model.moe.experts",
            f"must be 0 (dense) or >= 2, got {m.experts}",
            "set model.moe.experts=0 for the dense model, or the number of experts (e.g. 8)",
        )
    if m.experts == 0:
        return
    if not 1 <= m.top_k <= m.experts:
        raise ConfigError("model.moe.top_k", f"must be in [1, experts={m.experts}], got {m.top_k}", "e.g. top_k=2")
    if m.every_n_layers < 1:
        raise ConfigError(
            "model.moe.every_n_layers",
            f"must be >= 1, got {m.every_n_layers}",
            "1 = every layer, 2 = every other layer",
        )
    if m.layers is not None:
        bad = [i for i in m.layers if not 0 <= i < cfg.model.n_layers]
        if bad or not m.layers:
            raise ConfigError(
                "model.moe.layers",
                f"layer indices must be in [0, n_layers={cfg.model.n_layers}), got {list(m.layers)}",
                "list global layer indices, or null to use every_n_layers",
            )
    elif m.every_n_layers > cfg.model.n_layers:
        raise ConfigError(
            "model.moe.every_n_layers",
            f"{m.every_n_layers} > n_layers ({cfg.model.n_layers}): no layer would be MoE",
            "choose every_n_layers <= n_layers",
        )
    if m.shared_experts < 0:
        raise ConfigError("model.moe.shared_experts", f"must be >= 0, got {m.shared_experts}", "0 = none")
    if m.d_ff is not None and m.d_ff < 1:
        raise ConfigError("model.moe.d_ff", f"must be >= 1 or null, got {m.d_ff}", "null = the dense FFN width")
    for key in ("aux_loss_coef", "z_loss_coef", "bias_update_rate"):
        if getattr(m, key) < 0:
            raise ConfigError(f"model.moe.{key}", f"must be >= 0, got {getattr(m, key)}", "0 turns it off")
    if m.capacity_factor is not None and m.capacity_factor <= 0:
        raise ConfigError(
            "model.moe.capacity_factor",
            f"must be > 0 or null, got {m.capacity_factor}",
            "null = dropless, or e.g. 1.25",
        )
    # Not wired (yet): refused rather than run with the router losses or the expert weights handled wrongly.
    # pp (router losses through each stage's backward) and tp (experts replicated over tp) compose: model/moe.py,
    # parallel/tensor_parallel.py.
    refused = [
        (
            "parallelism.cp",
            p.cp > 1,
            "context-parallel ranks route different tokens and the expert loads "
            "(and the bias update) are summed over data-parallel ranks only",
            "set parallelism.cp=1",
        ),
        (
            "parallelism.engine",
            p.engine == "deepspeed",
            "the DeepSpeed engine does not add the router losses",
            "set parallelism.engine=native",
        ),
    ]
    for key, hit, why, fix in refused:
        if hit:
            raise ConfigError(key, f"not supported with model.moe.experts > 0: {why}", fix)
