"""Checks on ``train.resume`` before anything is loaded: each bad target is one ConfigError line (key, reason, fix).

* ``check_resume_target`` (when resolution failed): an explicit path that does not exist, an uncommitted
  ``.tmp-step-*`` save, a directory holding no complete checkpoint;
* ``check_resume_fits`` (on the resolved checkpoint, reading only its JSON sidecar, which it returns, and DCP
  metadata): a
  checkpoint of another model shape or vocabulary, of another tokenizer, or missing a rank's shard file.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import List

from lmforge.checkpoint.layout import COMPLETE, SIDECAR, complete_checkpoints, latest
from lmforge.config.errors import ConfigError
from lmforge.config.model import ModelConfig

KEY = "train.resume"
# Model fields that decide the tensor shapes (and so whether a checkpoint can be loaded at all).
SHAPE_FIELDS = (
    "vocab_size",
    "d_model",
    "n_layers",
    "n_heads",
    "n_kv_heads",
    "d_ff",
    "ffn_multiple_of",
    "mlp",
    "norm",
    "tie_embeddings",
)
FRESH = "or start a new run (train.resume=none, or another run.name)"


def _newest_near(path: Path) -> str:
    for root in (path.parent, path):
        found = latest(root) if root.is_dir() else None
        if found is not None:
            return f"train.resume={found}"
    return "train.resume=auto"


def check_resume_target(resume: str) -> None:
    if resume in ("auto", "none"):
        return
    path = Path(resume).expanduser()
    if not path.exists():
        raise ConfigError(
            KEY,
            f"{path} does not exist",
            "point at a step-NNNNNNNN checkpoint directory (or the "
            "checkpoints/ directory holding it), or use train.resume=auto (the newest of this run) or "
            "train.resume=none",
        )
    if path.name.startswith(".tmp-"):
        raise ConfigError(
            KEY,
            f"{path} is an uncommitted save (a .tmp-step-* directory is a save that never "
            "finished; its shards may be partial)",
            f"resume from a complete checkpoint: {_newest_near(path)}",
        )
    if not (path / COMPLETE).exists() and not complete_checkpoints(path):
        raise ConfigError(
            KEY,
            f"{path} is not a complete checkpoint and holds none (no {COMPLETE} marker)",
            "point at a step-NNNNNNNN directory with a COMPLETE marker, or its parent",
        )


def check_resume_fits(path: Path, model: ModelConfig, tokenizer_identity: dict) -> dict:
    """The checks above on checkpoint ``path``; returns its sidecar (the one read of it at resume)."""
    try:
        sidecar = json.loads((path / SIDECAR).read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(
            KEY, f"{path / SIDECAR} is unreadable ({e})", f"resume from another checkpoint {FRESH}"
        ) from None
    saved = (sidecar.get("config") or {}).get("model") or {}
    diffs = [(f, saved[f], getattr(model, f)) for f in SHAPE_FIELDS if f in saved and saved[f] != getattr(model, f)]
    if diffs:
        shown = ", ".join(f"model.{f}={a} (this run: {b})" for f, a, b in diffs)
        what = "vocabulary" if [d[0] for d in diffs] == ["vocab_size"] else "model shape"
        raise ConfigError(
            KEY,
            f"checkpoint {path} is of another {what}: it was saved with {shown}",
            f"resume with the checkpoint's model ({' '.join(f'model.{f}={a}' for f, a, _ in diffs)}) {FRESH}",
        )
    saved_tok = sidecar.get("tokenizer") or {}
    if saved_tok and (saved_tok.get("fingerprint"), saved_tok.get("vocab_size")) != (
        tokenizer_identity.get("fingerprint"),
        tokenizer_identity.get("vocab_size"),
    ):
        raise ConfigError(
            KEY,
            f"checkpoint {path} was trained with a {saved_tok.get('kind')} tokenizer "
            f"(vocab {saved_tok.get('vocab_size')}, fingerprint "
            f"{saved_tok.get('fingerprint')}), this run's data.tokenizer has vocab "
            f"{tokenizer_identity.get('vocab_size')}, fingerprint {tokenizer_identity.get('fingerprint')}",
            f"set data.tokenizer to the checkpoint's tokenizer {FRESH}",
        )
    if sidecar.get("format", "dcp") == "dcp":
        _check_shard_files(path)
    return sidecar


def _check_shard_files(path: Path) -> None:
    # deferred: imports torch; this module imports without it
    from lmforge.checkpoint.safe_io import SafeFileSystemReader

    if not (path / ".metadata").is_file():
        raise ConfigError(
            KEY,
            f"checkpoint {path} has no .metadata file: the checkpoint is incomplete",
            f"resume from another complete checkpoint {FRESH}",
        )
    meta = SafeFileSystemReader(str(path)).read_metadata()
    files = sorted({info.relative_path for info in (meta.storage_data or {}).values()})
    missing: List[str] = [f for f in files if not (path / f).is_file()]
    if missing:
        ranks = sorted({int(m.group(1)) for f in missing if (m := re.match(r"__(\d+)_", f))})
        who = f"rank {', '.join(map(str, ranks))}'s shard" if ranks else "shard files"
        raise ConfigError(
            KEY,
            f"checkpoint {path} is missing {', '.join(missing)} ({who}, listed in its .metadata): "
            "the checkpoint is incomplete",
            f"restore the file, resume from another complete checkpoint {FRESH}",
        )
