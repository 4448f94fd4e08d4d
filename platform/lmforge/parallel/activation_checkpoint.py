"""Activation checkpointing of transformer blocks (``parallelism.activation_checkpointing``).

- ``full``: every chosen block recomputes its forward during backward (stores only block inputs).
- ``selective``: op-level selective checkpointing: outputs of matmuls and attention are kept, cheap
  element-wise ops (norms, activations, RoPE) are recomputed, trading a little compute for most of the
  activation memory of the element-wise chain. ``parallelism.selective_matmuls=alternate`` keeps only the odd
  matmuls of each block (1st, 3rd, ...: wq, wv, w1, w2 of a SwiGLU block) and recomputes the others (wk, wo, w3)
  from their saved inputs: torchtitan's ``op`` policy, counted per block forward and per recompute.
- ``modules``: only the parts of a block that ``parallelism.recompute_modules`` names are recomputed
  (Megatron's ``--recompute-modules``): ``attention_core`` (the attention kernel: its q, k, v stay saved, its
  output and log-sum-exp are recomputed), ``mlp`` (the feed-forward, dense or MoE: only its input is saved),
  ``norms`` (both norms: only their inputs are saved).

``parallelism.recompute_layers=k`` applies the mode to the first ``k`` blocks of each pipeline stage only
(Megatron's ``--recompute-method block --recompute-num-layers k``); 0 applies it to every block. Applied after
tensor, context and expert parallelism (their module hooks run inside the recomputed region, so a sequence-parallel
all-gather is redone in backward) and before compile and FSDP, in ``parallel/parallelize.py``'s fixed order.
"""

from __future__ import annotations

import functools
from typing import Callable, List, Optional, Sequence

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

_SAVE_OPS = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
}


_MATMULS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default}  # a block's linears
SELECTIVE_MATMULS = ("all", "alternate")


def _policy(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op in _SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _alternate_matmuls_context():
    """Selective contexts for one block forward that keep the odd matmuls' outputs and recompute the even ones;
    the forward and the recompute count their matmuls separately, so both pick the same ones."""
    counts = {False: 0, True: 0}

    def policy(ctx, op, *args, **kwargs):
        if op in _MATMULS:
            counts[ctx.is_recompute] += 1
            if counts[ctx.is_recompute] % 2 == 0:
                return CheckpointPolicy.PREFER_RECOMPUTE
        return _policy(ctx, op)

    return create_selective_checkpoint_contexts(policy)


def selective_context(matmuls: str) -> Callable:
    """The ``context_fn`` of a selectively checkpointed block (``parallelism.selective_matmuls``)."""
    if matmuls not in SELECTIVE_MATMULS:
        raise ValueError(f"selective_matmuls={matmuls!r}: expected one of {SELECTIVE_MATMULS}")
    if matmuls == "alternate":
        return _alternate_matmuls_context
    return functools.partial(create_selective_checkpoint_contexts, _policy)


def recomputed(fn: Callable) -> Callable:
    """``fn`` run under non-reentrant checkpointing: its inputs are saved, everything inside is recomputed."""

    @functools.wraps(fn)
    def run(*args, **kwargs):
        return checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=False, **kwargs)

    return run


def checkpoint_block_parts(block: nn.Module, modules: Sequence[str]) -> None:
    """Recompute the named parts of one block (``config.parallelism.RECOMPUTE_MODULES``) in backward, in place."""
    if "attention_core" in modules:
        attention = block.attention
        attention.attend = recomputed(attention.attend)  # the instance's kernel (a cp rank's own, if set)
    if "mlp" in modules:
        block.feed_forward = checkpoint_wrapper(block.feed_forward, preserve_rng_state=False)
    if "norms" in modules:
        block.attention_norm = checkpoint_wrapper(block.attention_norm, preserve_rng_state=False)
        block.ffn_norm = checkpoint_wrapper(block.ffn_norm, preserve_rng_state=False)


def chosen_blocks(names: Sequence[str], stage_layers: Optional[Sequence[Sequence[str]]], first_k: int) -> List[str]:
    """The block names to checkpoint: the first ``first_k`` of each pipeline stage's blocks (``stage_layers``; None:
    the whole model is one stage), every block for ``first_k=0``."""
    groups = [list(names)] if stage_layers is None else [[n for n in stage if n in names] for stage in stage_layers]
    return [n for group in groups for n in (group if first_k == 0 else group[:first_k])]


def apply_activation_checkpointing(
    model: nn.Module,
    mode: str,
    *,
    modules: Sequence[str] = ("attention_core",),
    first_k: int = 0,
    stage_layers: Optional[Sequence[Sequence[str]]] = None,
    selective_matmuls: str = "all",
) -> List[str]:
    """Checkpoint ``model``'s blocks under ``mode`` (see the module docstring); returns the block names it wrapped.
    ``stage_layers``: the block names of each pipeline stage this model part holds, for ``first_k``;
    ``selective_matmuls``: which matmul outputs ``selective`` keeps (``all`` or ``alternate``)."""
    if mode == "none":
        return []
    chosen = chosen_blocks(list(model.layers.keys()), stage_layers, first_k)
    for name in chosen:
        block = model.layers[name]
        if mode == "modules":
            checkpoint_block_parts(block, modules)
        elif mode == "full":
            model.layers[name] = checkpoint_wrapper(block, preserve_rng_state=False)
        else:
            model.layers[name] = checkpoint_wrapper(
                block,
                preserve_rng_state=False,
                context_fn=selective_context(selective_matmuls),
            )
    return chosen
