"""Mixture-of-Experts feed-forward (``model.moe.*``), single-device code like the dense block.

    x [N, d] -> Router -> top-k experts per token, gate weights
             -> assignments sorted by expert (token-grouped) -> experts (grouped GEMM or loop)
             -> weighted sum back per token  (+ shared experts, which every token goes through)

Router. ``gating=softmax`` (Mixtral, Switch): probabilities over experts; ``sigmoid`` (DeepSeek-V3): an
independent score per expert. The top-k by score (plus the load-balancing ``expert_bias``, which only shifts
*which* experts are chosen, never the gate value) are the token's experts; with ``top_k > 1`` and
``normalize_weights`` their gate values are rescaled to sum to 1 (with top-1 they are not, or the router would
get no gradient).

Balancing. The auxiliary loss (Switch Transformer) ``E * sum_e f_e * P_e``: f_e the fraction of the micro
batch's assignments routed to expert e, P_e the mean gate probability of e (for sigmoid gating: the scores
normalised per token); 1 when balanced. The router z-loss (ST-MoE) ``mean(logsumexp(logits)^2)`` keeps logits
small. The auxiliary-loss-free update (DeepSeek-V3) moves ``expert_bias`` after each optimizer step by
``rate * sign(mean load - load_e)`` (``MoECollector.update_bias``, with the loads summed over the step and the
data-parallel ranks by the engine).

Capacity. ``capacity_factor: null`` is dropless. With a factor an expert takes at most
``ceil(factor * N * top_k / E)`` assignments per micro batch, first come (token order) first served; the
others are dropped: they contribute nothing (the token keeps its residual and its other experts) and are
counted. The dropped assignments are still multiplied (their output and gradient masked to zero): on one
device the cap saves no compute, it bounds what an expert receives.

Expert compute. Assignments are sorted by expert (stable: token order within an expert), so each expert's
tokens are one contiguous slice; ``torch._grouped_mm`` multiplies every slice by its expert's weights in one
call (CPU and CUDA in torch 2.13; it needs rows 16-byte aligned: ``d_model`` and the expert width times the
element size divisible by 16); ``compute=auto`` uses it on CUDA and the loop on CPU. The loop path runs one matmul per expert over the same slices: it is exact and
is what the grouped path is tested against; it reads the slice sizes on the host (a device sync per layer).

torch.compile (``parallelism.compile``) traces everything but ``Experts.forward``, which is a
``torch.compiler.disable`` boundary (its shapes depend on the routing; docs/model.md lists the breaks), applied by
``keep_experts_eager`` when a model is compiled (so a process that never compiles never imports torch._dynamo).

The aux terms of the last forward are kept on the layer (``MoEFeedForward.last``); ``MoECollector`` (built
once by the engine over its model) adds them to the training loss and gathers the per-layer expert-load
metrics. The engine, not this module, reduces the loads over ranks.

Pipeline parallelism. A pipeline schedule backpropagates only the last stage's cross-entropy, so a router loss
added after the forward would miss the earlier stages. There (``MoECollector.book_in_backward``) each MoE
layer's output passes through ``RouterLossInBackward``: the identity forward, whose backward also starts the
backward of the layer's router loss with gradient 1 (the schedule divides every gradient by the number of
micro batches, as the single-process loss ``sum_j (ce_j + router_j) / n`` does) and books the forward's loads
and terms. Backward runs once per micro batch and layer, also under activation checkpointing (whose recompute
is never booked), so the step's metrics and bias update count each forward exactly once (the schedule's
first-step metadata inference, a forward and backward on placeholder tensors, is not booked either).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from lmforge.config.model import ModelConfig, MoEConfig
from lmforge.model.activation import gelu_tanh
from lmforge.model.feed_forward import FeedForward, ffn_hidden_dim
from lmforge.model.init import canonical_name


def is_moe_layer(cfg: ModelConfig, layer: int) -> bool:
    """Whether global layer ``layer`` has an MoE feed-forward."""
    moe = cfg.moe
    if moe.experts == 0:
        return False
    if moe.layers is not None:
        return layer in moe.layers
    return (layer + 1) % moe.every_n_layers == 0


def moe_layer_ids(cfg: ModelConfig) -> List[int]:
    return [i for i in range(cfg.n_layers) if is_moe_layer(cfg, i)]


def expert_hidden_dim(cfg: ModelConfig) -> int:
    return cfg.moe.d_ff if cfg.moe.d_ff is not None else ffn_hidden_dim(cfg)


def grouped_mm_fits(d_in: int, d_out: int, dtype: torch.dtype) -> bool:
    """torch._grouped_mm's alignment rule: every row stride a multiple of 16 bytes."""
    size = torch.empty((), dtype=dtype).element_size()
    return (d_in * size) % 16 == 0 and (d_out * size) % 16 == 0


@dataclass
class RoutingStats:
    """One MoE layer's last forward: the unscaled loss terms (with grad) and the load (no grad)."""

    aux_loss: torch.Tensor  # scalar
    z_loss: torch.Tensor  # scalar
    tokens_per_expert: torch.Tensor  # [E] float32: assignments routed to each expert (before capacity)
    dropped: torch.Tensor  # scalar float32: assignments dropped by the capacity limit
    assignments: int  # N * top_k


def router_loss_term(cfg: MoEConfig, stats: RoutingStats) -> torch.Tensor:
    """One layer's share of the training loss: ``aux_loss_coef * aux + z_loss_coef * z``."""
    return cfg.aux_loss_coef * stats.aux_loss + cfg.z_loss_coef * stats.z_loss


def detached(stats: RoutingStats) -> RoutingStats:
    return RoutingStats(
        stats.aux_loss.detach(), stats.z_loss.detach(), stats.tokens_per_expert, stats.dropped, stats.assignments
    )


class RouterLossInBackward(torch.autograd.Function):
    """``y`` unchanged; backward passes ``y``'s gradient through and gives ``loss`` gradient 1, so the router loss
    of a layer on any pipeline stage reaches the parameters (``book(stats)`` records the forward it belongs to)."""

    @staticmethod
    def forward(
        ctx, y: torch.Tensor, loss: torch.Tensor, book: Callable[[RoutingStats], None], stats: RoutingStats
    ) -> torch.Tensor:
        ctx.book, ctx.stats = book, stats
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        ctx.book(ctx.stats)
        return grad, torch.ones((), dtype=torch.float32, device=grad.device), None, None


class Router(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        m = cfg.moe
        self.top_k, self.gating, self.normalize = m.top_k, m.gating, m.normalize_weights and m.top_k > 1
        self.gate = nn.Linear(cfg.d_model, m.experts, bias=False)
        # Persistent (checkpointed with the model), updated outside autograd by MoECollector.update_bias.
        self.register_buffer("expert_bias", torch.zeros(m.experts, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [N, d] -> (experts [N, k] int64, gate weights [N, k] fp32, logits [N, E] fp32, probs [N, E] fp32)."""
        logits = self.gate(x).float()
        scores = logits.softmax(-1) if self.gating == "softmax" else logits.sigmoid()
        chosen = torch.topk(scores + self.expert_bias, self.top_k, dim=-1).indices
        weights = scores.gather(-1, chosen)
        if self.normalize:
            weights = weights / weights.sum(-1, keepdim=True)
        probs = scores if self.gating == "softmax" else scores / scores.sum(-1, keepdim=True)
        return chosen, weights, logits, probs


class Experts(nn.Module):
    """E SwiGLU (or GELU) experts as stacked weights: w1, w3 [E, d, h], w2 [E, h, d]."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        e, d, h = cfg.moe.experts, cfg.d_model, expert_hidden_dim(cfg)
        self.gated = cfg.mlp == "swiglu"
        self.compute = cfg.moe.compute
        self.w1 = nn.Parameter(torch.empty(e, d, h))
        self.w2 = nn.Parameter(torch.empty(e, h, d))
        self.w3 = nn.Parameter(torch.empty(e, d, h)) if self.gated else None
        # Expert parallelism (parallel/expert_parallel.py) installs its token dispatch here: called as
        # ``token_dispatch(experts, x, counts)``, it sends the rows to their experts' ranks, runs ``run`` there
        # on that rank's experts and returns the results in ``x``'s row order. None: every expert is local.
        self.token_dispatch = None

    def uses_grouped(self, x: torch.Tensor) -> bool:
        """``auto``: the grouped GEMM on CUDA when the rows are aligned; the loop on CPU, where torch 2.13's
        _grouped_mm is slower than per-expert matmuls (benchmarks/moe.py) and the loop's host read costs nothing."""
        if self.compute != "auto":
            return self.compute == "grouped"
        return x.is_cuda and grouped_mm_fits(self.w1.shape[1], self.w1.shape[2], x.dtype)

    # torch.compile boundary (docs/model.md, MoE and torch.compile): the expert compute and the expert-parallel
    # dispatch run eagerly, one graph break per MoE layer. Their shapes depend on the routing (the loop's
    # slice sizes and the all-to-all splits are read on the host), and torch 2.13's fake kernel of
    # _grouped_mm accepts only bf16, so tracing them would either break inside or fail for fp32 weights.
    # The router, the sort, the combine and the loss terms around this call compile. The boundary is applied by
    # keep_experts_eager() when parallel/compile.py compiles a model, not by a decorator here: torch.compiler.disable
    # imports torch._dynamo (~2.3 CPU-s), which every process that imports the model would pay without compiling.
    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x [M, d]: rows sorted by expert, ``counts[e]`` rows for expert e (M = counts.sum()) -> [M, d]."""
        if self.token_dispatch is not None:
            return self.token_dispatch(self, x, counts)
        return self.run(x, counts, w1=self.w1, w2=self.w2, w3=self.w3)

    def run(
        self, x: torch.Tensor, counts: torch.Tensor, *, w1: torch.Tensor, w2: torch.Tensor, w3: Optional[torch.Tensor]
    ) -> torch.Tensor:
        """The experts ``w1, w2, w3`` ([len(counts), ...]) over rows sorted by expert."""
        if self.uses_grouped(x):
            offs = torch.cumsum(counts, 0).to(torch.int32)
            mm = lambda a, w: torch._grouped_mm(a, w, offs=offs)  # noqa: E731
        else:
            sizes = counts.tolist()  # host sync: the loop needs the slice sizes

            def mm(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
                return torch.cat([p @ w[e] for e, p in enumerate(a.split(sizes))])

        if self.gated:
            return mm(F.silu(mm(x, w1)) * mm(x, w3), w2)
        return mm(gelu_tanh(mm(x, w1)), w2)


_EXPERTS_EAGER = False


def keep_experts_eager() -> None:
    """Make ``Experts.forward`` the ``torch.compiler.disable`` boundary (idempotent); called before compiling."""
    global _EXPERTS_EAGER
    if not _EXPERTS_EAGER:
        Experts.forward = torch.compiler.disable(Experts.forward)
        _EXPERTS_EAGER = True


class MoEFeedForward(nn.Module):
    """The feed-forward of an MoE layer: routed experts plus ``shared_experts`` always-on ones (one dense FFN of
    ``shared_experts`` x the expert width)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        m: MoEConfig = cfg.moe
        self.n_experts, self.top_k, self.capacity_factor = m.experts, m.top_k, m.capacity_factor
        self.router = Router(cfg)
        self.experts = Experts(cfg)
        self.shared = FeedForward(cfg, hidden=m.shared_experts * expert_hidden_dim(cfg)) if m.shared_experts else None
        self.last: Optional[RoutingStats] = None
        self.loss_cfg = m
        # Pipeline parallelism (MoECollector.book_in_backward): the router loss enters the backward here and this
        # books the stats; None: the engine adds ``last``'s terms to the loss (MoECollector.router_loss).
        self.book_in_backward: Optional[Callable[[RoutingStats], None]] = None

    def reset_buffers(self, device: Optional[torch.device] = None) -> None:
        self.router.expert_bias = torch.zeros(
            self.n_experts, dtype=torch.float32, device=device or self.router.expert_bias.device
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        n, k, e = x.shape[0], self.top_k, self.n_experts
        chosen, weights, logits, probs = self.router(x)
        flat = chosen.reshape(-1)  # [N*k]: assignment a is token a // k
        order = torch.argsort(flat, stable=True)
        # per-expert assignment counts with a static shape [E] (bincount's output shape is data-dependent: a
        # graph break under torch.compile); exact integers, as bincount
        counts = torch.zeros(e, dtype=flat.dtype, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))
        keep = None
        if self.capacity_factor is not None:
            capacity = math.ceil(self.capacity_factor * n * k / e)
            # rank of each (sorted) assignment within its expert, in token order: beyond the capacity it is dropped
            position = torch.arange(order.numel(), device=x.device) - (torch.cumsum(counts, 0) - counts)[flat[order]]
            keep = position < capacity
        token = order // k
        out = self.experts(x[token], counts)
        if keep is not None:  # before the gate weight: a dropped row gives neither output nor any gradient
            out = torch.where(keep[:, None], out, out.new_zeros(()))
        out = out * weights.reshape(-1)[order].to(out.dtype)[:, None]
        y = torch.zeros_like(x).index_add(0, token, out)
        if self.shared is not None:
            y = y + self.shared(x)
        load = counts.float()
        self.last = RoutingStats(
            aux_loss=e * (load.detach() / (n * k) * probs.mean(0)).sum(),
            z_loss=torch.logsumexp(logits, -1).square().mean(),
            tokens_per_expert=load.detach(),
            dropped=(order.numel() - keep.sum()).float() if keep is not None else load.new_zeros(()),
            assignments=n * k,
        )
        if self.book_in_backward is not None and torch.is_grad_enabled():
            y = RouterLossInBackward.apply(
                y, router_loss_term(self.loss_cfg, self.last), self.book_in_backward, detached(self.last)
            )
        return y.reshape(shape)


class MoECollector:
    """The MoE layers of a model, as the engine sees them: their router loss for the training loss, the
    step's expert loads (metrics, bias update). Falsy for a dense model, which it leaves untouched.

    ``layer_names``: every MoE layer of the whole model (``moe_layer_names``), when ``model`` is one pipeline
    rank's part; the step's tensors (``counts``, ``terms``) have a row per layer of the whole model, this part's
    rows filled, so that summing them over the pipeline ranks gives every stage's layers."""

    def __init__(self, model: nn.Module, cfg: MoEConfig, layer_names: Optional[List[str]] = None):
        self.cfg = cfg
        self.layers: List[Tuple[str, MoEFeedForward]] = [
            (canonical_name(name).replace(".feed_forward", "").replace("layers.", "layer"), m)
            for name, m in model.named_modules()
            if isinstance(m, MoEFeedForward)
        ]
        self.names = list(layer_names) if layer_names is not None else [name for name, _ in self.layers]
        self.rows = [self.names.index(name) for name, _ in self.layers]
        self.pending: List[List[RoutingStats]] = []  # pipeline parallelism: the backwards booked per row
        self.micro_batches = 0
        self.reset()

    def __bool__(self) -> bool:
        return bool(self.names)

    def reset(self) -> None:
        self.counts: Optional[torch.Tensor] = None  # [L, E + 1]: assignments per expert, then dropped; summed over
        self.terms: Optional[torch.Tensor] = None  # [L, 3]: aux, z summed over the micro batches, their count

    def _book(self, row: int, stats: RoutingStats) -> None:
        if self.counts is None:
            device = stats.tokens_per_expert.device
            self.counts = torch.zeros(len(self.names), self.cfg.experts + 1, device=device)
            self.terms = torch.zeros(len(self.names), 3, device=device)
        self.counts[row, :-1] += stats.tokens_per_expert
        self.counts[row, -1] += stats.dropped
        self.terms[row] += torch.stack(
            [
                stats.aux_loss.detach().float(),
                stats.z_loss.detach().float(),
                stats.aux_loss.new_ones((), dtype=torch.float32),
            ]
        )

    def book_in_backward(self, micro_batches: int) -> None:
        """Pipeline parallelism: every layer adds its router loss to the backward at its output and books its
        forward there (``RouterLossInBackward``); ``router_loss`` is then not called. A step books the last
        ``micro_batches`` backwards of each layer: on the first step the schedule's metadata inference runs one
        forward and backward on placeholder tensors before the real micro batches, which must not count."""
        self.micro_batches = micro_batches
        self.pending = [[] for _ in self.names]
        for row, (_, m) in zip(self.rows, self.layers):
            m.book_in_backward = self.pending[row].append

    def router_loss(self) -> torch.Tensor:
        """``aux_loss_coef * aux + z_loss_coef * z`` summed over the MoE layers of the last forward; also books
        that forward's loads and terms (detached) for ``step_metrics``."""
        total = None
        for row, (_, m) in zip(self.rows, self.layers):
            term = router_loss_term(self.cfg, m.last)
            total = term if total is None else total + term
            self._book(row, m.last)
        return total

    def step_tensors(self, device: torch.device) -> Tuple[torch.Tensor, torch.Tensor]:
        """The step's ``counts`` and ``terms`` (zeros where this rank booked nothing), for the engine to reduce."""
        for row, booked in enumerate(self.pending):
            for stats in booked[-self.micro_batches :]:
                self._book(row, stats)
            booked.clear()
        if self.counts is None:
            self.counts = torch.zeros(len(self.names), self.cfg.experts + 1, device=device)
            self.terms = torch.zeros(len(self.names), 3, device=device)
        return self.counts, self.terms

    @torch.no_grad()
    def update_bias(self, loads: torch.Tensor) -> None:
        """Aux-loss-free balancing: ``bias_e += rate * sign(mean load - load_e)`` per layer (``loads`` [L, E], a
        row per layer of ``names``, the same on every rank: the engine sums it over the ranks first)."""
        step = self.cfg.bias_update_rate * torch.sign(loads.mean(-1, keepdim=True) - loads)
        for row, (_, m) in zip(self.rows, self.layers):
            m.router.expert_bias.add_(step[row].to(m.router.expert_bias.device))

    @property
    def loads(self) -> torch.Tensor:
        return self.counts[:, :-1]

    def step_metrics(self) -> Dict[str, torch.Tensor]:
        """The step, as device scalars (read on the host only on logging steps), per layer (loads and drops summed
        over the data-parallel ranks by the engine; the loss terms are this rank's):
        ``load_max`` (largest expert's share of the assignments; 1/E is balanced), ``load_max_over_mean``,
        ``load_min``, ``dropped`` (fraction of assignments dropped), ``aux_loss``, ``z_loss`` (mean over the
        micro batches); then the losses summed over layers, the dropped fraction and the worst layer's
        ``load_max_over_mean``. Resets the step's accumulators."""
        out: Dict[str, torch.Tensor] = {}
        loads, dropped = self.counts[:, :-1], self.counts[:, -1]
        assignments = loads.sum(-1)  # N * top_k per micro batch, before the capacity limit
        share = loads / assignments[:, None]
        mean_terms = self.terms[:, :2] / self.terms[:, 2:]
        for i, name in enumerate(self.names):
            out[f"moe/{name}/load_max"] = share[i].max()
            out[f"moe/{name}/load_max_over_mean"] = share[i].max() * share.shape[-1]
            out[f"moe/{name}/load_min"] = share[i].min()
            out[f"moe/{name}/dropped"] = dropped[i] / assignments[i]
            out[f"moe/{name}/aux_loss"] = mean_terms[i, 0]
            out[f"moe/{name}/z_loss"] = mean_terms[i, 1]
        out["moe/aux_loss"] = mean_terms[:, 0].sum()
        out["moe/z_loss"] = mean_terms[:, 1].sum()
        out["moe/dropped"] = dropped.sum() / assignments.sum()
        out["moe/load_max_over_mean"] = share.max() * share.shape[-1]  # the worst layer
        self.reset()
        return out


def moe_layer_names(cfg: ModelConfig) -> List[str]:
    """The collector's names of the model's MoE layers (``layer<i>``, global index)."""
    return [f"layer{i}" for i in moe_layer_ids(cfg)]
