"""``lmforge generate RUN_OR_CKPT``'s loading half: a checkpoint of any layout -> a single-process GPT + the run's
tokenizer, ready for ``lmforge.generation.generate``.

    run dir / checkpoints/ / step-N  --resolve_checkpoint--> newest complete step
        --load_full_model_state--> full tensors (DCP reshards FSDP2 / TP / PP saves into one process, no pickle)
        --> GPT built on the meta device, tensors assigned, RoPE tables rebuilt on the device
    state.json's data.tokenizer (checked against the fingerprint the run recorded) --> Tokenizer
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from lmforge.checkpoint.weights import WeightsError, load_full_model_state, read_sidecar, resolve_checkpoint
from lmforge.data.tokenizer import Tokenizer, load_tokenizer
from lmforge.interop.export import _tokenizer_json  # the run's tokenizer.json, found as `lmforge export` finds it
from lmforge.model.gpt import GPT


@dataclass
class GenerationModel:
    model: GPT
    tokenizer: Tokenizer
    checkpoint: Path


def load_model(source: Path, device: str = "cpu", dtype: torch.dtype = torch.float32) -> tuple[GPT, Path]:
    """The consolidated model of the newest complete checkpoint under ``source``, in eval mode on ``device``."""
    source = Path(source).expanduser()
    if not source.exists():
        raise WeightsError(
            f"{source} does not exist. Fix: pass a run directory (run.root/run.name), its "
            "checkpoints/ or a checkpoints/step-NNNNNNNN directory"
        )
    ckpt = resolve_checkpoint(source)
    cfg, state = load_full_model_state(ckpt, dtype)
    with torch.device("meta"):
        model = GPT(cfg)
    model.load_state_dict(state, strict=True, assign=True)
    model.rope.reset(torch.device(device))
    return model.to(device).eval(), ckpt


def load_for_generation(source: Path, tokenizer: Optional[Path] = None, device: str = "cpu") -> GenerationModel:
    model, ckpt = load_model(source, device)
    side = read_sidecar(ckpt)
    path = _tokenizer_json(side, tokenizer, ckpt)
    spec = str(side.get("config", {}).get("data", {}).get("tokenizer", "embedded"))
    return GenerationModel(model, load_tokenizer(str(path) if path is not None else spec), ckpt)
