"""Float8 training (``train.precision=fp8``): torchao's ``Float8Linear`` swapped in for the blocks' linears.

``convert_to_float8`` runs inside ``parallelize`` right after the pipeline split and before tensor parallelism,
FSDP and compile, on the meta-device model: each selected ``nn.Linear`` becomes a ``Float8Linear`` that keeps
its ``weight`` parameter (same name, same fp32 master value), so checkpoints, the name-keyed init and the Hugging
Face export see the same state dict as a bf16 run. Forward and backward cast the GEMM operands to float8 with
dynamic scales (``train.fp8.recipe``: one per tensor, or one per row) and call ``torch._scaled_mm``; everything
else (attention, norms, the loss) runs under the bf16 autocast of ``bf16-mixed``.

Which linears (``converts``): never the output head (``model.gpt.OutputHead``, not an ``nn.Linear`` anyway) or
an MoE router gate; not those whose name contains a ``train.fp8.filter_fqns`` entry; only dims that are
multiples of 16 (the float8 GEMM's requirement); with ``train.fp8.shape_filter`` only those above torchao's
per-recipe size thresholds. MoE routed experts (grouped GEMMs, not ``nn.Linear``) stay in bf16.

``enable_fsdp_float8_all_gather`` (tensorwise): FSDP2 gathers the float8 weights (their bytes as uint8, so gloo
too); ``after_optimizer_step`` precomputes their scales in one all-reduce. ``float8_tp_style``: torchao's float8 TP
styles for ``parallel/tensor_parallel.py``. ``high_precision_linears`` runs the converted model with plain
bf16 linears on the same weights, for the numerics check (``Float8Check``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from typing import Dict, Iterator, List, Optional

import torch
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from lmforge.config.errors import ActionableError
from lmforge.config.train import Float8Config
from lmforge.runtime.dist import rank

ALWAYS_KEPT = ("output", "router")  # module-name components that never convert: the head, the MoE router gate
FP8_DIM_MULTIPLE = 16  # torch._scaled_mm needs both GEMM dims of a weight divisible by 16
_warned: set = set()  # one-line warnings already printed by this process


def _import_torchao():
    """torchao's float8 API, imported quietly (its optional CUDA extensions log load failures on CPU builds)."""
    quiet = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    levels = [q.level for q in quiet]
    for q in quiet:
        q.setLevel(logging.ERROR)
    try:
        import torchao.float8 as ao_float8
    except ImportError as e:
        raise ActionableError(
            "train.precision=fp8", f"needs torchao ({e})", "pip install 'lmforge[fp8]' (torchao==0.18.0)"
        ) from None
    finally:
        for q, level in zip(quiet, levels):
            q.setLevel(level)
    return ao_float8


def converts(fqn: str, linear: nn.Linear, fp8: Float8Config) -> bool:
    """Whether the linear ``fqn`` (its name inside the model) is converted to float8 under ``fp8``."""
    if not isinstance(linear, nn.Linear) or any(part in ALWAYS_KEPT for part in fqn.split(".")):
        return False
    if any(name in fqn for name in fp8.filter_fqns):
        return False
    out_features, in_features = linear.weight.shape
    if out_features % FP8_DIM_MULTIPLE or in_features % FP8_DIM_MULTIPLE:
        return False
    if fp8.shape_filter:  # torchao's per-recipe thresholds (benchmarked on H100), after the checks above
        return _import_torchao()._auto_filter_for_recipe(fp8.recipe, filter_fqns=[])(linear, fqn)
    return True


def float8_fqns(model: nn.Module, fp8: Float8Config) -> List[str]:
    """The names of the linears ``convert_to_float8`` converts (no side effects; works on a meta-device model)."""
    return [name for name, module in model.named_modules() if converts(name, module, fp8)]


def linear_count(model: nn.Module) -> int:
    return sum(isinstance(m, nn.Linear) for m in model.modules())


def convert_to_float8(model: nn.Module, fp8: Float8Config, *, device: torch.device, compiled: bool) -> List[str]:
    """Swap the selected linears of ``model`` for torchao ``Float8Linear`` in place; returns their names.

    Refuses a CUDA device below compute capability 8.9 (no float8 tensor cores) in one line; announces the
    conversion, and warns once that without ``compiled`` the casts run unfused (slower than bf16)."""
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        raise ActionableError(
            "train.precision=fp8",
            f"{torch.cuda.get_device_name(device)} has no float8 GEMMs (compute capability "
            f"{'.'.join(map(str, torch.cuda.get_device_capability(device)))} < 8.9)",
            "use train.precision=bf16-mixed on this GPU",
        )
    ao = _import_torchao()
    config = ao.Float8LinearConfig.from_recipe_name(fp8.recipe)
    if fp8.enable_fsdp_float8_all_gather:
        config = dataclasses.replace(config, enable_fsdp_float8_all_gather=True)
    total = linear_count(model)
    names = float8_fqns(model, fp8)
    selected = set(names)
    ao.convert_to_float8_training(model, module_filter_fn=lambda _m, fqn: fqn in selected, config=config)
    if rank() == 0:
        print(
            f"lmforge: fp8 ({fp8.recipe}): {len(names)} of {total} linears in float8 "
            f"(train.fp8.shape_filter={str(fp8.shape_filter).lower()}, filter_fqns={list(fp8.filter_fqns)})",
            flush=True,
        )
        if not compiled:
            warn_once(
                "fp8-eager",
                "train.precision=fp8 without parallelism.compile=true casts to float8 in unfused eager kernels: "
                "slower than bf16-mixed; set parallelism.compile=true",
            )
    return names


def float8_tp_style(style, module: nn.Module):
    """torchao's float8 counterpart of the TP ``style`` planned for ``module`` (a ``ColwiseParallel`` or
    ``RowwiseParallel`` with the same layouts): the module's input cast to float8 before its redistribution (with
    lmforge's layouts there is none: the collectives stay the bf16 plan's) and its output gradient cast to float8
    before the linear's backward. Only for a converted linear under the
    tensorwise recipe (torchao's float8 TP styles assume one scale per tensor); otherwise ``style`` itself (a
    rowwise ``Float8Linear`` runs on the plain styles' DTensors, casting per row after the redistribution)."""
    ao = _import_torchao()
    if (
        not isinstance(module, ao.float8_linear.Float8Linear)
        or module.config.cast_config_input.scaling_granularity is not ao.ScalingGranularity.TENSORWISE
    ):
        return style
    from torchao.float8.float8_tensor_parallel import (  # deferred: torchao is optional (train.precision=fp8 only)
        Float8ColwiseParallel,
        Float8RowwiseParallel,
    )

    kind = {ColwiseParallel: Float8ColwiseParallel, RowwiseParallel: Float8RowwiseParallel}.get(type(style))
    if kind is None:
        return style
    return kind(
        input_layouts=style.input_layouts[0],
        output_layouts=style.output_layouts[0],
        use_local_output=style.use_local_output,
    )


def warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        print(f"lmforge: warning: {message}", flush=True)


def float8_modules(model: nn.Module) -> Iterator[nn.Module]:
    linear_cls = _import_torchao().float8_linear.Float8Linear
    return (m for m in model.modules() if isinstance(m, linear_cls))


def after_optimizer_step(model: nn.Module, fp8: Float8Config) -> None:
    """With the float8 FSDP all-gather: every converted weight's scale for the next all-gather, in one
    all-reduce of the amaxes (torchao's precompute_float8_dynamic_scale_for_fsdp)."""
    if fp8.enable_fsdp_float8_all_gather:
        _import_torchao().precompute_float8_dynamic_scale_for_fsdp(model)


@contextlib.contextmanager
def high_precision_linears(model: nn.Module):
    """Inside: every ``Float8Linear`` of ``model`` runs as a plain ``nn.Linear`` on the same parameters (bf16 under
    autocast). Not with the float8 FSDP all-gather, whose gathered weights are float8 already (refused in config)."""
    swapped = [(m, type(m)) for m in float8_modules(model)]
    try:
        for module, _cls in swapped:
            module.__class__ = nn.Linear
        yield len(swapped)
    finally:
        for module, cls in swapped:
            module.__class__ = cls


def gap_metrics(fp8_loss: torch.Tensor, bf16_loss: torch.Tensor) -> Dict[str, torch.Tensor]:
    """The numerics check's metrics: both losses on the check's batch and their difference (fp8 - bf16)."""
    return {"fp8/loss": fp8_loss.detach(), "fp8/bf16_loss": bf16_loss.detach(), "fp8/loss_gap": fp8_loss - bf16_loss}


def gap_warning(metrics: Dict[str, float], tolerance: float, step: int) -> Optional[str]:
    """The one-line warning for a check whose |gap| exceeds ``tolerance`` (None within it)."""
    gap = metrics["fp8/loss_gap"]
    if abs(gap) <= tolerance:
        return None
    return (
        f"fp8 numerics at step {step}: the check batch's float8 loss {metrics['fp8/loss']:.4f} differs from its bf16 "
        f"loss {metrics['fp8/bf16_loss']:.4f} by {gap:+.4f} (train.fp8.check_tolerance={tolerance}); try "
        "train.fp8.recipe=rowwise or keep more linears in bf16 (train.fp8.filter_fqns)"
    )
