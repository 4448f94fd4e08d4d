"""DeepSpeed checkpoints inside the platform's checkpoint policy, loaded without arbitrary unpickling.

A DeepSpeed checkpoint is a normal lmforge checkpoint directory (``step-N/`` with ``state.json`` and
``COMPLETE``, committed atomically by ``CheckpointManager``, same retention and resume rules) whose tensors
are DeepSpeed's own per-rank files under ``step-N/deepspeed/`` plus the per-rank RNG states as DCP in
``step-N/``; the sidecar says ``"format": "deepspeed"`` and records the ZeRO stage and data-parallel size.

DeepSpeed saves with ``torch.save`` and loads with ``torch.load(weights_only=False)``. Every load here runs
inside ``safe_io.weights_only_loads()``, which forces ``weights_only=True`` for every ``torch.load`` call and
allows exactly the three non-tensor types DeepSpeed pickles (``safe_io.DEEPSPEED_GLOBALS``); anything else is
refused (``UnsafeCheckpointError``). The RNG tensors and native checkpoints are read with ``safe_io.load_dcp``.

Changing the data-parallel size on resume converts the checkpoint to DeepSpeed's universal layout
(``ds_to_universal``, on rank 0, into a temporary directory beside it) and loads that.
"""
from __future__ import annotations

import contextlib
import io
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Dict

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from lmforge.checkpoint.rng import announce_missing, loadable_rng_state, rng_state_tensors, set_rng_state_tensors
from lmforge.checkpoint.safe_io import load_dcp, tensor_metadata, weights_only_loads
from lmforge.parallel.deepspeed_engine import DS_TAG  # the sub-directory holding DeepSpeed's files

FORMAT = "deepspeed"


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def is_deepspeed_engine(engine: Any) -> bool:
    return engine is not None and hasattr(engine, "save_checkpoint") and hasattr(engine, "ds")


def sidecar_fields(engine: Any) -> Dict[str, Any]:
    return {"format": FORMAT, "zero_stage": int(engine.stage), "dp_size": int(engine.dp_size)}


def save(engine: Any, tmp: Path) -> None:
    """Every rank: DeepSpeed's partitions into ``tmp/deepspeed/`` and this rank's RNG states (DCP) into ``tmp``."""
    engine.save_checkpoint(tmp)
    dcp.save(rng_state_tensors(_rank()), checkpoint_id=str(tmp))


def to_universal(src: Path, dst: Path) -> Path:
    """Convert ``src/deepspeed`` (ZeRO-1/2/3, any DP size) to the universal layout in ``dst/deepspeed``."""
    from deepspeed.checkpoint.ds_to_universal import main as ds_to_universal

    dst.mkdir(parents=True, exist_ok=True)
    args = SimpleNamespace(input_folder=str(Path(src) / DS_TAG), output_folder=str(dst / DS_TAG),
                           num_extract_workers=1, num_merge_workers=1, keep_temp_folder=False, strict=True,
                           inject_missing_state=True)
    sink = io.StringIO()  # its prints and progress bars; failures still raise
    with weights_only_loads(), contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
        ds_to_universal(args)
    return dst


def _restore_rng(path: Path) -> None:
    state, missing = loadable_rng_state(_rank(), tensor_metadata(path))
    announce_missing(path, missing)
    load_dcp(state, path)
    set_rng_state_tensors(state, _rank())


def load(engine: Any, path: Path, sidecar: dict, restore_rng: bool = True) -> None:
    """Load a DeepSpeed checkpoint into ``engine`` at any data-parallel size."""
    path = Path(path)
    same_world = sidecar.get("world_size") == _world()
    if sidecar.get("dp_size", sidecar.get("world_size")) == engine.dp_size:
        with weights_only_loads():
            engine.load_checkpoint(path)
    else:
        universal = path.parent / f".universal-{path.name}"
        if _rank() == 0:
            shutil.rmtree(universal, ignore_errors=True)
            to_universal(path, universal)
        _barrier()
        try:
            with weights_only_loads():
                engine.load_checkpoint(universal, universal=True)
        finally:
            _barrier()
            if _rank() == 0:
                shutil.rmtree(universal, ignore_errors=True)
    if restore_rng and same_world:
        _restore_rng(path)


def load_native(engine: Any, path: Path, sidecar: dict, restore_rng: bool = True) -> None:
    """Continue a DeepSpeed run from a native (DCP) checkpoint: every rank reads the full parameters and
    AdamW moments by name and keeps its ZeRO fragment (``DeepSpeedEngine.load_full_state``)."""
    meta = tensor_metadata(path)
    names = [n for n, _ in engine.inner.named_parameters()]
    keys = [f"model.{n}" for n in names] + [f"optim.state.{n}.{k}" for n in names for k in ("exp_avg", "exp_avg_sq", "step")]
    missing = [k for k in keys if k not in meta]
    if missing:
        raise ValueError(f"native checkpoint {path} lacks {len(missing)} tensors this model needs, e.g. {missing[:3]}")
    flat = {k: torch.empty(tuple(meta[k].size), dtype=meta[k].properties.dtype) for k in keys}
    load_dcp(flat, path, no_dist=True)
    steps = {int(float(flat[f"optim.state.{n}.step"])) for n in names}
    if len(steps) != 1:
        raise ValueError(f"native checkpoint {path}: AdamW step counts differ between parameters: {sorted(steps)}")
    engine.load_full_state({n: flat[f"model.{n}"] for n in names},
                           {n: {k: flat[f"optim.state.{n}.{k}"] for k in ("exp_avg", "exp_avg_sq")} for n in names},
                           steps.pop())
    if restore_rng and sidecar.get("world_size") == _world():
        _restore_rng(path)
