"""``lmforge sweep plan``: FLOP budgets x a shape family -> an IsoFLOP grid, as a sweep file and Hydra overrides.

For every budget C and every shape of the family (FLOPs per token f from lmforge.model.flops):

    D = C / f                      tokens, so that the run's training FLOPs are exactly C (up to step rounding)
    tpp = D / N,  N = f / 6        tokens per (FLOP-equivalent) parameter; shapes outside [tpp_min, tpp_max] are dropped

and ``sizes`` shapes spread evenly in ln N are kept (at least 5). Per budget (formulas of DeepSeek LLM, 2024,
fitted on C in FLOPs; coefficients are settings):

    tokens/step  B(C) = batch_coef * C^batch_exp   -> global batch = B / seq_len, rounded to a multiple of
                                                      micro_batch_size * dp, lowered until >= min_steps steps
    peak LR      lr(C) = clip(lr_coef * C^lr_exp, lr_min, lr_max), or rules.lr_by_size[shape] where that
                 table is set (a rate tuned per model size, e.g. by benchmarks/sweep_lr_scan.py)

Per run: max_steps = round(D / (global_batch * seq_len)) — the cosine schedule ends exactly at the run's own
token count (train.planned_tokens = max_steps * tokens/step); warmup = max(1, round(warmup_fraction * max_steps)).
Every run uses the same micro batch, dp size, eval_batches, seq_len and seed, so all runs evaluate on the same
fixed validation samples.
"""

from __future__ import annotations

import json
import math
import shlex
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import numpy as np

from lmforge.config.errors import ConfigError
from lmforge.optim.schedule import DECAY_SHAPES
from lmforge.runtime.rundir import escape_reason
from lmforge.scaling.errors import ScalingError
from lmforge.scaling.shapes import Shape, ShapeFamily

SWEEP_FILE = "sweep.json"
MIN_SIZES = 5


@dataclass
class Rules:
    tpp_min: float = 2.0
    tpp_max: float = 200.0
    sizes: int = 5
    batch_coef: float = 0.292
    batch_exp: float = 0.3271
    lr_coef: float = 0.3118
    lr_exp: float = -0.125
    lr_min: float = 0.0
    lr_max: float = 1.0
    min_lr_ratio: float = 0.1
    warmup_fraction: float = 0.05
    micro_batch_size: int = 8
    dp: int = 1
    min_steps: int = 20
    evals_per_run: int = 1
    eval_batches: int = 8
    log_points: int = 50
    budget_tolerance: float = 0.05
    seed: int = 1234
    # wsd-branches designs (``sweep plan --wsd-branches``): each branch decays over this fraction of its own steps
    # (optim.decay_steps = round(decay_fraction * train.max_steps)), shaped like optim.decay_shape.
    decay_fraction: float = 0.2
    decay_shape: str = "1-sqrt"
    # A peak learning rate per model size, keyed by the family's shape name ("l2-d32": 2 layers of width 32),
    # replacing lr(C) for every point and stable run of that size; every size the plan picks must be listed.
    # Empty: lr(C) for all.
    lr_by_size: Dict[str, float] = field(default_factory=dict)
    # Planning aids only (they change no run): the tokens per parameter at which the optimum is expected
    # (Hoffmann et al.: ~20), and a throughput model for the time estimate (0: no estimate): training FLOPs
    # per second of one worker, fixed seconds per run (start-up, evaluations), and parallel workers.
    expected_tpp: float = 20.0
    flops_per_second: float = 0.0
    seconds_per_run: float = 0.0
    jobs: int = 1

    def check(self) -> "Rules":
        if not 0 < self.tpp_min < self.tpp_max:
            raise ScalingError(
                "rules.tpp",
                f"need 0 < tpp_min < tpp_max, got {self.tpp_min}..{self.tpp_max}",
                "e.g. --tpp 2,200 (Chinchilla's optimum is ~20 tokens per parameter)",
            )
        if self.sizes < MIN_SIZES:
            raise ScalingError(
                "rules.sizes",
                f"{self.sizes} sizes per budget; an IsoFLOP profile needs at least {MIN_SIZES}",
                f"use --sizes {MIN_SIZES} or more",
            )
        for key in ("micro_batch_size", "dp", "min_steps", "evals_per_run", "eval_batches", "log_points"):
            if getattr(self, key) < 1:
                raise ScalingError(f"rules.{key}", f"must be >= 1, got {getattr(self, key)}", "set a positive value")
        if not 0 <= self.warmup_fraction < 1:
            raise ScalingError("rules.warmup_fraction", f"must be in [0, 1), got {self.warmup_fraction}", "e.g. 0.05")
        if not 0 < self.decay_fraction < 1:
            raise ScalingError(
                "rules.decay_fraction", f"must be in (0, 1), got {self.decay_fraction}", "e.g. 0.2 (Hagele et al.)"
            )
        if self.decay_shape not in DECAY_SHAPES:
            raise ScalingError(
                "rules.decay_shape", f"'{self.decay_shape}' is not a decay shape", f"use {', '.join(DECAY_SHAPES)}"
            )
        table = self.lr_by_size or {}
        try:
            if isinstance(table, str):  # --rule lr_by_size=l1-d8:0.02,l2-d16:0.01
                table = dict(pair.split(":", 1) for pair in table.split(","))
            self.lr_by_size = {str(k): float(lr) for k, lr in table.items()}
        except (TypeError, ValueError, AttributeError):
            raise ScalingError(
                "rules.lr_by_size",
                f"must map shape names to rates, got {self.lr_by_size!r}",
                "e.g. {l1-d8: 0.02, l2-d16: 0.01} (names as `sweep plan` prints them)",
            ) from None
        bad = [k for k, lr in self.lr_by_size.items() if not lr > 0]
        if bad:
            raise ScalingError("rules.lr_by_size", f"size(s) {bad}: need a positive rate", "fix the table")
        return self

    def tokens_per_step(self, budget: float) -> float:
        return self.batch_coef * budget**self.batch_exp

    def lr(self, budget: float, shape: str) -> float:
        if self.lr_by_size:
            if shape not in self.lr_by_size:
                raise ScalingError(
                    "rules.lr_by_size",
                    f"has no rate for size {shape} (it lists {', '.join(sorted(self.lr_by_size))})",
                    f"add {shape}: <lr> to the table (benchmarks/sweep_lr_scan.py tunes one), or narrow the family",
                )
            return self.lr_by_size[shape]
        return float(min(self.lr_max, max(self.lr_min, self.lr_coef * budget**self.lr_exp)))


@dataclass
class Point:
    id: str
    budget: float
    n_layers: int
    d_model: int
    n_heads: int
    n_kv_heads: int
    n_params: int
    n_flops: float
    n_matmul: int
    flops_per_token: int
    tokens: int
    tokens_per_param: float
    planned_flops: float
    budget_error: float
    max_steps: int
    global_batch_size: int
    micro_batch_size: int
    lr: float
    warmup_steps: int
    eval_every: int
    sweep_point: str
    run_dir: str
    overrides: List[str] = field(default_factory=list)
    # A wsd-branches design: the stable run whose checkpoint this point's cooldown branch resumes, that step, and
    # the branch's decay (optim.decay_steps = max_steps - branch_start); empty/0 for a run trained from scratch.
    stable_run: str = ""
    branch_start: int = 0
    decay_steps: int = 0
    run_flops: float = 0.0
    """FLOPs this run trains itself: planned_flops from scratch, the decay's share for a branch."""


@dataclass
class StableRun:
    """One model size's stable phase (warmup, then the peak rate held) in a wsd-branches design: it trains to its
    last branch start (``max_steps``; train.stop_at_step) and keeps a checkpoint at every branch start
    (checkpoint.at_steps); it is done when those checkpoints are complete. It is not a point."""

    id: str
    n_layers: int
    d_model: int
    n_params: int
    n_flops: float
    flops_per_token: int
    max_steps: int
    global_batch_size: int
    lr: float
    warmup_steps: int
    planned_tokens: int
    branch_starts: List[int]
    branches: List[str]
    run_flops: float
    sweep_point: str
    run_dir: str
    overrides: List[str] = field(default_factory=list)

    @property
    def planned_flops(self) -> float:
        return self.run_flops


FROM_SCRATCH, WSD_BRANCHES = "from-scratch", "wsd-branches"


@dataclass
class Sweep:
    name: str
    run_root: str
    budgets: List[float]
    family: Dict[str, Any]
    rules: Dict[str, Any]
    common_overrides: List[str]
    points: List[Point]
    version: int = 1
    design: str = FROM_SCRATCH
    stable_runs: List[StableRun] = field(default_factory=list)
    from_scratch_flops: float = 0.0
    """The FLOPs of training every point from scratch (the design's cost without branches)."""

    def to_json(self) -> Dict:
        return asdict(self)

    @staticmethod
    def from_json(data: Dict) -> "Sweep":
        data = dict(data)
        data["points"] = [Point(**p) for p in data["points"]]
        data["stable_runs"] = [StableRun(**r) for r in data.get("stable_runs", [])]
        return Sweep(**data)

    def units(self) -> List[Any]:
        """Every run to train, stable runs first (their branches resume them): Slurm array indices refer to this."""
        return [*self.stable_runs, *self.points]

    def point(self, pid: str) -> Any:
        for p in self.units():
            if p.id == pid:
                return p
        raise ScalingError(
            f"sweep '{self.name}'", f"has no point '{pid}'", f"points: {', '.join(p.id for p in self.units())}"
        )

    def stable(self, sid: str) -> StableRun:
        return next(r for r in self.stable_runs if r.id == sid)

    def total_flops(self) -> float:
        """The FLOPs the sweep trains: every run's own share (a branch only its decay)."""
        return float(sum(u.run_flops or u.planned_flops for u in self.units()))


def budget_label(c: float) -> str:
    mant, exp = f"{c:.2e}".split("e")
    mant = mant.rstrip("0").rstrip(".")
    return f"{mant}e{int(exp)}"


def _value(v: Any) -> str:
    if isinstance(v, bool):
        return str(v).lower()
    if v is None:
        return "null"
    if isinstance(v, float):
        return repr(v)
    if isinstance(v, (list, tuple)):
        return "[" + ",".join(_value(x) for x in v) + "]"
    s = str(v)
    if any(ch in s for ch in " =,:[]{}'\"()+") or s == "":
        return "'" + s.replace("\\", "\\\\").replace("'", "\\'") + "'"
    return s


def _steps_and_batch(tokens: float, budget: float, rules: Rules, seq_len: int) -> tuple[int, int]:
    unit = rules.micro_batch_size * rules.dp
    seqs = rules.tokens_per_step(budget) / seq_len
    gbs = max(unit, int(round(seqs / unit)) * unit)
    while gbs > unit and tokens / (gbs * seq_len) < rules.min_steps:
        gbs -= unit
    return max(1, int(round(tokens / (gbs * seq_len)))), gbs


def select_sizes(candidates: List[Shape], k: int) -> List[Shape]:
    """``k`` candidates spread evenly in ln N (always the smallest and the largest)."""
    if len(candidates) <= k:
        return candidates
    logs = np.log([s.n_flops for s in candidates])
    chosen: List[int] = []
    for target in np.linspace(logs[0], logs[-1], k):
        order = np.argsort(np.abs(logs - target))
        chosen.append(next(int(i) for i in order if int(i) not in chosen))
    return [candidates[i] for i in sorted(chosen)]


def plan(
    name: str,
    budgets: Sequence[float],
    family: ShapeFamily,
    rules: Rules,
    run_root: str,
    extra_overrides: Sequence[str] = (),
) -> Sweep:
    rules.check()
    shapes = sorted(family.check().shapes(), key=lambda s: s.n_flops)
    if not budgets:
        raise ScalingError("sweep plan", "no budgets given", "pass --budgets 1e11,3e11 (FLOPs per run)")
    if not name or "/" in name or " " in name or escape_reason(name):
        raise ScalingError("sweep plan --name", f"'{name}' is not a usable sweep name", "use letters, digits, - and _")
    root = str(Path(run_root).expanduser().absolute())
    common = [
        f"run.root={root}",
        f"run.sweep_name={name}",
        f"logging.wandb.group={name}",
        f"train.micro_batch_size={rules.micro_batch_size}",
        f"train.eval_batches={rules.eval_batches}",
        f"train.seed={rules.seed}",
        "train.grad_accum=null",
        "optim.schedule=cosine",
        f"optim.min_lr_ratio={rules.min_lr_ratio}",
        *extra_overrides,
    ]
    points: List[Point] = []
    for c in sorted(float(b) for b in budgets):
        if not c > 0:
            raise ScalingError("sweep plan --budgets", f"budget {c} is not positive", "give FLOPs per run, e.g. 1e11")
        fits = [s for s in shapes if rules.tpp_min <= (c / s.flops_per_token) / s.n_flops <= rules.tpp_max]
        if len(fits) < rules.sizes:
            tpp = [(c / s.flops_per_token) / s.n_flops for s in shapes]
            span = (
                f"the family spans {max(tpp):.3g} (smallest, {shapes[0].model.name}) to {min(tpp):.3g} (largest, "
                f"{shapes[-1].model.name})"
            )
            raise ScalingError(
                f"budget C={budget_label(c)}",
                f"only {len(fits)} shape(s) of the family have tokens/parameter in [{rules.tpp_min:g}, {rules.tpp_max:g}] "
                f"but {rules.sizes} sizes are required ({span})",
                "widen --tpp, extend the family's layer range (min_layers/max_layers), or move the budget",
            )
        for s in select_sizes(fits, rules.sizes):
            m = s.model
            tokens_wanted = c / s.flops_per_token
            steps, gbs = _steps_and_batch(tokens_wanted, c, rules, m.seq_len)
            tokens = steps * gbs * m.seq_len
            planned = float(tokens * s.flops_per_token)
            err = planned / c - 1
            pid = f"c{budget_label(c)}-l{m.n_layers}-d{m.d_model}"
            if abs(err) > rules.budget_tolerance:
                raise ScalingError(
                    f"point {pid}",
                    f"step rounding puts its FLOPs {err:+.1%} off the budget (only {steps} step(s) of {gbs} sequences)",
                    "lower rules.micro_batch_size or raise the budget so each run has more steps",
                )
            warmup = min(steps - 1, max(1, round(rules.warmup_fraction * steps))) if steps > 1 else 0
            lr = rules.lr(c, m.name)
            eval_every = max(1, math.ceil(steps / rules.evals_per_run))
            sweep_point = f"{name}/{pid}"
            tags = [f"budget={budget_label(c)}", f"N={s.n_flops:.4g}", f"D={tokens:.4g}"]
            own = {
                **{o.split("=", 1)[0]: o.split("=", 1)[1] for o in s.model_overrides()},
                "train.max_steps": steps,
                "train.global_batch_size": gbs,
                "train.planned_tokens": tokens,
                "train.eval_every": eval_every,
                "optim.lr": lr,
                "optim.warmup_steps": warmup,
                "logging.every_steps": max(1, steps // rules.log_points),
                "run.sweep_point": sweep_point,
                "run.sweep_params": float(s.n_flops),
                "run.sweep_tokens": float(tokens),
                "run.sweep_flops": planned,
                "logging.wandb.tags": tags,
            }
            overrides = common + [
                f"{k}={v if isinstance(v, str) and k.startswith('model.') else _value(v)}" for k, v in own.items()
            ]
            points.append(
                Point(
                    pid,
                    c,
                    m.n_layers,
                    m.d_model,
                    m.n_heads,
                    int(m.n_kv_heads),
                    s.n_params,
                    s.n_flops,
                    s.n_matmul,
                    s.flops_per_token,
                    tokens,
                    tokens / s.n_flops,
                    planned,
                    err,
                    steps,
                    gbs,
                    rules.micro_batch_size,
                    lr,
                    warmup,
                    eval_every,
                    sweep_point,
                    str(Path(root) / sweep_point),
                    overrides,
                    run_flops=planned,
                )
            )
    budgets_sorted = sorted(float(b) for b in budgets)
    total = float(sum(p.planned_flops for p in points))
    return Sweep(
        name, root, budgets_sorted, family.as_dict(), asdict(rules), list(common), points, 1, FROM_SCRATCH, [], total
    )


def validate_points(sweep: Sweep) -> None:
    """Compose and validate every point's config as ``lmforge train`` would (no compute).

    The common overrides are composed by Hydra once; each point's own overrides are plain ``key=value``
    assignments and are merged onto that, which is what Hydra's command-line override does for them.
    """
    from omegaconf import OmegaConf

    from lmforge.config.compose import compose  # deferred: imports omegaconf; this module imports without it
    from lmforge.config.validate import validate  # deferred: imports omegaconf; this module imports without it

    try:
        base = compose(sweep.common_overrides)
    except Exception as e:  # noqa: BLE001  Hydra's own override errors
        raise ScalingError(
            f"sweep '{sweep.name}'",
            f"its common overrides do not compose ({e})",
            "fix the preset's overrides or the ones after --",
        ) from None
    for p in sweep.units():
        own = [o for o in p.overrides if o not in sweep.common_overrides]
        cfg = OmegaConf.merge(base, OmegaConf.from_dotlist(own))
        try:
            typed = validate(cfg)
            dp = typed.parallelism.dp_replicate * typed.parallelism.dp_shard
            if dp != sweep.rules.get("dp", 1):
                raise ConfigError(
                    "parallelism",
                    f"data-parallel size {dp} differs from the plan's rules.dp "
                    f"{sweep.rules.get('dp', 1)} (the batch rule and the validation set assume it)",
                    "set rules.dp to the data-parallel size, or pass matching parallelism overrides",
                )
        except ConfigError as e:
            raise ScalingError(
                f"point {p.id}", f"its config is invalid ({e})", "fix the family/rules or the extra overrides"
            ) from None


def write_sweep(sweep: Sweep, out_dir: Path) -> Path:
    """sweep.json (the plan), overrides.txt (one `lmforge train` line per point) and Hydra per-point configs."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / SWEEP_FILE
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(sweep.to_json(), indent=1))
    tmp.replace(path)
    lines = [" ".join(shlex.quote(o) for o in p.overrides) for p in sweep.units()]
    (out_dir / "overrides.txt").write_text("\n".join(lines) + "\n")
    group = out_dir / "hydra" / "sweep_point"
    group.mkdir(parents=True, exist_ok=True)
    from omegaconf import OmegaConf

    for p in sweep.units():
        own = [o for o in p.overrides if o not in sweep.common_overrides]
        cfg = OmegaConf.from_dotlist(own)
        (group / f"{p.id}.yaml").write_text(
            f"# @package _global_\n# sweep {sweep.name}, point {p.id}\n" + OmegaConf.to_yaml(cfg)
        )
    return path


def load_sweep(path: Path) -> Sweep:
    path = Path(path)
    if path.is_dir():
        path = path / SWEEP_FILE
    if not path.is_file():
        raise ScalingError(str(path), "no sweep file here", "run `lmforge sweep plan ... --out DIR` first")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:  # a sweep file is JSON, never unpickled
        raise ScalingError(
            str(path),
            f"is not a JSON sweep plan ({type(e).__name__})",
            "re-plan it with `lmforge sweep plan ... --out DIR`",
        ) from None
    return Sweep.from_json(data)


def optimum_check(sweep: Sweep) -> List[str]:
    """Per budget: the grid's N range and where the expected optimum N_exp lies in it, with C = 6 N D and
    D = expected_tpp * N, i.e. N_exp = sqrt(C / (6 expected_tpp)); 'interior' when it is inside the grid
    and at least 15% of the grid's ln-N span from either edge."""
    tpp = float(sweep.rules.get("expected_tpp", 20.0))
    lines = []
    for c in sweep.budgets:
        ns = [p.n_flops for p in sweep.points if p.budget == c]
        lo, hi = min(ns), max(ns)
        n_exp = math.sqrt(c / (6 * tpp))
        pos = (math.log(n_exp) - math.log(lo)) / (math.log(hi) - math.log(lo)) if hi > lo else float("nan")
        where = "interior" if 0.15 <= pos <= 0.85 else ("NEAR THE EDGE" if 0 <= pos <= 1 else "OUTSIDE THE GRID")
        lines.append(
            f"C={budget_label(c)}: N {lo:.3g}..{hi:.3g}; expected optimum (tpp {tpp:g}) N={n_exp:.3g} at "
            f"{pos:.0%} of the ln-N span: {where}"
        )
    return lines


def time_estimate(sweep: Sweep) -> Optional[str]:
    """Estimated wall time from the rules' throughput model, or None when it has no throughput."""
    rate = float(sweep.rules.get("flops_per_second", 0.0))
    if rate <= 0:
        return None
    jobs = max(1, int(sweep.rules.get("jobs", 1)))
    per_run = float(sweep.rules.get("seconds_per_run", 0.0))
    work = sorted((u.run_flops or u.planned_flops) / rate + per_run for u in sweep.units())[::-1]
    lanes = [0.0] * jobs
    for w in work:  # largest first onto the least-loaded worker
        lanes[lanes.index(min(lanes))] += w
    return (
        f"estimated time: {max(lanes) / 60:.0f} min with {jobs} worker(s) ({sum(work) / 60:.0f} worker-minutes; "
        f"{rate:.3g} training FLOP/s and {per_run:g} s per run per worker, rules.flops_per_second/seconds_per_run)"
    )


def summary_table(sweep: Sweep) -> str:
    branched = bool(sweep.stable_runs)
    head = f"{'point':<24} {'N(flops)':>10} {'params':>10} {'tokens':>10} {'tok/N':>7} {'steps':>6} {'batch':>5} {'lr':>8} {'FLOPs err':>9}"
    if branched:
        head += f" {'stable run':<18} {'start':>6} {'decay':>6}"
    rows = [head, "-" * len(head)]
    for p in sweep.points:
        row = (
            f"{p.id:<24} {p.n_flops:>10.3g} {p.n_params:>10.3g} {p.tokens:>10.3g} {p.tokens_per_param:>7.1f} "
            f"{p.max_steps:>6d} {p.global_batch_size:>5d} {p.lr:>8.2e} {p.budget_error:>+9.2%}"
        )
        rows.append(row + (f" {p.stable_run:<18} {p.branch_start:>6d} {p.decay_steps:>6d}" if branched else ""))
    for r in sweep.stable_runs:
        rows.append(
            f"{r.id:<24} {r.n_flops:>10.3g} {r.n_params:>10.3g} {'':>10} {'':>7} {r.max_steps:>6d} "
            f"{r.global_batch_size:>5d} {r.lr:>8.2e} {'':>9} checkpoints at {','.join(map(str, r.branch_starts))}"
        )
    return "\n".join(rows)
