"""Weighted mixtures of Megatron shards through megatron-core's ``BlendedMegatronDatasetBuilder``.

Determinism. Sample ``i`` of the training stream is a pure function of (seed, the sources and their
normalised weights, seq_len, N), where N, the number of samples the index is built for, is fixed once:
``N = ceil(train.planned_tokens / seq_len)`` (planned tokens default to max_steps x tokens per step) at
the run's first launch, and then read back from every checkpoint (``num_train_samples`` in the data
state). Neither a resume, nor a different data-parallel size, nor a longer ``max_steps`` changes N, so
what was already seen is never re-shuffled.

Extension. When a run needs more than N samples (``max_steps`` raised past the plan), the stream goes on
in *passes* of N samples: pass k (k >= 1) is the same mixture's index built with seed ``seed + k``.
Sample ``i`` is ``pass[i // N][i % N]``; samples ``[0, N)`` are untouched by the extension. Set
``train.planned_tokens`` generously at the start to keep a run in one pass.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import numpy as np

from lmforge.config.data import DataConfig
from lmforge.config.errors import ConfigError
from lmforge.data import index_cache
from lmforge.data.checks import check_shard, check_splits, normalise_weights, split_string
from lmforge.data.epochs import check_epochs
from lmforge.data.megatron_import import quiet_megatron_import
from lmforge.data.sources import resolve_source, source_shards
from lmforge.data.tokenizer import Tokenizer


class MegatronTokenizerAdapter:
    """The few attributes GPTDataset reads from a tokenizer; ``unique_identifiers`` enter the cache hash.

    No ``pad``: lmforge's tokenizers have none. Without one megatron-core uses its own pad id, -1 (no token's id),
    the very id it fell back to when this adapter claimed ``pad = eod``, then without its warning that the pad id
    collides with another special token. ``pad`` is not in ``unique_identifiers``: the cache hash is unchanged."""

    def __init__(self, tok: Tokenizer, shard_digests: Optional[Dict[str, str]] = None):
        self.eod = tok.eod
        self.vocab_size = tok.vocab_size
        self.unique_identifiers = {"class": "lmforge", **tok.identity, "shards": dict(shard_digests or {})}


@dataclass
class Mixture:
    passes: List[object]  # BlendedDataset (or GPTDataset for one source) per pass of num_train_samples
    valid: Dict[str, object]
    sources: List[str]
    weights: List[float]
    num_train_samples: int
    tokenizer: Tokenizer
    shard_meta: Dict[str, Optional[dict]] = field(default_factory=dict)
    seed: int = 0
    seq_len: int = 0
    notes: List[str] = field(default_factory=list)
    blend_source: List[int] = field(default_factory=list)  # dataset of the train blend -> its source (many shards)

    def source_of(self, dataset_id: int) -> int:
        return self.blend_source[dataset_id] if self.blend_source else dataset_id

    @property
    def train(self) -> object:
        return self.passes[0]

    @property
    def total_samples(self) -> int:
        return self.num_train_samples * len(self.passes)

    def train_sample(self, i: int) -> dict:
        k, j = divmod(i, self.num_train_samples)
        if k >= len(self.passes):
            raise IndexError(
                f"sample {i} is past the {len(self.passes)} pass(es) of {self.num_train_samples} samples "
                "built for this run; build the mixture with total_train_samples >= the samples consumed"
            )
        return self.passes[k][j]

    def train_text(self, i: int) -> Tuple[np.ndarray, int]:
        """Sample ``i`` as seq_len + 1 token ids and its source id, without building megatron's per-sample dict.

        Same ids as ``train_sample(i)``: tokens = text[:-1], labels = text[1:] (checked in tests); this skips the
        torch tensors, loss mask and position ids megatron-core makes for every sample and lmforge never uses.
        """
        k, j = divmod(i, self.num_train_samples)
        if k >= len(self.passes):
            self.train_sample(i)  # raises the explanatory IndexError
        ds = self.passes[k]
        if getattr(ds, "dataset_index", None) is not None:  # a BlendedDataset
            source = int(ds.dataset_index[j])
            text, _ = ds.datasets[source]._query_document_sample_shuffle_indices(int(ds.dataset_sample_index[j]))
            return text, self.source_of(source)
        if hasattr(ds, "datasets"):  # a BlendedDataset whose indices are not loaded yet: the public path
            sample = ds[j]
            return np.concatenate([np.asarray(sample["tokens"]), np.asarray(sample["labels"])[-1:]]), self.source_of(
                int(sample["dataset_id"])
            )
        text, _ = ds._query_document_sample_shuffle_indices(j)
        return text, 0

    def signature(self) -> dict:
        return {
            "sources": dict(zip(self.sources, [round(w, 6) for w in self.weights])),
            "seq_len": self.seq_len,
            "seed": self.seed,
        }


def build_mixture(
    cfg: DataConfig,
    tokenizer: Tokenizer,
    *,
    seq_len: int,
    seed: int,
    num_train_samples: int,
    num_valid_samples: int,
    cache_dir: Path,
    total_train_samples: Optional[int] = None,
    guard: bool = True,
) -> Mixture:
    """Check every source, then build (or load from the cache) the train passes and per-source valid sets.

    ``guard=False``: the caller holds the index lock already (``index_build.build_for``)."""
    logging.getLogger("megatron").setLevel(logging.WARNING)
    if not cfg.sources:
        raise ConfigError("data.sources", "no data sources", "pick a data preset (data=default) or add sources")
    names, weights, note = normalise_weights({n: cfg.sources[n].weight for n in cfg.sources})
    notes = [note] if note else []
    from lmforge.runtime.dist import rank  # deferred: runtime.dist imports torch; importing lmforge.data does not

    if note and rank() == 0:
        print(note, flush=True)
    workers = max(1, int(getattr(cfg, "prepare_workers", 1) or 1))
    paths = [resolve_source(n, cfg.sources[n].path, tokenizer, cache_dir, workers) for n in names]
    # A source that is a directory of many shards enters the blend shard by shard, weighted by their tokens.
    members: List[List[Tuple[Path, int]]] = [source_shards(n, p) or [(p, 0)] for n, p in zip(names, paths)]
    shards = [check_shard(n, p, tokenizer) for n, group in zip(names, members) for p, _ in group]
    train_tokens = [check_splits(shard, cfg.valid_fraction, seq_len)["train"] for shard in shards]
    known, first = {}, 0
    for n, p, group in zip(names, paths, members):  # per source: its shards' train tokens together
        known[n] = (p, sum(train_tokens[first : first + len(group)]))
        first += len(group)
    found = check_epochs(cfg, max(num_train_samples, total_train_samples or 0) * seq_len, cache_dir, known)
    repeated = [s for s in found if s.epochs > 1.0]
    if repeated:  # allowed up to data.max_epochs, never silent
        notes.append(
            "data: this run repeats its train split: "
            + ", ".join(f"{s.name} {s.epochs:.2f}x" for s in repeated)
            + f" (data.max_epochs {cfg.max_epochs:g} refuses more)"
        )
        if rank() == 0:
            print(notes[-1], flush=True)
    # Imported after the checks: megatron-core takes seconds to import, a bad shard should fail before that.
    with quiet_megatron_import():
        from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
        from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    prefixes, blend_weights, blend_source = [], [], []
    for k, (weight, group) in enumerate(zip(weights, members)):
        source_tokens = sum(t for _, t in group) or 1
        for p, tokens in group:
            prefixes.append(p)
            blend_weights.append(weight * tokens / source_tokens if len(group) > 1 else weight)
            blend_source.append(k)
    index_dir = cache_dir / "index"
    index_dir.mkdir(parents=True, exist_ok=True)
    index_cache.check_visible(index_dir)
    adapter = MegatronTokenizerAdapter(
        tokenizer,
        {
            (n if len(g) == 1 else f"{n}/{p.name}"): index_cache.content_digest(p)
            for n, g in zip(names, members)
            for p, _ in g
        },
    )

    def gpt_config(blend, random_seed: int) -> GPTDatasetConfig:
        return GPTDatasetConfig(
            random_seed=random_seed,
            sequence_length=seq_len,
            blend=blend,
            split=split_string(cfg.valid_fraction),
            path_to_cache=str(index_dir),
            tokenizer=adapter,
            reset_position_ids=False,
            reset_attention_mask=False,
            eod_mask_loss=False,
            create_attention_mask=False,  # causal attention is implicit: no dense [S, S] mask per sample
            mid_level_dataset_surplus=0.005,
        )

    always = lambda: True  # noqa: E731  megatron-core makes rank 0 build first, the others load its files
    blend = ([str(p) for p in prefixes], blend_weights if len(prefixes) > 1 else None)
    total = max(num_train_samples, total_train_samples or num_train_samples)
    n_passes = math.ceil(total / num_train_samples)
    passes = []
    with index_cache.build_guard(index_dir, lock=guard):
        for k in range(n_passes):
            train, _, _ = BlendedMegatronDatasetBuilder(
                GPTDataset, [num_train_samples, 1, 0], always, gpt_config(blend, seed + k)
            ).build()
            passes.append(train)
        valid = {}
        for name, group in zip(names, members):
            source_tokens = sum(t for _, t in group) or 1
            shard_weights = [t / source_tokens for _, t in group] if len(group) > 1 else None
            source_blend = ([str(p) for p, _ in group], shard_weights)
            # megatron-core wants every split sized when a blend has weights (a many-shard source)
            sizes = [None, num_valid_samples, None] if len(group) == 1 else [1, num_valid_samples, 0]
            _, v, _ = BlendedMegatronDatasetBuilder(GPTDataset, sizes, always, gpt_config(source_blend, seed)).build()
            valid[name] = v
    meta = {s.name: s.meta for s in shards}  # a many-shard source keeps its last shard's sidecar
    return Mixture(
        passes,
        valid,
        names,
        weights,
        num_train_samples,
        tokenizer,
        meta,
        seed,
        seq_len,
        notes,
        blend_source if len(prefixes) != len(names) else [],
    )
