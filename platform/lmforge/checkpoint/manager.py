"""Save and load training state with torch.distributed.checkpoint (DCP).

Tensors (model, optimizer, per-rank RNG states) go through DCP, which reshards between parallel layouts.
Everything else (step, data position, scheduler, gradient scaler, config, W&B run id, counters) goes into
the JSON sidecar ``state.json``. Nothing is unpickled on load: every file is read through ``safe_io`` (DCP
tensors and allow-listed metadata types, the sidecar as JSON); a crafted file raises ``UnsafeCheckpointError``.

A save writes into ``.tmp-step-N/``; only when every rank has finished writing (for an async save: when every
rank's background write has completed) does rank 0 run the commit protocol (``checkpoint/commit.py``: files
fsynced, sidecar, ``COMPLETE``, atomic rename to ``step-N/``, an existing ``step-N/`` replaced without a
window in which neither copy is loadable). ``checkpoint.async_mode``:

- ``none``: ``dcp.save``; the loop is blocked for the whole write.
- ``thread`` / ``process``: ``dcp.async_save``; the loop is blocked only while the state is copied to CPU
  (the *stall*, returned by ``save``), then the write runs in a thread (over a dedicated gloo group, so it
  never interleaves with the training collectives) or a separate process. ``poll()`` (called once per step)
  commits it as soon as all ranks are done; ``wait()`` blocks until it is committed.
"""
from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_state_dict, set_state_dict)

from lmforge.checkpoint import deepspeed_io, fault_injection
from lmforge.checkpoint.commit import commit, make_dir, restore_asides
from lmforge.checkpoint.fault_injection import PausingWriter, pause_spec
from lmforge.checkpoint.layout import (COMPLETE, PINNED, SIDECAR, STEP_RE, aside_dir, complete_checkpoints, is_complete,
                                       latest, step_dir, step_of, tmp_dir)
from lmforge.checkpoint.retention import plan_retention
from lmforge.checkpoint.safe_io import CheckpointException, UnsafeCheckpointError, load_dcp, read_json, tensor_metadata
from lmforge.checkpoint.rng import announce_missing, loadable_rng_state, rng_state_tensors, set_rng_state_tensors
from lmforge.comm.vote import LaggedVote
from lmforge.config.checkpoint import CheckpointConfig


class CheckpointError(RuntimeError):
    pass


def _dist() -> bool:
    return dist.is_available() and dist.is_initialized()


def _barrier() -> None:
    if _dist() and dist.get_world_size() > 1:
        dist.barrier()


def _rank() -> int:
    return dist.get_rank() if _dist() else 0


def _world() -> int:
    return dist.get_world_size() if _dist() else 1


@dataclass
class SaveResult:
    step: int
    path: Path  # the final directory (visible once committed)
    stall_s: float  # how long save() blocked the caller
    committed: bool  # False while an async write is still running


@dataclass
class _Pending:
    step: int
    tmp: Path
    final: Path
    future: Any
    sidecar: dict
    started: float


class CheckpointManager:
    def __init__(self, root: Path, cfg: CheckpointConfig, engine: Any = None):
        self.root = Path(root)
        self.cfg = cfg
        self.attach_engine(engine)
        # Called on rank 0 between writing the DCP shards and committing (in-process tests).
        self.before_commit: Optional[Callable[[Path], None]] = None
        # Called on rank 0 after each commit with (step, path, write seconds); the trainer logs it.
        self.on_commit: Optional[Callable[[int, Path, float], None]] = None
        self.pending: Optional[_Pending] = None
        self._write_vote: Optional[LaggedVote] = None  # "has every rank finished the async write?" (poll)
        self._async_group = None
        if cfg.async_mode in ("thread", "process") and _dist():
            # Collective call: every rank constructs the manager at the same point of Trainer.__init__. A gloo group
            # because async_save needs a CPU backend (an NCCL-only default group is refused) and so that the
            # background thread never interleaves its collectives with the training ones.
            self._async_group = dist.new_group(backend="gloo")

    # ---- save -------------------------------------------------------------------------------------

    def attach_engine(self, engine: Any) -> None:
        """A DeepSpeed engine writes its own files (checkpoint/deepspeed_io.py); the native engine goes through DCP."""
        self.deepspeed = engine if deepspeed_io.is_deepspeed_engine(engine) else None
    def tensor_state(self, model: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer]) -> Dict[str, Any]:
        if optimizer is not None:
            msd, osd = get_state_dict(model, optimizer)
        else:
            msd, osd = get_state_dict(model, [])[0], {}
        state: Dict[str, Any] = {"model": msd, "optim": osd}
        state.update(rng_state_tensors(_rank()))
        return state

    def save(self, step: int, model: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer],
             sidecar: dict) -> SaveResult:
        t0 = time.perf_counter()
        self.wait()  # at most one save in flight; commits the previous one first
        final = step_dir(self.root, step)
        tmp = tmp_dir(self.root, step)
        if _rank() == 0:
            make_dir(self.root)
            if tmp.exists():
                shutil.rmtree(tmp)
            make_dir(tmp)
        _barrier()
        side = json.loads(json.dumps({"step": step, **sidecar}))  # a snapshot, JSON-clean
        if self.deepspeed is not None:  # DeepSpeed's save is synchronous; same commit, sidecar and retention
            side.update(deepspeed_io.sidecar_fields(self.deepspeed))
            deepspeed_io.save(self.deepspeed, tmp)
            self._commit(_Pending(step, tmp, final, None, side, t0))
            return SaveResult(step, final, time.perf_counter() - t0, committed=True)
        state = self.tensor_state(model, optimizer)
        pause_after = pause_spec(step)
        writer = PausingWriter(tmp, pause_after) if pause_after is not None else FileSystemWriter(str(tmp))
        if self.cfg.async_mode in ("thread", "process"):
            from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

            kind = AsyncCheckpointerType.PROCESS if self.cfg.async_mode == "process" else AsyncCheckpointerType.THREAD
            future = dcp.async_save(state, storage_writer=writer, async_checkpointer_type=kind,
                                    process_group=self._async_group)
            future = getattr(future, "upload_completion", future)
            self.pending = _Pending(step, tmp, final, future, side, time.perf_counter())
            return SaveResult(step, final, time.perf_counter() - t0, committed=False)
        dcp.save(state, storage_writer=writer)
        self._commit(_Pending(step, tmp, final, None, side, t0))
        return SaveResult(step, final, time.perf_counter() - t0, committed=True)

    def poll(self) -> Optional[Path]:
        """Commit the in-flight async save if every rank's write has finished; never blocks on I/O."""
        if self.pending is None:
            return None
        done = self.pending.future.done()
        if _world() > 1:
            if self._write_vote is None:
                self._write_vote = LaggedVote(_collective_device(), "all")
            done = self._write_vote.exchange(done)  # every rank done, agreed a poll later without a stall
        if not done:
            return None
        return self.wait()

    def wait(self) -> Optional[Path]:
        """Block until the in-flight async save (if any) is written by every rank, then commit it."""
        pending, self.pending = self.pending, None
        if self._write_vote is not None:
            self._write_vote.collect()  # drop a vote still in flight: the next save starts a fresh one
        if pending is None:
            return None
        try:
            pending.future.result()
        except Exception as e:  # noqa: BLE001 - a failed write must not become a checkpoint
            raise CheckpointError(f"async checkpoint save of step {pending.step} into {pending.tmp} failed on "
                                  f"rank {_rank()}: {e}. The previous complete checkpoint stays the latest") from e
        self._commit(pending)
        return pending.final

    def _commit(self, p: _Pending) -> None:
        _barrier()  # every rank has finished writing its shards
        if _rank() == 0:
            if self.before_commit is not None:
                self.before_commit(p.tmp)
            commit(p.tmp, p.final, p.step, p.sidecar,
                   on_stage=lambda stage: fault_injection.commit_stage(stage, p.step, p.final))
            self.apply_retention()
            if self.on_commit is not None:
                self.on_commit(p.step, p.final, time.perf_counter() - p.started)
        _barrier()

    def apply_retention(self) -> List[Path]:
        """Keep the newest ``keep_last``, every ``keep_every``-th step, and anything pinned. Returns deleted.

        Also finishes re-saves a crash interrupted (rank 0, after a commit): an aside copy ``.old-step-N`` with
        no ``step-N`` is renamed back, one whose ``step-N`` is complete again is deleted."""
        restore_asides(self.root)
        done = {step_of(p): p for p in complete_checkpoints(self.root)}
        pinned = [s for s, p in done.items() if (p / PINNED).exists()]
        _, delete = plan_retention(done, self.cfg.keep_last, self.cfg.keep_every, pinned)
        for step in sorted(delete):
            shutil.rmtree(done[step], ignore_errors=True)
        in_flight = self.pending.tmp if self.pending is not None else None
        for stale in self.root.glob(".tmp-step-*"):
            if stale != in_flight:
                shutil.rmtree(stale, ignore_errors=True)
        return [done[s] for s in sorted(delete)]

    # ---- pins (the loss guard and users protect checkpoints from retention) ------------------------
    @staticmethod
    def pin(path: Path, reason: str) -> None:
        if _rank() == 0:
            (Path(path) / PINNED).write_text(reason)

    @staticmethod
    def unpin(path: Path) -> None:
        if _rank() == 0:
            (Path(path) / PINNED).unlink(missing_ok=True)

    def pin_latest(self, reason: str, at_or_before: Optional[int] = None) -> Optional[Path]:
        """Pin the newest complete checkpoint (with step <= ``at_or_before`` if given), e.g. the last good
        one before a loss spike. Returns it, or None when there is none."""
        candidates = [p for p in complete_checkpoints(self.root)
                      if at_or_before is None or step_of(p) <= at_or_before]
        if not candidates:
            return None
        self.pin(candidates[-1], reason)
        return candidates[-1]

    def pinned(self) -> Dict[int, str]:
        return {step_of(p): (p / PINNED).read_text() for p in complete_checkpoints(self.root) if (p / PINNED).exists()}

    # ---- load -------------------------------------------------------------------------------------
    def resolve(self, resume: str) -> Optional[Path]:
        """``auto``: newest complete checkpoint or None; ``none``: None; else an explicit directory."""
        return resolve_resume(self.root, resume)

    def load(self, path: Path, model: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer],
             restore_rng: bool = True) -> dict:
        sidecar = read_json(path / SIDECAR)
        fmt = sidecar.get("format", "dcp")
        if self.deepspeed is None and fmt == deepspeed_io.FORMAT:
            raise CheckpointError(f"checkpoint {path} is in the DeepSpeed format but this run uses the native engine. "
                                  f"Fix: convert it (lmforge ckpt convert {path} OUT --to native) and resume from "
                                  f"OUT, or set parallelism.engine=deepspeed")
        if self.deepspeed is not None:  # a DeepSpeed checkpoint, or a native one continued by DeepSpeed
            load = deepspeed_io.load if fmt == deepspeed_io.FORMAT else deepspeed_io.load_native
            load(self.deepspeed, path, sidecar, restore_rng)
            return sidecar
        state = self.tensor_state(model, optimizer)
        check_model_fits(path, state["model"], partial=is_pipeline_stage(model))
        same_world = sidecar.get("world_size") == _world()
        for k in [k for k in state if k.startswith("rng/")]:
            state.pop(k)
        if restore_rng and same_world:
            rng, missing = loadable_rng_state(_rank(), tensor_metadata(path))
            announce_missing(path, missing)
            state.update(rng)
        try:
            load_dcp(state, path)
        except UnsafeCheckpointError:
            raise  # already one line naming the file, the reason and the fix
        except (Exception, CheckpointException) as e:  # DCP wraps per-rank failures
            raise CheckpointError(f"checkpoint {path} could not be loaded: {str(e)[:2000]}. Fix: resume with the "
                                  f"config the checkpoint was saved with, or start fresh (train.resume=none)") from None
        opts = StateDictOptions(strict=True)
        if optimizer is not None:
            set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"], options=opts)
        else:
            set_state_dict(model, [], model_state_dict=state["model"], optim_state_dict={}, options=opts)
        if restore_rng and same_world:
            set_rng_state_tensors(state, _rank())
        return sidecar


def resolve_resume(root: Path, resume: str) -> Optional[Path]:
    """The checkpoint ``train.resume`` names, or None; the one place resume resolution fails (CheckpointError).

    ``auto``: the newest complete checkpoint under ``root`` (a run's ``checkpoints/``), or None; ``none``: None;
    else a ``step-N`` directory, or a directory holding them (``checkpoints/``). A ``step-N`` missing because a
    crash hit a re-save between its two renames resolves to its aside copy ``.old-step-N`` (checkpoint/commit.py).
    """
    if resume == "none":
        return None
    if resume == "auto":
        return latest(root)
    path = Path(resume).expanduser()
    if path.is_dir() and not is_complete(path):
        inner = latest(path)
        if inner is not None:
            return inner
    if not path.exists() and STEP_RE.match(path.name):
        aside = aside_dir(path.parent, step_of(path))
        if is_complete(aside):
            return aside
    if not path.exists():
        raise CheckpointError(f"train.resume={resume}: no such directory. Fix: point at a step-NNNNNNNN directory or "
                              f"its parent, or use train.resume=auto")
    if not is_complete(path):
        raise CheckpointError(f"train.resume={resume}: not a complete checkpoint (no {COMPLETE} marker). "
                              f"Fix: point at a step-NNNNNNNN directory or its parent, or use train.resume=auto")
    return path


def model_mismatches(path: Path, model_state: Dict[str, Any], partial: bool = False) -> List[str]:
    """Differences between the model tensors in checkpoint ``path`` and ``model_state`` (global shapes).

    ``partial``: the model is one pipeline stage, so checkpoint tensors of other stages are expected extras."""
    meta = tensor_metadata(path)
    saved = {k[len("model."):]: tuple(getattr(v, "size", ())) for k, v in meta.items() if k.startswith("model.")}
    problems = []
    for name, tensor in model_state.items():
        if not hasattr(tensor, "shape"):
            continue
        if name not in saved:
            problems.append(f"{name}: missing from the checkpoint (model has {list(tensor.shape)})")
        elif tuple(saved[name]) != tuple(tensor.shape):
            problems.append(f"{name}: checkpoint {list(saved[name])} vs model {list(tensor.shape)}")
    for name in sorted(set(saved) - set(model_state)) if not partial else ():
        problems.append(f"{name}: in the checkpoint but not in the model (checkpoint {list(saved[name])})")
    return problems


def is_pipeline_stage(model: torch.nn.Module) -> bool:
    """A pipeline stage lacks the embedding (later stages) or the final norm (earlier stages)."""
    return getattr(model, "tok_embeddings", True) is None or getattr(model, "norm", True) is None


def check_model_fits(path: Path, model_state: Dict[str, Any], partial: bool = False) -> None:
    problems = model_mismatches(path, model_state, partial)
    if problems:
        shown = "\n  ".join(problems[:40]) + (f"\n  ... and {len(problems) - 40} more" if len(problems) > 40 else "")
        saved_model = ""
        try:
            saved_model = f" (saved with model={json.loads((path / SIDECAR).read_text())['config']['model']})"
        except (OSError, KeyError, ValueError, TypeError):
            pass
        raise CheckpointError(
            f"checkpoint {path} does not fit this model: {len(problems)} mismatched tensor(s):\n  {shown}\n"
            f"Fix: resume with the model config the checkpoint was saved with{saved_model}, "
            f"or start a new run (train.resume=none or another run.name)")


def _collective_device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")

