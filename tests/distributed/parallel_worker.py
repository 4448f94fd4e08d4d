"""Rank-side code of the parallel parity tests (started by tests/harness.py ``run_ranks``).

Each case composes a real config (``lmforge.config.compose`` + ``validate``), builds the NativeEngine for
its layout on the current world, and runs a few optimizer steps on fixed real-text samples through the real
``BatchStream`` (data sharded by the data-parallel rank only). It returns per-step losses and gradient
norms, the sample indices this rank consumed, an eval loss, and every parameter's DTensor placements and
local/global shapes, for the test process to compare with the single-process run.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from types import SimpleNamespace
from typing import Dict, List, Optional

import numpy as np
import torch
import torch.distributed as dist

BASE = [
    "model=tiny",
    "model.seq_len=32",
    "comm=cpu_gloo",
    "train.device=cpu",
    "train.precision=fp32",
    "train.micro_batch_size=2",
    "train.global_batch_size=8",
    "optim.warmup_steps=0",
    "optim.lr=3e-3",
    "optim.grad_clip=0.05",
]
LR = 3e-3


class FixedSamples:
    """The part of a data Mixture that BatchStream reads, over a fixed list of tokenized real text."""

    def __init__(self, samples: List[List[int]], eod: Optional[int] = None):
        self.samples = samples
        self.tokenizer = SimpleNamespace(eod=eod)  # the document-end id of data.document_masking cases
        self.sources = ["books"]
        self.num_train_samples = len(samples)
        self.consumed: List[int] = []

    def train_sample(self, i: int) -> dict:
        text, source = self.train_text(i)
        return {"tokens": text[:-1], "labels": text[1:], "dataset_id": source}

    def train_text(self, i: int):
        """Sample ``i`` as seq_len + 1 token ids and its source id (what BatchStream reads)."""
        self.consumed.append(i)
        return np.asarray(self.samples[i % len(self.samples)], dtype=np.int64), 0


def init_world() -> None:
    from lmforge.comm.process_group import init_process_group
    from lmforge.config.comm import CommConfig

    torch.set_num_threads(1)
    init_process_group(CommConfig(backend="gloo"), torch.device("cpu"))


def build_config(overrides: List[str]):
    from lmforge.config.compose import compose
    from lmforge.config.validate import validate

    return validate(compose(BASE + list(overrides)), world_size=dist.get_world_size())


def build_engine(cfg):
    from lmforge.parallel.native_engine import NativeEngine

    torch.manual_seed(cfg.train.seed)
    device = torch.device("cpu")
    return NativeEngine(cfg, device)


def describe_params(module: torch.nn.Module) -> Dict[str, dict]:
    from lmforge.model.init import canonical_name

    out = {}
    for name, p in module.named_parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        out[canonical_name(name)] = {
            "placements": [str(x) for x in getattr(p, "placements", [])],
            "mesh": list(getattr(p.device_mesh, "mesh_dim_names", None) or []) if hasattr(p, "device_mesh") else [],
            "local": list(local.shape),
            "global": list(p.shape),
        }
    return out


ALL_GATHER, REDUCE_SCATTER = "c10d::_allgather_base_", "c10d::_reduce_scatter_base_"  # FSDP2's collectives


@contextlib.contextmanager
def counting_collectives(counts: Dict[str, List[int]]):
    """Profile the block and append how many c10d calls of each op it dispatched (real collectives) to
    ``counts[op]``."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        yield
    names = [e.name for e in prof.events()]
    for op, seen in counts.items():
        seen.append(names.count(op))


def _fsdp_params(parts):
    from torch.distributed.fsdp import FSDPModule, fully_shard

    for part in parts:
        for module in part.modules():
            if isinstance(module, FSDPModule):
                for group in fully_shard.state(module)._fsdp_param_groups:
                    yield from group.fsdp_params


def unsharded_grad_bytes(parts) -> int:
    """Bytes of full (unsharded) gradients FSDP2 holds right now: zero between micro batches when it reduces
    per micro batch, every block's when it defers."""
    total = 0
    for fp in _fsdp_params(parts):
        unsharded = getattr(fp, "_unsharded_param", None)
        for g in (getattr(fp, "unsharded_accumulated_grad", None), unsharded.grad if unsharded is not None else None):
            if g is not None:
                local = g.to_local() if hasattr(g, "to_local") else g  # a TP-sharded gradient: this rank's part
                total += local.numel() * local.element_size()
    return total


def gathered_param_bytes(parts) -> int:
    """Bytes FSDP2's all-gather outputs (the gathered parameters, param_dtype) occupy right now: their storage is
    freed when a parameter is resharded."""
    return sum(t.untyped_storage().nbytes() for fp in _fsdp_params(parts) for t in fp.all_gather_outputs)


@contextlib.contextmanager
def recording_pipeline_backward_buffers(parts, held: List[dict]):
    """After every pipeline stage backward of the block: FSDP2's gathered parameter and unsharded gradient bytes
    (the schedule reduce-scatters only after the last one, so the last is the step's peak)."""
    from torch.distributed.pipelining.stage import _PipelineStageBase

    backward = _PipelineStageBase.backward_maybe_with_nosync

    def recorded(stage, *args, **kwargs):
        result = backward(stage, *args, **kwargs)
        held.append({"params": gathered_param_bytes(parts), "grads": unsharded_grad_bytes(parts)})
        return result

    _PipelineStageBase.backward_maybe_with_nosync = recorded
    try:
        yield
    finally:
        _PipelineStageBase.backward_maybe_with_nosync = backward


def shift_positions_by_micro_batches(pipeline, shift: int) -> None:
    """This pipeline rank's stages get the document positions of the micro batch ``shift`` earlier (rolled)."""
    train_step = pipeline.train_step

    def shifted(tokens, targets, positions=None):
        rows = positions.shape[0] // pipeline.n_microbatches
        return train_step(tokens, targets, positions.roll(shift * rows, dims=0))

    pipeline.train_step = shifted


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if hasattr(t, "_local_tensor") else t


def probe_float8(engine) -> Dict[str, set]:
    """What the first block's wq (a Float8Linear) computes with at each forward: its weight (after FSDP's
    all-gather: float8 data under the float8 all-gather) and its input (after the TP style's input hook: float8 under
    torchao's float8 TP styles), as 'type:dtype'."""
    seen: Dict[str, set] = {"weight": set(), "input": set()}

    def describe(t: torch.Tensor) -> str:
        local = _local(t)
        return f"{type(local).__name__}:{getattr(local, '_data', local).dtype}"

    def record(module, inputs):
        seen["weight"].add(describe(module.weight))
        seen["input"].add(describe(inputs[0]))

    engine.inner.get_submodule("layers.0.attention.wq").register_forward_pre_hook(record)
    return seen


def precomputed_scales(engine) -> int:
    """How many converted weights hold a scale precomputed for the next float8 all-gather."""
    return sum(getattr(_local(p), "_precomputed_scale", None) is not None for p in engine.inner.parameters())


def scale_from_local_shards(engine) -> None:
    """After torchao's one all-reduce of the weights' amaxes, overwrite every precomputed scale with one from this
    rank's shard alone: the gathered float8 weight then mixes shards cast with different scales under one."""
    from lmforge.parallel import native_engine

    precompute = native_engine.after_optimizer_step

    def local_scales(model, fp8):
        precompute(model, fp8)
        for p in model.parameters():
            local = _local(p)
            if getattr(local, "_precomputed_scale", None) is not None:
                amax = local._tensor.abs().max().clamp(min=1e-12).to(torch.float64)
                local._precomputed_scale = (torch.finfo(torch.float8_e4m3fn).max / amax).to(torch.float32)

    native_engine.after_optimizer_step = local_scales


def run_case(
    overrides: List[str],
    samples: List[List[int]],
    steps: int,
    grad_sync: bool = True,
    save_to: Optional[str] = None,
    count_reduce_scatters: bool = False,
    eod: Optional[int] = None,
    expert_destination_shift: int = 0,
    drop_first_stage_router_loss: bool = False,
    later_stage_positions_shift: int = 0,
    reshard_blocks_after_forward: bool = False,
    regather_each_micro_batch: bool = False,
    fp8_probe: bool = False,
    fp8_local_scales: bool = False,
) -> dict:
    from lmforge.config.validate import check_batch
    from lmforge.data.loader import BatchStream
    from lmforge.model.document_mask import document_positions
    from lmforge.model.init import canonical_name

    cfg = build_config(overrides)
    if reshard_blocks_after_forward:  # negative control of zero bubble x FSDP: the layout validation refuses
        cfg.parallelism.reshard_after_forward = True
    engine = build_engine(cfg)
    if not grad_sync:  # negative control: no DDP wrapper and no manual all-reduce
        assert not cfg.parallelism.overlap_grad_reduce and engine.manual_grad_sync
        engine.manual_grad_sync = False
    if expert_destination_shift:  # negative control of expert parallelism: tokens sent to the wrong ep rank
        from lmforge.parallel.expert_parallel import token_dispatches

        for dispatch in token_dispatches(engine.inner):
            dispatch.destination_shift = expert_destination_shift
    if drop_first_stage_router_loss and engine.mesh["pp"].get_local_rank() == 0:  # negative control (MoE, pp > 1)
        import dataclasses

        for _, layer in engine.moe.layers:
            layer.loss_cfg = dataclasses.replace(layer.loss_cfg, aux_loss_coef=0.0, z_loss_coef=0.0)
    if later_stage_positions_shift and engine.mesh["pp"].get_local_rank() > 0:  # negative control (docmask, pp > 1)
        shift_positions_by_micro_batches(engine.pipeline, later_stage_positions_shift)
    if regather_each_micro_batch:  # negative control of the kept-gathered deferred sync: reshard after each backward
        from lmforge.parallel.data_parallel import set_fsdp_gradient_sync

        assert engine.defer_fsdp_sync and not cfg.parallelism.reshard_after_forward
        engine._grad_sync = lambda last: set_fsdp_gradient_sync(engine.parts, enabled=last) or contextlib.nullcontext()
    seen_fp8 = probe_float8(engine) if fp8_probe else None
    if fp8_local_scales:  # negative control of the float8 all-gather: each rank's weight scales from its own shard
        scale_from_local_shards(engine)
    data = FixedSamples(samples, eod)
    stream = BatchStream(
        data,
        check_batch(cfg),
        dp_rank=engine.dp_rank,
        device=torch.device("cpu"),
        document_masking=cfg.data.document_masking,
        loss_after_eod=cfg.data.loss_after_eod,
    )
    losses, norms, held_grad_bytes, held_param_bytes, moe = [], [], [], [], {}
    collectives = {REDUCE_SCATTER: [], ALL_GATHER: []}
    backward_buffers: List[dict] = []
    if count_reduce_scatters and engine.pipeline is None:  # FSDP's held bytes before each micro batch's forward

        def probed_grad_sync(last: bool, grad_sync=engine._grad_sync):
            held_grad_bytes.append(unsharded_grad_bytes(engine.parts))
            held_param_bytes.append(gathered_param_bytes(engine.parts))
            return grad_sync(last)

        engine._grad_sync = probed_grad_sync
    engine.train()
    for _ in range(steps):
        batches = stream.step_batches()
        if count_reduce_scatters:  # FSDP2's all-gathers and gradient reduce-scatters (gloo: as all-reduces)
            probe = recording_pipeline_backward_buffers if engine.pipeline is not None else None
            with (
                counting_collectives(collectives),
                probe(engine.parts, backward_buffers) if probe else contextlib.nullcontext(),
            ):
                result = engine.train_step(batches, LR)
        else:
            result = engine.train_step(batches, LR)
        losses.append(float(result.loss))
        norms.append(float(result.grad_norm))
        moe = {k: float(v) for k, v in (result.moe or {}).items()}  # MoE models: the last step's expert loads
    engine.eval()
    held_out = torch.tensor(samples[-4:])
    positions = document_positions(held_out[:, :-1], eod) if cfg.data.document_masking else None
    eval_loss = float(engine.eval_loss(held_out[:, :-1], held_out[:, 1:], positions))
    engine.train()
    out = {
        "losses": losses,
        "grad_norms": norms,
        "consumed": data.consumed,
        "eval_loss": eval_loss,
        "dp_rank": engine.dp_rank,
        "params": describe_params(engine.inner),
        "rank": dist.get_rank(),
        "coords": {
            n: engine.mesh[n].get_local_rank()
            for n in ("pp", "dp_replicate", "dp_shard", "tp")
            + (("ep",) if cfg.parallelism.ep > 1 else ())
            + (("cp",) if cfg.parallelism.cp > 1 else ())
        },
        "reduce_scatters": collectives[REDUCE_SCATTER],
        "all_gathers": collectives[ALL_GATHER],
        "held_param_bytes": held_param_bytes,
        "pipeline_backward_buffers": backward_buffers,
        "param_dtypes": sorted({str(p.dtype) for p in engine.inner.parameters()}),
        "micro_batches": check_batch(cfg).grad_accum,
        "held_grad_bytes": held_grad_bytes,
        "moe": moe,
        "expert_bias": {
            canonical_name(n): b.tolist() for n, b in engine.inner.named_buffers() if n.endswith("expert_bias")
        },
    }
    if seen_fp8 is not None:
        out["fp8_probe"] = {**{k: sorted(v) for k, v in seen_fp8.items()}, "precomputed": precomputed_scales(engine)}
    if save_to:
        from lmforge.checkpoint.manager import CheckpointManager
        from lmforge.config.checkpoint import CheckpointConfig

        CheckpointManager(Path(save_to), CheckpointConfig(), engine).save(
            steps, sidecar={"world_size": dist.get_world_size()}
        )
    dist.barrier()
    return out


def run_cases(cases: Dict[str, dict], samples: List[List[int]], steps: int) -> Dict[str, dict]:
    """Several layouts, one after another, in one launch (each builds its own mesh on the same world);
    a case may set its own ``steps`` (0: evaluate the initial weights only), or be ``{"call": "module:function"}``
    (with keyword ``args``): another check run in the same launch (e.g. context_parallel_worker's attention kernel
    check)."""
    import importlib

    init_world()
    out = {}
    for name, case in cases.items():
        if "call" in case:
            module, function = case["call"].split(":")
            out[name] = getattr(importlib.import_module(module), function)(**case.get("args", {}))
        else:
            out[name] = run_case(samples=samples, **{"steps": steps, **case})
    return out


def resume_case(overrides: List[str], samples: List[List[int]], steps: int, checkpoint: str, more: int = 1) -> dict:
    """Load a checkpoint saved under another layout and run ``more`` steps (the second one's loss depends on the
    loaded optimizer moments too); return the first one's loss and all losses."""
    from lmforge.checkpoint.layout import latest
    from lmforge.checkpoint.manager import CheckpointManager
    from lmforge.config.checkpoint import CheckpointConfig
    from lmforge.config.validate import check_batch
    from lmforge.data.loader import BatchStream

    cfg = build_config(overrides)
    engine = build_engine(cfg)
    manager = CheckpointManager(Path(checkpoint), CheckpointConfig(), engine)  # the engine reports its state layout
    manager.load(latest(Path(checkpoint)))
    data = FixedSamples(samples)
    stream = BatchStream(data, check_batch(cfg), dp_rank=engine.dp_rank, device=torch.device("cpu"))
    stream.state.consumed_samples = steps * cfg.train.global_batch_size
    results = [engine.train_step(stream.step_batches(), LR) for _ in range(more)]
    return {
        "loss": float(results[0].loss),
        "grad_norm": float(results[0].grad_norm),
        "consumed": data.consumed,
        "losses": [float(r.loss) for r in results],
    }


def resume_cases(cases: Dict[str, dict], samples: List[List[int]], steps: int, checkpoint: str) -> Dict[str, dict]:
    init_world()
    out = {}
    for name, case in cases.items():
        out[name] = resume_case(samples=samples, steps=steps, checkpoint=checkpoint, **case)
        dist.barrier()
    return out


def train_entry(argv: List[str]) -> int:
    """``python -m lmforge.train ARGV`` inside this rank (the harness set RANK/WORLD_SIZE/MASTER_*)."""
    from lmforge.train import main

    return main(argv)
