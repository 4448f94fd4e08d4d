"""``index_build.build_for``: a run's megatron-core indices built before any process group, under the cache
lock. Two processes race on a fresh index directory: exactly one builds, the other waits on the lock (no
shared process group, so no collective timeout) and loads the same files; both read identical samples."""

from __future__ import annotations

import pytest


def test_build_for_refuses_inside_a_process_group(tmp_path, data_cache):
    import torch.distributed as dist

    from lmforge.config.compose import compose
    from lmforge.config.validate import validate
    from lmforge.data.index_build import build_for

    cfg = validate(compose(["model=tiny", f"data.cache_dir={data_cache}", f"run.root={tmp_path}"]))
    # Other data tests in this process may already hold one (tests/data_support.py ensure_world); then use it.
    mine = not dist.is_initialized()
    if mine:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with pytest.raises(RuntimeError, match="before the process group exists"):
            build_for(cfg)
    finally:
        if mine:
            dist.destroy_process_group()
