"""``lmforge sweep plan --wsd-branches``: a design laid out as stable runs plus WSD cooldown branches.

Hagele et al. 2024 ("Scaling Laws and Compute-Optimal Training Beyond Fixed Training Durations"): a run at a
constant rate, cooled down from its checkpoints, gives one point per budget for the price of one long run plus
the cooldowns. From a planned design (IsoFLOP or scattered), per model size (the points sharing a shape):

- the batch, peak LR and warmup are those the rules give the size's smallest budget (one run cannot change
  them later; the smallest budget's batch keeps every branch at >= rules.min_steps steps);
- each point's branch: ``steps = round(C / (flops_per_token * batch * seq_len))``,
  ``decay = max(1, round(rules.decay_fraction * steps))`` (``optim.decay_steps``, shape ``rules.decay_shape``),
  ``start = steps - decay``; it resumes the stable run's checkpoint at ``start`` (``train.resume``) with
  ``train.max_steps=steps`` and only decays, so it trains what a WSD run planned for ``steps`` would from
  ``start`` on (tests/e2e/test_cooldown_branch.py);
- the stable run: the WSD run planned for the size's largest budget (its ``train.max_steps`` and decay), stopped
  at that budget's branch start (``train.stop_at_step``, so its last checkpoint is not a finished run's and every
  branch may change the schedule's end), a checkpoint kept at every branch start (``checkpoint.at_steps``);
- one data plan for all of them: ``train.planned_tokens`` = the size's largest branch's tokens.

Cost: per size, the stable run (largest start) plus every branch's decay, against every point from scratch.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Dict, List, Tuple

from lmforge.checkpoint.layout import step_dir
from lmforge.runtime.rundir import RunPaths
from lmforge.scaling.errors import ScalingError
from lmforge.scaling.plan import WSD_BRANCHES, Point, Rules, StableRun, Sweep, _value, budget_label


def _own(p: Point, common: List[str]) -> Dict[str, str]:
    """The point's own overrides as key -> value text, in order."""
    return dict(o.split("=", 1) for o in p.overrides if o not in common and "=" in o)


def _line(common: List[str], own: Dict[str, object]) -> List[str]:
    return common + [f"{k}={v if isinstance(v, str) else _value(v)}" for k, v in own.items()]


def _by_shape(sweep: Sweep) -> List[List[Point]]:
    groups: Dict[Tuple[str, ...], List[Point]] = {}
    for p in sweep.points:
        key = tuple(o for o in p.overrides if o.startswith("model.") and o not in sweep.common_overrides)
        groups.setdefault(key, []).append(p)
    return [sorted(g, key=lambda p: p.budget) for g in sorted(groups.values(), key=lambda g: g[0].n_flops)]


def _branch(p: Point, ref: Point, rules: Rules) -> Tuple[int, int, int]:
    """(steps, decay steps, start) of ``p``'s branch at the batch of ``ref`` (its size's smallest budget)."""
    seq_len = ref.tokens // (ref.max_steps * ref.global_batch_size)
    steps = max(1, int(round(p.budget / p.flops_per_token / (ref.global_batch_size * seq_len))))
    decay = max(1, int(round(rules.decay_fraction * steps)))
    start = steps - decay
    if start < max(1, ref.warmup_steps):
        raise ScalingError(
            f"point {p.id}",
            f"its branch of {steps} steps would start its {decay}-step decay at step {start}, before the stable "
            f"run's {ref.warmup_steps} warmup steps end",
            "lower rules.decay_fraction or rules.warmup_fraction, or raise rules.min_steps",
        )
    return steps, decay, start


def branch_design(sweep: Sweep, rules: Rules) -> Sweep:
    """``sweep`` (every point from scratch) as stable runs plus one cooldown branch per point."""
    rules.check()
    common = [o if not o.startswith("optim.schedule=") else "optim.schedule=wsd" for o in sweep.common_overrides]
    stable_runs: List[StableRun] = []
    points: List[Point] = []
    for group in _by_shape(sweep):
        ref = group[0]
        plans = {p.id: _branch(p, ref, rules) for p in group}
        seq_len = ref.tokens // (ref.max_steps * ref.global_batch_size)
        tokens_of = {pid: steps * ref.global_batch_size * seq_len for pid, (steps, _, _) in plans.items()}
        data_plan = max(tokens_of.values())
        starts = sorted({start for _, _, start in plans.values()})
        horizon, last_decay, _ = max(plans.values())
        sid = f"stable-l{ref.n_layers}-d{ref.d_model}"
        stable_point = f"{sweep.name}/{sid}"
        stable_dir = str(Path(sweep.run_root) / stable_point)
        model = {k: v for k, v in _own(ref, sweep.common_overrides).items() if k.startswith("model.")}
        stable_own = {
            **model,
            "train.max_steps": horizon,
            "train.stop_at_step": starts[-1],
            "train.global_batch_size": ref.global_batch_size,
            "train.planned_tokens": data_plan,
            "train.eval_every": 0,
            "optim.lr": ref.lr,
            "optim.warmup_steps": ref.warmup_steps,
            "optim.decay_steps": last_decay,
            "optim.decay_shape": rules.decay_shape,
            "logging.every_steps": max(1, starts[-1] // rules.log_points),
            "checkpoint.enabled": True,
            "checkpoint.every_steps": 0,
            "checkpoint.save_final": True,
            "checkpoint.keep_last": 1,
            "checkpoint.at_steps": starts,
            "run.sweep_point": stable_point,
            "run.sweep_params": float(ref.n_flops),
            "logging.wandb.tags": ["stable", f"N={ref.n_flops:.4g}"],
        }
        stable_runs.append(
            StableRun(
                sid,
                ref.n_layers,
                ref.d_model,
                ref.n_params,
                ref.n_flops,
                ref.flops_per_token,
                starts[-1],
                ref.global_batch_size,
                ref.lr,
                ref.warmup_steps,
                data_plan,
                starts,
                [p.id for p in group],
                float(starts[-1] * ref.global_batch_size * seq_len * ref.flops_per_token),
                stable_point,
                stable_dir,
                _line(common, stable_own),
            )
        )
        for p in group:
            points.append(_branch_point(sweep, p, ref, plans[p.id], tokens_of[p.id], stable_runs[-1], common, rules))
    points.sort(key=lambda p: (p.budget, p.n_flops))
    return Sweep(
        sweep.name,
        sweep.run_root,
        sweep.budgets,
        sweep.family,
        sweep.rules,
        common,
        points,
        sweep.version,
        WSD_BRANCHES,
        stable_runs,
        sweep.from_scratch_flops,
    )


def _branch_point(
    sweep: Sweep,
    p: Point,
    ref: Point,
    plan: Tuple[int, int, int],
    tokens: int,
    stable: StableRun,
    common: List[str],
    rules: Rules,
) -> Point:
    steps, decay, start = plan
    planned = float(tokens * p.flops_per_token)
    err = planned / p.budget - 1
    if abs(err) > rules.budget_tolerance:
        raise ScalingError(
            f"point {p.id}",
            f"at its size's batch of {ref.global_batch_size} sequences, step rounding puts its FLOPs {err:+.1%} off "
            f"the budget ({steps} steps)",
            "lower rules.micro_batch_size or raise the budget so each run has more steps",
        )
    own = {
        **{k: v for k, v in _own(p, sweep.common_overrides).items() if k.startswith("model.")},
        "train.max_steps": steps,
        "train.global_batch_size": ref.global_batch_size,
        "train.planned_tokens": stable.planned_tokens,
        "train.eval_every": max(1, math.ceil(steps / rules.evals_per_run)),
        "train.resume": str(step_dir(RunPaths(Path(stable.run_dir)).checkpoints, start)),
        "optim.lr": ref.lr,
        "optim.warmup_steps": ref.warmup_steps,
        "optim.decay_steps": decay,
        "optim.decay_shape": rules.decay_shape,
        "logging.every_steps": max(1, steps // rules.log_points),
        "run.sweep_point": p.sweep_point,
        "run.sweep_params": float(p.n_flops),
        "run.sweep_tokens": float(tokens),
        "run.sweep_flops": planned,
        "logging.wandb.tags": [f"budget={budget_label(p.budget)}", f"N={p.n_flops:.4g}", f"D={tokens:.4g}", stable.id],
    }
    return Point(
        p.id,
        p.budget,
        p.n_layers,
        p.d_model,
        p.n_heads,
        p.n_kv_heads,
        p.n_params,
        p.n_flops,
        p.n_matmul,
        p.flops_per_token,
        tokens,
        tokens / p.n_flops,
        planned,
        err,
        steps,
        ref.global_batch_size,
        p.micro_batch_size,
        ref.lr,
        ref.warmup_steps,
        own["train.eval_every"],
        p.sweep_point,
        p.run_dir,
        _line(common, own),
        stable_run=stable.id,
        branch_start=start,
        decay_steps=decay,
        run_flops=float(
            decay * ref.global_batch_size * (tokens // (steps * ref.global_batch_size)) * p.flops_per_token
        ),
    )


def flops_summary(sweep: Sweep) -> str:
    """One line: the design's FLOPs from scratch against stable runs plus branches."""
    total = sweep.total_flops()
    scratch = sweep.from_scratch_flops
    line = (
        f"FLOPs: {scratch:.3g} with every point from scratch; {total:.3g} as {len(sweep.stable_runs)} stable runs + "
        f"{len(sweep.points)} cooldown branches ({total / scratch:.1%} of from scratch, {1 - total / scratch:.1%} saved)"
    )
    single = [r.id for r in sweep.stable_runs if len(r.branches) == 1]
    if single:  # a size the design uses at one budget only: its stable run plus one branch is a run from scratch
        line += (
            f"\n{len(single)} of {len(sweep.stable_runs)} stable runs serve one budget only and save nothing "
            f"({', '.join(single)})"
        )
    return line
