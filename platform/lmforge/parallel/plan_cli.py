"""``lmforge plan [--json] [--search] [hydra overrides]``: check a layout before it queues.

    lmforge plan +exp=gpt_1b cluster.nodes=4
    lmforge plan +exp=gpt_7b cluster.nodes=2 parallelism.tp=2 parallelism.dp_shard=8
    lmforge plan --search +exp=gpt_1b cluster.nodes=16

Composes the config exactly as ``lmforge train`` does, runs the same ``validate()`` (every check that needs
no process group: layout, batch, DeepSpeed, tokenizer vocabulary, ...) with the world size
``cluster.nodes * cluster.gpus_per_node``, prints the mesh, parameters, FLOPs, memory per device and a
predicted step time with where it goes, and exits 2 with the reason and a fix when the layout is impossible or
does not fit. ``--search`` ranks the feasible layouts of the model, batch and cluster by predicted throughput
(``lmforge.parallel.layout_search``) and prints the best five.
"""

from __future__ import annotations

import json
import sys
from typing import Callable, Optional, Sequence

from lmforge.config.errors import ConfigError


def plan_from_overrides(overrides: Sequence[str]):
    """Compose, validate and plan; raises ConfigError for an impossible or out-of-memory layout."""
    # deferred: a subcommand's module loads only when it runs (`--help` stays light)
    from lmforge.config.compose import compose

    # deferred: a subcommand's module loads only when it runs (`--help` stays light)
    from lmforge.config.validate import planned_world_size, validate

    # deferred: a subcommand's module loads only when it runs (`--help` stays light)
    from lmforge.parallel.planner import make_plan

    cfg = compose(list(overrides))
    world = planned_world_size(cfg)
    validated = validate(cfg, world_size=world if world is not None else 0)  # exactly lmforge train's checks
    return make_plan(validated, world)


def plan_json(plan) -> dict:
    # deferred: a subcommand's module loads only when it runs (`--help` stays light)
    from lmforge.parallel.memory_estimate import bytes_table

    return {
        "world_size": plan.world_size,
        "device": plan.device_kind,
        "precision": plan.precision,
        "mesh": {
            "pp": plan.cfg.parallelism.pp,
            "dp_replicate": plan.cfg.parallelism.dp_replicate,
            "dp_shard": plan.cfg.parallelism.dp_shard,
            "tp": plan.cfg.parallelism.tp,
            "cp": plan.cfg.parallelism.cp,
            "ep": plan.cfg.parallelism.ep,
        },
        "cp_exchange_bytes_per_step": plan.cp_exchange_bytes,
        "ep_all_to_all_bytes_per_step": plan.ep_all_to_all_bytes,
        "expert_parameters_per_device": plan.memory.state.expert_numel,
        "parameters": plan.n_params,
        "flops_per_token": plan.flops_per_token,
        "flops_per_step": plan.flops_per_step,
        "tokens_per_step": plan.batch.tokens_per_step,
        "memory_bytes": dict(bytes_table(plan.memory)),
        "memory_total_bytes": plan.memory.total,
        "activations_by_mode_bytes": plan.memory.activations_by_mode,
        "usable_memory_bytes": plan.usable_memory,
        "fits": plan.fits,
        "step_time_s": plan.step_time_s,
        "tokens_per_s": plan.tokens_per_s,
        "model_tflops_per_device": plan.model_tflops_per_device,
        "step_time_breakdown_s": dict(plan.step.rows()),
        "links": [g.describe() for g in plan.step.groups],
        "bubble": plan.bubble,
        "warnings": plan.warnings,
    }


def main(argv: Optional[Sequence[str]] = None, extra_checks: Sequence[Callable[[object], Sequence[str]]] = ()) -> int:
    """``extra_checks`` (from higher layers, e.g. ``trainer.entry_checks.plan_lines``: the eval tasks and the data
    epochs) take the typed config and return lines for the plan, or raise ConfigError to refuse it."""
    # deferred: a subcommand's module loads only when it runs (`--help` stays light)
    from lmforge.parallel.planner import check_fits, format_plan

    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] in ("-h", "--help"):
        print(__doc__.strip())
        return 0
    as_json = "--json" in args
    overrides = [a for a in args if a not in ("--json", "--search")]
    if "--search" in args:
        return search_main(overrides)
    try:
        plan = plan_from_overrides(overrides)
    except ConfigError as e:
        print(f"lmforge plan: refused: {e}", file=sys.stderr)
        return 2
    lines, refusal = [], None
    try:
        lines = [line for check in extra_checks for line in check(plan.cfg)]
    except ConfigError as e:
        refusal = e
    if as_json:
        print(json.dumps({**plan_json(plan), "checks": lines}, indent=1))
    else:
        print("\n".join([format_plan(plan), *lines]))
    if refusal is not None:
        print(f"lmforge plan: refused: {refusal}", file=sys.stderr)
        return 2
    try:
        check_fits(plan)
    except ConfigError as e:
        print(f"lmforge plan: refused: {e}", file=sys.stderr)
        return 2
    return 0


def search_main(overrides: Sequence[str]) -> int:
    # deferred: a subcommand's module loads only when it runs (`--help` stays light)
    from lmforge.parallel.layout_search import format_search, search_layouts

    try:
        plan = plan_from_overrides(overrides)
        cands, feasible = search_layouts(plan.cfg, plan.world_size)
    except ConfigError as e:
        print(f"lmforge plan: refused: {e}", file=sys.stderr)
        return 2
    cfg = plan.cfg
    print(
        f"plan       {cfg.model.name} on {cfg.cluster.nodes} x {cfg.cluster.gpus_per_node} {plan.device_kind} "
        f"(world size {plan.world_size}), global batch {plan.batch.global_batch_size} x {cfg.model.seq_len} tokens"
    )
    print(format_search(cands, feasible))
    return 0 if cands else 2


if __name__ == "__main__":
    raise SystemExit(main())
