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
fails), all-gathered before attention / the MLP and reduce-scattered after them.
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from lmforge.model.moe import MoEFeedForward


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
                "attention": PrepareModuleInput(
                    input_layouts=(Shard(1), None, None), desired_input_layouts=(Replicate(), None, None)
                ),
                "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
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


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool) -> None:
    """Shard ``model`` (a GPT or the part of it one pipeline rank holds) over ``tp_mesh`` in place."""
    if tp_mesh.size() == 1:
        return
    parallelize_module(model, tp_mesh, outer_plan(model, sequence_parallel))
    for block in model.layers.values():
        ffn = block.feed_forward
        moe = isinstance(ffn, MoEFeedForward)
        parallelize_module(block, tp_mesh, block_plan(sequence_parallel, moe, moe and ffn.shared is not None))


class VocabParallelOutput(ParallelStyle):
    """Column parallelism of an ``OutputHead`` over the vocabulary (what ``ColwiseParallel`` does for an
    ``nn.Linear``, which the head is not): its own weight, if untied, becomes ``Shard(0)``; a tied head is handed
    the vocab-parallel embedding table, already ``Shard(0)``. The hidden states arrive as ``input_layout``
    (``Shard(1)`` under sequence parallelism) and are replicated; each rank computes its vocabulary slice of
    the logits (``Shard(-1)``), which are gathered into a replicated plain tensor."""

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
