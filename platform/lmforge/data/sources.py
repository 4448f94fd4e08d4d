"""Where a data source's tokens are: an embedded corpus (prepared on first use, once, under a lock), a shard
prefix, or a directory of shards with a manifest (``lmforge data prepare --shard-size``); and the data cache dir
the embedded shards and megatron-core's indices live in."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional, Tuple

from lmforge.config.data import DataConfig
from lmforge.config.errors import ConfigError
from lmforge.data.checks import check_prefix_exists
from lmforge.data.embedded import SOURCES, VERSION
from lmforge.data.indexed_shard import read_meta
from lmforge.data.notices import first_use_notice
from lmforge.data.prepare import prepare
from lmforge.data.sharded_prepare import MANIFEST, PLAN, read_manifest
from lmforge.data.tokenizer import Tokenizer
from lmforge.runtime.env_vars import read


def source_shards(name: str, path: Path) -> Optional[List[Tuple[Path, int]]]:
    """(prefix, tokens) of each shard when ``path`` is a directory prepared with --shard-size; else None."""
    if not path.is_dir():
        return None
    manifest = read_manifest(path)
    if manifest is None:
        why = (
            "its preparation has not finished (plan.json but no complete manifest.json)"
            if (path / PLAN).exists()
            else f"it holds no {MANIFEST}"
        )
        raise ConfigError(
            f"data.sources.{name}.path",
            f"{path} is a directory, but {why}",
            f"finish it (`lmforge data prepare ... --out {path} --shard-size N` again, or --finalize), "
            "or give a shard prefix",
        )
    return [(path / s["name"], int(s["tokens"])) for s in manifest["shards"]]


def check_sources_present(cfg: DataConfig) -> None:
    """Refuse, before any process group or tokenizer work, a mixture whose non-embedded source (weight > 0) has no
    shards at its path: neither a shard prefix's .bin/.idx nor a directory with a complete manifest."""
    for name, source in cfg.sources.items():
        if source.weight <= 0 or source.path.startswith("embedded:") or not source.path:
            continue
        path = Path(source.path).expanduser()
        if source_shards(name, path) is None:  # a directory is checked for its manifest there
            check_prefix_exists(name, path)


def unprepared_sources(cfg: DataConfig) -> List[str]:
    """``name (path)`` of each non-embedded source with weight > 0 whose shards are not there yet."""
    out = []
    for name, source in cfg.sources.items():
        path = Path(source.path).expanduser()
        if source.weight <= 0 or source.path.startswith("embedded:") or not source.path or path.is_dir():
            continue
        if not Path(f"{path}.idx").exists():
            out.append(f"{name} ({source.path})")
    return out


def resolve_source(name: str, path: str, tokenizer: Tokenizer, cache_dir: Path, workers: int = 1) -> Path:
    """Embedded corpora are prepared on first use (once, under a lock); other paths are shard prefixes or
    directories of shards with a manifest (see :func:`source_shards`)."""
    if path.startswith("embedded:"):
        corpus = path.split(":", 1)[1]

        if corpus not in SOURCES:
            raise ConfigError(
                f"data.sources.{name}.path",
                f"unknown embedded corpus '{corpus}'",
                f"use one of {', '.join('embedded:' + s for s in SOURCES)} or a shard prefix",
            )
        prefix = cache_dir / "shards" / f"embedded-{corpus}-v{VERSION}-{tokenizer.fingerprint}"
        if read_meta(prefix) is None:
            first_use_notice(f"tokenizing the embedded corpus {corpus}", Path(f"{prefix}.bin"))
        prepare([path], prefix, tokenizer, source=path, workers=workers)
        return prefix
    if not path:
        raise ConfigError(f"data.sources.{name}.path", "is empty", "give a shard prefix or embedded:NAME")
    return Path(path).expanduser()


def default_cache_dir(cfg: DataConfig, run_root: str) -> Path:
    if cfg.cache_dir:
        return Path(cfg.cache_dir).expanduser().absolute()
    env = read("LMFORGE_DATA_CACHE")
    if env:
        return Path(env).absolute()
    return Path(run_root).expanduser().absolute().parent / ".cache" / "lmforge-data"
