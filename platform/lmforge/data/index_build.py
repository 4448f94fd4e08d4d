"""Every megatron-core index a launch uses, built in one process before any process group exists
(:func:`build_for`), under the index cache's lock (:mod:`lmforge.data.index_cache`): the batch script's prepare
step calls it, so the ranks find every index built and never wait for a build inside a collective."""

from __future__ import annotations

import contextlib
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, List, Optional

from lmforge.data.file_lock import file_lock
from lmforge.data.mixture import build_mixture
from lmforge.data.sources import default_cache_dir
from lmforge.data.stream_size import stream_sizes
from lmforge.data.tokenizer import load_tokenizer


@dataclass
class BuildReport:
    index_dir: Path
    built: List[str] = field(default_factory=list)  # cache sets (description files) this call wrote
    present: List[str] = field(default_factory=list)  # every description file after the call
    lock_wait_s: float = 0.0  # time spent waiting for another builder's lock (never inside a collective)
    mixture: object = None  # the built Mixture, for callers that train or compare samples


@contextlib.contextmanager
def _private_world() -> Iterator[None]:
    """A process group of this process alone (megatron-core's blended index build calls ``get_rank()``): its
    collectives have no peer to wait for."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def build_for(cfg, prior_state: Optional[dict] = None) -> BuildReport:
    """Build (or load) every megatron-core index a launch of ``cfg`` (a RootConfig) uses, in this process.

    Call it with no process group (the batch script's prepare step, ``lmforge.launch.jobctl prepare``; it
    makes a one-process group of its own for megatron-core, which calls ``get_rank()``): the
    embedded shards are prepared under their lock and the indices built under ``index/.build.lock``; a
    concurrent caller waits on the lock and then loads the same files. ``prior_state`` is a checkpoint's data
    state (its ``num_train_samples`` fixes the index size on resume). Writes nothing to stdout (the prepare
    step's stdout is evaluated by the shell)."""
    from lmforge.config.validate import check_batch  # deferred: imports omegaconf; this module imports without it
    from lmforge.runtime.dist import is_distributed  # deferred: imports torch; this module imports without it

    if is_distributed():
        raise RuntimeError(
            "index_cache.build_for runs before the process group exists (it must not wait in a "
            "collective); call it from the job's prepare step"
        )
    plan = check_batch(cfg)
    cache = default_cache_dir(cfg.data, cfg.run.root)
    index_dir = cache / "index"
    index_dir.mkdir(parents=True, exist_ok=True)
    with contextlib.redirect_stdout(sys.stderr), _private_world():
        tokenizer = load_tokenizer(cfg.data.tokenizer, cache)
        n, total = stream_sizes(
            cfg.train, plan.tokens_per_step, plan.global_batch_size, cfg.model.seq_len, prior_state=prior_state
        )
        t0 = time.perf_counter()
        # One lock for the whole build (build_mixture is told not to take it again: a second flock on a new
        # descriptor of the same file would wait for this process itself).
        with file_lock(index_dir / ".build.lock"):
            waited = time.perf_counter() - t0
            before = {p.name for p in index_dir.glob("*-description.txt")}
            mixture = build_mixture(
                cfg.data,
                tokenizer,
                seq_len=cfg.model.seq_len,
                seed=cfg.train.seed,
                num_train_samples=n,
                num_valid_samples=cfg.train.eval_batches * plan.micro_batch_size * plan.dp_size,
                cache_dir=cache,
                total_train_samples=total,
                guard=False,
            )
            after = sorted(p.name for p in index_dir.glob("*-description.txt"))
    return BuildReport(index_dir, sorted(set(after) - before), after, waited, mixture)
