"""Pipeline parallelism: split the GPT into stages by layers and run a ``torch.distributed.pipelining`` schedule.

Stages. ``pp * pp_virtual_stages`` stages of consecutive layers: ``parallelism.pp_layers[s]`` for stage ``s``
(an uneven split, e.g. fewer blocks on the stages that also hold the embedding and the head), else
``n_layers / stages`` each; stage 0 also holds ``tok_embeddings``, the last stage ``norm`` and ``output``.
Layers keep their *global* names (``layers.5...``), so initialisation (keyed by name) and checkpoints are
identical to the single-device model's, and a checkpoint saved with pp=2 (any split) loads with another split
or with pp=1.

Placement. Looped schedules (1F1B, Interleaved1F1B, InterleavedZeroBubble) put stage ``s`` on pipeline rank
``s % pp``; ZBVZeroBubble uses the "V" placement (rank 0 holds the first and the last stage).

One pipeline rank builds a single *part*: ``GPT(cfg, layers, embedding, head)`` with the layers (and
embedding/head) of all its stages (``rank_part``). That module owns the parameters (optimizer, checkpoints,
gradient clipping see it). Each stage is a ``GPTStage`` (``GPT.stage``): a module over the part's own
submodules listing only the stage's layers, which ``PipelineStage`` runs. Tied embeddings across stages are
not supported (validated).

Loss. The schedule computes ``cross_entropy`` per microbatch on the last stage and scales gradients by the
number of microbatches, so gradients equal those of the mean loss over the batch, as without pipelining.
With FSDP the schedule turns gradient sync off until the last microbatch (one reduce-scatter per step).
Zero-bubble schedules with FSDP need ``reshard_after_forward=false`` (validated): their input backward takes the
parameters for the later weight backward from the stage module, which after a reshard holds the sharded ones.

Document masking. Every pipeline rank holds the whole batch, so its document positions [B, T] (int64, no
gradient) go to the schedule as a keyword stage input: ``torch.distributed.pipelining`` splits keyword inputs
into micro batches like the tokens and passes micro batch ``i``'s rows to every stage's forward of micro batch
``i`` (``forward_one_chunk(i, args, kwargs[i])``), whatever order the schedule runs them in (1F1B, interleaved,
zero bubble, V) and again in an activation-checkpointing recompute (inside that forward). Nothing is sent
between stages for them; each stage builds its own mask.

Evaluation. Forward only, stage by stage with point-to-point sends; each send carries a header with the
activation's dtype and shape, so the receiving stage never assumes the training dtype.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from lmforge.config.model import ModelConfig
from lmforge.config.parallelism import ParallelismConfig, chunk_layers
from lmforge.model.gpt import GPT, GPTStage
from lmforge.parallel.loss_parallel import loss_function, sharded_logits

V_SCHEDULES = ("ZBVZeroBubble",)
MULTI_STAGE_SCHEDULES = ("Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble")
# Activation dtypes a stage can emit, by index in the evaluation header.
ACTIVATION_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass
class StagePlan:
    n_stages: int
    stage_to_rank: Dict[int, int]
    layers: Dict[int, List[str]]  # stage index -> global layer names

    def local_stages(self, pp_rank: int) -> List[int]:
        return sorted(s for s, r in self.stage_to_rank.items() if r == pp_rank)

    @property
    def last_stage_rank(self) -> int:
        return self.stage_to_rank[self.n_stages - 1]


def stage_to_rank(pp: int, n_stages: int, schedule: str) -> Dict[int, int]:
    if schedule in V_SCHEDULES:
        mapping = {}
        for s in range(n_stages):
            lap, pos = divmod(s, pp)
            mapping[s] = pos if lap % 2 == 0 else pp - 1 - pos
        return mapping
    return {s: s % pp for s in range(n_stages)}


def plan_stages(n_layers: int, cfg: ParallelismConfig) -> StagePlan:
    """Stage ``s`` holds ``chunk_layers(cfg, n_layers)[s]`` consecutive blocks (``parallelism.pp_layers``, or the
    even split), placed by ``stage_to_rank``."""
    counts = chunk_layers(cfg, n_layers)
    starts = [sum(counts[:s]) for s in range(len(counts))]
    layers = {s: [str(i) for i in range(start, start + counts[s])] for s, start in enumerate(starts)}
    return StagePlan(len(counts), stage_to_rank(cfg.pp, len(counts), cfg.pp_schedule), layers)


def rank_part(cfg: ModelConfig, plan: StagePlan, pp_rank: int) -> GPT:
    """The GPT part pipeline rank ``pp_rank`` holds (its stages' layers; embedding and head if it holds the
    first / last stage), built on the current default device."""
    stages = plan.local_stages(pp_rank)
    layers = [int(name) for s in stages for name in plan.layers[s]]
    return GPT(cfg, layers, embedding=0 in stages, head=plan.n_stages - 1 in stages)


def build_stages(part: GPT, plan: StagePlan, pp_rank: int) -> List[GPTStage]:
    """This rank's stages over ``part`` (call after TP / AC / compile, which replace the part's blocks)."""
    return [
        part.stage(s, plan.layers[s], first=s == 0, last=s == plan.n_stages - 1) for s in plan.local_stages(pp_rank)
    ]


def build_schedule(
    stages: List[GPTStage],
    plan: StagePlan,
    pp_mesh: DeviceMesh,
    device: torch.device,
    cfg: ParallelismConfig,
    n_microbatches: int,
):
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import get_schedule_class

    group = pp_mesh.get_group()
    stages = [PipelineStage(stage, stage.stage_index, plan.n_stages, device, group=group) for stage in stages]
    cls = get_schedule_class(cfg.pp_schedule)
    if cfg.pp_schedule in MULTI_STAGE_SCHEDULES:
        return cls(stages, n_microbatches=n_microbatches, loss_fn=loss_function, scale_grads=True)
    return cls(stages[0], n_microbatches=n_microbatches, loss_fn=loss_function, scale_grads=True)


class PipelineRunner:
    """Runs one training step (the schedule) or a forward-only evaluation across the pipeline ranks."""

    def __init__(
        self,
        stages: List[GPTStage],
        plan: StagePlan,
        pp_mesh: DeviceMesh,
        device: torch.device,
        cfg: ParallelismConfig,
        n_microbatches: int,
    ):
        self.stages = stages
        self.plan = plan
        self.pp_mesh = pp_mesh
        self.pp_rank = pp_mesh.get_local_rank()
        self.group = pp_mesh.get_group()
        self.device = device
        self.n_microbatches = n_microbatches
        self.loss_parallel = cfg.loss_parallel and cfg.tp > 1  # parallel/loss_parallel.py
        self.schedule = build_schedule(stages, plan, pp_mesh, device, cfg, n_microbatches)

    @property
    def has_first(self) -> bool:
        return self.plan.stage_to_rank[0] == self.pp_rank

    @property
    def has_last(self) -> bool:
        return self.plan.last_stage_rank == self.pp_rank

    def _global(self, pp_rank: int) -> int:
        return dist.get_global_rank(self.group, pp_rank)

    def broadcast_from_last(self, value: torch.Tensor) -> torch.Tensor:
        dist.broadcast(value, src=self._global(self.plan.last_stage_rank), group=self.group)
        return value

    def train_step(
        self, tokens: torch.Tensor, targets: torch.Tensor, positions: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        """Forward + backward of the whole batch; returns the mean loss (on every pipeline rank). ``positions``
        [B, T]: the batch's document positions (data.document_masking), given on every pipeline rank."""
        losses: List[torch.Tensor] = []
        kwargs = {"target": targets, "losses": losses} if self.has_last else {}
        if positions is not None:  # a stage input keyword: the schedule splits it like the tokens and hands
            kwargs["positions"] = positions  # micro batch i's rows to every stage's forward of micro batch i
        args = (tokens,) if self.has_first else ()
        with sharded_logits(self.loss_parallel):  # the last stage's head hands the loss its vocab shard (tp)
            self.schedule.step(*args, **kwargs)
        loss = (
            torch.stack([x.detach().float() for x in losses]).mean()
            if self.has_last
            else torch.zeros((), device=self.device)
        )
        return self.broadcast_from_last(loss)

    def send_activation(self, h: torch.Tensor, dst: int) -> None:
        """Send a stage's output with a header (dtype, shape), so the receiver allocates exactly what was
        computed: bf16 under ``bf16-mixed``, FSDP ``param_dtype=bf16`` or ``precision=bf16``, fp32 with
        ``train.fp32_residual`` or in fp32, ``T/tp`` positions under sequence parallelism."""
        header = torch.tensor([ACTIVATION_DTYPES.index(h.dtype), *h.shape], dtype=torch.int64, device=self.device)
        dist.send(header, dst=self._global(dst), group=self.group)
        dist.send(h.contiguous(), dst=self._global(dst), group=self.group)

    def recv_activation(self, src: int) -> torch.Tensor:
        header = torch.empty(4, dtype=torch.int64, device=self.device)
        dist.recv(header, src=self._global(src), group=self.group)
        code, *shape = header.tolist()
        h = torch.empty(shape, dtype=ACTIVATION_DTYPES[code], device=self.device)
        dist.recv(h, src=self._global(src), group=self.group)
        return h

    @torch.no_grad()
    def eval_loss(
        self, tokens: torch.Tensor, targets: torch.Tensor, positions: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        """Forward only, stage by stage with point-to-point sends (any batch size); loss on every rank."""
        with sharded_logits(self.loss_parallel):
            return self.eval_forward(tokens, lambda logits: loss_function(logits, targets).float(), (), positions)

    @torch.no_grad()
    def eval_forward(self, tokens: torch.Tensor, head, shape, positions: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Forward only; ``head(logits)`` on the last stage gives an fp32 tensor of ``shape``, broadcast to every
        pipeline rank (the loss; per-token log-likelihoods for downstream evaluation). ``positions``: the batch's
        document positions, given to every stage (data.document_masking)."""
        extra = {} if positions is None else {"positions": positions}
        h: Optional[torch.Tensor] = tokens
        by_index = {stage.stage_index: stage for stage in self.stages}
        loss = torch.zeros(shape, device=self.device)
        for s in range(self.plan.n_stages):
            owner = self.plan.stage_to_rank[s]
            if owner != self.pp_rank:
                continue
            if s > 0:
                prev = self.plan.stage_to_rank[s - 1]
                if prev != self.pp_rank:
                    h = self.recv_activation(prev)
            h = by_index[s](h, **extra)
            if s == self.plan.n_stages - 1:
                loss = head(h)
            else:
                nxt = self.plan.stage_to_rank[s + 1]
                if nxt != self.pp_rank:
                    self.send_activation(h, nxt)
        return self.broadcast_from_last(loss)
