"""The checks of ``parallelism.cp`` (context parallelism) that need no process group.

Supported: cp with FSDP/HSDP (``dp_shard``/``dp_replicate``), TP (with or without sequence parallelism), PP, full
activation checkpointing, GQA/MQA, ``data.document_masking`` (the cp exchange masks by document, so
``document_attention`` must be ``sdpa``, and ``loss_after_eod=keep``), ring or all-gather K/V exchange, on the
native engine (not yet with ``eval.tasks``). Everything else is refused here with one line
(``parallel/context_parallel.py`` holds the implementation).
"""

from __future__ import annotations

from lmforge.config.errors import ConfigError
from lmforge.config.schema import RootConfig


def check_context_parallel(cfg: RootConfig) -> None:
    p, m = cfg.parallelism, cfg.model
    if p.cp == 1:
        return
    chunks = 2 * p.cp
    if m.seq_len % chunks:
        raise ConfigError(
            "parallelism.cp",
            f"seq_len ({m.seq_len}) is not divisible by 2*cp ({chunks}): the "
            "load-balanced layout splits each sequence into 2*cp equal chunks",
            f"choose a seq_len divisible by {chunks} (or a cp dividing seq_len/2)",
        )
    if p.engine != "native":
        raise ConfigError(
            "parallelism.cp",
            "context parallelism runs on the native engine only",
            "set parallelism.engine=native (or parallelism.cp=1 with DeepSpeed)",
        )
    if cfg.data.document_masking and cfg.data.document_attention != "sdpa":
        raise ConfigError(
            "data.document_attention",
            f"{cfg.data.document_attention} is not used with context "
            "parallelism (cp > 1): the cp K/V exchange applies the document mask itself, block by block",
            "set data.document_attention=sdpa for cp > 1",
        )
    if cfg.data.loss_after_eod == "mask":
        raise ConfigError(
            "data.loss_after_eod",
            "mask with context parallelism (cp > 1) would average per-rank "
            "means over different numbers of kept targets (the masked targets fall unevenly on the cp "
            "ranks), which is not the mean over the sequence",
            "set data.loss_after_eod=keep for cp > 1",
        )
    if cfg.eval.tasks:
        raise ConfigError(
            "eval.tasks",
            "in-loop task evaluation with context parallelism (cp > 1) is not supported "
            "yet: its requests are not cut into the cp layout",
            "set eval.tasks=[] for the cp run and score its checkpoints with "
            "`python -m lmforge.evaluation.offline RUN`",
        )
    if p.compile:
        raise ConfigError(
            "parallelism.compile",
            "torch.compile of the context-parallel attention (a custom autograd "
            "Function with point-to-point sends) is not supported",
            "set parallelism.compile=false for cp > 1",
        )
    if p.activation_checkpointing == "selective":
        raise ConfigError(
            "parallelism.activation_checkpointing",
            "selective checkpointing would recompute the context-parallel K/V exchange op by op",
            "use activation_checkpointing=full (or none) with cp > 1",
        )
    if p.sequence_parallel and (m.seq_len // p.cp) % p.tp:
        raise ConfigError(
            "parallelism.sequence_parallel",
            f"a cp rank's sequence ({m.seq_len}/{p.cp} = {m.seq_len // p.cp} tokens) is not divisible by tp ({p.tp})",
            "choose a seq_len divisible by cp*tp",
        )
