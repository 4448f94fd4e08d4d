"""Save and load an engine's training state as atomic checkpoints, and resolve ``train.resume``.

The manager is built after the engine and holds it only through the Engine contract (parallel/contract.py):
the engine reports its ``StateLayout`` and ``STATE_IO`` below picks the state IO for that format, the native one
(``checkpoint/state_io.py``: model, optimizer and per-rank RNG tensors through DCP, which reshards between
parallel layouts) or DeepSpeed's own files (``checkpoint/deepspeed_io.py``); save and load never ask which
engine it is. Everything else (step, data position, scheduler, config, W&B run id, counters) goes into
the JSON sidecar ``state.json``. ``find_resume`` resolves ``train.resume`` before the engine exists and reads
the sidecar once (the data position sizes the data index). Nothing is unpickled on load: every file is read
through ``safe_io`` (DCP tensors and allow-listed metadata types, the sidecar as JSON); a crafted file raises
``UnsafeCheckpointError``.

A save writes into ``.tmp-step-N/``; only when every rank has finished writing (for an async save: when every
rank's background write has completed) does rank 0 run the commit protocol (``checkpoint/commit.py``: files
fsynced, sidecar, ``COMPLETE``, atomic rename to ``step-N/``, an existing ``step-N/`` replaced without a
window in which neither copy is loadable). ``checkpoint.async_mode``:

- ``none``: ``dcp.save``; the loop is blocked for the whole write (always so for the DeepSpeed format).
- ``thread`` / ``process``: ``dcp.async_save``; the loop is blocked only while the state is copied to CPU
  (the *stall*, returned by ``save``), then the write runs in a thread (over a dedicated gloo group, so it
  never interleaves with the training collectives) or a separate process (which logs warnings and errors only:
  ``checkpoint/async_process.py``). ``poll()`` (called once per step) commits it as soon as all ranks are done;
  ``wait()`` blocks until it is committed.
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from lmforge.checkpoint import async_process, fault_injection, retention
from lmforge.checkpoint.commit import commit, make_dir, restore_asides
from lmforge.checkpoint.deepspeed_io import DeepSpeedStateIO
from lmforge.checkpoint.layout import (
    COMPLETE,
    SIDECAR,
    aside_dir,
    complete_checkpoints,
    is_aside,
    is_complete,
    latest,
    parse_step,
    step_dir,
    step_of,
    tmp_dir,
)
from lmforge.checkpoint.resume_check import check_resume_fits, check_resume_target
from lmforge.checkpoint.safe_io import read_json
from lmforge.checkpoint.state_io import CheckpointError, DcpStateIO, StateIO
from lmforge.comm.vote import LaggedVote
from lmforge.config.checkpoint import CheckpointConfig
from lmforge.config.model import ModelConfig
from lmforge.parallel.contract import DCP, DEEPSPEED, Engine, StateLayout
from lmforge.runtime.dist import barrier, is_distributed, rank, world_size

# The state IO for each StateLayout.format an engine reports (parallel/contract.py): the one place a format is chosen.
STATE_IO: Dict[str, Callable[[Engine, StateLayout], StateIO]] = {
    DCP: lambda engine, layout: DcpStateIO(engine.inner, engine.optimizer, layout.pipeline_stage),
    DEEPSPEED: lambda engine, layout: DeepSpeedStateIO(engine, layout.sidecar),
}


def state_io_for(engine: Engine) -> StateIO:
    layout = engine.state_layout()
    return STATE_IO[layout.format](engine, layout)


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


@dataclass(frozen=True)
class ResumePoint:
    """The checkpoint a run resumes from and its sidecar, read once (``find_resume``). ``named``: the checkpoint
    ``train.resume`` names when the run continues from a newer one of its own instead (``resume_target``)."""

    path: Path
    sidecar: dict
    named: Optional[Path] = None


class CheckpointManager:
    """Saves and loads ``engine``'s state (any ``parallel.contract.Engine``); without an engine, ``save``/``load``
    take a bare model and optimizer (native format), e.g. for conversion, import and tests."""

    def __init__(self, root: Path, cfg: CheckpointConfig, engine: Optional[Engine] = None):
        self.root = Path(root)
        self.cfg = cfg
        self.state: Optional[StateIO] = state_io_for(engine) if engine is not None else None
        # Called on every rank once a save's write is done (synchronous) or under way (async), before its commit,
        # with (step, final path, stall seconds); then on rank 0 after each commit with (step, path, write seconds).
        # The trainer logs them, in that order: checkpoint_save, checkpoint_commit.
        self.on_save: Optional[Callable[[int, Path, float], None]] = None
        self.on_commit: Optional[Callable[[int, Path, float], None]] = None
        self.pending: Optional[_Pending] = None
        self._write_vote: Optional[LaggedVote] = None  # "has every rank finished the async write?" (poll)
        self._async_group = None
        if cfg.async_mode in ("thread", "process") and is_distributed():
            # Collective call: every rank constructs the manager at the same point of Trainer.__init__. A gloo group
            # because async_save needs a CPU backend (an NCCL-only default group is refused) and so that the
            # background thread never interleaves its collectives with the training ones.
            self._async_group = dist.new_group(backend="gloo")

    def _state_io(self, model: Optional[torch.nn.Module], optimizer: Optional[torch.optim.Optimizer]) -> StateIO:
        if model is not None:
            return DcpStateIO(model, optimizer)
        if self.state is None:
            raise ValueError("CheckpointManager built without an engine: pass the model (and optimizer)")
        return self.state

    def _async_kind(self) -> Any:
        if self.cfg.async_mode not in ("thread", "process"):
            return None
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

        if self.cfg.async_mode == "process":
            async_process.install()  # the writer process logs warnings and errors, not an INFO line per save
            return AsyncCheckpointerType.PROCESS
        return AsyncCheckpointerType.THREAD

    # ---- save -------------------------------------------------------------------------------------
    def save(
        self,
        step: int,
        model: Optional[torch.nn.Module] = None,
        optimizer: Optional[torch.optim.Optimizer] = None,
        sidecar: Optional[dict] = None,
    ) -> SaveResult:
        """Save the engine's state (or ``model``/``optimizer``) and ``sidecar`` as checkpoint ``step``."""
        t0 = time.perf_counter()
        io = self._state_io(model, optimizer)
        self.wait()  # at most one save in flight; commits the previous one first
        final = step_dir(self.root, step)
        tmp = tmp_dir(self.root, step)
        if rank() == 0:
            make_dir(self.root)
            if tmp.exists():
                shutil.rmtree(tmp)
            make_dir(tmp)
        barrier()
        side = json.loads(json.dumps({"step": step, **(sidecar or {}), **io.sidecar_fields()}))  # a JSON-clean snapshot
        future = io.save(tmp, fault_injection.storage_writer(tmp, step), self._async_kind(), self._async_group)
        if future is not None:
            self.pending = _Pending(step, tmp, final, future, side, time.perf_counter())
            self._saved(step, final, time.perf_counter() - t0)
            return SaveResult(step, final, time.perf_counter() - t0, committed=False)
        self._saved(step, final, time.perf_counter() - t0)  # written: reported before the commit it is followed by
        self._commit(_Pending(step, tmp, final, None, side, t0))
        return SaveResult(step, final, time.perf_counter() - t0, committed=True)

    def _saved(self, step: int, final: Path, stall_s: float) -> None:
        if self.on_save is not None:
            self.on_save(step, final, stall_s)

    def poll(self) -> Optional[Path]:
        """Commit the in-flight async save if every rank's write has finished; never blocks on I/O."""
        if self.pending is None:
            return None
        done = self.pending.future.done()
        if world_size() > 1:
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
            raise CheckpointError(
                f"async checkpoint save of step {pending.step} into {pending.tmp} failed on "
                f"rank {rank()}: {e}. The previous complete checkpoint stays the latest"
            ) from e
        self._commit(pending)
        return pending.final

    def _commit(self, p: _Pending) -> None:
        barrier()  # every rank has finished writing its shards
        if rank() == 0:
            commit(
                p.tmp,
                p.final,
                p.step,
                p.sidecar,
                on_stage=lambda stage: fault_injection.commit_stage(stage, p.step, p.final),
            )
            self.apply_retention()
            if self.on_commit is not None:
                self.on_commit(p.step, p.final, time.perf_counter() - p.started)
        barrier()

    def apply_retention(self) -> List[Path]:
        """Keep the newest ``keep_last``, every ``keep_every``-th step, ``at_steps`` and anything pinned. Returns deleted.

        Also finishes re-saves a crash interrupted (rank 0, after a commit): an aside copy ``.old-step-N`` with
        no ``step-N`` is renamed back, one whose ``step-N`` is complete again is deleted."""
        restore_asides(self.root)
        done = {step_of(p): p for p in complete_checkpoints(self.root)}
        pinned = [s for s, p in done.items() if retention.is_pinned(p) or s in self.cfg.at_steps]
        _, delete = retention.plan_retention(done, self.cfg.keep_last, self.cfg.keep_every, pinned)
        for step in sorted(delete):
            shutil.rmtree(done[step], ignore_errors=True)
        in_flight = self.pending.tmp if self.pending is not None else None
        for stale in self.root.glob(".tmp-step-*"):
            if stale != in_flight:
                shutil.rmtree(stale, ignore_errors=True)
        return [done[s] for s in sorted(delete)]

    # ---- pins (checkpoint/retention.py: the loss guard, the replica check and users protect checkpoints) ----
    pin = staticmethod(retention.pin)
    unpin = staticmethod(retention.unpin)

    def pin_latest(self, reason: str, at_or_before: Optional[int] = None) -> Optional[Path]:
        """Pin the newest complete checkpoint (with step <= ``at_or_before`` if given). Returns it, or None."""
        return retention.pin_last_good(self.root, reason, at_or_before)

    def pinned(self) -> Dict[int, str]:
        return retention.pinned(self.root)

    # ---- load -------------------------------------------------------------------------------------
    def resolve(self, resume: str) -> Optional[Path]:
        """``auto``: newest complete checkpoint or None; ``none``: None; else an explicit directory."""
        return resolve_resume(self.root, resume)

    def load(
        self,
        path: Path,
        model: Optional[torch.nn.Module] = None,
        optimizer: Optional[torch.optim.Optimizer] = None,
        *,
        restore_rng: bool = True,
        sidecar: Optional[dict] = None,
    ) -> dict:
        """Load checkpoint ``path`` into the engine (or ``model``/``optimizer``); returns its sidecar (read here
        unless given, e.g. a ``ResumePoint``'s)."""
        io = self._state_io(model, optimizer)
        sidecar = read_json(Path(path) / SIDECAR) if sidecar is None else sidecar
        io.load(Path(path), sidecar, restore_rng)
        return sidecar

    def resume(self, point: "ResumePoint", restore_rng: bool = True) -> dict:
        """Load the engine's state from ``point`` (``find_resume``); returns the sidecar read there."""
        return self.load(point.path, restore_rng=restore_rng, sidecar=point.sidecar)


def find_resume(
    root: Path, resume: str, model: ModelConfig, tokenizer_identity: Callable[[], dict]
) -> Optional[ResumePoint]:
    """Resolve ``train.resume`` under ``root`` (a run's ``checkpoints/``), check that the checkpoint fits this
    model and tokenizer, and read its sidecar once. None: start fresh. A bad target is one ConfigError line.

    ``tokenizer_identity``: gives this run's tokenizer identity, called only when there is a checkpoint to check
    (a fresh start loads no tokenizer for it)."""
    try:
        path, named = resume_target(root, resume)
    except CheckpointError:
        check_resume_target(resume)  # says why in one line (exit 2)
        raise
    if path is None:
        return None
    return ResumePoint(path, check_resume_fits(path, model, tokenizer_identity()), named)  # the sidecar, read once


def resume_target(root: Path, resume: str) -> Tuple[Optional[Path], Optional[Path]]:
    """(the checkpoint to resume, the one ``train.resume`` named when that is not it). A named checkpoint outside
    ``root`` (another run's: a cooldown branch's stable run, a fine-tune's base) is where this run *starts*: once
    the run has a complete checkpoint of its own, a relaunch (a requeue, a torchrun restart, the same command again)
    continues from its newest one instead of starting over, as torchtitan's ``initial_load_path`` does. A named
    checkpoint inside ``root`` (a roll-back to an earlier step of this run) is resumed exactly as named."""
    path = resolve_resume(root, resume)
    if resume in ("auto", "none") or path is None or _inside(path, root):
        return path, None
    own = latest(root)
    return (own, path) if own is not None else (path, None)


def _inside(path: Path, root: Path) -> bool:
    try:
        path.resolve().relative_to(Path(root).resolve())
    except ValueError:
        return False
    return True


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
    step = parse_step(path.name)
    if not path.exists() and step is not None and not is_aside(path):
        aside = aside_dir(path.parent, step)
        if is_complete(aside):
            return aside
    if not path.exists():
        raise CheckpointError(
            f"train.resume={resume}: no such directory. Fix: point at a step-NNNNNNNN directory or "
            f"its parent, or use train.resume=auto"
        )
    if not is_complete(path):
        raise CheckpointError(
            f"train.resume={resume}: not a complete checkpoint (no {COMPLETE} marker). "
            f"Fix: point at a step-NNNNNNNN directory or its parent, or use train.resume=auto"
        )
    return path


def _collective_device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
