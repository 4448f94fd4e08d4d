"""Every bad data input fails before training with its own error: key/file, reason, fix."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from data_support import data_config, ensure_world

from lmforge.config.errors import ConfigError
from lmforge.data.checks import normalise_weights
from lmforge.data.embedded import iter_documents
from lmforge.data.mixture import build_mixture
from lmforge.data.prepare import prepare
from lmforge.data.tokenizer import load_tokenizer, train_bpe


@pytest.fixture(scope="module")
def chapters():
    return [d for _, d in zip(range(60), iter_documents("books"))]


@pytest.fixture(scope="module")
def tok(data_cache):
    return load_tokenizer("embedded", data_cache)


@pytest.fixture(scope="module")
def small_tok(tmp_path_factory, chapters):
    path = train_bpe(chapters[:10], 600, tmp_path_factory.mktemp("smalltok") / "tokenizer.json")
    return load_tokenizer(str(path))


@pytest.fixture(scope="module")
def pristine(tmp_path_factory, tok, chapters):
    """A valid 60-chapter shard of real text, prepared once."""
    root = tmp_path_factory.mktemp("pristine")
    jsonl = root / "in.jsonl"
    jsonl.write_text("".join(json.dumps({"text": t}) + "\n" for t in chapters))
    prepare([str(jsonl)], root / "books", tok)
    return root / "books"


@pytest.fixture
def shard(tmp_path, pristine):
    """A per-test copy of the pristine shard, free to damage."""
    for ext in ("bin", "idx", "meta.json"):
        shutil.copy(f"{pristine}.{ext}", f"{tmp_path}/books.{ext}")
    return tmp_path / "books"


def build(prefix, tok, cache, seq_len=64, valid_fraction=0.02, weights=None):
    ensure_world()
    weights = weights or {"books": 1.0}
    cfg = data_config(
        cache, weights, {n: str(prefix) for n in weights}, valid_fraction=valid_fraction, tokenizer=tok.source
    )
    return build_mixture(cfg, tok, seq_len=seq_len, seed=1, num_train_samples=256, num_valid_samples=8, cache_dir=cache)


def test_missing_prefix(tmp_path, tok):
    with pytest.raises(
        ConfigError,
        match=r"data.sources.books.path': no Megatron shard at prefix .*nope .*"
        r"Fix: fix the prefix, or create it: re-run `lmforge data prepare",
    ):
        build(tmp_path / "nope", tok, tmp_path / "cache")


def test_prefix_given_with_suffix(tmp_path, tok):
    with pytest.raises(ConfigError, match=r"names a file, but the path is a prefix. Fix: drop the suffix"):
        build(tmp_path / "nope.bin", tok, tmp_path / "cache")


@pytest.mark.parametrize("gone", ["idx", "bin"])
def test_missing_idx_or_bin(shard, tok, tmp_path, gone):
    os.unlink(f"{shard}.{gone}")
    with pytest.raises(
        ConfigError, match=rf"books.{gone} is missing \(only books.\w+ exists\): the shard is incomplete"
    ):
        build(shard, tok, tmp_path / "cache")


def test_truncated_bin(shard, tok, tmp_path):
    size = os.path.getsize(f"{shard}.bin")
    os.truncate(f"{shard}.bin", size - 1000)
    with pytest.raises(
        ConfigError,
        match=rf"books.bin has {size - 1000} bytes but books.idx describes {size} "
        r"\(\d+ tokens of uint16\): the shard is truncated",
    ):
        build(shard, tok, tmp_path / "cache")


def test_corrupt_and_truncated_idx(shard, tok, tmp_path):
    raw = Path(f"{shard}.idx").read_bytes()
    Path(f"{shard}.idx").write_bytes(raw[:-16])
    with pytest.raises(ConfigError, match=r"books.idx is truncated: .* the shard is corrupt"):
        build(shard, tok, tmp_path / "cache")
    Path(f"{shard}.idx").write_bytes(b"GARBAGE!!" + raw[9:])
    with pytest.raises(ConfigError, match=r"is not a Megatron index \(no MMIDIDX header\): the shard is corrupt"):
        build(shard, tok, tmp_path / "cache")


def test_negative_and_all_zero_weights():
    with pytest.raises(ConfigError, match=r"data.sources.code.weight': is negative \(-0.5\)"):
        normalise_weights({"books": 1.0, "code": -0.5})
    with pytest.raises(ConfigError, match=r"'data.sources': every weight is zero \(books=0.0, code=0\)"):
        normalise_weights({"books": 0.0, "code": 0})
    with pytest.raises(ConfigError, match=r"data.sources.books.weight': must be a finite number"):
        normalise_weights({"books": float("nan")})
    names, weights, note = normalise_weights({"books": 3, "code": 1, "reference": 0})
    assert names == ["books", "code"] and weights == [0.75, 0.25]
    assert (
        note == "data: weights books=3, code=1, reference=0 normalised to books=0.7500, code=0.2500; "
        "weight 0 leaves out reference"
    )
    assert normalise_weights({"books": 0.6, "code": 0.4})[2] is None  # already normalised: nothing to say


def test_shard_from_another_tokenizer(shard, small_tok, tmp_path):
    with pytest.raises(
        ConfigError,
        match=r"shard .*books was tokenized with hf tokenizer \(vocab 8192.*but this run's "
        r"tokenizer \(data.tokenizer\) is hf tokenizer \(vocab 600",
    ):
        build(shard, small_tok, tmp_path / "cache")


def test_token_ids_beyond_the_vocabulary(shard, small_tok, tmp_path):
    os.unlink(f"{shard}.meta.json")  # as a shard from Megatron-LM/NeMo would come: no sidecar, so it is scanned
    with pytest.raises(ConfigError, match=r"contains token id \d{4}, but the tokenizer's vocabulary has 600 ids"):
        build(shard, small_tok, tmp_path / "cache")


@pytest.mark.timeout(60)  # megatron-core would loop forever on this split: the check must come first
def test_split_with_zero_documents(tmp_path, tok, chapters):
    (tmp_path / "ten.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in chapters[:10]))
    prepare([str(tmp_path / "ten.jsonl")], tmp_path / "ten", tok)
    with pytest.raises(
        ConfigError,
        match=r"data.valid_fraction': source 'books' .* has 10 documents; "
        r"valid_fraction=0.02 leaves its valid split with 0 documents .*"
        r"Fix: give 'books' at least 25 documents",
    ):
        build(tmp_path / "ten", tok, tmp_path / "cache")


@pytest.mark.timeout(60)
def test_seq_len_longer_than_the_stream(shard, tok, tmp_path):
    with pytest.raises(
        ConfigError,
        match=r"model.seq_len': the train split of source 'books' .* has only \d+ tokens, "
        r"fewer than one sample of seq_len \+ 1 = 1000001",
    ):
        build(shard, tok, tmp_path / "cache", seq_len=1_000_000)
    with pytest.raises(ConfigError, match=r"the valid split of source 'books' .* has only \d+ tokens"):
        build(shard, tok, tmp_path / "cache", seq_len=20_000)


def test_unknown_embedded_corpus(tmp_path, tok):
    with pytest.raises(ConfigError, match=r"data.sources.books.path': unknown embedded corpus 'novels'"):
        build("embedded:novels", tok, tmp_path / "cache")
