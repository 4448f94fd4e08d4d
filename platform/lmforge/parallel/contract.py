"""The Engine contract: what the trainer, checkpoint, fault and metrics code may use of an engine.

Both engines (``NativeEngine``: torch's FSDP2/DDP/TP/PP stack; ``DeepSpeedEngine``: ZeRO-1/2/3) satisfy
``Engine``; code above ``parallel/`` names only what is listed here, never an engine class, and never asks
an engine what it is (no ``hasattr``/``isinstance`` on engines).

Checkpoints: an engine reports how its training state is laid out (``state_layout()`` -> ``StateLayout``);
``lmforge.checkpoint`` owns the files (atomic commit, safe loading, sidecar, retention) and picks the state
IO for the reported ``format`` from one table, without knowing which engine it holds:

- ``"dcp"``: the parameter-owning module (``inner``) and ``optimizer`` as state dicts keyed by parameter name,
  through torch DCP (reshards between layouts). ``pipeline_stage``: ``inner`` holds only this rank's pipeline
  stages, so a checkpoint's tensors of other stages are expected, not a mismatch.
- ``"deepspeed"``: the engine writes and reads its own per-rank files (``OwnFilesState``): DeepSpeed's ZeRO
  partitions under ``<checkpoint>/deepspeed/``.

``StateLayout.sidecar`` is what the checkpoint's ``state.json`` records about the layout (e.g. the ZeRO stage
and data-parallel size a DeepSpeed checkpoint was written with); empty for the native format, whose sidecar
stays as it always was.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Dict, Mapping, Optional, Protocol, Sequence, Tuple, runtime_checkable

import torch
from torch import nn

if TYPE_CHECKING:
    from lmforge.parallel.mesh import ParallelDims

DCP = "dcp"
DEEPSPEED = "deepspeed"
FORMATS = (DCP, DEEPSPEED)


@dataclass(frozen=True)
class StateLayout:
    """How an engine's state goes into a checkpoint directory (reported by the engine, read by checkpoint/)."""

    format: str  # one of FORMATS
    pipeline_stage: bool = False  # ``inner`` holds one rank's pipeline stages (format "dcp")
    sidecar: Mapping[str, Any] = field(default_factory=dict)  # recorded in the checkpoint's state.json

    def __post_init__(self) -> None:
        if self.format not in FORMATS:
            raise ValueError(f"StateLayout.format={self.format!r}: expected one of {FORMATS}")


@dataclass
class StepResult:
    loss: torch.Tensor  # scalar, mean over the global batch (same value on every rank)
    grad_norm: torch.Tensor  # scalar, global pre-clip norm
    skipped: Optional[torch.Tensor] = None  # the guard's verdict (bool device tensor); None without a guard
    moe: Optional[Dict[str, torch.Tensor]] = None  # expert-load metrics (model/moe.py), device scalars; None: dense
    fp8: Optional[Dict[str, torch.Tensor]] = None  # a step with the float8 numerics check (parallel/float8.py)
    committed: bool = True  # False: replica FT (CrossReplica) committed no update this step; the step is redone


class CrossReplica(Protocol):
    """Gradient averaging across replica groups and the commit vote (lmforge.fault.replica_ft.ReplicaFT).

    An engine given one (``engine.cross_replica``) averages its gradients (and the step's loss) through it after
    backward, and steps the optimizer only when ``should_commit()`` says every participating replica may."""

    def average(self, flat: torch.Tensor) -> None:
        """Average ``flat`` in place over the participating replica groups (blocking)."""

    def should_commit(self) -> bool: ...


class StepGuard(Protocol):
    """Decides on the device whether to skip this update (lmforge.fault.loss_guard.LossGuard)."""

    def skip_tensor(self, loss: torch.Tensor, grad_norm: torch.Tensor) -> torch.Tensor: ...


@runtime_checkable
class Engine(Protocol):
    """One optimizer step over a global batch, evaluation, and the state a checkpoint holds."""

    device: torch.device
    dims: "ParallelDims"  # the parallel layout (pp, dp_replicate, dp_shard, tp)
    precision: str  # resolved: "fp32" | "bf16-mixed" | "bf16" | "fp8"
    model: nn.Module  # what the forward runs through (wrapped: DDP, DeepSpeed's engine)
    inner: nn.Module  # owns this rank's parameters: optimizer, checkpoints, clipping, replica checks
    optimizer: torch.optim.Optimizer
    dp_group: Any  # the data-parallel process group (losses and token counts are reduced over it)
    replica_group: Any  # ranks holding a replica of this rank's shard (fault/consistency.py); None: none
    cross_replica: Optional[CrossReplica]  # replica groups beyond this process group (fault.replica_ft); None: none

    @property
    def dp_rank(self) -> int: ...

    @property
    def dp_size(self) -> int: ...

    def train_step(self, micro_batches: Sequence, lr: float, guard: Optional[StepGuard] = None) -> StepResult: ...

    def eval_loss(
        self, tokens: torch.Tensor, targets: torch.Tensor, positions: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        """``positions``: the batch's document positions (data.document_masking; lmforge.data.loader)."""

    def train(self) -> None: ...

    def eval(self) -> None: ...

    def state_layout(self) -> StateLayout: ...

    def token_logprobs(self, tokens: torch.Tensor, targets: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """Downstream evaluation: ``[B, T]`` log-likelihood of each target and whether it is the greedy token, on
        every rank of this data-parallel replica (not reduced over dp; ``lmforge.evaluation`` shards batches)."""


@runtime_checkable
class OwnFilesState(Protocol):
    """An engine whose state layout is not ``"dcp"``: it writes and reads its own files in a directory."""

    dp_size: int
    inner: nn.Module

    def save_checkpoint(self, directory: Path) -> None:
        """Every rank: this rank's files into ``directory`` (the checkpoint layer fsyncs and commits them)."""

    def load_checkpoint(self, directory: Path, universal: bool = False) -> None:
        """Every rank: read them back (``universal``: the layout-independent form, after a data-parallel change)."""

    def load_full_state(
        self, params: Dict[str, torch.Tensor], moments: Dict[str, Dict[str, torch.Tensor]], step: int
    ) -> None:
        """Set full parameter values and AdamW moments by name (continuing from a ``"dcp"`` checkpoint)."""
