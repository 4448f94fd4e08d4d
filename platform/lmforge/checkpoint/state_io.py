"""The native state format (``StateLayout.format == "dcp"``): model, optimizer and RNG tensors through DCP.

Model and optimizer go in as state dicts keyed by global parameter name (``get_state_dict``; the optimizer's
hyperparameters too, per parameter: ``flatten_optimizer_state_dict``, so the pipeline ranks' param groups, each
over that rank's parameters, never collide under one group index), so any parallel layout reads any other's
checkpoint, under any pipeline stage map; this rank's RNG states go in the same DCP save under ``rng/rank<r>/``
(checkpoint/rng.py). Loading reads through ``safe_io.load_dcp`` (nothing unpickled) after checking that every
model tensor is in the checkpoint with its global shape (``check_model_fits``; a pipeline stage expects the
other stages' tensors as extras). The DeepSpeed format is ``checkpoint/deepspeed_io.py``; both are a ``StateIO``,
which is all ``CheckpointManager`` calls.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Dict, List, Optional, Protocol

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from lmforge.checkpoint.layout import SIDECAR
from lmforge.checkpoint.rng import announce_missing, loadable_rng_state, rng_state_tensors, set_rng_state_tensors
from lmforge.checkpoint.safe_io import CheckpointException, UnsafeCheckpointError, load_dcp, tensor_metadata
from lmforge.parallel.contract import DCP, DEEPSPEED
from lmforge.runtime.dist import rank, world_size

INDEXED_GROUP = re.compile(r"^optim\.param_groups\.\d+\.")


class CheckpointError(RuntimeError):
    pass


class StateIO(Protocol):
    """How one state format is written into and read from a checkpoint directory (what the manager calls)."""

    def sidecar_fields(self) -> Dict[str, Any]:
        """What the sidecar records about the format (merged into ``state.json``)."""

    def save(self, directory: Path, writer: Any, async_kind: Any = None, group: Any = None) -> Optional[Any]:
        """Every rank writes its part into ``directory``; None when written, else a future (async DCP save)."""

    def load(self, path: Path, sidecar: dict, restore_rng: bool = True) -> None:
        """Every rank reads its part of checkpoint ``path`` (``sidecar``: its state.json)."""


class DcpStateIO:
    """The native format for ``model`` (the parameter-owning module) and ``optimizer`` (None: model only)."""

    def __init__(
        self, model: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer] = None, pipeline_stage: bool = False
    ):
        self.model = model
        self.optimizer = optimizer
        self.pipeline_stage = pipeline_stage

    def sidecar_fields(self) -> Dict[str, Any]:
        return {}  # a native sidecar has no "format" key (it is the default)

    def tensors(self, flat_optimizer: bool = True) -> Dict[str, Any]:
        if self.optimizer is not None:
            options = StateDictOptions(flatten_optimizer_state_dict=flat_optimizer)
            msd, osd = get_state_dict(self.model, self.optimizer, options=options)
        else:
            msd, osd = get_state_dict(self.model, [])[0], {}
        state: Dict[str, Any] = {"model": msd, "optim": osd}
        state.update(rng_state_tensors(rank()))
        return state

    def save(self, directory: Path, writer: Any, async_kind: Any = None, group: Any = None) -> Optional[Any]:
        state = self.tensors()
        if async_kind is None:
            dcp.save(state, storage_writer=writer)
            return None
        future = dcp.async_save(state, storage_writer=writer, async_checkpointer_type=async_kind, process_group=group)
        return getattr(future, "upload_completion", future)

    def load(self, path: Path, sidecar: dict, restore_rng: bool = True) -> None:
        if sidecar.get("format", DCP) == DEEPSPEED:
            raise CheckpointError(
                f"checkpoint {path} is in the DeepSpeed format but this run uses the native engine. "
                f"Fix: convert it (lmforge ckpt convert {path} OUT --to native) and resume from "
                f"OUT, or set parallelism.engine=deepspeed"
            )
        flat = not has_indexed_param_groups(path)
        state = self.tensors(flat_optimizer=flat)
        check_model_fits(path, state["model"], partial=self.pipeline_stage)
        same_world = sidecar.get("world_size") == world_size()
        for k in [k for k in state if k.startswith("rng/")]:
            state.pop(k)
        if restore_rng and same_world:
            rng, missing = loadable_rng_state(rank(), tensor_metadata(path))
            announce_missing(path, missing)
            state.update(rng)
        try:
            load_dcp(state, path)
        except UnsafeCheckpointError:
            raise  # already one line naming the file, the reason and the fix
        except (Exception, CheckpointException) as e:  # DCP wraps per-rank failures
            raise CheckpointError(
                f"checkpoint {path} could not be loaded: {str(e)[:2000]}. Fix: resume with the "
                f"config the checkpoint was saved with, or start fresh (train.resume=none)"
            ) from None
        opts = StateDictOptions(strict=True, flatten_optimizer_state_dict=flat)
        optimizers = self.optimizer if self.optimizer is not None else []
        set_state_dict(
            self.model, optimizers, model_state_dict=state["model"], optim_state_dict=state["optim"], options=opts
        )
        if restore_rng and same_world:
            set_rng_state_tensors(state, rank())


def has_indexed_param_groups(path: Path) -> bool:
    """Whether the checkpoint holds the optimizer's param groups by group index (``optim.param_groups.0.lr``,
    each group with its ``params`` list) rather than per parameter name (``optim.param_groups.<name>.lr``).
    By index, the ranks of a pipeline write different lists under the same key and DCP keeps one rank's, so
    such a checkpoint only loads where every rank held every parameter name (no pipeline when saved)."""
    return any(INDEXED_GROUP.match(key) for key in tensor_metadata(path))


def model_mismatches(path: Path, model_state: Dict[str, Any], partial: bool = False) -> List[str]:
    """Differences between the model tensors in checkpoint ``path`` and ``model_state`` (global shapes).

    ``partial``: the model is one pipeline stage, so checkpoint tensors of other stages are expected extras."""
    meta = tensor_metadata(path)
    saved = {k[len("model.") :]: tuple(getattr(v, "size", ())) for k, v in meta.items() if k.startswith("model.")}
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
            f"or start a new run (train.resume=none or another run.name)"
        )
