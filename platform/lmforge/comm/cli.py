"""lmforge comm bench: collective bandwidth over the current world (run it under torchrun or srun).

    torchrun --nproc_per_node=8 -m lmforge.cli comm bench comm=single_node
    srun --ntasks-per-node=8 lmforge comm bench comm=infiniband --floor-gbps 300 --max-bytes 1G
    torchrun --nproc_per_node=2 -m lmforge.cli comm bench comm=cpu_gloo --device cpu --max-bytes 4M   # CPU, gloo

Arguments with = are Hydra overrides of the config (the comm preset is exported exactly as training does).
Rank 0 prints an nccl-tests-style table and writes --out (JSON) plus the same table as .txt.
Exit status 0: passed the floor (or no floor); 1: below the floor; 2: bad arguments or config, or a world of one
process (no peer to move bytes to: nothing to measure).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import List, Sequence

from lmforge.config.errors import ConfigError
from lmforge.runtime.env_vars import launch_world_size, launched, local_rank

WORLD_OF_ONE = (
    "lmforge comm bench: world size 1: one process has no peer to move bytes to, so there is no bandwidth to "
    "measure. Fix: run it under a launcher, e.g. torchrun --nproc_per_node=2 -m lmforge.cli comm bench ..."
)


def _parser() -> argparse.ArgumentParser:
    from lmforge.comm.bench import OPS  # deferred: a subcommand's module loads only when it runs (`--help` stays light)

    p = argparse.ArgumentParser(prog="lmforge comm bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--ops", default=",".join(OPS), help=f"comma-separated subset of {','.join(OPS)}")
    p.add_argument("--min-bytes", default="8", help="smallest message (e.g. 8, 4K)")
    p.add_argument("--max-bytes", default="16M", help="largest message (e.g. 64M, 1G)")
    p.add_argument("--factor", type=int, default=2, help="size multiplier between steps of the sweep")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument(
        "--floor-gbps",
        type=float,
        default=None,
        help="bus-bandwidth floor in GB/s (default: comm.preflight_floor_gbps)",
    )
    p.add_argument("--floor-ops", default=None, help="ops the floor applies to (default: comm.preflight_floor_ops)")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--out", default="comm_bench.json", help="JSON result (rank 0); the table goes beside it as .txt")
    p.add_argument("--run-dir", default=None, help="also record the exported environment in RUN_DIR/comm_env.json")
    p.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. comm=infiniband comm.env.NCCL_ALGO=Ring")
    return p


def bench_main(argv: Sequence[str]) -> int:
    args = _parser().parse_args(list(argv))
    from omegaconf import OmegaConf

    # deferred: a subcommand's module loads only when it runs (`--help` stays light)
    from lmforge.comm.bench import OPS, parse_size, run_bench, size_sweep

    # deferred: a subcommand's module loads only when it runs (`--help` stays light)
    from lmforge.comm.process_group import destroy_process_group, init_process_group

    # deferred: a subcommand's module loads only when it runs (`--help` stays light)
    from lmforge.config.comm import CommConfig

    # deferred: a subcommand's module loads only when it runs (`--help` stays light)
    from lmforge.config.comm_checks import check_comm

    # deferred: a subcommand's module loads only when it runs (`--help` stays light)
    from lmforge.config.compose import compose

    # deferred: a subcommand's module loads only when it runs (`--help` stays light)
    from lmforge.runtime.hardware import select_device

    try:
        ops = [o.strip() for o in args.ops.split(",") if o.strip()]
        unknown = [o for o in ops if o not in OPS]
        if unknown:
            raise ConfigError(
                "--ops", f"unknown collective(s) {', '.join(unknown)}", f"use a subset of {','.join(OPS)}"
            )
        cfg = compose(args.overrides)
        comm: CommConfig = OmegaConf.to_object(
            OmegaConf.merge(OmegaConf.structured(CommConfig), OmegaConf.to_container(cfg.comm, resolve=True))
        )
        check_comm(comm, args.device)
        sizes = size_sweep(parse_size(args.min_bytes), parse_size(args.max_bytes), args.factor)
    except (ConfigError, ValueError) as e:
        print(f"lmforge comm bench: {e}", file=sys.stderr)
        return 2
    if not launched() or launch_world_size() == 1:
        print(WORLD_OF_ONE, file=sys.stderr)
        return 2
    device = select_device(args.device, local_rank())
    world = init_process_group(comm, device, run_dir=Path(args.run_dir) if args.run_dir else None)
    try:
        result = run_bench(ops, sizes, args.iters, args.warmup, device)
        floor = comm.preflight_floor_gbps if args.floor_gbps is None else args.floor_gbps
        floor_ops = [o.strip() for o in (args.floor_ops or comm.preflight_floor_ops).split(",")]
        result.check_floor(floor, floor_ops)
        if world.rank == 0:
            print(result.table(), flush=True)
            result.write(Path(args.out))
    finally:
        destroy_process_group()
    return 0 if result.passed else 1


def main(argv: Sequence[str]) -> int:
    argv: List[str] = list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        print("\nsubcommands: bench")
        return 0
    if argv[0] == "bench":
        return bench_main(argv[1:])
    print(f"lmforge comm: unknown subcommand '{argv[0]}'; subcommands: bench", file=sys.stderr)
    return 2
