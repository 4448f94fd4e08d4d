"""megatron-core's index cache: who builds it, where it lives, and how it is kept consistent.

- Where: ``<data cache dir>/index`` (``data.cache_dir``, else ``$LMFORGE_DATA_CACHE``, else
  ``<run.root>/../.cache/lmforge-data``). For multi-node jobs it must be on a filesystem every node sees;
  :func:`check_visible` fails fast (``data.cache_dir``) when a rank cannot see rank 0's files.
- Who: megatron-core's builder makes global rank 0 build and save the indices, holds the others at a
  barrier, then lets them load the saved files (a guaranteed cache hit).
- Never reused for other parameters: every file name starts with the md5 of a JSON description holding the
  dataset path, split, sample count, seed, sequence length and the tokenizer's ``unique_identifiers``;
  lmforge adds the tokenizer fingerprint and each shard's content digest to those identifiers, so a change
  to any of them (or a re-prepared shard at the same prefix) misses the cache and builds new files.
- Concurrency: megatron-core writes the files in place (description first, then ``np.save``), which is not
  atomic. Rank 0 therefore builds under an exclusive ``flock`` on ``index/.build.lock`` (other jobs sharing
  the cache wait), and before building it deletes any torn set (a description without all its arrays, or an
  array that does not load), so a crash mid-write is rebuilt instead of being reused.
- Outside collectives: inside a job the ranks other than 0 wait for rank 0's build at megatron-core's
  barrier, under the process group's timeout, which a big corpus's index build can exceed. :func:`build_for`
  builds everything a run's launch needs in one process with no process group, under the same lock (a
  second builder, another job or node, waits on the lock, not in a collective, then loads the files). The
  batch script's prepare step calls it (``jobctl prepare``), so the ranks find every index built
  (:mod:`lmforge.data.index_build`).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import uuid
from pathlib import Path
from typing import Dict, Iterator, List

import numpy as np

from lmforge.config.errors import ConfigError
from lmforge.data.file_lock import file_lock

log = logging.getLogger(__name__)

# The arrays megatron-core saves next to each ``<hash>-<Class>-<split>-description.txt``.
ARRAYS: Dict[str, List[str]] = {
    "GPTDataset": ["document_index.npy", "sample_index.npy", "shuffle_index.npy"],
    "BlendedDataset": ["dataset_index.npy", "dataset_sample_index.npy"],
}


def sweep_torn(index_dir: Path) -> List[str]:
    """Delete every cache set that is incomplete or unreadable; returns the hashes removed."""
    removed = []
    for desc in sorted(index_dir.glob("*-description.txt")):
        base = desc.name[: -len("description.txt")]
        cls = base.split("-")[1] if base.count("-") >= 2 else ""
        ok = True
        for affix in ARRAYS.get(cls, []):
            path = index_dir / f"{base}{affix}"
            try:
                np.load(path, mmap_mode="r", allow_pickle=False)
            except (OSError, ValueError):
                ok = False
                break
        if not ok:
            for path in index_dir.glob(f"{base}*"):
                path.unlink(missing_ok=True)
            removed.append(base.rstrip("-"))
    # Arrays whose description is gone. One listing of the descriptions, not one per array: the index dir of a
    # long-lived cache holds thousands of files, and every run's rank 0 sweeps it (a glob per array was quadratic).
    described = {d.name[: d.name.find("-")] for d in index_dir.glob("*-description.txt")}
    for path in index_dir.glob("*.npy"):
        if path.name[: path.name.find("-")] not in described:
            path.unlink(missing_ok=True)
            removed.append(path.name.rsplit("-", 1)[0])
    if removed:
        log.warning("data: removed %d torn index cache set(s) in %s: %s", len(removed), index_dir, removed)
    return removed


@contextlib.contextmanager
def build_guard(index_dir: Path, lock: bool = True) -> Iterator[None]:
    """Wrap megatron-core's build on every rank: rank 0 builds under the lock (``lock=False``: the caller holds
    it already), after sweeping torn sets."""
    from lmforge.runtime.dist import rank  # deferred: runtime.dist imports torch; importing lmforge.data does not

    index_dir.mkdir(parents=True, exist_ok=True)
    if rank() != 0:
        yield
        return
    with file_lock(index_dir / ".build.lock") if lock else contextlib.nullcontext():
        sweep_torn(index_dir)
        yield


def check_visible(index_dir: Path) -> None:
    """Fail fast when the cache dir is not shared: every rank must see a file rank 0 just wrote."""
    import torch.distributed as dist

    # deferred: imports torch; this module imports without it
    from lmforge.runtime.dist import barrier, rank, world_size

    if world_size() == 1:
        return
    token = [uuid.uuid4().hex if rank() == 0 else None]
    dist.broadcast_object_list(token, src=0)
    probe = index_dir / f".visible-{token[0]}"
    if rank() == 0:
        index_dir.mkdir(parents=True, exist_ok=True)
        probe.write_text("probe")
    barrier()
    seen = probe.exists()
    flags = [None] * world_size()
    dist.all_gather_object(flags, seen)
    barrier()
    if rank() == 0:
        probe.unlink(missing_ok=True)
    blind = [r for r, f in enumerate(flags) if not f]
    if blind:
        raise ConfigError(
            "data.cache_dir",
            f"{index_dir} is not shared: ranks {blind} cannot see a file rank 0 "
            "wrote there, but rank 0 alone builds megatron-core's index cache",
            "point data.cache_dir (or $LMFORGE_DATA_CACHE) at a filesystem all nodes mount",
        )


def content_digest(prefix: Path) -> str:
    """A digest of a shard's content: its whole .idx (all lengths) plus the .bin size."""
    h = hashlib.sha256()
    with open(f"{prefix}.idx", "rb") as fh:
        for block in iter(lambda: fh.read(1 << 22), b""):
            h.update(block)
    h.update(str(Path(f"{prefix}.bin").stat().st_size).encode())
    return h.hexdigest()[:16]
