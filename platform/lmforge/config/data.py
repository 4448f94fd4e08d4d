"""Schema of the ``data`` config group (``conf/data/*.yaml``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Dict, Literal, Optional


@dataclass
class DataSourceConfig:
    # Prefix of a Megatron indexed dataset (PREFIX.bin / PREFIX.idx), or ``embedded:<name>`` for the
    # corpora that ship with lmforge (books, code, reference).
    path: str = ""
    weight: float = 1.0


@dataclass
class DataConfig:
    name: str = "default"
    sources: Dict[str, DataSourceConfig] = field(default_factory=dict)
    # ``embedded`` (the BPE trained on the embedded corpus), a path to a tokenizer.json, or ``tiktoken:NAME``.
    tokenizer: str = "embedded"
    # Where prepared shards and index caches live; None means <run.root>/../.cache/lmforge-data.
    cache_dir: Optional[str] = None
    # Fraction of each source's documents held out for validation.
    valid_fraction: float = 0.02
    # Loader threads/processes; 0 means the main process builds batches.
    num_workers: int = 0
    # Tokenizer processes when an ``embedded:`` source is prepared on first use (output is the same for any).
    prepare_workers: int = 1
    # Refuse a run that would read any source more than this many times (planned tokens x weight / the
    # source's train tokens; see lmforge/data/epochs.py). 0: no limit.
    max_epochs: float = 4.0
    # Document-masked packing (docs/data.md): attention causal within each document of a packed sample only and
    # RoPE positions restarting after every EOD token. Off: plain packing (attention across documents).
    document_masking: bool = False
    # The attention kernel of a document-masked run: ``sdpa`` (exact boolean-mask SDPA, any device; the
    # reference), ``flex`` (FlexAttention with a block mask: skips blocks outside every document) or ``varlen``
    # (torch's varlen_attn: flash attention over each document of the packed [B*T] stream; CUDA, bf16).
    document_attention: Annotated[str, Literal["sdpa", "flex", "varlen"]] = "sdpa"
    # The loss of the token after an EOD (predicted from the EOD, i.e. the next document's first token):
    # ``keep`` it (the plain causal-LM loss) or ``mask`` it out of the loss (megatron's eod_mask_loss).
    loss_after_eod: Annotated[str, Literal["keep", "mask"]] = "keep"
