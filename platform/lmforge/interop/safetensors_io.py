"""Read and write Hugging Face safetensors checkpoints: one file, or shards plus ``model.safetensors.index.json``."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Dict, Iterator, List, Tuple

import torch

from lmforge.interop.errors import InteropError

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B)?\s*$", re.IGNORECASE)
_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}


def parse_size(text: str) -> int:
    """'5GB' -> 5_000_000_000 (HF's convention: decimal units; KiB/MiB/GiB are binary)."""
    m = _SIZE_RE.match(str(text))
    if not m:
        raise InteropError(f"--max-shard-size {text!r} is not a size. Fix: e.g. 5GB, 500MB, 200KiB or a byte count")
    return int(float(m.group(1)) * _UNITS[(m.group(2) or "").upper()])


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def plan_shards(tensors: Dict[str, torch.Tensor], max_shard_bytes: int) -> List[List[str]]:
    """Greedy, in the given order; a tensor larger than the limit gets a shard of its own."""
    shards: List[List[str]] = [[]]
    size = 0
    for name, t in tensors.items():
        n = _nbytes(t)
        if shards[-1] and size + n > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += n
    return shards


def write_checkpoint(tensors: Dict[str, torch.Tensor], out_dir: Path, max_shard_bytes: int) -> List[str]:
    """Write ``tensors`` as ``model.safetensors`` or shards + index; returns the file names written."""
    from safetensors.torch import save_file

    shards = plan_shards(tensors, max_shard_bytes)
    meta = {"format": "pt"}
    if len(shards) == 1:
        save_file({n: tensors[n].contiguous() for n in shards[0]}, str(out_dir / SINGLE), metadata=meta)
        return [SINGLE]
    files, weight_map = [], {}
    for k, names in enumerate(shards, start=1):
        fname = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        save_file({n: tensors[n].contiguous() for n in names}, str(out_dir / fname), metadata=meta)
        files.append(fname)
        weight_map.update({n: fname for n in names})
    total = sum(_nbytes(t) for t in tensors.values())
    (out_dir / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    return files + [INDEX]


def checkpoint_files(hf_dir: Path) -> List[Path]:
    if (hf_dir / INDEX).is_file():
        weight_map = json.loads((hf_dir / INDEX).read_text()).get("weight_map", {})
        files = sorted(set(weight_map.values()))
        missing = [f for f in files if not (hf_dir / f).is_file()]
        if missing:
            raise InteropError(
                f"{hf_dir / INDEX} names shard files that are not there: {', '.join(missing)}. "
                "Fix: copy the complete checkpoint"
            )
        return [hf_dir / f for f in files]
    if (hf_dir / SINGLE).is_file():
        return [hf_dir / SINGLE]
    pickled = [p.name for p in hf_dir.glob("*.bin")] + [p.name for p in hf_dir.glob("*.pt")]
    hint = (
        (
            f" It has {', '.join(sorted(pickled))}: pickled weights are not loaded (arbitrary code). Convert them "
            "to safetensors in a trusted environment first"
        )
        if pickled
        else ""
    )
    raise InteropError(
        f"{hf_dir}: no {SINGLE} or {INDEX}.{hint}. Fix: point at a local HF checkpoint directory saved with safetensors"
    )


def tensor_shapes(files: List[Path]) -> Dict[str, Tuple[Tuple[int, ...], str, Path]]:
    """{name: (shape, dtype string, file)} without reading the tensor data."""
    from safetensors import safe_open

    out = {}
    for f in files:
        with safe_open(str(f), framework="pt") as fh:
            for name in fh.keys():
                sl = fh.get_slice(name)
                out[name] = (tuple(sl.get_shape()), sl.get_dtype(), f)
    return out


def iter_tensors(files: List[Path], names: List[str]) -> Iterator[Tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    wanted = set(names)
    for f in files:
        with safe_open(str(f), framework="pt") as fh:
            for name in fh.keys():
                if name in wanted:
                    yield name, fh.get_tensor(name)
