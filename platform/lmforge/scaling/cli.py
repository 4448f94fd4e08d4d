"""``lmforge sweep plan|run|status|collect`` and ``lmforge scaling fit``.

lmforge sweep plan --preset tiny_cpu --name demo [--budgets 1e10,3e10] [--run-root runs] [--wsd-branches] [-- OVERRIDES]
lmforge sweep run runs/demo [--launcher local|hydra|slurm-array] [--jobs 2] [--dry-run]
lmforge sweep status runs/demo
lmforge sweep collect runs/demo                       # -> runs/demo/results.csv
lmforge scaling fit runs/demo [--targets 1e21,1e22] [--bootstrap 200] [--wandb [auto|online|offline]]
lmforge scaling fit table.csv --n-col params --d-col tokens --loss-col loss [--drop-highest-loss 3] [--bins 6]
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import fields
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from lmforge.runtime.env_vars import read
from lmforge.scaling.errors import ScalingError


def _floats(text: str) -> List[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def _coerce(cls, key: str, value: str, what: str) -> Any:
    names = {f.name: f for f in fields(cls)}
    if key not in names:
        raise ScalingError(f"--{what} {key}", "is not a known setting", f"known: {', '.join(names)}")
    default = getattr(cls(), key)
    if isinstance(default, bool):
        return value.lower() in ("1", "true", "yes")
    if isinstance(default, int):
        return int(float(value))
    if isinstance(default, float):
        return float(value)
    return value


def load_preset(name: str) -> Dict[str, Any]:
    from omegaconf import OmegaConf

    # deferred: a subcommand's module loads only when it runs (`--help` stays light)
    from lmforge.config.compose import conf_dir

    path = Path(name)
    if not path.is_file():
        path = conf_dir() / "sweep" / f"{name}.yaml"
    if not path.is_file():
        known = sorted(p.stem for p in (conf_dir() / "sweep").glob("*.yaml"))
        raise ScalingError(
            f"--preset {name}", "no such sweep preset", f"known presets: {', '.join(known)}, or a YAML path"
        )
    return OmegaConf.to_container(OmegaConf.load(path), resolve=True)


def _embedded_tokenizer(vocab: int, run_root: str, extra: Sequence[str]) -> str:
    # deferred: a subcommand's module loads only when it runs (`--help` stays light)
    from lmforge.config.data import DataConfig

    # deferred: a subcommand's module loads only when it runs (`--help` stays light)
    from lmforge.data.sources import default_cache_dir

    # deferred: a subcommand's module loads only when it runs (`--help` stays light)
    from lmforge.data.tokenizer import build_embedded_tokenizer

    cache = default_cache_dir(DataConfig(), run_root)
    for o in extra:
        if o.startswith("data.cache_dir="):
            cache = Path(o.split("=", 1)[1]).expanduser().absolute()
    return str(build_embedded_tokenizer(cache, vocab))


def cmd_plan(argv: Sequence[str]) -> int:
    from lmforge.scaling.plan import (
        Rules,
        optimum_check,
        plan,
        summary_table,
        time_estimate,
        validate_points,
        write_sweep,
    )  # deferred: a subcommand's module loads only when it runs (`--help` stays light)

    # deferred: a subcommand's module loads only when it runs (`--help` stays light)
    from lmforge.scaling.shapes import ShapeFamily

    argv = list(argv)
    extra: List[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1 :]
    ap = argparse.ArgumentParser(prog="lmforge sweep plan", description="Plan an IsoFLOP grid.")
    ap.add_argument("--preset", default=None, help="conf/sweep/NAME.yaml or a YAML path")
    ap.add_argument("--name", default=None, help="sweep name (W&B group, run-directory folder)")
    ap.add_argument("--budgets", default=None, help="FLOPs per run, comma-separated (e.g. 1e18,3e18,1e19)")
    ap.add_argument("--tpp", default=None, help="tokens-per-parameter range MIN,MAX")
    ap.add_argument("--sizes", type=int, default=None, help="model sizes per budget (>= 5)")
    ap.add_argument("--family", action="append", default=[], metavar="KEY=VALUE", help="shape-family setting")
    ap.add_argument("--rule", action="append", default=[], metavar="KEY=VALUE", help="batch/LR/eval rule setting")
    ap.add_argument("--run-root", default=None, help="parent of run directories (default: runs)")
    ap.add_argument("--out", default=None, help="where sweep.json goes (default: <run-root>/<name>)")
    ap.add_argument("--no-validate", action="store_true", help="skip composing each point's config")
    ap.add_argument(
        "--wsd-branches",
        action="store_true",
        default=None,
        help="lay the design out as one stable WSD run per size plus a cooldown branch per point "
        "(Hagele et al. 2024; --rule decay_fraction=0.2 --rule decay_shape=1-sqrt)",
    )
    args = ap.parse_args(argv)
    preset = load_preset(args.preset) if args.preset else {}
    name = args.name or preset.get("name")
    if not name:
        raise ScalingError("sweep plan", "no sweep name", "pass --name NAME (or a --preset)")
    fam = ShapeFamily(**(preset.get("family") or {}))
    for kv in args.family:
        k, v = kv.split("=", 1)
        setattr(fam, k, _coerce(ShapeFamily, k, v, "family"))
    rules = Rules(**(preset.get("rules") or {}))
    for kv in args.rule:
        k, v = kv.split("=", 1)
        setattr(rules, k, _coerce(Rules, k, v, "rule"))
    if args.tpp:
        rules.tpp_min, rules.tpp_max = _floats(args.tpp)
    if args.sizes is not None:
        rules.sizes = args.sizes
    budgets = _floats(args.budgets) if args.budgets else [float(b) for b in preset.get("budgets", [])]
    run_root = args.run_root or "runs"
    overrides = [str(o) for o in preset.get("overrides", [])] + extra
    if preset.get("embedded_tokenizer_vocab") and not any(o.startswith("data.tokenizer=") for o in overrides):
        overrides.append(
            f"data.tokenizer={_embedded_tokenizer(int(preset['embedded_tokenizer_vocab']), run_root, overrides)}"
        )
    sweep = plan(name, budgets, fam, rules, run_root, overrides)
    if args.wsd_branches or (args.wsd_branches is None and preset.get("wsd_branches")):
        # deferred: a subcommand's module loads only when it runs (`--help` stays light)
        from lmforge.scaling.branches import branch_design

        sweep = branch_design(sweep, rules)
    if not args.no_validate:
        validate_points(sweep)
    out = Path(args.out) if args.out else Path(sweep.run_root) / name
    path = write_sweep(sweep, out)
    if preset.get("targets"):
        (out / "targets.txt").write_text(",".join(f"{float(t):g}" for t in preset["targets"]) + "\n")
    print(summary_table(sweep))
    total = sweep.total_flops()
    print(f"\n{len(sweep.units())} runs, {total:.3g} FLOPs in total. Sweep file: {path}")
    if sweep.stable_runs:
        # deferred: a subcommand's module loads only when it runs (`--help` stays light)
        from lmforge.scaling.branches import flops_summary

        print(flops_summary(sweep))
    for line in optimum_check(sweep):
        print(line)
    estimate = time_estimate(sweep)
    if estimate:
        print(estimate)
    print(f"Hydra overrides per run: {out / 'overrides.txt'}; next: lmforge sweep run {out}")
    return 0


def cmd_run(argv: Sequence[str]) -> int:
    # deferred: a subcommand's module loads only when it runs (`--help` stays light)
    from lmforge.scaling.plan import load_sweep

    # deferred: a subcommand's module loads only when it runs (`--help` stays light)
    from lmforge.scaling.runner import run_sweep

    ap = argparse.ArgumentParser(prog="lmforge sweep run", description="Run the unfinished points of a sweep.")
    ap.add_argument("sweep", type=Path, help="sweep directory or sweep.json")
    ap.add_argument("--launcher", default="local", choices=["local", "hydra", "slurm-array"])
    ap.add_argument("--jobs", type=int, default=1, help="local: worker processes in parallel")
    ap.add_argument("--isolate", action="store_true", help="local: one process per point")
    ap.add_argument("--hydra-launcher", default="basic", help="basic | submitit_local | submitit_slurm")
    ap.add_argument(
        "--launcher-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="hydra: hydra.launcher.KEY=VALUE; slurm-array: extra sbatch argument",
    )
    ap.add_argument(
        "--slurm-script", default=None, help="slurm-array: the array script (default slurm/sweep_worker.sh)"
    )
    ap.add_argument("--dry-run", action="store_true", help="print the commands only")
    args = ap.parse_args(argv)
    sweep_dir = args.sweep if args.sweep.is_dir() else args.sweep.parent
    sweep = load_sweep(args.sweep)
    return run_sweep(
        sweep,
        sweep_dir,
        args.launcher,
        args.jobs,
        args.isolate,
        args.hydra_launcher,
        args.launcher_arg,
        Path(args.slurm_script) if args.slurm_script else None,
        args.dry_run,
    )


def cmd_status(argv: Sequence[str]) -> int:
    # deferred: a subcommand's module loads only when it runs (`--help` stays light)
    from lmforge.scaling.plan import load_sweep

    # deferred: a subcommand's module loads only when it runs (`--help` stays light)
    from lmforge.scaling.runner import DONE, status, status_report

    ap = argparse.ArgumentParser(prog="lmforge sweep status")
    ap.add_argument("sweep", type=Path)
    args = ap.parse_args(argv)
    sweep = load_sweep(args.sweep)
    print(status_report(sweep))
    return 0 if all(v == DONE for v in status(sweep).values()) else 1


def cmd_collect(argv: Sequence[str]) -> int:
    # deferred: a subcommand's module loads only when it runs (`--help` stays light)
    from lmforge.scaling.collect import collect, collect_wandb, write_results

    # deferred: a subcommand's module loads only when it runs (`--help` stays light)
    from lmforge.scaling.plan import load_sweep

    ap = argparse.ArgumentParser(prog="lmforge sweep collect", description="Gather final losses of finished runs.")
    ap.add_argument("sweep", type=Path)
    ap.add_argument("--smooth-fraction", type=float, default=0.1)
    ap.add_argument("--out", type=Path, default=None, help="directory for results.csv (default: the sweep's)")
    ap.add_argument("--wandb-project", default=None, help="read from W&B's API instead (online only)")
    ap.add_argument("--wandb-entity", default=None)
    args = ap.parse_args(argv)
    sweep = load_sweep(args.sweep)
    out = args.out or (args.sweep if args.sweep.is_dir() else args.sweep.parent)
    if args.wandb_project:
        rows, missing = collect_wandb(args.wandb_project, sweep.name, sweep, args.wandb_entity), []
    else:
        rows, missing = collect(sweep, args.smooth_fraction)
    path = write_results(rows, out)
    print(f"{len(rows)} finished run(s) -> {path}")
    if missing:
        print(f"not finished (left out): {', '.join(missing)}", file=sys.stderr)
    for r in rows:
        print(
            f"  {r['id']:<24} loss {r.get('final_val_loss', float('nan')):.4f}  FLOPs {r.get('flops_error', 0):+.2%} vs budget"
        )
    return 0


def _read_observations(args) -> tuple:
    """(observations, the table's path, fit.json 'source' record) for ``scaling fit``'s input."""
    # deferred: a subcommand's module loads only when it runs (`--help` stays light)
    from lmforge.scaling.approach3 import MIN_POINTS

    # deferred: a subcommand's module loads only when it runs (`--help` stays light)
    from lmforge.scaling.collect import RESULTS_FILE
    from lmforge.scaling.data import (
        TableColumns,
        drop_highest_losses,
        observations_from_rows,
        observations_from_table,
        read_csv,
        read_table,
    )  # deferred: a subcommand's module loads only when it runs (`--help` stays light)

    src = args.results / RESULTS_FILE if args.results.is_dir() else args.results
    external = any(v is not None for v in (args.n_col, args.d_col, args.c_col, args.loss_col)) or src.suffix == ".jsonl"
    if external:
        if args.n_col is None or args.loss_col is None:
            raise ScalingError(
                "scaling fit",
                "an external table needs --n-col and --loss-col (and --d-col or --c-col)",
                "e.g. --n-col params --d-col tokens --loss-col loss",
            )
        cols = TableColumns(
            args.n_col, args.loss_col, args.d_col, args.c_col, args.id_col, args.n_scale, args.d_scale, args.c_scale
        )
        rows = read_table(src)
        obs = observations_from_table(rows, cols, str(src))
        source = {"table": str(src), "columns": cols.describe()}
    else:
        if not src.is_file():
            raise ScalingError(
                str(src),
                "no results file",
                "run `lmforge sweep collect SWEEP_DIR` first, or pass a "
                "CSV/JSONL table with --n-col, --d-col or --c-col, and --loss-col",
            )
        rows = read_csv(src)
        obs = observations_from_rows(rows, args.loss, args.n, source=src)
        source = {"table": str(src), "columns": {"n": args.n, "loss": args.loss, "d": "tokens", "c": "budget"}}
    ids = list(obs.ids)  # row order, before filters
    source["filters"] = []
    if args.drop_highest_loss:
        obs, dropped = drop_highest_losses(obs, args.drop_highest_loss)
        source["filters"].append({"filter": f"drop_highest_loss={args.drop_highest_loss}", "dropped": dropped})
    if len(obs) < MIN_POINTS:
        raise ScalingError(
            str(src),
            f"has {len(obs)} usable run(s) after filters; a fit needs at least {MIN_POINTS} "
            "(the law has 5 free parameters)",
            "add runs, or drop fewer (--drop-highest-loss)",
        )
    metric = None
    if args.metric_col:
        by_id = {}
        for i, r in enumerate(rows):
            if args.metric_col not in r:
                raise ScalingError(
                    f"--metric-col {args.metric_col}", f"is not a column of {src}", f"columns: {', '.join(rows[0])}"
                )
            try:
                by_id[ids[i]] = float(r[args.metric_col]) if r[args.metric_col] not in (None, "") else float("nan")
            except (TypeError, ValueError):
                raise ScalingError(
                    f"{src} row {i + 1}",
                    f"column '{args.metric_col}' holds {r[args.metric_col]!r}, not a number",
                    "fix or remove that row",
                ) from None
        metric = [by_id[i] for i in obs.ids]
    return obs, src, source, metric


def _sweep_name(folder: Path) -> str:
    """The sweep's name when ``folder`` holds its plan (the W&B group of its points), else the folder's name."""
    # deferred: a subcommand's module loads only when it runs (`--help` stays light)
    from lmforge.scaling.plan import SWEEP_FILE, load_sweep

    return load_sweep(folder).name if (folder / SWEEP_FILE).is_file() else folder.name


def cmd_fit(argv: Sequence[str]) -> int:
    # deferred: a subcommand's module loads only when it runs (`--help` stays light)
    from lmforge.scaling.bootstrap import METHODS

    # deferred: a subcommand's module loads only when it runs (`--help` stays light)
    from lmforge.scaling.report import fit_all, summary_text, write_report

    ap = argparse.ArgumentParser(prog="lmforge scaling fit", description="Approach 2 and 3 fits, predictions, plots.")
    ap.add_argument(
        "results",
        type=Path,
        help="results.csv or a sweep directory holding one, or any CSV/JSONL "
        "table of runs (with --n-col, --d-col or --c-col, --loss-col)",
    )
    ap.add_argument(
        "--loss",
        default="final_val_loss",
        help="final_val_loss | smoothed_val_loss | final_train_loss | smoothed_train_loss",
    )
    ap.add_argument("--n", default="n_flops", help="size column: n_flops (C = 6ND exactly) | n_params | n_matmul")
    ap.add_argument("--n-col", default=None, help="external table: the parameters column (unit: parameters)")
    ap.add_argument("--d-col", default=None, help="external table: the training-tokens column (unit: tokens)")
    ap.add_argument(
        "--c-col",
        default=None,
        help="external table: the training-FLOPs column (unit: FLOPs); "
        "without --d-col, D = C / (6N); without --c-col, C = 6ND",
    )
    ap.add_argument("--loss-col", default=None, help="external table: the final loss column (unit: nats/token)")
    ap.add_argument("--id-col", default=None, help="external table: a run name column (default: row numbers)")
    for what, unit in (("n", "parameters"), ("d", "tokens"), ("c", "FLOPs")):
        ap.add_argument(
            f"--{what}-scale",
            type=float,
            default=1.0,
            help=f"multiply the {what.upper()} column by this to get {unit} (e.g. 1e6 for millions)",
        )
    ap.add_argument(
        "--drop-highest-loss",
        type=int,
        default=0,
        metavar="K",
        help="leave out the K highest-loss runs (recorded in fit.json)",
    )
    ap.add_argument("--bins", type=int, default=6, help="scattered tables: Approach 2's log-spaced budget bins")
    ap.add_argument(
        "--metric-col",
        default=None,
        help="downstream: an eval metric column (e.g. one sweep collect "
        "copied from the runs' last evaluation) to fit with a sigmoidal link",
    )
    ap.add_argument("--metric-against", default="loss", choices=["loss", "compute"])
    ap.add_argument(
        "--metric-chance", type=float, default=None, help="fix the link's floor (e.g. 0.25 for 4-way choice)"
    )
    ap.add_argument("--targets", default=None, help="budgets to predict for (default: the preset's targets.txt)")
    ap.add_argument("--approach", default="2,3")
    ap.add_argument("--bootstrap", type=int, default=100, help="bootstrap replicates (0: none)")
    ap.add_argument(
        "--bootstrap-method",
        default="auto",
        choices=METHODS,
        help="auto: stable-runs (a cluster bootstrap) when the table names stable runs, else within-budget on an "
        "IsoFLOP grid, runs (Approach 3) on a scattered table",
    )
    ap.add_argument("--level", type=float, default=0.95)
    ap.add_argument("--huber-delta", type=float, default=1e-3, help="<= 0: plain least squares")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None, help="output directory (default: <results dir>/fit)")
    ap.add_argument(
        "--wandb",
        nargs="?",
        const="auto",
        default=read("LMFORGE_SCALING_WANDB", "disabled"),
        choices=["auto", "online", "offline", "disabled"],
        help="log the fit to W&B (bare --wandb: auto = online with an API key, offline without; as logging.wandb.mode)",
    )
    ap.add_argument("--wandb-project", default="lmforge")
    ap.add_argument("--group", default=None, help="W&B group (default: the sweep's name)")
    args = ap.parse_args(argv)
    obs, src, source, metric = _read_observations(args)
    if args.bootstrap and args.bootstrap_method != "auto":  # an explicit method the table cannot support: refused now
        # deferred: a subcommand's module loads only when it runs (`--help` stays light)
        from lmforge.scaling.approach2 import binned

        # deferred: a subcommand's module loads only when it runs (`--help` stays light)
        from lmforge.scaling.bootstrap import SCATTERED, check_method, design_of

        check_method(obs, args.bootstrap_method, args.bins)
        if design_of(obs) == SCATTERED:
            check_method(binned(obs, args.bins), args.bootstrap_method, args.bins)
    targets_file = src.parent / "targets.txt"
    targets = (
        _floats(args.targets) if args.targets else (_floats(targets_file.read_text()) if targets_file.exists() else [])
    )
    out = args.out or src.parent / "fit"
    report = fit_all(
        obs,
        targets,
        [a.strip() for a in args.approach.split(",")],
        args.bootstrap,
        args.level,
        args.seed,
        args.huber_delta if args.huber_delta > 0 else None,
        out,
        args.bootstrap_method,
        args.bins,
        source,
    )
    if metric is not None:
        # deferred: a subcommand's module loads only when it runs (`--help` stays light)
        from lmforge.scaling.report import add_downstream

        add_downstream(
            report,
            obs,
            metric,
            args.metric_col,
            args.metric_against,
            args.metric_chance,
            min(args.bootstrap, 100),
            args.level,
            args.seed,
        )
        if out is not None:
            write_report(report, out)
    print(summary_text(report))
    if args.wandb != "disabled":
        # deferred: a subcommand's module loads only when it runs (`--help` stays light)
        from lmforge.scaling.fit_wandb import log_fit

        group = args.group or _sweep_name(src.parent)
        wandb_dir = log_fit(
            report, obs, mode=args.wandb, project=args.wandb_project, group=group, out_dir=out, say=print
        )
        if wandb_dir:
            print(f"W&B: {wandb_dir}")
    return 1 if report.errors else 0


SWEEP_VERBS = {"plan": cmd_plan, "run": cmd_run, "status": cmd_status, "collect": cmd_collect}
SCALING_VERBS = {"fit": cmd_fit}


def _dispatch(table, prog: str, argv: Optional[Sequence[str]]) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        return 0
    sub = table.get(argv[0])
    if sub is None:
        print(f"{prog}: unknown subcommand '{argv[0]}'; choose one of {', '.join(table)}", file=sys.stderr)
        return 2
    try:
        return sub(argv[1:])
    except ScalingError as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return 2


def sweep_main(argv: Optional[Sequence[str]] = None) -> int:
    return _dispatch(SWEEP_VERBS, "lmforge sweep", argv)


def scaling_main(argv: Optional[Sequence[str]] = None) -> int:
    return _dispatch(SCALING_VERBS, "lmforge scaling", argv)
