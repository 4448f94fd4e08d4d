"""DeepSpeed checkpoints inside the platform's checkpoint policy, loaded without arbitrary unpickling.

A DeepSpeed checkpoint is a normal lmforge checkpoint directory (``step-N/`` with ``state.json`` and
``COMPLETE``, committed atomically by ``CheckpointManager``, same retention and resume rules) whose tensors
are DeepSpeed's own per-rank files under ``step-N/deepspeed/`` plus the per-rank RNG states as DCP in
``step-N/``; the sidecar says ``"format": "deepspeed"`` and records the ZeRO stage and data-parallel size.
``DeepSpeedStateIO`` is this format's ``StateIO`` (checkpoint/state_io.py), chosen by ``CheckpointManager`` when
the engine's ``StateLayout.format`` is ``"deepspeed"``; it talks to the engine only through
``parallel.contract.OwnFilesState`` (``save_checkpoint``, ``load_checkpoint``, ``load_full_state``).

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
from typing import Any, Dict, Optional

import torch
import torch.distributed.checkpoint as dcp

from lmforge.checkpoint.rng import announce_missing, loadable_rng_state, rng_state_tensors, set_rng_state_tensors
from lmforge.checkpoint.safe_io import load_dcp, tensor_metadata, weights_only_loads
from lmforge.parallel.contract import DEEPSPEED, OwnFilesState
from lmforge.parallel.deepspeed_engine import DS_TAG  # the sub-directory holding DeepSpeed's files
from lmforge.runtime.dist import barrier, rank, world_size

FORMAT = DEEPSPEED


class DeepSpeedStateIO:
    """The DeepSpeed format for an engine that writes its own files (``parallel.contract.OwnFilesState``)."""

    def __init__(self, engine: OwnFilesState, sidecar: Optional[Dict[str, Any]] = None):
        self.engine = engine
        self.layout_fields = dict(sidecar or {})  # the engine's StateLayout.sidecar: zero_stage, dp_size

    def sidecar_fields(self) -> Dict[str, Any]:
        return {"format": FORMAT, **self.layout_fields}

    def save(self, directory: Path, writer: Any = None, async_kind: Any = None, group: Any = None) -> None:
        """Synchronous (DeepSpeed writes with ``torch.save``); the DCP writer and async mode do not apply."""
        save(self.engine, directory)

    def load(self, path: Path, sidecar: dict, restore_rng: bool = True) -> None:
        """A DeepSpeed checkpoint at any data-parallel size, or a native one continued by DeepSpeed."""
        reader = load if sidecar.get("format") == FORMAT else load_native
        reader(self.engine, path, sidecar, restore_rng)


def save(engine: OwnFilesState, tmp: Path) -> None:
    """Every rank: DeepSpeed's partitions into ``tmp/deepspeed/`` and this rank's RNG states (DCP) into ``tmp``."""
    engine.save_checkpoint(tmp)
    dcp.save(rng_state_tensors(rank()), checkpoint_id=str(tmp))


def to_universal(src: Path, dst: Path) -> Path:
    """Convert ``src/deepspeed`` (ZeRO-1/2/3, any DP size) to the universal layout in ``dst/deepspeed``."""
    from deepspeed.checkpoint.ds_to_universal import main as ds_to_universal

    dst.mkdir(parents=True, exist_ok=True)
    args = SimpleNamespace(
        input_folder=str(Path(src) / DS_TAG),
        output_folder=str(dst / DS_TAG),
        num_extract_workers=1,
        num_merge_workers=1,
        keep_temp_folder=False,
        strict=True,
        inject_missing_state=True,
    )
    sink = io.StringIO()  # its prints and progress bars; failures still raise
    with weights_only_loads(), contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
        ds_to_universal(args)
    return dst


def _restore_rng(path: Path) -> None:
    state, missing = loadable_rng_state(rank(), tensor_metadata(path))
    announce_missing(path, missing)
    load_dcp(state, path)
    set_rng_state_tensors(state, rank())


def load(engine: OwnFilesState, path: Path, sidecar: dict, restore_rng: bool = True) -> None:
    """Load a DeepSpeed checkpoint into ``engine`` at any data-parallel size."""
    path = Path(path)
    same_world = sidecar.get("world_size") == world_size()
    if sidecar.get("dp_size", sidecar.get("world_size")) == engine.dp_size:
        with weights_only_loads():
            engine.load_checkpoint(path)
    else:
        universal = path.parent / f".universal-{path.name}"
        if rank() == 0:
            shutil.rmtree(universal, ignore_errors=True)
            to_universal(path, universal)
        barrier()
        try:
            with weights_only_loads():
                engine.load_checkpoint(universal, universal=True)
        finally:
            barrier()
            if rank() == 0:
                shutil.rmtree(universal, ignore_errors=True)
    if restore_rng and same_world:
        _restore_rng(path)


def load_native(engine: OwnFilesState, path: Path, sidecar: dict, restore_rng: bool = True) -> None:
    """Continue a DeepSpeed run from a native (DCP) checkpoint: every rank reads the full parameters and
    AdamW moments by name and keeps its ZeRO fragment (``DeepSpeedEngine.load_full_state``)."""
    meta = tensor_metadata(path)
    names = [n for n, _ in engine.inner.named_parameters()]
    keys = [f"model.{n}" for n in names] + [
        f"optim.state.{n}.{k}" for n in names for k in ("exp_avg", "exp_avg_sq", "step")
    ]
    missing = [k for k in keys if k not in meta]
    if missing:
        raise ValueError(f"native checkpoint {path} lacks {len(missing)} tensors this model needs, e.g. {missing[:3]}")
    flat = {k: torch.empty(tuple(meta[k].size), dtype=meta[k].properties.dtype) for k in keys}
    load_dcp(flat, path, no_dist=True)
    steps = {int(float(flat[f"optim.state.{n}.step"])) for n in names}
    if len(steps) != 1:
        raise ValueError(f"native checkpoint {path}: AdamW step counts differ between parameters: {sorted(steps)}")
    engine.load_full_state(
        {n: flat[f"model.{n}"] for n in names},
        {n: {k: flat[f"optim.state.{n}.{k}"] for k in ("exp_avg", "exp_avg_sq")} for n in names},
        steps.pop(),
    )
    if restore_rng and sidecar.get("world_size") == world_size():
        _restore_rng(path)
