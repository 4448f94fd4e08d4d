"""The resumable, data-parallel-sharded batch stream.

Optimizer step s consumes global samples [c, c + G) where c = consumed samples before the step and G
the global batch. Micro batch j on data-parallel rank r takes samples c + j*(m*dp) + r*m + [0, m) for
micro batch size m: every step sees the same set of samples for any data-parallel size, and resuming at
``consumed_samples`` continues the exact stream. Under a batch ramp (``train.batch_size_schedule``,
:mod:`lmforge.config.batch_ramp`) G is the ramp's batch at c, a function of c alone, and the step has
G / (m*dp) micro batches per rank: the same rule, the same samples per step for any data-parallel size.

Per-source accounting: every consumed sample carries the id of the source it was drawn from; the trainer
sums the tokens per source over ranks, and :meth:`BatchStream.share_metrics` reports the realised share of
each source next to its requested (normalised) weight.

Prefetch (``data.num_workers >= 1``): the micro batches of the next two steps are built on worker threads
(:mod:`lmforge.data.prefetch`) while the current step trains; the stream handed to the trainer, its
``state_dict()`` and a resume are bit-identical to ``num_workers=0``. On CUDA the host batches are pinned
and copied on a side stream that the compute stream waits for. Call :meth:`BatchStream.close` when done.

Sequence-length warmup (``train.seq_len_schedule``, :mod:`lmforge.config.seq_len_warmup`): the step starting at c
cuts each of its samples into P(c) pieces of T / P consecutive tokens, a view [m*P, T/P] of the same host batch
(document positions recomputed per piece): the same samples, the same tokens, shorter sequences.

Replica groups (``fault.replica_ft=torchft``, :meth:`BatchStream.follow_replicas`): each step, replica group r of
the n participating ones reads the r-th slice of a global batch of n x G samples; a step no replica commits
consumes nothing (:meth:`BatchStream.rewind`) and is read again with the next quorum's membership.

Documents (``data.document_masking``): each micro batch also carries ``positions`` [m, T], every token's
position inside its document, restarting after each of the tokenizer's EOD tokens
(:func:`lmforge.model.document_mask.document_positions`); the model masks attention and restarts RoPE from it.
``data.loss_after_eod=mask`` sets the target after each EOD to -100, which the cross-entropy ignores.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterator, List, Optional

import numpy as np
import torch

from lmforge.config.batch import BatchPlan
from lmforge.data.mixture import Mixture
from lmforge.data.prefetch import StepPrefetcher
from lmforge.model.document_mask import document_positions, document_square_sum

IGNORE_INDEX = -100  # F.cross_entropy's default ignore_index: a target the loss skips


@dataclass
class MicroBatch:
    tokens: torch.Tensor  # [m, T] int64
    targets: torch.Tensor  # [m, T] int64
    source_ids: List[int]
    positions: Optional[torch.Tensor] = None  # [m, T] int64 with data.document_masking, else None
    document_square_sum: int = 0  # sum of its documents' length^2 (FLOPs, model/flops.py), counted on the host


def document_fields(
    tokens: torch.Tensor, targets: torch.Tensor, eod: Optional[int], document_masking: bool, loss_after_eod: str
) -> Optional[torch.Tensor]:
    """The batch's document positions (None when masking is off); masks the targets after EODs in place.
    ``eod``: the tokenizer's end-of-document id (read only when masking or ``loss_after_eod=mask``)."""
    if not document_masking and loss_after_eod == "keep":
        return None  # the plain packed batch, untouched
    if loss_after_eod == "mask":
        targets[tokens == eod] = IGNORE_INDEX
    return document_positions(tokens, eod) if document_masking else None


def cut_pieces(mb: MicroBatch, pieces: int, eod: Optional[int]) -> MicroBatch:
    """Each row of ``mb`` as ``pieces`` rows of consecutive tokens (views: pinned memory stays pinned); document
    positions (when ``mb`` has them) restart at every piece, which is a sequence of its own."""
    m, t = mb.tokens.shape
    tokens, targets = mb.tokens.view(m * pieces, t // pieces), mb.targets.view(m * pieces, t // pieces)
    if mb.positions is None:
        return MicroBatch(tokens, targets, mb.source_ids)
    positions = document_positions(tokens, eod)
    pinned = positions.pin_memory() if mb.tokens.is_pinned() else positions
    return MicroBatch(tokens, targets, mb.source_ids, pinned, document_square_sum(positions))


@dataclass
class DataState:
    consumed_samples: int = 0
    tokens_per_source: Dict[str, int] = field(default_factory=dict)


class BatchStream:
    def __init__(
        self,
        mixture: Mixture,
        plan: BatchPlan,
        *,
        dp_rank: int,
        device: torch.device,
        num_workers: int = 0,
        prefetch_steps: int = 2,
        document_masking: bool = False,
        loss_after_eod: str = "keep",
        batch_at: Optional[Callable[[int], int]] = None,
        pieces_at: Optional[Callable[[int], int]] = None,
    ):
        """``batch_at(consumed)``: the global batch of the step starting there (a batch ramp's ``batch_at``);
        None = ``plan.global_batch_size`` for every step. ``pieces_at(consumed)``: the pieces each of the step's
        samples is cut into (a sequence-length warmup's); None = whole samples."""
        self.pieces_at = pieces_at
        self.mixture = mixture
        self.batch_at = batch_at or (lambda _consumed: self.plan.global_batch_size)  # the plan follow_replicas sets
        self.document_masking, self.loss_after_eod = document_masking, loss_after_eod
        # The EOD id the documents end with (the tokenizer megatron-core packed with), read once, when batches need it
        self.eod = mixture.tokenizer.eod if document_masking or loss_after_eod != "keep" else None
        self.plan = plan
        self.dp_rank = self.base_dp_rank = dp_rank
        self.device = device
        self.state = DataState(tokens_per_source={s: 0 for s in mixture.sources})
        self.prefetcher: Optional[StepPrefetcher[MicroBatch]] = None
        if num_workers > 0:
            self.prefetcher = StepPrefetcher(
                self._host_batch, self._step_ranges, self.batch_at, num_workers, depth=prefetch_steps
            )
        self._copy_stream = None  # the side CUDA stream of the host-to-device copies, made on first use

    def follow_replicas(self, base: BatchPlan, rank: int, count: int) -> None:
        """Read the next step as replica ``rank`` of ``count`` participating replica groups, each of ``base``'s
        layout: the step consumes ``count`` x ``base.global_batch_size`` samples (fault.replica_ft; refused with
        prefetch threads, whose slices are fixed)."""
        self.plan = BatchPlan(
            base.micro_batch_size, base.grad_accum, base.dp_size * count, base.global_batch_size * count, base.seq_len
        )
        self.dp_rank = rank * base.dp_size + self.base_dp_rank

    def rewind(self, consumed: int) -> None:
        """Put the stream back at ``consumed`` samples (a step that no replica group committed is read again)."""
        self.state.consumed_samples = consumed

    def sample_indices(self, consumed: int, micro: int) -> range:
        p = self.plan
        start = consumed + micro * p.micro_batch_size * p.dp_size + self.dp_rank * p.micro_batch_size
        return range(start, start + p.micro_batch_size)

    def _step_ranges(self, consumed: int) -> List[range]:
        per_micro = self.plan.micro_batch_size * self.plan.dp_size
        return [self.sample_indices(consumed, j) for j in range(self.batch_at(consumed) // per_micro)]

    def _host_batch(self, indices: range) -> MicroBatch:
        """One micro batch in host memory (pinned when training on CUDA); runs on prefetch threads too."""
        texts, ids = zip(*(self.mixture.train_text(i) for i in indices))
        text = torch.from_numpy(np.stack(texts).astype(np.int64, copy=False))
        pin = self.device.type == "cuda"  # the shifted copies land in pinned memory directly: no second copy
        tokens = torch.empty((text.shape[0], text.shape[1] - 1), dtype=torch.int64, pin_memory=pin)
        targets = torch.empty(tokens.shape, dtype=torch.int64, pin_memory=pin)
        tokens.copy_(text[:, :-1])
        targets.copy_(text[:, 1:])
        positions = document_fields(tokens, targets, self.eod, self.document_masking, self.loss_after_eod)
        if positions is None:
            return MicroBatch(tokens, targets, list(ids))
        pairs = document_square_sum(positions)
        return MicroBatch(tokens, targets, list(ids), positions.pin_memory() if pin else positions, pairs)

    def _to_device(self, batches: List[MicroBatch]) -> List[MicroBatch]:
        """Copy host batches to the GPU on a side stream; the compute stream waits for the copies."""
        if self.device.type != "cuda":
            return batches
        if self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream(self.device)
        compute = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self._copy_stream):
            moved = [
                MicroBatch(
                    mb.tokens.to(self.device, non_blocking=True),
                    mb.targets.to(self.device, non_blocking=True),
                    mb.source_ids,
                    None if mb.positions is None else mb.positions.to(self.device, non_blocking=True),
                    mb.document_square_sum,
                )
                for mb in batches
            ]
        compute.wait_stream(self._copy_stream)  # kernels queued from now on see the copied batches
        for mb in moved:  # allocated on the copy stream, used on the compute stream: not reused before it is done
            for t in (mb.tokens, mb.targets, mb.positions):
                if t is not None:
                    t.record_stream(compute)
        return moved

    def step_batches(self) -> List[MicroBatch]:
        """The micro batches of the next optimizer step on this rank (advances the state)."""
        c = self.state.consumed_samples
        if self.prefetcher is not None:
            host = self.prefetcher.take(c)
        else:
            host = [self._host_batch(r) for r in self._step_ranges(c)]
        if self.pieces_at is not None and self.pieces_at(c) > 1:
            host = [cut_pieces(mb, self.pieces_at(c), self.eod) for mb in host]
        batches = self._to_device(host)
        self.state.consumed_samples = c + self.batch_at(c)
        return batches

    def close(self) -> None:
        """Stop and join the prefetch threads (idempotent); later steps are built in the calling thread."""
        if self.prefetcher is not None:
            self.prefetcher.close()
            self.prefetcher = None

    def count_tokens(self, per_source_global: Dict[str, int]) -> None:
        for k, v in per_source_global.items():
            self.state.tokens_per_source[k] = self.state.tokens_per_source.get(k, 0) + int(v)

    def valid_batches(self, source: str, n_batches: int) -> Iterator[MicroBatch]:
        """Fixed held-out batches of one source, sharded over data-parallel ranks (with their document fields)."""
        ds = self.mixture.valid[source]
        m, dp = self.plan.micro_batch_size, self.plan.dp_size
        for b in range(n_batches):
            start = b * m * dp + self.dp_rank * m
            idx = [i % len(ds) for i in range(start, start + m)]
            samples = [ds[i] for i in idx]
            tokens = torch.stack([torch.as_tensor(s["tokens"]) for s in samples]).long().to(self.device)
            targets = torch.stack([torch.as_tensor(s["labels"]) for s in samples]).long().to(self.device)
            positions = document_fields(tokens, targets, self.eod, self.document_masking, self.loss_after_eod)
            yield MicroBatch(tokens, targets, [], positions)

    def share_metrics(self) -> Dict[str, float]:
        """Realised vs requested weight per source, from the tokens actually consumed."""
        total = sum(self.state.tokens_per_source.values())
        out: Dict[str, float] = {}
        for name, weight in zip(self.mixture.sources, self.mixture.weights):
            out[f"data/weight/{name}"] = weight
            if total:
                out[f"data/share/{name}"] = self.state.tokens_per_source.get(name, 0) / total
        return out

    def state_dict(self) -> dict:
        return {
            "consumed_samples": self.state.consumed_samples,
            "tokens_per_source": dict(self.state.tokens_per_source),
            "num_train_samples": self.mixture.num_train_samples,
            "mixture": self.mixture.signature(),
        }

    def load_state_dict(self, state: dict) -> None:
        saved_n = state.get("num_train_samples")
        if saved_n is not None and int(saved_n) != self.mixture.num_train_samples:
            raise ValueError(
                f"the checkpoint's data index was built for {saved_n} samples, this mixture for "
                f"{self.mixture.num_train_samples}: the stream would differ. Fix: build the mixture with "
                "stream_size.stream_sizes(..., prior_state=<checkpoint data state>) (the trainer does)"
            )
        saved_mix = state.get("mixture")
        if saved_mix is not None and saved_mix != self.mixture.signature():
            warnings.warn(
                f"data: resuming with a different mixture {self.mixture.signature()} than the checkpoint's "
                f"{saved_mix}; the stream continues at sample {state['consumed_samples']} of the new mixture",
                stacklevel=2,
            )
        if self.prefetcher is not None:
            self.prefetcher.drop()  # built for the old position; take() would also notice, this frees them now
        self.state.consumed_samples = int(state["consumed_samples"])
        self.state.tokens_per_source = {k: int(v) for k, v in state.get("tokens_per_source", {}).items()}
