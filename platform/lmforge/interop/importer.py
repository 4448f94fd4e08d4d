"""``lmforge import hf HF_DIR [--out DIR]``: a local Hugging Face Llama, StableLM, Mixtral or Qwen2-MoE checkpoint ->
lmforge weights.

    HF_DIR/config.json      --mapping.model_config_from_hf--> ModelConfig (refuses what lmforge can't represent)
    HF_DIR/*.safetensors    --names and shapes checked against that model, every problem named-->
                            GPT (fp32) --CheckpointManager.save--> OUT/checkpoints/step-00000000 (DCP + state.json)
    OUT/conf/exp/NAME.yaml  the matching experiment: model shape, tokenizer, train.init_from=<that checkpoint>

Training then starts from the imported weights with a fresh optimizer and data position:

    lmforge train --config-dir OUT/conf +exp=NAME [more overrides]

Only local directories and safetensors files are read (no hub, no pickles).
"""

from __future__ import annotations

import json
import re
import shutil
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import List, Optional

import torch

from lmforge.checkpoint.manager import CheckpointManager
from lmforge.config.checkpoint import CheckpointConfig
from lmforge.config.model import ModelConfig
from lmforge.config.schema import RootConfig
from lmforge.data.tokenizer import load_tokenizer
from lmforge.interop.errors import InteropError
from lmforge.interop.mapping import describe, expected_hf_tensors, from_hf_state, model_config_from_hf
from lmforge.interop.safetensors_io import checkpoint_files, iter_tensors, tensor_shapes
from lmforge.model.gpt import GPT

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
IGNORED = re.compile(r"(^|\.)rotary_emb\.inv_freq$")  # a buffer some old checkpoints carry; recomputed from theta


@dataclass
class ImportResult:
    out_dir: Path
    checkpoint: Path
    exp_name: str
    exp_file: Path
    model: ModelConfig
    overrides: List[str] = field(default_factory=list)  # Hydra overrides, one argument each (shlex.join for a shell)
    notes: List[str] = field(default_factory=list)

    @property
    def train_command(self) -> str:
        return f"lmforge train --config-dir {self.out_dir / 'conf'} +exp={self.exp_name}"


def _read_config(hf_dir: Path) -> dict:
    if not hf_dir.is_dir():
        hub_like = re.fullmatch(r"[\w.-]+/[\w.-]+", str(hf_dir)) is not None
        hint = " (it looks like a hub id: lmforge never downloads; fetch it yourself)" if hub_like else ""
        raise InteropError(
            f"{hf_dir}: not a local directory{hint}. Fix: pass a local directory holding config.json "
            "and safetensors weights"
        )
    path = hf_dir / "config.json"
    if not path.is_file():
        raise InteropError(f"{hf_dir}: no config.json. Fix: point at a Hugging Face model directory")
    return json.loads(path.read_text())


def check_tensors(cfg: ModelConfig, files: List[Path]) -> List[str]:
    """Compare the checkpoint's tensors with the model ``cfg`` describes; returns the HF names to read."""
    expected = expected_hf_tensors(cfg)
    found = {n: v for n, v in tensor_shapes(files).items() if not IGNORED.search(n)}
    problems: List[str] = []
    tied_head = cfg.tie_embeddings and "lm_head.weight" in found
    for name in sorted(set(expected) - set(found)):
        problems.append(f"missing tensor {name} {expected[name]}")
    for name in sorted(set(found) - set(expected)):
        if name == "lm_head.weight" and tied_head:
            continue  # some tied checkpoints store the head too; checked equal to the embedding on load
        problems.append(f"unexpected tensor {name} {found[name][0]}")
    for name in sorted(set(expected) & set(found)):
        if tuple(found[name][0]) != expected[name]:
            problems.append(f"tensor {name} has shape {tuple(found[name][0])}, config.json implies {expected[name]}")
    if problems:
        raise InteropError(
            f"the checkpoint does not match its config.json ({len(problems)} problem(s)): "
            f"{describe(problems)}. Fix: use a complete, unmodified Llama checkpoint whose config.json "
            "describes its tensors"
        )
    return sorted(set(expected) | ({"lm_head.weight"} if tied_head else set()))


def _load_model(cfg: ModelConfig, files: List[Path], names: List[str], dtype: torch.dtype):
    hf = dict(iter_tensors(files, names))
    head = hf.pop("lm_head.weight") if cfg.tie_embeddings and "lm_head.weight" in hf else None
    state = {n: t.to(dtype) for n, t in from_hf_state(cfg, hf).items()}
    if head is not None and not torch.equal(head.to(dtype), state["tok_embeddings.weight"]):
        raise InteropError(
            "config.json says tie_word_embeddings=true but lm_head.weight differs from "
            "model.embed_tokens.weight. Fix: set tie_word_embeddings=false in config.json"
        )
    with torch.device("meta"):
        model = GPT(cfg)
    model.load_state_dict(state, strict=True, assign=True)
    model.rope.reset(torch.device("cpu"))  # the RoPE tables are buffers, not in the state dict
    return model


def _tokenizer(hf_dir: Path, out_dir: Path, cfg: ModelConfig, notes: List[str]):
    src = hf_dir / "tokenizer.json"
    if not src.is_file():
        notes.append("no tokenizer.json in the checkpoint: set data.tokenizer yourself")
        return None, None
    try:
        tok = load_tokenizer(str(src))
    except ValueError as e:
        notes.append(f"tokenizer.json not usable by lmforge as is ({e}); set data.tokenizer yourself")
        return None, None
    if tok.vocab_size > cfg.vocab_size:
        notes.append(f"tokenizer.json has {tok.vocab_size} tokens, more than the model's {cfg.vocab_size}; not used")
        return None, None
    dst = out_dir / "tokenizer.json"
    shutil.copyfile(src, dst)
    return dst, tok.identity


def _exp_yaml(hf_dir: Path, cfg: ModelConfig, tokenizer: Optional[Path], init_from: Path) -> str:
    from omegaconf import OmegaConf

    body: dict = {"model": asdict(cfg), "train": {"init_from": str(init_from)}}
    if tokenizer is not None:
        body["data"] = {"tokenizer": str(tokenizer)}
    head = (
        "# @package _global_\n"
        f"# Written by `lmforge import hf {hf_dir}`: the model shape of that checkpoint, and its weights as the\n"
        "# starting point (train.init_from; optimizer and data position start fresh). Use it with\n"
        f"#   lmforge train --config-dir {init_from.parents[1] / 'conf'} +exp=NAME [overrides]\n"
    )
    return head + OmegaConf.to_yaml(OmegaConf.create(body))


def hydra_value(value) -> str:
    """``value`` written as Hydra's override grammar reads it back: null, true/false, numbers, ``[a,b]`` lists,
    strings bare when Hydra reads them back unchanged, else single-quoted."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(hydra_value(v) for v in value) + "]"
    text = str(value)
    if _hydra_reads(text) == text:
        return text
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _hydra_reads(text: str):
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    try:
        return OverridesParser.create().parse_override(f"k={text}").value()
    except HydraException:  # not a value Hydra accepts bare (an '=', a quote, ...)
        return None


def hydra_overrides(prefix: str, values: dict) -> List[str]:
    """One ``prefix.key=value`` override per leaf of ``values`` (nested dicts become dotted keys), each one
    command-line argument: join them with ``shlex.join`` for a shell."""
    out: List[str] = []
    for key, value in values.items():
        if isinstance(value, dict):
            out.extend(hydra_overrides(f"{prefix}.{key}", value))
        else:
            out.append(f"{prefix}.{key}={hydra_value(value)}")
    return out


def _exp_name(hf_dir: Path) -> str:
    return "hf_" + re.sub(r"[^A-Za-z0-9_]+", "_", hf_dir.resolve().name).strip("_").lower()


def import_hf(
    hf_dir: Path,
    out_dir: Optional[Path] = None,
    name: Optional[str] = None,
    seq_len: Optional[int] = None,
    dtype: str = "fp32",
    force: bool = False,
) -> ImportResult:
    from lmforge.config.validate import check_model  # deferred: imports omegaconf; this module imports without it
    from lmforge.trainer.trainer import config_dict  # deferred: imports omegaconf, yaml; this module imports without it

    hf_dir = Path(hf_dir).expanduser()
    hf = _read_config(hf_dir)
    name = name or _exp_name(hf_dir)
    out_dir = Path(out_dir or Path("runs") / f"import-{name}").expanduser().absolute()
    if dtype not in DTYPES:
        raise InteropError(f"--dtype {dtype!r}: choose one of {', '.join(DTYPES)}")
    if (out_dir / "checkpoints").exists() and not force:
        raise InteropError(f"{out_dir} already holds checkpoints. Fix: choose another --out or pass --force")
    cfg = model_config_from_hf(hf, name, seq_len)
    root = RootConfig(model=cfg)
    check_model(root)  # the same head/GQA checks `lmforge train` runs
    files = checkpoint_files(hf_dir)
    names = check_tensors(cfg, files)
    model = _load_model(cfg, files, names, DTYPES[dtype])

    notes: List[str] = []
    out_dir.mkdir(parents=True, exist_ok=True)
    if force and (out_dir / "checkpoints").exists():
        shutil.rmtree(out_dir / "checkpoints")
    tok_path, identity = _tokenizer(hf_dir, out_dir, cfg, notes)
    if tok_path is not None:
        root.data.tokenizer = str(tok_path)
    manager = CheckpointManager(out_dir / "checkpoints", CheckpointConfig())
    sidecar = {
        "config": config_dict(root),
        "tokenizer": identity,
        "world_size": 1,
        "data": None,
        "imported_from": {"path": str(hf_dir.resolve()), "model_type": hf.get("model_type"), "dtype": dtype},
    }
    with warnings.catch_warnings():  # DCP's "torch.distributed is disabled ... single process": intended here
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        ckpt = manager.save(0, model, None, sidecar).path
    exp_dir = out_dir / "conf" / "exp"
    exp_dir.mkdir(parents=True, exist_ok=True)
    exp_file = exp_dir / f"{name}.yaml"
    exp_file.write_text(_exp_yaml(hf_dir, cfg, tok_path, ckpt).replace("+exp=NAME", f"+exp={name}"))
    overrides = hydra_overrides("model", asdict(cfg)) + hydra_overrides("train", {"init_from": str(ckpt)})
    if tok_path is not None:
        overrides += hydra_overrides("data", {"tokenizer": str(tok_path)})
    return ImportResult(out_dir, ckpt, name, exp_file, cfg, overrides, notes)
