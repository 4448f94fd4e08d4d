"""Multi-rank benchmark plumbing shared by benchmarks/context_parallel.py and benchmarks/expert_parallel.py:
spawn ``world`` local gloo ranks, build each one's NativeEngine, and bring rank 0's result back."""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
from typing import Callable, List, Sequence


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def engine_on_rank(rank: int, world: int, port: int, overrides: List[str], threads: int):
    """In a spawned rank: the torch.distributed environment, threads, the validated config, the process group
    and the engine. Returns (cfg, engine); the caller ends with ``destroy_process_group()``."""
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    import torch

    from lmforge.comm.process_group import init_process_group
    from lmforge.config.compose import compose
    from lmforge.config.validate import validate
    from lmforge.parallel.native_engine import NativeEngine
    from lmforge.runtime.hardware import pin_threads

    pin_threads(threads, world)
    cfg = validate(compose(overrides), world_size=world)
    device = torch.device("cpu")
    init_process_group(cfg.comm, device)
    return cfg, NativeEngine(cfg, device)


def run_on_ranks(target: Callable, world: int, args: Sequence, what: str) -> dict:
    """Start ``target(rank, world, port, *args, queue)`` on ``world`` spawned ranks; return what rank 0 puts on
    the queue, or raise naming ``what`` once a rank has died."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=target, args=(r, world, port, *args, queue)) for r in range(world)]
    for p in procs:
        p.start()
    result = None
    while result is None:
        try:
            result = queue.get(timeout=5)
        except Exception:  # queue.Empty: stop waiting once a rank has died
            failed = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            if failed:
                raise RuntimeError(f"{what}: a rank exited with {failed}") from None
    for p in procs:
        p.join(timeout=120)
    return result
