"""Save and load training state with torch.distributed.checkpoint (DCP).

Tensors (model, optimizer, per-rank RNG states) go through DCP, which reshards between parallel layouts.
Everything else (step, data position, scheduler step, config, W&B run id, counters) goes into the JSON
sidecar ``state.json``. Nothing is unpickled on load: DCP is loaded with ``weights_only`` semantics and
the sidecar is JSON.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any, Callable, Dict, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_state_dict, set_state_dict)

from lmforge.checkpoint.layout import (COMPLETE, PINNED, SIDECAR, complete_checkpoints, latest, step_dir, tmp_dir)
from lmforge.checkpoint.rng import rng_state_tensors, set_rng_state_tensors
from lmforge.config.checkpoint import CheckpointConfig


class CheckpointError(RuntimeError):
    pass


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


class CheckpointManager:
    def __init__(self, root: Path, cfg: CheckpointConfig):
        self.root = root
        self.cfg = cfg
        # Test hook: called on rank 0 between writing the DCP shards and committing (see tests/e2e).
        self.before_commit: Optional[Callable[[Path], None]] = None

    # ---- save -------------------------------------------------------------------------------------
    def tensor_state(self, model: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer]) -> Dict[str, Any]:
        if optimizer is not None:
            msd, osd = get_state_dict(model, optimizer)
        else:
            msd, osd = get_state_dict(model, [])[0], {}
        state: Dict[str, Any] = {"model": msd, "optim": osd}
        state.update(rng_state_tensors(_rank()))
        return state

    def save(self, step: int, model: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer], sidecar: dict) -> Path:
        final = step_dir(self.root, step)
        tmp = tmp_dir(self.root, step)
        if _rank() == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            if tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir(parents=True)
        _barrier()
        dcp.save(self.tensor_state(model, optimizer), checkpoint_id=str(tmp))
        _barrier()
        if _rank() == 0:
            if self.before_commit is not None:
                self.before_commit(tmp)
            side = tmp / SIDECAR
            side.write_text(json.dumps({"step": step, **sidecar}, indent=1, sort_keys=True))
            (tmp / COMPLETE).write_text(str(step))
            _fsync_dir(tmp)
            if final.exists():  # a re-save of the same step (e.g. preemption right after a periodic save)
                shutil.rmtree(final)
            os.replace(tmp, final)
            _fsync_dir(self.root)
            self.apply_retention()
        _barrier()
        return final

    def apply_retention(self) -> None:
        """Keep the newest ``keep_last``, every ``keep_every``-th step, and anything pinned."""
        done = complete_checkpoints(self.root)
        keep = set(done[-self.cfg.keep_last:]) if self.cfg.keep_last > 0 else set()
        for path in done:
            step = int(path.name.split("-")[1])
            if self.cfg.keep_every and step % self.cfg.keep_every == 0:
                keep.add(path)
            if (path / PINNED).exists():
                keep.add(path)
        for path in done:
            if path not in keep:
                shutil.rmtree(path, ignore_errors=True)
        for stale in self.root.glob(".tmp-step-*"):
            shutil.rmtree(stale, ignore_errors=True)

    @staticmethod
    def pin(path: Path, reason: str) -> None:
        (path / PINNED).write_text(reason)

    # ---- load -------------------------------------------------------------------------------------
    def resolve(self, resume: str) -> Optional[Path]:
        """``auto``: newest complete checkpoint or None; ``none``: None; else an explicit directory."""
        if resume == "none":
            return None
        if resume == "auto":
            return latest(self.root)
        path = Path(resume).expanduser()
        if path.is_dir() and not (path / COMPLETE).exists():
            inner = latest(path)
            if inner is not None:
                return inner
        if not (path / COMPLETE).exists():
            raise CheckpointError(f"train.resume={resume}: not a complete checkpoint (no {COMPLETE} marker). "
                                  f"Fix: point at a step-NNNNNNNN directory or its parent, or use train.resume=auto")
        return path

    def load(self, path: Path, model: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer],
             restore_rng: bool = True) -> dict:
        sidecar = json.loads((path / SIDECAR).read_text())
        state = self.tensor_state(model, optimizer)
        rng_keys = [k for k in state if k.startswith("rng/")]
        saved_world = sidecar.get("world_size")
        same_world = saved_world == (dist.get_world_size() if dist.is_initialized() else 1)
        if not (restore_rng and same_world):
            for k in rng_keys:
                state.pop(k)
        try:
            dcp.load(state, checkpoint_id=str(path))
        except Exception as e:  # DCP raises RuntimeError/CheckpointException wrapping per-rank failures
            raise CheckpointError(mismatch_message(path, e)) from None
        opts = StateDictOptions(strict=True)
        if optimizer is not None:
            set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"], options=opts)
        else:
            set_state_dict(model, [], model_state_dict=state["model"], optim_state_dict={}, options=opts)
        if restore_rng and same_world:
            set_rng_state_tensors(state, _rank())
        return sidecar


def mismatch_message(path: Path, err: Exception) -> str:
    text = str(err)
    lines = [ln.strip() for ln in text.splitlines() if "size mismatch" in ln or "Missing key" in ln
             or "shape" in ln.lower() or "missing" in ln.lower()]
    detail = "; ".join(dict.fromkeys(lines)) or text.splitlines()[0] if text else type(err).__name__
    return (f"checkpoint {path} does not fit this model: {detail[:2000]}. Fix: resume with the model config the "
            f"checkpoint was saved with (see its state.json 'config'), or start a new run (train.resume=none)")


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass
