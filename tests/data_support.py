"""Helpers shared by the data tests and their rank processes: a world of one, a mixture, a batch stream."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Dict, List, Optional

import torch

from lmforge.config.batch import batch_plan
from lmforge.config.data import DataConfig, DataSourceConfig

THREE_SOURCES = {"books": 0.5, "code": 0.3, "reference": 0.2}


def ensure_world() -> None:
    """megatron-core's builder needs an initialised process group: a gloo world of one on a file store."""
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)


def data_config(
    cache: Path,
    weights: Dict[str, float],
    paths: Optional[Dict[str, str]] = None,
    valid_fraction: float = 0.02,
    tokenizer: str = "embedded",
) -> DataConfig:
    paths = paths or {n: f"embedded:{n}" for n in weights}
    return DataConfig(
        sources={n: DataSourceConfig(paths[n], w) for n, w in weights.items()},
        tokenizer=tokenizer,
        cache_dir=str(cache),
        valid_fraction=valid_fraction,
    )


def make_stream(
    cache: Path,
    weights: Dict[str, float],
    seq_len: int,
    micro: int,
    global_batch: int,
    dp: int,
    dp_rank: int,
    num_train_samples: int,
    seed: int = 1234,
    total: Optional[int] = None,
    paths: Optional[Dict[str, str]] = None,
):
    from lmforge.data.loader import BatchStream
    from lmforge.data.mixture import build_mixture
    from lmforge.data.tokenizer import load_tokenizer

    ensure_world()
    cfg = data_config(cache, weights, paths)
    tok = load_tokenizer(cfg.tokenizer, cache)
    mixture = build_mixture(
        cfg,
        tok,
        seq_len=seq_len,
        seed=seed,
        num_train_samples=num_train_samples,
        num_valid_samples=micro * dp,
        cache_dir=cache,
        total_train_samples=total,
    )
    plan = batch_plan(micro, global_batch, dp, seq_len)
    return BatchStream(mixture, plan, dp_rank=dp_rank, device=torch.device("cpu"))


def step_records(stream, steps: int) -> List[List[dict]]:
    """Per step, this rank's samples as (global index, source id, token checksum) in consumption order."""
    out = []
    for _ in range(steps):
        c = stream.state.consumed_samples
        batches = stream.step_batches()
        recs = []
        for j, mb in enumerate(batches):
            for idx, sid, row in zip(stream.sample_indices(c, j), mb.source_ids, mb.tokens):
                recs.append({"i": idx, "src": sid, "sum": int(row.sum()), "head": row[:8].tolist()})
        out.append(recs)
    return out


def rank_stream(cache: str, steps: int, seq_len: int, micro: int, global_batch: int, n: int, seed: int = 4321) -> dict:
    """Run inside a real gloo rank (tests/harness.run_ranks): this rank's slice of the global stream."""
    from lmforge.comm.process_group import init_process_group
    from lmforge.config.comm import CommConfig

    os.environ["LMFORGE_DATA_CACHE"] = cache
    world = init_process_group(CommConfig(backend="gloo"), torch.device("cpu"))
    stream = make_stream(
        Path(cache), THREE_SOURCES, seq_len, micro, global_batch, world.world_size, world.rank, n, seed
    )
    return {"rank": world.rank, "steps": step_records(stream, steps)}


def rank_check_visible(caches: List[str]) -> str:
    """Each rank looks at its own cache dir, as nodes with node-local caches would."""
    from lmforge.comm.process_group import init_process_group
    from lmforge.config.comm import CommConfig
    from lmforge.data.index_cache import check_visible

    world = init_process_group(CommConfig(backend="gloo"), torch.device("cpu"))
    check_visible(Path(caches[world.rank]) / "index")
    return "visible"
