"""``lmforge export hf RUN_DIR_OR_CHECKPOINT OUT_DIR``: a training checkpoint -> a Hugging Face checkpoint.

    checkpoint (DCP, any layout) --load_full_model_state--> full fp32 tensors (one process, no pickle)
        --mapping.to_hf_state--> model.safetensors (or shards + index), config.json, generation_config.json,
        tokenizer.json + tokenizer_config.json + special_tokens_map.json (HF/BPE tokenizers), lmforge_export.json

The output directory is written under a temporary name and renamed into place when complete.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

import torch

from lmforge.checkpoint.weights import checkpoint_model_config, load_full_model_state, read_sidecar, resolve_checkpoint
from lmforge.config.data import DataConfig
from lmforge.data.sources import default_cache_dir
from lmforge.data.tokenizer import EOD_TOKEN, embedded_tokenizer_path, load_tokenizer
from lmforge.interop.errors import InteropError
from lmforge.interop.mapping import family_for, hf_config, to_hf_state
from lmforge.interop.moe_mapping import export_notes, refuse_router_bias
from lmforge.interop.mup_fold import fold_note
from lmforge.interop.safetensors_io import parse_size, write_checkpoint
from lmforge.runtime.file_modes import set_tree

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
HF_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
EXPORT_INFO = "lmforge_export.json"


@dataclass
class ExportResult:
    out_dir: Path
    checkpoint: Path
    architecture: str
    files: List[str] = field(default_factory=list)
    tokenizer: Optional[str] = None  # the tokenizer.json copied, or None
    notes: List[str] = field(default_factory=list)


def _embedded_tokenizer_candidates(cfg: dict, ckpt: Path) -> List[Path]:
    """Where the run's data cache can be: its config (data.cache_dir, $LMFORGE_DATA_CACHE, run.root/../.cache),
    then beside the run directory itself (run.root may have been relative to another working directory)."""
    data = DataConfig(cache_dir=cfg.get("data", {}).get("cache_dir"))
    roots = [default_cache_dir(data, cfg.get("run", {}).get("root", "runs"))]
    run_dir = ckpt.absolute().parents[1]  # <root>/<run>/checkpoints/step-N
    roots.append(run_dir.parent.parent / ".cache" / "lmforge-data")
    return [embedded_tokenizer_path(r) for r in roots]


def _tokenizer_json(side: dict, override: Optional[Path], ckpt: Path) -> Optional[Path]:
    """The run's tokenizer.json, checked against the fingerprint the checkpoint recorded; None for tiktoken."""
    cfg = side.get("config", {})
    spec = str(cfg.get("data", {}).get("tokenizer", "embedded"))
    identity = side.get("tokenizer") or {}
    if override is None and (spec.startswith("tiktoken:") or identity.get("kind") == "tiktoken"):
        return None
    if override is not None:
        path = Path(override).expanduser()
    elif spec == "embedded":
        candidates = _embedded_tokenizer_candidates(cfg, ckpt)
        path = next((c for c in candidates if c.is_file()), candidates[0])
    else:
        path = Path(spec).expanduser()
    if not path.is_file():
        raise InteropError(
            f"the run's tokenizer (data.tokenizer={spec!r}) is not at {path}. Fix: pass "
            "--tokenizer PATH/tokenizer.json (the file the run trained with), set LMFORGE_DATA_CACHE "
            "to the run's data cache, or --no-tokenizer to export weights only"
        )
    tok = load_tokenizer(str(path))
    want = identity.get("fingerprint")
    if want and tok.fingerprint != want:
        raise InteropError(
            f"tokenizer {path} (fingerprint {tok.fingerprint}) is not the one the run trained with "
            f"(fingerprint {want} in state.json). Fix: pass --tokenizer with the run's tokenizer.json"
        )
    return path


def _write_tokenizer(src: Path, out: Path, eod_token: str, seq_len: int) -> None:
    shutil.copyfile(src, out / "tokenizer.json")
    special = {"bos_token": eod_token, "eos_token": eod_token, "pad_token": eod_token}
    (out / "special_tokens_map.json").write_text(json.dumps(special, indent=2))
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "model_max_length": seq_len,
                "clean_up_tokenization_spaces": False,
                "add_bos_token": False,
                "add_eos_token": False,
                **special,
            },
            indent=2,
        )
    )


def export_hf(
    source: Path,
    out_dir: Path,
    dtype: str = "fp32",
    max_shard_size: str = "5GB",
    tokenizer: Optional[Path] = None,
    with_tokenizer: bool = True,
    force: bool = False,
) -> ExportResult:
    if dtype not in DTYPES:
        raise InteropError(f"--dtype {dtype!r}: choose one of {', '.join(DTYPES)}")
    max_bytes = parse_size(max_shard_size)
    out_dir = Path(out_dir).expanduser().absolute()
    if out_dir.exists() and any(out_dir.iterdir()) and not force:
        raise InteropError(f"{out_dir} exists and is not empty. Fix: choose a new OUT_DIR or pass --force")
    ckpt = resolve_checkpoint(Path(source))
    cfg = checkpoint_model_config(ckpt)
    fam = family_for(cfg)  # refuse unrepresentable architectures before reading any tensor
    side = read_sidecar(ckpt)
    tok_path = _tokenizer_json(side, tokenizer, ckpt) if with_tokenizer else None
    _, state = load_full_model_state(ckpt, DTYPES[dtype])
    refuse_router_bias(state)  # MoE: a bias that changes the routing has no HF counterpart
    tensors: Dict[str, torch.Tensor] = to_hf_state(cfg, state)
    identity = side.get("tokenizer") or {}
    eod = identity.get("eod")
    result = ExportResult(out_dir, ckpt, fam.architecture, notes=export_notes(cfg))
    if eod is None:
        result.notes.append("state.json records no tokenizer: bos/eos token ids left unset")
    if cfg.parametrization == "mup":
        result.notes.append(fold_note(cfg))

    tmp = out_dir.with_name(f".{out_dir.name}.tmp-{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    try:
        result.files = write_checkpoint(tensors, tmp, max_bytes)
        (tmp / "config.json").write_text(json.dumps(hf_config(cfg, HF_DTYPE_NAMES[DTYPES[dtype]], eod), indent=2))
        gen = {"bos_token_id": eod, "eos_token_id": eod, "pad_token_id": eod, "do_sample": False}
        (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2))
        result.files += ["config.json", "generation_config.json"]
        if tok_path is not None:
            _write_tokenizer(tok_path, tmp, EOD_TOKEN, cfg.seq_len)
            result.tokenizer = str(tok_path)
            result.files += ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"]
        elif with_tokenizer:
            result.notes.append(
                f"tokenizer {identity.get('kind', '?')} is not a HF tokenizer: no tokenizer files "
                "written (use the matching HF tokenizer)"
            )
        info = {
            "checkpoint": str(ckpt),
            "step": side.get("step"),
            "architecture": fam.architecture,
            "dtype": dtype,
            "model": asdict(cfg),
            "tokenizer": identity,
        }
        (tmp / EXPORT_INFO).write_text(json.dumps(info, indent=2, sort_keys=True))
        result.files.append(EXPORT_INFO)
        set_tree(tmp)  # every file 0o640 (safetensors writes its own 0o600), the folder 0o750: runtime/file_modes.py
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return result
