"""``lmforge launch``: start training locally under torchrun, or submit it to Slurm.

lmforge launch --nproc 2 +exp=smoke parallelism=ddp       local torchrun, N processes (CPU or GPU)
lmforge launch --slurm --nodes 2 +exp=gpt_1b              sbatch slurm/train.sh +exp=gpt_1b
lmforge launch --slurm --submitit +exp=gpt_1b             the same, through submitit (sweeps, Python callers)
lmforge launch [--slurm] --dry-run ...                    print what would run / be submitted
"""

from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Optional, Sequence


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="lmforge launch",
        description=__doc__.splitlines()[0],
        epilog="Everything not an option is a Hydra override passed to lmforge.train.",
    )
    p.add_argument("--nproc", type=int, default=None, help="local processes (default: cluster.gpus_per_node)")
    p.add_argument("--max-restarts", type=int, default=None, help="torchrun restarts (default: fault.max_restarts)")
    p.add_argument("--slurm", action="store_true", help="submit slurm/train.sh with sbatch instead of running here")
    p.add_argument("--nodes", type=int, default=None, help="Slurm nodes (default: cluster.nodes)")
    p.add_argument(
        "--time", type=int, default=None, help="Slurm time limit in minutes (default: cluster.time_limit_min)"
    )
    p.add_argument("--submitit", action="store_true", help="with --slurm: submit through submitit (Python API)")
    p.add_argument("--submitit-folder", default="runs/submitit", help="submitit's job folder")
    p.add_argument("--sbatch-arg", action="append", default=[], help="extra sbatch option, repeatable")
    p.add_argument("--dry-run", action="store_true", help="print the command (and sbatch script) and exit")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    args, overrides = parser().parse_known_args(list(sys.argv[1:] if argv is None else argv))
    bad = [o for o in overrides if o.startswith("--")]
    if bad:
        print(f"lmforge launch: unknown option {bad[0]}; see lmforge launch --help", file=sys.stderr)
        return 2
    # deferred: a subcommand's module loads only when it runs (`--help` stays light)
    from lmforge.config.errors import ActionableError

    try:
        return _launch(args, overrides)
    except ActionableError as e:  # a bad key, layout or path: one line, exit 2, before anything starts or is submitted
        print(f"lmforge launch: {e}", file=sys.stderr)
        return 2


def _launch(args: argparse.Namespace, overrides: Sequence[str]) -> int:
    if args.slurm:
        # deferred: a subcommand's module loads only when it runs (`--help` stays light)
        from lmforge.launch import slurm

        launch = slurm.plan(overrides, args.nodes, args.time, args.sbatch_arg)
        if args.dry_run:
            print(slurm.dry_run_text(launch), end="")
            return 0
        if args.submitit:
            print(slurm.submit_submitit(launch, Path(args.submitit_folder)))
        else:
            print(slurm.submit(launch))
        return 0
    # deferred: a subcommand's module loads only when it runs (`--help` stays light)
    from lmforge.config.compose import compose
    from lmforge.launch import local  # deferred: a subcommand's module loads only when it runs (`--help` stays light)
    from lmforge.trainer.startup import (
        check_start,  # deferred: a subcommand's module loads only when it runs (`--help` stays light)
    )

    # A bad task file: one line here, not in every worker (epochs: the workers')
    cfg = check_start(compose(list(overrides)), epochs=False).validated
    nproc = args.nproc or cfg.cluster.gpus_per_node
    launch = local.LocalLaunch(
        nproc=nproc,
        overrides=list(overrides),
        max_restarts=cfg.fault.max_restarts if args.max_restarts is None else args.max_restarts,
        run_id=local.new_run_id(),
        port=local.free_port(),
    )
    if args.dry_run:  # the script line, then the torchrun line it runs (its own --dry-run)
        print(shlex.join(launch.command()[3:]), flush=True)
        return subprocess.run(launch.command(dry_run=True)).returncode
    return local.run(launch, cfg.cluster.max_requeues, local.run_dir_of(cfg, launch.run_id), cfg.train.stop_at_step)


if __name__ == "__main__":
    raise SystemExit(main())
