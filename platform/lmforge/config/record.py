"""The config as a run records it (``config.yaml``, each checkpoint's ``state.json``, each launch's record, W&B):
resolved, secrets redacted; and the keys in which two such records differ."""

from __future__ import annotations

from typing import Any, Dict, Tuple

from omegaconf import OmegaConf

from lmforge.config.schema import RootConfig
from lmforge.runtime.secrets import redact


def config_dict(cfg: RootConfig) -> dict:
    """``cfg`` as a plain dict: interpolations resolved, secret values redacted."""
    return redact(OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True))


def flatten(tree: Any, prefix: str = "") -> Dict[str, Any]:
    """``{"optim": {"lr": 0.003}}`` -> ``{"optim.lr": 0.003}`` (lists are values)."""
    if not isinstance(tree, dict):
        return {prefix: tree}
    flat: Dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}.{key}" if prefix else str(key)
        flat.update(flatten(value, name) if isinstance(value, dict) and value else {name: value})
    return flat


def config_changes(recorded: dict, now: dict) -> Dict[str, Tuple[Any, Any]]:
    """The dotted keys whose value in ``now`` differs from ``recorded``: ``{key: (recorded, now)}``, in ``now``'s
    order (a key missing on one side reads as None there). ``train.resume`` is where a launch starts, not what it
    trains, and is left out."""
    old, new = flatten(recorded or {}), flatten(now or {})
    keys = list(new) + [k for k in old if k not in new]
    return {k: (old.get(k), new.get(k)) for k in keys if k != "train.resume" and old.get(k) != new.get(k)}
