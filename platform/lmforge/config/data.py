"""Schema of the ``data`` config group (``conf/data/*.yaml``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Dict, Literal, Optional

from lmforge.config.ranges import NonNegativeFloat, NonNegativeInt, Range


@dataclass
class DataSourceConfig:
    path: str = ""
    """Prefix of a Megatron indexed dataset (PREFIX.bin / PREFIX.idx), a directory of shards, or
    ``embedded:<name>`` for the corpora that ship with lmforge (books, code, reference)."""
    weight: float = 1.0
    """Share of this source in the mixture (weights are normalised)."""


@dataclass
class DataConfig:
    name: str = "default"
    """The preset's name (a conf/data file name)."""
    sources: Dict[str, DataSourceConfig] = field(default_factory=dict)
    """The mixture: name -> {path, weight}. No default here (a mapping merges, so a default would join every
    preset's sources): the data presets name them."""
    tokenizer: str = "embedded"
    """``embedded`` (the BPE trained on the embedded corpus), a path to a tokenizer.json, or ``tiktoken:NAME``."""
    cache_dir: Optional[str] = None
    """Where prepared shards and index caches live; null = <run.root>/../.cache/lmforge-data."""
    valid_fraction: Annotated[float, Range(0, 1, low_open=True, high_open=True, fix="e.g. 0.02")] = 0.02
    """Fraction of each source's documents held out for validation, in (0, 1)."""
    num_workers: NonNegativeInt = 0
    """Loader threads; 0 = the main process builds batches."""
    prepare_workers: int = 1
    """Tokenizer processes when an ``embedded:`` source is prepared on first use (the output is the same for
    any number)."""
    max_epochs: NonNegativeFloat = 4.0
    """Refuse a run that would read any source more than this many times (planned tokens x weight / the source's
    train tokens; data/epochs.py). 0 = no limit."""
    document_masking: bool = False
    """Document-masked packing (docs/data.md): attention causal within each document of a packed sample only and
    RoPE positions restarting after every EOD token. Off: attention across the documents of a packed sample."""
    document_attention: Annotated[str, Literal["sdpa", "flex", "varlen"]] = "sdpa"
    """The attention kernel of a document-masked run: sdpa (exact boolean-mask SDPA, any device; the reference),
    flex (FlexAttention with a block mask: skips blocks outside every document) or varlen (torch's varlen_attn:
    flash attention over each document of the packed stream; CUDA, bf16)."""
    loss_after_eod: Annotated[str, Literal["keep", "mask"]] = "keep"
    """The loss of the token after an EOD (the next document's first token, predicted from the EOD): keep it (the
    plain causal-LM loss), or mask it out of the loss (megatron's eod_mask_loss)."""
