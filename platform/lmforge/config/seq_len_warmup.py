"""Sequence-length warmup (``train.seq_len_schedule``): how many pieces each sample is cut into, by samples seen.

The stream stays the one the data index and the batch schedule define: a step takes the same samples of
model.seq_len (T) tokens as without the warmup, and cuts each into P pieces of T / P consecutive tokens, trained as
P independent sequences (their own causal attention and RoPE positions from 0). P halves in equal stages:

    k      = log2(T / start)                          (start = T / 2^k, checked)
    stage  = min(k, floor(consumed * k / warmup_samples))
    P      = 2^(k - stage),  length = T / P

for the step that starts after ``consumed`` samples: a function of the samples consumed only (as the batch ramp),
so every data-parallel size and every resume cuts the same samples the same way. Tokens per step, tokens_seen and
the loss's token mean are unchanged; the attention FLOPs per token follow the length (the meter's MFU uses them).
Under ``parallelism.compile`` each length compiles once: k + 1 compilations, announced at the start and counted by
the trainer's ``seq_len`` events. Context parallelism cuts every piece into 2 x cp chunks, so ``start`` must be a
multiple of 2 x cp (refused otherwise).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from lmforge.config.errors import ConfigError
from lmforge.config.schema import RootConfig
from lmforge.config.train import TrainConfig

KEY = "train.seq_len_schedule"


@dataclass(frozen=True)
class SeqLenWarmup:
    seq_len: int
    start: int
    warmup_samples: int

    @property
    def stages(self) -> int:
        return (self.seq_len // self.start).bit_length() - 1

    def pieces_at(self, consumed: int) -> int:
        """Pieces each sample of the step starting after ``consumed`` samples is cut into (1 = full length)."""
        stage = min(self.stages, consumed * self.stages // self.warmup_samples)
        return 2 ** (self.stages - stage)

    def lengths(self) -> list:
        return [self.start * 2**i for i in range(self.stages + 1)]

    def describe(self, compiled: bool) -> str:
        """One line for the run's start block: the lengths, and what ``parallelism.compile`` does with them."""
        line = (
            f"lmforge: sequence-length warmup: {', '.join(map(str, self.lengths()))} tokens in {self.stages + 1} "
            f"stages over {self.warmup_samples:,} samples (each sample cut into pieces; same samples, same tokens)"
        )
        return line + ("; parallelism.compile: each new length may recompile the blocks" if compiled else "")


def seq_len_warmup(train: TrainConfig, seq_len: int) -> Optional[SeqLenWarmup]:
    """The run's warmup, or None when ``train.seq_len_schedule.start`` is 0 (checked: ``check_seq_len_warmup``)."""
    s = train.seq_len_schedule
    return None if s.start == 0 else SeqLenWarmup(seq_len, s.start, s.warmup_samples)


def check_seq_len_warmup(cfg: RootConfig) -> None:
    """Refuse a start that is not model.seq_len / 2^k, or a piece context parallelism cannot cut (one line each)."""
    s, t = cfg.train.seq_len_schedule, cfg.model.seq_len
    if s.start == 0:
        if s.warmup_samples:
            raise ConfigError(f"{KEY}.start", "is 0 (no warmup) but warmup_samples is set", "set a start > 0")
        return
    allowed = [t >> i for i in range(1, t.bit_length()) if t % (1 << i) == 0]
    if s.start not in allowed:
        raise ConfigError(
            f"{KEY}.start",
            f"{s.start} is not model.seq_len ({t}) / 2^k for some k >= 1",
            f"use one of {', '.join(map(str, allowed[:5]))}",
        )
    chunks = 2 * cfg.parallelism.cp
    if cfg.parallelism.cp > 1 and s.start % chunks:
        raise ConfigError(
            f"{KEY}.start",
            f"{s.start}-token pieces do not split into 2 x cp = {chunks} context-parallel chunks",
            f"use a start divisible by {chunks}",
        )
    p = cfg.parallelism
    if p.sequence_parallel and (s.start // p.cp) % p.tp:
        raise ConfigError(
            f"{KEY}.start",
            f"a cp rank's piece ({s.start}/{p.cp} tokens) is not divisible by tp ({p.tp}) for sequence parallelism",
            f"use a start divisible by cp x tp = {p.cp * p.tp}",
        )
    if s.warmup_samples == 0:
        raise ConfigError(f"{KEY}.warmup_samples", "is 0 with a warmup on", "set the samples the warmup spans")
