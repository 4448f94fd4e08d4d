"""Tensor parallelism (Megatron-style, on DTensor) and sequence parallelism, applied from outside the model.

Per transformer block, over the ``tp`` mesh dim:

- ``attention.wq/wk/wv`` and ``feed_forward.w1/w3``: column-parallel (output features sharded, ``Shard(0)``
  of the weight), so each rank computes a slice of the heads / hidden units with no communication;
- ``attention.wo`` and ``feed_forward.w2``: row-parallel (input features sharded, ``Shard(1)``), whose
  partial outputs are summed by one all-reduce (or reduce-scatter under sequence parallelism).

The model reads local head counts from the weight shapes (``view(..., -1, head_dim)``), so nothing inside
``lmforge.model`` knows about TP. Outside the blocks:

- ``tok_embeddings``: vocab-parallel (rows of the table sharded; each rank looks up the ids it owns and
  one all-reduce / reduce-scatter combines them);
- ``output`` (``model.gpt.OutputHead``): vocab-parallel (``VocabParallelOutput``: the head's own weight, or
  with tied embeddings the embedding table it is handed, sharded by vocabulary rows), logits gathered to a
  replicated plain tensor so the loss (and a pipeline stage boundary) sees ordinary tensors; every TP rank
  computes the identical loss.

Mixture-of-Experts blocks (``model/moe.py``): attention as above; the router and the routed experts are
replicated (plain parameters, each tp rank routes and computes every token of its batch: identical values and
gradients on every tp rank, so no reduction is needed), the shared experts are column/row-parallel like the
dense FFN with a replicated output. Under sequence parallelism the MoE block's input is gathered to the full
sequence first (plain tensor, so routing and capacity see the same tokens as one device) and its output is
cut back to this rank's sequence shard (a local slice; the backward all-gathers its gradient). With expert
parallelism the routed experts are then split over ep and still replicated over tp (parallel/expert_parallel.py).

Sequence parallelism (``sequence_parallel=true``) additionally shards the norms' activations along the
sequence dim (``SequenceParallel``): the residual stream between blocks is the *local* sequence shard,
a plain ``[B, T/tp, d]`` tensor (mixing plain tensors and DTensors in the residual add
fails), all-gathered before attention / the MLP and reduce-scattered after them. The linears reading the
gathered input (wq/wk/wv, w1/w3) keep only this rank's shard of it for backward (``SequenceGatheredInput``: a
saved-tensor hook that stores the shard and all-gathers it again, once per module, when backward first needs it),
so every activation of a block is divided by tp (Korthikanti et al. 2022; ``parallel/activation_table.py``). Under
bf16 autocast the shard is cast before the gather (the values each linear's own cast would give; the gather moves
half the bytes, the three input gradients are summed in bf16). Under activation checkpointing (or any other
saved-tensor hook) and inside a compiled graph the hook stands aside: checkpointing already recomputes the gather,
and the compiler decides what its graph saves.

``train.precision=fp8``: the linears are torchao ``Float8Linear`` by then (parallel/float8.py); under the
tensorwise recipe without sequence parallelism the converted ones get torchao's float8 TP styles
(``float8.float8_tp_style``), otherwise the plain styles above, each ``Float8Linear`` casting what it reads.
"""

from __future__ import annotations

from functools import partial
from typing import Callable, Optional

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInputOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from lmforge.model.moe import MoEFeedForward
from lmforge.parallel.float8 import float8_tp_style
from lmforge.parallel.loss_parallel import keep_logits_sharded


def block_plan(sequence_parallel: bool, moe: bool = False, shared_experts: bool = False) -> dict:
    """The TP plan of one transformer block (keys relative to the block); ``moe``: its feed-forward is an
    ``MoEFeedForward`` (with ``shared_experts``), whose router and routed experts stay out of the plan (replicated)."""
    plan = {
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=Shard(1) if sequence_parallel else Replicate()),
    }
    if not moe:
        plan.update(
            {
                "feed_forward.w1": ColwiseParallel(),
                "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1) if sequence_parallel else Replicate()),
                "feed_forward.w3": ColwiseParallel(),
            }
        )
    elif shared_experts:  # the shared experts' FFN: column/row-parallel, output replicated (added to the routed)
        plan.update(
            {
                "feed_forward.shared.w1": ColwiseParallel(),
                "feed_forward.shared.w3": ColwiseParallel(),
                "feed_forward.shared.w2": RowwiseParallel(output_layouts=Replicate()),
            }
        )
    if sequence_parallel:
        plan.update(
            {
                "attention_norm": SequenceParallel(),
                "ffn_norm": SequenceParallel(),
                # (x, cos, sin): gather the sequence shard of x; the RoPE tables are plain full-length tensors.
                "attention": SequenceGatheredInput(),
                "feed_forward": SequenceGatheredInput(),
            }
        )
        if moe:  # the full sequence in as a plain tensor (routing sees one device's tokens), the shard out
            plan["feed_forward"] = PrepareModuleInputOutput(
                input_layouts=(Shard(1),),
                desired_input_layouts=(Replicate(),),
                use_local_input=True,
                output_layouts=(Replicate(),),
                desired_output_layouts=(Shard(1),),
                use_local_output=True,
            )
    return plan


def outer_plan(model: nn.Module, sequence_parallel: bool) -> dict:
    """Embedding, final norm and output; only for the modules this (pipeline stage) model holds."""
    plan = {}
    if getattr(model, "tok_embeddings", None) is not None:
        plan["tok_embeddings"] = RowwiseParallel(
            input_layouts=Replicate(), output_layouts=Shard(1) if sequence_parallel else Replicate()
        )
    if getattr(model, "norm", None) is not None and sequence_parallel:
        plan["norm"] = SequenceParallel()
    if getattr(model, "output", None) is not None:
        plan["output"] = VocabParallelOutput(Shard(1) if sequence_parallel else Replicate())
    return plan


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool, float8: bool = False) -> None:
    """Shard ``model`` (a GPT or the part of it one pipeline rank holds) over ``tp_mesh`` in place; ``float8``
    (``train.precision=fp8``) without sequence parallelism: the converted linears get torchao's float8 TP styles
    (``float8.float8_tp_style``). Under sequence parallelism they keep the plain styles: the shard is gathered in
    bf16 by ``SequenceGatheredInput`` (its shard kept for backward) and each ``Float8Linear`` casts what it reads;
    torchao's styles there move float8 tensors through DTensor collectives, which gloo cannot (no float8 dtypes:
    'Invalid scalar type')."""
    if tp_mesh.size() == 1:
        return
    parallelize_module(model, tp_mesh, outer_plan(model, sequence_parallel))
    for block in model.layers.values():
        ffn = block.feed_forward
        moe = isinstance(ffn, MoEFeedForward)
        plan = block_plan(sequence_parallel, moe, moe and ffn.shared is not None)
        if float8 and not sequence_parallel:
            plan = {name: float8_tp_style(style, block.get_submodule(name)) for name, style in plan.items()}
        parallelize_module(block, tp_mesh, plan)


class VocabParallelOutput(ParallelStyle):
    """Column parallelism of an ``OutputHead`` over the vocabulary (what ``ColwiseParallel`` does for an
    ``nn.Linear``, which the head is not): its own weight, if untied, becomes ``Shard(0)``; a tied head is handed
    the vocab-parallel embedding table, already ``Shard(0)``. The hidden states arrive as ``input_layout``
    (``Shard(1)`` under sequence parallelism) and are replicated; each rank computes its vocabulary slice of
    the logits (``Shard(-1)``), which are gathered into a replicated plain tensor, or, inside
    ``loss_parallel.sharded_logits()``, handed on as that DTensor to the vocab-parallel loss."""

    def __init__(self, input_layout: Placement):
        super().__init__()
        self.input_layout = input_layout

    @staticmethod
    def _shard_weight(name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        if name == "" and module.weight is not None:
            module.weight = nn.Parameter(
                distribute_tensor(module.weight, mesh, [Shard(0)]), requires_grad=module.weight.requires_grad
            )

    @staticmethod
    def _replicate_input(input_layout: Placement, module: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
        h, *rest = inputs
        if not isinstance(h, DTensor):
            h = DTensor.from_local(h, mesh, [input_layout], run_check=False)
        return (h.redistribute(mesh, [Replicate()]), *rest)

    @staticmethod
    def _gather_logits(module: nn.Module, logits: DTensor, mesh: DeviceMesh) -> torch.Tensor:
        if keep_logits_sharded():  # the loss is vocab-parallel (parallel/loss_parallel.py)
            return logits
        return logits.redistribute(mesh, [Replicate()]).to_local()

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(
            module,
            device_mesh,
            self._shard_weight,
            partial(self._replicate_input, self.input_layout),
            self._gather_logits,
        )


def keep_grads_in_param_layout(model: nn.Module) -> int:
    """Make every DTensor gradient take its parameter's placements once it is accumulated.

    DTensor's embedding backward has no vocab-sharded rule: the gradient of the ``Shard(0)`` (vocab-parallel)
    embedding table comes back ``Replicate`` — the full vocab x d table on every TP rank, kept until the
    optimizer step (about 0.5 GB per rank in fp32 for gpt_7b's untied 32000 x 4096 table). Slicing it to the
    parameter's layout right after accumulation is a local copy (no communication) and frees the full table;
    the values are the same, so clipping and the update see bit-identical local gradients. Gradients that FSDP
    reduce-scatters are assigned by FSDP, not accumulated, and never reach this hook. Returns the hook count.
    """
    count = 0
    for param in model.parameters():
        if isinstance(param, DTensor) and param.requires_grad:
            param.register_post_accumulate_grad_hook(_to_param_layout)
            count += 1
    return count


def _to_param_layout(param: torch.Tensor) -> None:
    grad = param.grad
    if isinstance(grad, DTensor) and tuple(grad.placements) != tuple(param.placements):
        local = grad.redistribute(param.device_mesh, param.placements).to_local().clone()  # own the slice
        param.grad = DTensor.from_local(
            local, param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride()
        )


def _storage_key(t: torch.Tensor) -> int:
    local = t._local_tensor if isinstance(t, DTensor) else t
    return local.untyped_storage()._cdata


class _ShardRef:
    """What the graph holds in place of a view of the gathered input: the view's geometry (local and, for a
    DTensor, global) and the keeper that gathers the shard again."""

    __slots__ = ("keeper", "size", "stride", "offset", "spec")

    def __init__(self, keeper: "ShardKeeper", t: torch.Tensor):
        local = t._local_tensor if isinstance(t, DTensor) else t
        self.keeper = keeper
        self.size, self.stride, self.offset = local.size(), local.stride(), local.storage_offset()
        self.spec = (t.device_mesh, t.placements, t.size(), t.stride()) if isinstance(t, DTensor) else None


class ShardKeeper:
    """Saved-tensor hooks that keep a sequence shard instead of the all-gathered tensor built from it.

    ``gathered``: the (local) gathered tensor the linears read; ``regather``: returns it again (an all-gather of the
    shard it closes over) in backward. Every saved tensor sharing ``gathered``'s storage is packed as a
    ``_ShardRef``; the first unpack gathers once and the result is dropped when the last reference was unpacked.
    Other saved tensors pass through unchanged."""

    def __init__(self, gathered: torch.Tensor, regather: Callable[[], torch.Tensor]):
        self.key = _storage_key(gathered)
        self.base = (gathered._local_tensor if isinstance(gathered, DTensor) else gathered).storage_offset()
        self.regather = regather
        self.pending = 0
        self.cached: Optional[torch.Tensor] = None

    def pack(self, t: torch.Tensor):
        if _storage_key(t) != self.key:
            return t
        self.pending += 1
        return _ShardRef(self, t)

    def unpack(self, packed):
        if not isinstance(packed, _ShardRef):
            return packed
        if self.cached is None:
            with torch.no_grad():
                full = self.regather()
            self.cached = full._local_tensor if isinstance(full, DTensor) else full
        local = self.cached.as_strided(packed.size, packed.stride, packed.offset - self.base)
        self.pending -= 1
        if self.pending <= 0:
            self.cached = None
        if packed.spec is None:
            return local
        mesh, placements, shape, stride = packed.spec
        with torch.no_grad():
            return DTensor.from_local(local, mesh, placements, run_check=False, shape=shape, stride=stride)


def keeps_shards() -> bool:
    """Whether the linears of this forward may keep sequence shards: grad recorded, eager, and no other
    saved-tensor hook (activation checkpointing) in charge of what is saved."""
    if torch.compiler.is_compiling() or not torch.is_grad_enabled():
        return False
    return torch._C._autograd._top_saved_tensors_default_hooks(False) is None


class SequenceGatheredInput(ParallelStyle):
    """A module's first input, a sequence shard (``Shard(1)``), all-gathered to ``Replicate`` before its forward
    (the other inputs, e.g. RoPE tables, pass as they are), with :class:`ShardKeeper` installed for the forward so
    its linears keep the shard rather than the gathered sequence."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module.register_forward_pre_hook(partial(self._gather, device_mesh))
        module.register_forward_hook(self._release, always_call=True)
        return module

    @staticmethod
    def _gather(mesh: DeviceMesh, module: nn.Module, inputs: tuple) -> tuple:
        x, *rest = inputs
        if not isinstance(x, DTensor):
            x = DTensor.from_local(x, mesh, [Shard(1)], run_check=False)
        if torch.is_autocast_enabled(x.device.type):  # cast the shard once: the gather moves half the bytes
            x = x.to(torch.get_autocast_dtype(x.device.type))
        gathered = x.redistribute(mesh, [Replicate()])
        if keeps_shards() and gathered.requires_grad:
            shard = x.detach()
            keeper = ShardKeeper(gathered, lambda: shard.redistribute(mesh, [Replicate()]))
            hooks = torch.autograd.graph.saved_tensors_hooks(keeper.pack, keeper.unpack)
            hooks.__enter__()
            module._sequence_shard_hooks = hooks
        return (gathered, *rest)

    @staticmethod
    def _release(module: nn.Module, inputs: tuple, output):
        hooks = module.__dict__.pop("_sequence_shard_hooks", None)
        if hooks is not None:
            hooks.__exit__(None, None, None)
        return output
