"""How many times a run would repeat each source of its mixture, and the refusal past ``data.max_epochs``.

Source ``s`` with normalised weight ``w`` and ``T`` tokens in its train split is read
``planned_tokens * w / T`` times (megatron-core's blended index draws each source by weight and repeats it in
epochs). A run whose most-repeated source would exceed ``data.max_epochs`` (default 4) refuses to start:
training mostly on repeats says nothing about the model a real corpus would give.

The counts come from the shards' ``.idx`` files alone (sequence lengths; no tokens are read), so the check
runs before any process group exists (``lmforge.train``, which prepares the embedded corpora first) and in
``lmforge plan``, for every source whose shard is already there; the mixture builder repeats it once every shard
is prepared, before megatron-core builds an index.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from lmforge.config.data import DataConfig
from lmforge.config.errors import ConfigError
from lmforge.data.checks import normalise_weights, split_bounds, split_string
from lmforge.data.embedded import VERSION
from lmforge.data.indexed_shard import ShardFormatError, read_index
from lmforge.data.sources import default_cache_dir, resolve_source
from lmforge.data.stream_size import stream_sizes
from lmforge.data.tokenizer import embedded_tokenizer_path, load_tokenizer

if TYPE_CHECKING:
    from lmforge.data.tokenizer import Tokenizer


@dataclass
class SourceEpochs:
    name: str
    prefix: Path
    train_tokens: int
    weight: float
    planned_tokens: int

    @property
    def epochs(self) -> float:
        return self.planned_tokens * self.weight / max(1, self.train_tokens)


def train_split_tokens(idx_path: Path, valid_fraction: float) -> int:
    """Tokens of a shard's train split, from its .idx (megatron-core's document split)."""
    index = read_index(idx_path)
    beg, end = split_bounds(len(index.lengths), split_string(valid_fraction))["train"]  # megatron imported quietly
    return int(index.lengths[beg:end].sum(dtype=np.int64))


# How the checks get this run's tokenizer when they need it: a loader called at most once per check (the entry
# checks pass theirs, lmforge.trainer.entry_checks, so one start loads it once); None: data.tokenizer loaded here.
TokenizerSource = Optional[Callable[[], "Tokenizer"]]


def _tokenizer_of(cfg: DataConfig, cache_dir: Path, tokenizer: TokenizerSource):
    if tokenizer is not None:
        return tokenizer()

    return load_tokenizer(cfg.tokenizer, cache_dir)


def known_prefix(
    name: str, path: str, cfg: DataConfig, cache_dir: Path, tokenizer: TokenizerSource = None
) -> Optional[Path]:
    """The shard prefix of a source when it can be named without preparing anything, else None (``tokenizer``:
    this run's, asked for only when the embedded tokenizer is already built)."""
    if not path.startswith("embedded:"):
        return Path(path).expanduser() if path else None
    if cfg.tokenizer != "embedded":
        return None  # the fingerprint of another tokenizer needs it loaded; the trainer checks after preparing

    if not embedded_tokenizer_path(cache_dir).exists():
        return None
    fingerprint = _tokenizer_of(cfg, cache_dir, tokenizer).fingerprint  # cfg.tokenizer is "embedded" here
    return cache_dir / "shards" / f"embedded-{path.split(':', 1)[1]}-v{VERSION}-{fingerprint}"


def source_epochs(
    cfg: DataConfig,
    planned_tokens: int,
    cache_dir: Path,
    known: Optional[Dict[str, Tuple[Path, int]]] = None,
    tokenizer: TokenizerSource = None,
) -> List[SourceEpochs]:
    """Epochs per source for the sources whose shard index is readable. ``known``: {source: (shard prefix, train
    split tokens)} for sources checked already (the mixture builder's ``check_splits``), read from no file again."""
    names, weights, _ = normalise_weights({n: cfg.sources[n].weight for n in cfg.sources})
    out = []
    for name, weight in zip(names, weights):
        if known and name in known:
            prefix, tokens = known[name]
            out.append(SourceEpochs(name, Path(prefix), tokens, weight, planned_tokens))
            continue
        prefix = known_prefix(name, cfg.sources[name].path, cfg, cache_dir, tokenizer)
        if prefix is None or not Path(f"{prefix}.idx").exists():
            continue
        try:
            tokens = train_split_tokens(Path(f"{prefix}.idx"), cfg.valid_fraction)
        except (ShardFormatError, OSError, KeyError):
            continue  # check_shard names the problem when the trainer opens it
        out.append(SourceEpochs(name, Path(prefix), tokens, weight, planned_tokens))
    return out


def check_epochs(
    cfg: DataConfig,
    planned_tokens: int,
    cache_dir: Path,
    known: Optional[Dict[str, Tuple[Path, int]]] = None,
    tokenizer: TokenizerSource = None,
) -> List[SourceEpochs]:
    """Raise ConfigError (``data.max_epochs``) when a source would be repeated more than ``cfg.max_epochs`` times."""
    found = source_epochs(cfg, planned_tokens, cache_dir, known, tokenizer)
    if cfg.max_epochs <= 0 or not found:
        return found
    worst = max(found, key=lambda s: s.epochs)
    if worst.epochs > cfg.max_epochs:
        need = math.ceil(planned_tokens * worst.weight / cfg.max_epochs)
        raise ConfigError(
            "data.max_epochs",
            f"the run plans {planned_tokens:,} tokens, which would read source '{worst.name}' ({worst.train_tokens:,} "
            f"train tokens at weight {worst.weight:.3g}, {worst.prefix}) {worst.epochs:,.1f} times, more than "
            f"data.max_epochs={cfg.max_epochs:g}",
            f"train on a corpus with >= {need:,} tokens for '{worst.name}' (data=<preset> with real shards made by "
            f"`lmforge data prepare`), lower train.max_steps / train.planned_tokens, or raise data.max_epochs="
            f"{math.ceil(worst.epochs)} to accept the repetition",
        )
    return found


def run_planned_tokens(cfg) -> int:
    """Tokens a fresh launch of ``cfg`` (a RootConfig) will read: its data index size or its steps, the larger."""
    from lmforge.config.validate import check_batch  # deferred: imports omegaconf; this module imports without it

    plan = check_batch(cfg)
    _, total = stream_sizes(cfg.train, plan.tokens_per_step, plan.global_batch_size, cfg.model.seq_len)
    return total * cfg.model.seq_len


def prepare_embedded(
    cfg: DataConfig, cache_dir: Path, tokenizer: TokenizerSource = None
) -> Dict[str, Tuple[Path, int]]:
    """Prepare the tokenizer and the embedded corpora of ``cfg`` (each once, under its lock, as the mixture
    builder would next); {source: (shard prefix, train split tokens)} of the embedded sources."""
    embedded = {n: s.path for n, s in cfg.sources.items() if s.path.startswith("embedded:")}
    if not embedded:
        return {}
    tok = _tokenizer_of(cfg, cache_dir, tokenizer)
    workers = max(1, int(getattr(cfg, "prepare_workers", 1) or 1))
    known = {}
    for name, path in embedded.items():
        prefix = resolve_source(name, path, tok, cache_dir, workers)
        known[name] = (prefix, train_split_tokens(Path(f"{prefix}.idx"), cfg.valid_fraction))
    return known


def check_run(cfg, prepare: bool = False, tokenizer: TokenizerSource = None) -> List[SourceEpochs]:
    """``check_epochs`` for a RootConfig. ``prepare=False`` (``lmforge plan``, the Slurm prepare step): the
    sources whose shards exist already, nothing written. ``prepare=True`` (``lmforge.train``, before its process
    group): the embedded corpora are prepared first, so a fresh cache is checked as fully as a warm one.
    ``tokenizer``: how to get this run's tokenizer if it is needed (``trainer.entry_checks`` passes its one load)."""
    cache = default_cache_dir(cfg.data, cfg.run.root)
    known = prepare_embedded(cfg.data, cache, tokenizer) if prepare else None
    return check_epochs(cfg.data, run_planned_tokens(cfg), cache, known, tokenizer)


def describe(found: List[SourceEpochs], max_epochs: float, unprepared: Sequence[str] = ()) -> str:
    """One line for ``lmforge plan`` (``unprepared``: the sources with no shards yet, named with their paths)."""
    missing = f"; not prepared yet: {', '.join(unprepared)}" if unprepared else ""
    if not found:
        return f"data       epochs unknown until the shards are prepared (`lmforge data prepare`){missing}"
    parts = ", ".join(f"{s.name} {s.epochs:.2f}" for s in found)
    return f"data       epochs per source: {parts} (data.max_epochs {max_epochs:g}){missing}"
