"""The native engine: owns the (parallelized) model and optimizer and runs one optimizer step.

The trainer only talks to an engine (this one, or the DeepSpeed engine), so wrapping and the optimizer
step are the only things that differ between engines.
"""

from __future__ import annotations

import contextlib
from typing import Dict, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from lmforge.config.document_masking import check_document_masking
from lmforge.config.parallelism import fsdp_grad_sync_mode
from lmforge.config.validated import Validated
from lmforge.model.gpt import GPT
from lmforge.model.logprobs import target_logprobs
from lmforge.model.moe import MoECollector, moe_layer_names
from lmforge.optim.adamw import build_optimizer, set_learning_rate
from lmforge.parallel.contract import DCP, StateLayout, StepGuard, StepResult
from lmforge.parallel.data_parallel import allreduce_gradients, set_fsdp_gradient_sync
from lmforge.parallel.float8 import after_optimizer_step, gap_metrics, high_precision_linears
from lmforge.parallel.grad_clip import clip_grad_norm
from lmforge.parallel.loss_parallel import loss_function, sharded_logits
from lmforge.parallel.mesh import ParallelDims, ParallelMesh, build_mesh, dp_rank
from lmforge.parallel.parallelize import parallelize
from lmforge.parallel.precision import autocast_context, resolve_precision


def optimizer_step(optimizer: torch.optim.Optimizer, skip: Optional[torch.Tensor]) -> None:
    """Step, unless ``skip`` (a bool device tensor) is true — without reading it when the optimizer can.

    Fused Adam/AdamW take a ``found_inf`` tensor (the ``GradScaler`` mechanism): the kernel leaves weights,
    moments and the step count unchanged when it is non-zero, so the skip costs no host sync. Any other
    optimizer needs the verdict on the host: one sync, the price of ``optim.fused=false`` with the guard on.
    """
    if skip is None:
        optimizer.step()
    elif getattr(optimizer, "_step_supports_amp_scaling", False):
        optimizer.found_inf = skip.to(torch.float32)
        try:
            optimizer.step()
        finally:
            del optimizer.found_inf
    elif not bool(skip):
        optimizer.step()


class NativeEngine:
    def __init__(self, cfg: Validated, device: torch.device):
        self.cfg = cfg  # validate()'s result: the typed config (cfg.<group>) and its batch plan (cfg.plan)
        self.device = device
        self.dims = ParallelDims.from_config(cfg.parallelism)
        self.mesh: ParallelMesh = build_mesh(self.dims, device)
        self.precision = resolve_precision(cfg.train.precision, device)
        with torch.device("meta"):
            model = GPT(cfg.model)
        check_document_masking(cfg.cfg, device.type)  # train.device=auto resolved: the backend's device check
        model.document_attention = cfg.data.document_attention  # used by batches with document positions
        par = parallelize(model, cfg.cfg, self.mesh, device, batch=cfg.plan)
        self.inner = par.model  # owns this rank's parameters: optimizer, checkpoints, clipping
        self.model = par.module
        self.parts = par.parts
        self.pipeline = par.pipeline
        self.manual_grad_sync = par.manual_grad_sync
        self.context = par.context  # cp > 1: each rank's share of every sequence (parallel/context_parallel.py)
        # tp > 1: the loss on vocab-sharded logits, never gathered (parallel/loss_parallel.py)
        self.loss_parallel = cfg.parallelism.loss_parallel and self.dims.tp > 1
        self.optimizer = build_optimizer(self.inner, cfg.optim, device, cfg.model)
        # The MoE layers' router losses and loads (rows for every stage's layers); empty: dense.
        self.moe = MoECollector(self.inner, cfg.model.moe, moe_layer_names(cfg.model))
        if self.pipeline is not None and self.moe:
            # the schedule backpropagates only the last stage's loss: router losses through backward (model/moe.py)
            self.moe.book_in_backward(self.pipeline.n_microbatches)
        self.dp_group = self.mesh["dp"].get_group()
        # Losses are means over each rank's tokens: averaged over every rank holding a part of the batch (dp x cp).
        self.loss_group = self.mesh["dp_cp"].get_group() if self.dims.cp > 1 else self.dp_group
        self.loss_ranks = self.dims.dp * self.dims.cp
        # Ranks holding a replica of this rank's shard (fault/consistency.py compares them); None: no replicas.
        self.replica_group = self.mesh["dp_replicate"].get_group() if self.dims.dp_replicate > 1 else None
        self.pp_group = self.mesh["pp"].get_group() if self.dims.pp > 1 else None
        # FSDP without pipelining, deferring: no reduce-scatter until the last micro batch's backward.
        self.defer_fsdp_sync = (
            self.dims.dp_shard * self.dims.cp > 1
            and self.pipeline is None
            and fsdp_grad_sync_mode(cfg.parallelism) == "last_microbatch"
        )
        # train.precision=fp8: the float8 settings; the numerics check's batch (this launch's first micro batch)
        self.fp8 = cfg.train.fp8 if self.precision == "fp8" else None
        self._fp8_check_batch: Optional[Tuple[torch.Tensor, ...]] = None
        self._fp8_steps = 0
        # fault.replica_ft: gradients averaged over the replica groups, the update only on their commit (the trainer
        # sets it; lmforge.fault.replica_ft)
        self.cross_replica = None  # a contract.CrossReplica under fault.replica_ft

    @property
    def dp_rank(self) -> int:
        return dp_rank(self.mesh)

    @property
    def dp_size(self) -> int:
        return self.dims.dp

    def _grad_sync(self, last: bool):
        """Gradient reduction for one micro batch's backward: only on the last one when deferring (blocks kept
        gathered after forward then stay gathered until the last backward: one all-gather per step)."""
        if self.defer_fsdp_sync:
            set_fsdp_gradient_sync(
                self.parts, enabled=last, keep_gathered=not self.cfg.parallelism.reshard_after_forward
            )
            return contextlib.nullcontext()
        if not last and hasattr(self.model, "no_sync"):
            return self.model.no_sync()
        return contextlib.nullcontext()

    def forward_loss(
        self, tokens: torch.Tensor, targets: torch.Tensor, positions: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        """``positions``: the batch's document positions (data.document_masking), None for plain causal."""
        if self.context is not None:  # this cp rank's two chunks of every sequence; document positions stay
            tokens, targets = self.context.shard(tokens), self.context.shard(targets)  # whole (keys' documents)
        with autocast_context(self.precision, self.device), sharded_logits(self.loss_parallel):
            logits = self.model(tokens) if positions is None else self.model(tokens, positions=positions)
        return loss_function(logits, targets)  # vocab-parallel on sharded logits (tp, parallelism.loss_parallel)

    def train_step(self, micro_batches: Sequence, lr: float, guard: Optional[StepGuard] = None) -> StepResult:
        if self.pipeline is not None:
            tokens = torch.cat([mb.tokens for mb in micro_batches])
            targets = torch.cat([mb.targets for mb in micro_batches])
            # document masking: every stage gets its micro batch's positions (whole under cp: the keys' documents)
            positions = (
                None if micro_batches[0].positions is None else torch.cat([mb.positions for mb in micro_batches])
            )
            if self.context is not None:  # cp x pp: every stage runs on this cp rank's two chunks
                tokens, targets = self.context.shard(tokens), self.context.shard(targets)
            with autocast_context(self.precision, self.device):
                total = self.pipeline.train_step(tokens, targets, positions)
        else:
            n = len(micro_batches)
            total = torch.zeros((), device=self.device)
            for j, mb in enumerate(micro_batches):
                with self._grad_sync(last=j == n - 1):
                    loss = self.forward_loss(mb.tokens, mb.targets, mb.positions) / n
                    total += loss.detach()  # the reported loss is the cross-entropy alone
                    if self.moe:
                        loss = loss + self.moe.router_loss() / n  # aux load-balancing + z-loss (model/moe.py)
                    loss.backward()
        if self.manual_grad_sync:
            allreduce_gradients(self.inner, self.dp_group)
        if self.loss_ranks > 1:
            dist.all_reduce(total, group=self.loss_group)
            total /= self.loss_ranks
        if self.cross_replica is not None and not self._replicas_commit(total):
            self.optimizer.zero_grad(set_to_none=True)  # no replica steps: the trainer redoes this step
            return StepResult(total, torch.zeros((), device=self.device), committed=False)
        grad_norm = clip_grad_norm(self.inner.parameters(), self.cfg.optim.grad_clip, self.pp_group)
        skip = guard.skip_tensor(total, grad_norm) if guard is not None else None
        set_learning_rate(self.optimizer, lr)
        optimizer_step(self.optimizer, skip)
        self.optimizer.zero_grad(set_to_none=True)
        if self.fp8 is not None:
            after_optimizer_step(self.inner, self.fp8)  # float8 all-gather: next gather's scales, one all-reduce
        moe = self._moe_step() if self.moe else None
        return StepResult(total, grad_norm, skip, moe, self._fp8_check(micro_batches[0]))

    @torch.no_grad()
    def _replicas_commit(self, total: torch.Tensor) -> bool:
        """fault.replica_ft: gradients and the loss averaged over the participating replica groups in one flat
        all-reduce, then their commit vote (True: every participant may step; a failed peer makes it False).
        Inside a group of several ranks this runs after the group's own reduction (DDP's all-reduce, FSDP's
        reduce-scatter): each rank averages its local gradients (FSDP, TP: its shards) with the same rank of the
        others."""
        grads = [
            p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
            for p in self.inner.parameters()
            if p.grad is not None
        ]
        flat = torch.cat([g.reshape(-1) for g in grads] + [total.reshape(1).to(grads[0].dtype)])
        self.cross_replica.average(flat)
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()
        total.copy_(flat[offset])
        return self.cross_replica.should_commit()

    def _fp8_check(self, mb) -> Optional[Dict[str, torch.Tensor]]:
        """Every ``train.fp8.check_every`` steps of this launch: the loss of its first micro batch under float8 and
        with bf16 linears on the same (just updated) weights; two extra forwards, no backward (parallel/float8.py)."""
        if self.fp8 is None or not self.fp8.check_every:
            return None
        if self._fp8_check_batch is None:
            positions = None if mb.positions is None else mb.positions.clone()
            self._fp8_check_batch = (mb.tokens.clone(), mb.targets.clone(), positions)
        self._fp8_steps += 1
        if self._fp8_steps % self.fp8.check_every:
            return None
        fp8_loss = self.eval_loss(*self._fp8_check_batch)
        with high_precision_linears(self.inner):
            bf16_loss = self.eval_loss(*self._fp8_check_batch)
        return gap_metrics(fp8_loss, bf16_loss)

    def _moe_step(self) -> Dict[str, torch.Tensor]:
        """After the optimizer step: the step's expert loads summed over the data-parallel ranks and, with pp > 1,
        every stage's layers gathered (small all-reduces), the aux-loss-free bias update from them (the same on
        every rank), and the metrics."""
        counts, terms = self.moe.step_tensors(self.device)
        if self.dims.pp > 1:  # each stage fills its own layers' rows
            both = torch.cat([counts, terms], dim=1)
            dist.all_reduce(both, group=self.pp_group)
            counts, terms = both[:, : counts.shape[1]], both[:, counts.shape[1] :]
        if self.dims.dp > 1:
            counts = counts.contiguous()
            dist.all_reduce(counts, group=self.dp_group)
        self.moe.counts, self.moe.terms = counts, terms.contiguous()
        if self.cfg.model.moe.bias_update_rate > 0:
            self.moe.update_bias(self.moe.loads)
        return self.moe.step_metrics()

    @torch.no_grad()
    def eval_loss(
        self, tokens: torch.Tensor, targets: torch.Tensor, positions: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        if self.pipeline is not None:
            if self.context is not None:
                tokens, targets = self.context.shard(tokens), self.context.shard(targets)
            with autocast_context(self.precision, self.device):
                loss = self.pipeline.eval_loss(tokens, targets, positions)
        else:
            loss = self.forward_loss(tokens, targets, positions)
        self._reshard()
        if self.loss_ranks > 1:
            loss = loss.clone()
            dist.all_reduce(loss, group=self.loss_group)
            loss /= self.loss_ranks
        return loss

    def _reshard(self) -> None:
        """FSDP2 keeps parameters gathered after a forward without backward (eval): free them again."""
        from torch.distributed.fsdp import FSDPModule

        for part in self.parts:
            for module in part.modules():
                if isinstance(module, FSDPModule):
                    module.reshard()

    def train(self) -> None:
        for part in {id(m): m for m in [self.model, *self.parts]}.values():
            part.train()

    def eval(self) -> None:
        for part in {id(m): m for m in [self.model, *self.parts]}.values():
            part.eval()

    # ---- the checkpoint contract (parallel/contract.py) -------------------------------------------------
    def state_layout(self) -> StateLayout:
        """Model and optimizer state dicts through DCP; with pp > 1 ``inner`` holds only this rank's stages."""
        return StateLayout(DCP, pipeline_stage=self.dims.pp > 1)

    # ---- downstream evaluation (lmforge.evaluation) -------------------------------------------------------
    @torch.no_grad()
    def token_logprobs(self, tokens: torch.Tensor, targets: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """Per-token log-likelihood of ``targets`` and whether each is the greedy token, ``[B, T]`` each, on every
        rank of this data-parallel replica (pp: broadcast from the last stage). Not reduced over dp."""
        with autocast_context(self.precision, self.device):
            if self.pipeline is not None:
                out = self.pipeline.eval_forward(
                    tokens, lambda logits: target_logprobs(logits, targets), (2, *targets.shape)
                )
            else:
                out = target_logprobs(self.model(tokens), targets)
        self._reshard()
        return out[0], out[1] > 0.5
