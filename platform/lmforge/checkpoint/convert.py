"""Convert checkpoints between engines, so a run can switch: DeepSpeed (ZeRO, any stage and DP size) -> native (DCP).

    deepspeed_to_native(src_step_dir, dst_root, build_optimizer)   -> dst_root/step-N (DCP + state.json)

The way back needs no conversion: a DeepSpeed run resumes from a native checkpoint directly
(``deepspeed_io.load_native`` puts each parameter's value and AdamW moments into the ZeRO partitions).

DeepSpeed -> native goes through DeepSpeed's universal layout (one fp32 value plus AdamW moments per
parameter, ``ds_to_universal``), then builds the single-device model and lmforge's AdamW, fills parameters and
optimizer state by name and saves them exactly as ``CheckpointManager`` does; the per-rank RNG states and the
sidecar (step, data position, W&B run id, scheduler) are carried over unchanged, so resuming the native run
continues the same data stream and schedule. The result is committed atomically like any checkpoint.
Every file is read through ``safe_io`` (no arbitrary unpickling): DeepSpeed's and the universal layout's ``.pt``
files with ``weights_only_loads`` (tensors, primitives, DeepSpeed's three allow-listed types), the RNG tensors
with ``load_dcp``, the sidecar as JSON. A refused file ends the command with one line and exit code 2.

CLI: ``lmforge ckpt convert SRC DST --to native``.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Dict

import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from lmforge.checkpoint import deepspeed_io
from lmforge.checkpoint.commit import commit, make_dir
from lmforge.checkpoint.layout import COMPLETE, SIDECAR, latest, step_dir, tmp_dir
from lmforge.checkpoint.safe_io import UnsafeCheckpointError, load_dcp, read_json, tensor_metadata, weights_only_loads
from lmforge.config.model import ModelConfig
from lmforge.model.gpt import GPT

MOMENTS = ("exp_avg", "exp_avg_sq")


def _rng_tensors(path: Path) -> Dict[str, torch.Tensor]:
    """Every rank's RNG tensors stored (as DCP) in checkpoint ``path``."""
    meta = tensor_metadata(path)
    state = {k: torch.empty(tuple(v.size), dtype=v.properties.dtype) for k, v in meta.items() if k.startswith("rng/")}
    if state:
        load_dcp(state, path, no_dist=True)
    return state


def _model_from_sidecar(sidecar: dict) -> GPT:
    fields = {k: v for k, v in sidecar["config"]["model"].items() if k in ModelConfig.__dataclass_fields__}
    model = GPT(ModelConfig(**fields))
    return model


def _commit(dst_root: Path, step: int, write: Callable[[Path], None], sidecar: dict) -> Path:
    """``write`` the tensor files into ``.tmp-step-N/``, then the commit protocol every checkpoint uses."""
    tmp, final = tmp_dir(dst_root, step), step_dir(dst_root, step)
    make_dir(dst_root)
    shutil.rmtree(tmp, ignore_errors=True)
    make_dir(tmp)
    write(tmp)
    commit(tmp, final, step, sidecar)
    return final


def deepspeed_to_native(
    src: Path, dst_root: Path, build_optimizer: Callable[[nn.Module], torch.optim.Optimizer]
) -> Path:
    """A DeepSpeed checkpoint directory ``src`` (step-N) -> native ``dst_root/step-N``. Single process."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    src = Path(src)
    sidecar = read_json(src / SIDECAR)
    if sidecar.get("format") != deepspeed_io.FORMAT:
        raise ValueError(f"{src} is not a DeepSpeed checkpoint (sidecar format {sidecar.get('format', 'dcp')!r})")
    model = _model_from_sidecar(sidecar)
    optimizer = build_optimizer(model)
    with tempfile.TemporaryDirectory(prefix="lmforge-universal-") as tmp:
        zero = deepspeed_io.to_universal(src, Path(tmp) / "u") / deepspeed_io.DS_TAG / "zero"
        with weights_only_loads():
            step = None
            for name, p in model.named_parameters():
                pdir = zero / name
                with torch.no_grad():
                    p.copy_(_param_file(pdir / "fp32.pt").view_as(p))
                state = {m: _param_file(pdir / f"{m}.pt").view_as(p).clone() for m in MOMENTS}
                step_file = pdir / "step.pt"
                if step is None:
                    step = _adam_step(zero, step_file)
                optimizer.state[p] = {"step": torch.tensor(float(step)), **state}
    msd, osd = get_state_dict(model, optimizer, options=StateDictOptions(flatten_optimizer_state_dict=True))
    tensors = {"model": msd, "optim": osd, **_rng_tensors(src)}
    side = {k: v for k, v in sidecar.items() if k not in ("format", "zero_stage", "dp_size")}
    side["converted_from"] = {
        "format": deepspeed_io.FORMAT,
        "path": str(src),
        "zero_stage": sidecar.get("zero_stage"),
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    return _commit(Path(dst_root), int(sidecar["step"]), lambda d: dcp.save(tensors, checkpoint_id=str(d)), side)


def _param_file(path: Path) -> torch.Tensor:
    """One tensor of the universal layout (saved as a tensor or as {"param": tensor, ...})."""
    value = torch.load(path, map_location="cpu")  # inside weights_only_loads (see deepspeed_to_native)
    return value["param"] if isinstance(value, dict) else value


def _adam_step(zero: Path, step_file: Path) -> int:
    if step_file.exists():
        return int(float(_param_file(step_file)))
    common = torch.load(zero / "optimizer_state.pt", map_location="cpu")
    for state in (common.get("optimizer_state_dict") or {}).get("state", {}).values():  # ZeRO-3: flat groups
        if "step" in state:
            return int(float(state["step"]))
    for group in common.get("param_groups", []):
        if "step" in group:
            return int(group["step"])
    raise ValueError(f"no AdamW step count found in {zero}")


def main(argv, build_optimizer_for: Callable[[nn.Module, dict], torch.optim.Optimizer]) -> int:
    """``lmforge ckpt convert SRC DST_ROOT --to native``. ``build_optimizer_for(model, optim_config_dict)``
    is the trainer's optimizer factory (passed in by the CLI: this layer never imports the trainer)."""
    import argparse

    ap = argparse.ArgumentParser(prog="lmforge ckpt convert", description=__doc__.split("\n\n")[0])
    ap.add_argument("src", type=Path, help="a checkpoint directory (step-NNNNNNNN) or a run's checkpoints/ dir")
    ap.add_argument(
        "dst", type=Path, help="checkpoints root to write step-NNNNNNNN into (resume with train.resume=DST)"
    )
    ap.add_argument("--to", choices=("native",), required=True)
    args = ap.parse_args(list(argv))

    src = args.src if (args.src / COMPLETE).exists() else latest(args.src)
    if src is None:
        print(f"lmforge: {args.src} holds no complete checkpoint", flush=True)
        return 2
    try:
        sidecar = read_json(src / SIDECAR)

        def factory(model: nn.Module) -> torch.optim.Optimizer:
            return build_optimizer_for(model, sidecar["config"]["optim"])

        out = deepspeed_to_native(src, args.dst, factory)
    except (UnsafeCheckpointError, ValueError) as e:
        print(f"lmforge ckpt convert: {e}", file=sys.stderr, flush=True)
        return 2
    print(f"converted {src} ({sidecar.get('format', 'dcp')}) -> {out} (native)", flush=True)
    return 0
