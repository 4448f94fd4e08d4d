"""Model weights out of a training checkpoint, in any parallel layout, without arbitrary unpickling.

Two uses:

* ``load_full_model_state(path)`` -> ``(ModelConfig, {name: full tensor})`` in one process, no process group:
  the model described by the checkpoint's ``state.json`` is built un-sharded on the meta device, its state
  dict is allocated on CPU and DCP fills it, resharding whatever layout the run saved (FSDP2 shards, TP
  slices, pipeline stages) into full tensors. This is what ``lmforge export`` consolidates.
* ``load_model_weights(path, model)`` fills an already built (possibly parallelized) model from a checkpoint's
  ``model.*`` tensors only: the optimizer, data position and RNG are left fresh. ``train.init_from`` uses it.

Reading goes through ``lmforge.checkpoint.safe_io`` (no arbitrary unpickling); only tensors are requested.
"""

from __future__ import annotations

import warnings
from dataclasses import fields
from pathlib import Path
from typing import Any, Dict, Optional, Tuple

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from lmforge.checkpoint.layout import COMPLETE, SIDECAR, latest
from lmforge.checkpoint.safe_io import (
    CheckpointException,
    UnsafeCheckpointError,
    load_dcp,
    read_json,  # noqa: F401
    read_metadata_safely,
)
from lmforge.config.errors import ConfigError
from lmforge.config.model import ModelConfig
from lmforge.model.feed_forward import ffn_hidden_dim
from lmforge.model.gpt import GPT, kv_heads

MODEL_PREFIX = "model."


class WeightsError(ValueError):
    pass


def resolve_checkpoint(path: Path) -> Path:
    """A ``step-NNNNNNNN`` directory, a ``checkpoints/`` directory, or a run directory -> newest complete step."""
    path = Path(path).expanduser()
    if (path / COMPLETE).is_file() and (path / SIDECAR).is_file():
        return path
    for root in (path / "checkpoints", path):
        found = latest(root)
        if found is not None:
            return found
    raise WeightsError(
        f"{path}: no complete checkpoint here (looked for {COMPLETE} + {SIDECAR} in the directory, "
        f"its checkpoints/ and step-* subdirectories). Fix: pass a run directory or a "
        f"checkpoints/step-NNNNNNNN directory of a finished save"
    )


def read_sidecar(ckpt: Path) -> dict:
    return read_json(Path(ckpt) / SIDECAR)


def model_config_from_dict(d: Dict[str, Any], where: str) -> ModelConfig:
    known = {f.name for f in fields(ModelConfig)}
    unknown = sorted(set(d) - known)
    if unknown:
        raise WeightsError(
            f"{where}: model config has keys this lmforge does not know: {', '.join(unknown)}. "
            "Fix: use the lmforge version that wrote the checkpoint"
        )
    return ModelConfig(**{k: v for k, v in d.items() if k in known})


def checkpoint_model_config(ckpt: Path) -> ModelConfig:
    side = read_sidecar(ckpt)
    cfg = side.get("config", {}).get("model")
    if not isinstance(cfg, dict):
        raise WeightsError(f"{ckpt}/{SIDECAR} has no config.model. Fix: use a checkpoint written by lmforge")
    return model_config_from_dict(cfg, f"{ckpt}/{SIDECAR}")


def saved_model_tensors(ckpt: Path) -> Dict[str, TensorStorageMetadata]:
    """{model parameter name: DCP tensor metadata (global shape, dtype, chunks)} of a checkpoint."""
    md = read_metadata_safely(ckpt)
    return {
        k[len(MODEL_PREFIX) :]: v
        for k, v in md.state_dict_metadata.items()
        if k.startswith(MODEL_PREFIX) and isinstance(v, TensorStorageMetadata)
    }


def check_names_and_shapes(ckpt: Path, expected: Dict[str, Tuple[int, ...]]) -> None:
    saved = saved_model_tensors(ckpt)
    missing = sorted(set(expected) - set(saved))
    unexpected = sorted(set(saved) - set(expected))
    wrong = sorted(
        f"{n} (checkpoint {tuple(saved[n].size)}, model {tuple(expected[n])})"
        for n in set(expected) & set(saved)
        if tuple(saved[n].size) != tuple(expected[n])
    )
    problems = []
    if missing:
        problems.append("missing in checkpoint: " + ", ".join(missing))
    if unexpected:
        problems.append("not in the model: " + ", ".join(unexpected))
    if wrong:
        problems.append("shape mismatch: " + ", ".join(wrong))
    if problems:
        raise WeightsError(
            f"checkpoint {ckpt} does not fit the model: {'; '.join(problems)}. Fix: use the model "
            f"config the checkpoint was saved with (its {SIDECAR} 'config.model')"
        )


def _build_meta_model(cfg: ModelConfig) -> torch.nn.Module:
    with torch.device("meta"):
        return GPT(cfg)


def load_full_model_state(
    ckpt: Path, dtype: Optional[torch.dtype] = None
) -> Tuple[ModelConfig, Dict[str, torch.Tensor]]:
    """Consolidate the ``model.*`` tensors of a checkpoint of any layout into full CPU tensors (one process)."""
    cfg = checkpoint_model_config(ckpt)
    meta = _build_meta_model(cfg)
    saved = saved_model_tensors(ckpt)
    expected = {n: tuple(p.shape) for n, p in meta.state_dict().items()}
    check_names_and_shapes(ckpt, expected)
    state = {n: torch.empty(expected[n], dtype=saved[n].properties.dtype) for n in expected}
    with warnings.catch_warnings():  # "torch.distributed is disabled ... single process": intended here
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        load_dcp({"model": state}, ckpt, no_dist=True)
    if dtype is not None:
        state = {n: t.to(dtype) for n, t in state.items()}
    return cfg, state


SHAPE_KEYS = ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff", "mlp", "norm", "tie_embeddings")


def _shape_facts(cfg: ModelConfig) -> Dict[str, Any]:
    facts = {k: getattr(cfg, k) for k in SHAPE_KEYS}
    facts["n_kv_heads"] = kv_heads(cfg)
    facts["d_ff"] = ffn_hidden_dim(cfg)
    return facts


def load_model_weights(path: Path, model: torch.nn.Module, cfg: ModelConfig, key: str = "train.init_from") -> Path:
    """Fill ``model`` (plain, FSDP2- or TP-sharded) with the model tensors of the checkpoint at ``path``.

    Every rank calls this (DCP reads each rank's own slices). Shape-defining config differences are
    reported by key before any tensor is read.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

    try:
        ckpt = resolve_checkpoint(Path(path))
        saved_cfg = checkpoint_model_config(ckpt)
    except (WeightsError, FileNotFoundError, UnsafeCheckpointError) as e:
        raise ConfigError(key, str(e)) from None
    ours, theirs = _shape_facts(cfg), _shape_facts(saved_cfg)
    diff = [f"model.{k}: checkpoint {theirs[k]!r}, this run {ours[k]!r}" for k in SHAPE_KEYS if ours[k] != theirs[k]]
    if diff:
        raise ConfigError(
            key,
            f"checkpoint {ckpt} was saved for a different model shape ({'; '.join(diff)})",
            "use the model config it was saved with (e.g. the exp written by `lmforge import hf`)",
        )
    msd, _ = get_state_dict(model, [])
    try:
        load_dcp({"model": msd}, ckpt)
    except UnsafeCheckpointError as e:
        raise ConfigError(key, str(e)) from None
    except (Exception, CheckpointException) as e:  # DCP wraps per-rank failures (a BaseException)
        raise ConfigError(key, f"could not load the model tensors of {ckpt}: {str(e).splitlines()[0][:500]}") from None
    set_state_dict(model, [], model_state_dict=msd, optim_state_dict={}, options=StateDictOptions(strict=True))
    return ckpt
