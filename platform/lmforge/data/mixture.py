"""Weighted mixtures of Megatron shards through megatron-core's ``BlendedMegatronDatasetBuilder``.

Sample ``i`` of the training stream is a pure function of (seed, the sources and their weights, seq_len,
and the number of samples the index is built for). That number is fixed from the run's *planned* tokens
and stored with every checkpoint, so a resume rebuilds the identical index.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

import numpy as np

from lmforge.config.data import DataConfig
from lmforge.data.prepare import prepare
from lmforge.data.shards import read_meta
from lmforge.data.tokenizer import Tokenizer


class MegatronTokenizerAdapter:
    """The few attributes GPTDataset reads from a tokenizer."""

    def __init__(self, tok: Tokenizer):
        self.eod = tok.eod
        self.pad = tok.eod
        self.vocab_size = tok.vocab_size
        self.unique_identifiers = {"class": "lmforge", **tok.identity}


@dataclass
class Mixture:
    train: object
    valid: Dict[str, object]
    sources: List[str]
    weights: List[float]
    num_train_samples: int
    tokenizer: Tokenizer
    shard_meta: Dict[str, dict] = field(default_factory=dict)

    def train_sample(self, i: int) -> dict:
        return self.train[i % self.num_train_samples]


def resolve_source(name: str, path: str, tokenizer: Tokenizer, cache_dir: Path) -> Path:
    """Embedded corpora are prepared on first use (once, under a lock); other paths are shard prefixes."""
    if path.startswith("embedded:"):
        corpus = path.split(":", 1)[1]
        prefix = cache_dir / "shards" / f"embedded-{corpus}-{tokenizer.fingerprint}"
        prepare([path], prefix, tokenizer, source=path)
        return prefix
    return Path(path).expanduser()


def _split_string(valid_fraction: float) -> str:
    valid = max(1, round(valid_fraction * 10000))
    return f"{10000 - valid},{valid},0"


def build_mixture(cfg: DataConfig, tokenizer: Tokenizer, seq_len: int, seed: int, num_train_samples: int,
                  num_valid_samples: int, cache_dir: Path) -> Mixture:
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    logging.getLogger("megatron").setLevel(logging.WARNING)
    names = list(cfg.sources)
    if not names:
        raise ValueError("config key 'data.sources': no data sources. Fix: pick a data preset (data=default)")
    prefixes = [resolve_source(n, cfg.sources[n].path, tokenizer, cache_dir) for n in names]
    raw = [float(cfg.sources[n].weight) for n in names]
    total = sum(raw)
    weights = [w / total for w in raw]
    index_cache = cache_dir / "index"
    index_cache.mkdir(parents=True, exist_ok=True)

    def gpt_config(blend) -> GPTDatasetConfig:
        return GPTDatasetConfig(
            random_seed=seed, sequence_length=seq_len, blend=blend, split=_split_string(cfg.valid_fraction),
            path_to_cache=str(index_cache), tokenizer=MegatronTokenizerAdapter(tokenizer),
            reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False,
            create_attention_mask=False, mid_level_dataset_surplus=0.005,
        )

    always = lambda: True  # noqa: E731  every rank builds; megatron-core makes rank 0 go first
    blend = ([str(p) for p in prefixes], weights if len(prefixes) > 1 else None)
    train, _, _ = BlendedMegatronDatasetBuilder(GPTDataset, [num_train_samples, 1, 0], always,
                                                gpt_config(blend)).build()
    valid = {}
    for name, prefix in zip(names, prefixes):
        _, v, _ = BlendedMegatronDatasetBuilder(GPTDataset, [None, num_valid_samples, None], always,
                                                gpt_config(([str(prefix)], None))).build()
        valid[name] = v
    meta = {n: read_meta(p) for n, p in zip(names, prefixes) if Path(str(p) + ".meta.json").exists()}
    return Mixture(train, valid, names, weights, num_train_samples, tokenizer, meta)


def default_cache_dir(cfg: DataConfig, run_root: str) -> Path:
    if cfg.cache_dir:
        return Path(cfg.cache_dir).expanduser().absolute()
    env = os.environ.get("LMFORGE_DATA_CACHE")
    if env:
        return Path(env).absolute()
    return (Path(run_root).expanduser().absolute().parent / ".cache" / "lmforge-data")


def sample_source_ids(sample: dict) -> Optional[int]:
    ds = sample.get("dataset_id")
    return None if ds is None else int(np.asarray(ds))
