"""train.seq_len_schedule: the pieces per sample by samples consumed, the cut itself, and what is refused."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from lmforge.config.errors import ConfigError
from lmforge.config.schema import RootConfig
from lmforge.config.seq_len_warmup import SeqLenWarmup, check_seq_len_warmup
from lmforge.config.train import SeqLenScheduleConfig
from lmforge.data.loader import MicroBatch, cut_pieces
from lmforge.model.document_mask import document_positions


def test_the_length_doubles_in_equal_stages_by_samples_consumed():
    w = SeqLenWarmup(seq_len=256, start=32, warmup_samples=300)  # 3 stages of 100 samples: 32, 64, 128, then 256
    assert w.stages == 3 and w.lengths() == [32, 64, 128, 256]
    pieces = [w.pieces_at(c) for c in (0, 99, 100, 199, 200, 299, 300, 10_000)]
    assert pieces == [8, 8, 4, 4, 2, 2, 1, 1]


def test_a_cut_keeps_every_token_and_its_target_in_order():
    text = torch.arange(2 * 9).view(2, 9)  # two samples of 8 tokens (+1 for the shifted targets)
    mb = MicroBatch(text[:, :-1].clone(), text[:, 1:].clone(), [0, 1])
    cut = cut_pieces(mb, 4, eod=None)
    assert cut.tokens.shape == (8, 2) and cut.source_ids == [0, 1]  # sources stay per sample: token counts hold
    assert torch.equal(cut.tokens.reshape(2, 8), mb.tokens) and torch.equal(cut.targets.reshape(2, 8), mb.targets)
    assert torch.equal(cut.targets[:, :-1], cut.tokens[:, 1:])  # each piece's targets are its next tokens


def test_document_positions_restart_at_every_piece():
    tokens = torch.tensor([[5, 6, 0, 7, 8, 9, 1, 2]])  # eod 0 ends the first document
    mb = MicroBatch(tokens.clone(), tokens.clone(), [0], document_positions(tokens, 0), 0)
    cut = cut_pieces(mb, 2, eod=0)
    assert cut.positions.tolist() == [[0, 1, 2, 0], [0, 1, 2, 3]]
    assert mb.positions.tolist() == [[0, 1, 2, 0, 1, 2, 3, 4]]  # control: uncut, the second document runs on


def configured(start: int, warmup_samples: int = 64, seq_len: int = 128, **par) -> RootConfig:
    base = RootConfig()
    schedule = SeqLenScheduleConfig(start=start, warmup_samples=warmup_samples)
    return replace(
        base,
        model=replace(base.model, seq_len=seq_len),
        train=replace(base.train, seq_len_schedule=schedule),
        parallelism=replace(base.parallelism, **par),
    )


def refusal(cfg: RootConfig) -> str:
    with pytest.raises(ConfigError) as e:
        check_seq_len_warmup(cfg)
    return str(e.value)


def test_refused_lengths():
    check_seq_len_warmup(configured(32, cp=2))  # 32 = 128 / 4, and 4 context-parallel chunks of 8: accepted
    assert refusal(configured(48)) == (
        "config key 'train.seq_len_schedule.start': 48 is not model.seq_len (128) / 2^k for some k >= 1. Fix: use "
        "one of 64, 32, 16, 8, 4"
    )
    assert refusal(configured(128)).startswith("config key 'train.seq_len_schedule.start': 128 is not")
    assert refusal(configured(4, cp=4)) == (
        "config key 'train.seq_len_schedule.start': 4-token pieces do not split into 2 x cp = 8 context-parallel "
        "chunks. Fix: use a start divisible by 8"
    )
    assert refusal(configured(32, warmup_samples=0)).startswith(
        "config key 'train.seq_len_schedule.warmup_samples': is 0"
    )
