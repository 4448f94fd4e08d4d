"""prepare -> .bin/.idx round-trips to the tokenizer's ids on real text; tokenizers load from local files only."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from lmforge.data import cli as data_cli
from lmforge.data.embedded import iter_documents
from lmforge.data.indexed_shard import read_index, token_dtype, write_shard
from lmforge.data.prepare import prepare
from lmforge.data.tokenizer import EOD_TOKEN, Tokenizer, export_tiktoken, load_tokenizer


@pytest.fixture(scope="module")
def tokenizer(data_cache):
    return load_tokenizer("embedded", data_cache)


@pytest.fixture(scope="module")
def austen(tmp_path_factory):
    """Real text in every input form: a directory of chapter files and a JSONL file."""
    root = tmp_path_factory.mktemp("austen")
    chapters = [d for _, d in zip(range(40), iter_documents("books"))]
    (root / "dir").mkdir()
    for i, text in enumerate(chapters[:20]):
        (root / "dir" / f"ch{i:03d}.txt").write_text(text, encoding="utf-8")
    with open(root / "rest.jsonl", "w", encoding="utf-8") as fh:
        for text in chapters[20:]:
            fh.write(json.dumps({"text": text, "meta": "x"}) + "\n")
    return root, chapters


def read_docs(prefix: Path):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    ds = IndexedDataset(str(prefix))
    return [np.asarray(ds[i]).tolist() for i in range(len(ds))]


def test_prepare_round_trips_real_text_with_worker_processes(tmp_path, tokenizer, austen):
    root, chapters = austen
    meta = prepare([str(root / "dir"), str(root / "rest.jsonl")], tmp_path / "austen", tokenizer, workers=2)
    docs = read_docs(tmp_path / "austen")
    expected = [tokenizer.encode(t) + [tokenizer.eod] for t in chapters]
    assert docs == expected  # exact ids, input order kept across 2 worker processes, EOD appended
    assert tokenizer.decode(docs[3][:-1]) == chapters[3]
    assert read_index(Path(f"{tmp_path}/austen.idx")).dtype == np.uint16
    assert meta["documents"] == 40 and meta["tokens"] == sum(map(len, expected))
    assert meta["tokenizer"] == tokenizer.identity and meta["dtype"] == "uint16" and meta["workers"] == 2
    assert meta["max_token_id"] == max(max(d) for d in expected)


def test_int32_when_the_vocabulary_does_not_fit_uint16(tmp_path, tokenizer, austen):
    assert token_dtype(65536) is np.uint16 and token_dtype(65537) is np.int32
    _, chapters = austen
    big = Tokenizer(tokenizer.backend, "hf", tokenizer.eod, 100_000, "big-vocab", tokenizer.source)
    ids = [tokenizer.encode(t) + [70_000] for t in chapters[:3]]  # an id only int32 can hold
    meta = write_shard(tmp_path / "wide", ids, big, "test")
    assert meta["dtype"] == "int32" and read_index(Path(f"{tmp_path}/wide.idx")).dtype == np.int32
    assert read_docs(tmp_path / "wide") == [d + [tokenizer.eod] for d in ids]


def test_train_tokenizer_cli_then_prepare_with_it_and_progress_bar(tmp_path, austen, capsys):
    root, chapters = austen
    out = tmp_path / "tok" / "tokenizer.json"
    assert data_cli.main(["train-tokenizer", str(root / "dir"), "--vocab-size", "600", "--out", str(out)]) == 0
    tok = load_tokenizer(str(out))
    assert tok.vocab_size == 600 and tok.backend.token_to_id(EOD_TOKEN) == tok.eod
    assert tok.decode(tok.encode(chapters[0])) == chapters[0]
    assert (
        data_cli.main(
            [
                "prepare",
                str(root / "rest.jsonl"),
                "--out",
                str(tmp_path / "p"),
                "--tokenizer",
                str(out),
                "--workers",
                "1",
                "--progress",
            ]
        )
        == 0
    )
    captured = capsys.readouterr()
    assert "tokenizing" in captured.err  # the tqdm bar
    meta = json.loads(Path(f"{tmp_path}/p.meta.json").read_text())
    assert meta["tokenizer"]["fingerprint"] == tok.fingerprint and meta["documents"] == 20


def test_tiktoken_from_local_file_matches_the_bpe_it_was_exported_from(tmp_path, tokenizer, austen, monkeypatch):
    _, chapters = austen
    path = export_tiktoken(Path(tokenizer.source), tmp_path / "embedded.tiktoken")
    tt = load_tokenizer(f"tiktoken:{path}")
    assert tt.kind == "tiktoken" and tt.vocab_size == tokenizer.vocab_size and tt.eod == tokenizer.eod
    for text in chapters[:5]:
        assert tt.encode(text) == tokenizer.encode(text)
    assert tt.decode(tt.encode(chapters[1])) == chapters[1]
    meta = prepare(["embedded:reference"], tmp_path / "ref-tt", tt)
    assert meta["tokenizer"]["kind"] == "tiktoken"
    # A named encoding loads only from $TIKTOKEN_CACHE_DIR: never a download.
    monkeypatch.delenv("TIKTOKEN_CACHE_DIR", raising=False)
    with pytest.raises(ValueError, match="needs its file in \\$TIKTOKEN_CACHE_DIR"):
        load_tokenizer("tiktoken:r50k_base")
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path / "empty"))
    with pytest.raises(ValueError, match="could not be loaded offline"):
        load_tokenizer("tiktoken:r50k_base")


def test_tokenizer_files_that_cannot_work_are_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match="no tokenizer.json at"):
        load_tokenizer(str(tmp_path / "missing.json"))
    (tmp_path / "bad.tiktoken").write_text("not base64 at all\n")
    with pytest.raises(ValueError, match="bad.tiktoken:1 is not a '<base64 token> <rank>' line"):
        load_tokenizer(f"tiktoken:{tmp_path / 'bad.tiktoken'}")


def test_bad_prepare_inputs(tmp_path, tokenizer):
    with pytest.raises(FileNotFoundError, match="input '.*nowhere' does not exist"):
        prepare([str(tmp_path / "nowhere")], tmp_path / "x", tokenizer)
    (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\n["not", "an object"]\n')
    with pytest.raises(ValueError, match="bad.jsonl:2: a JSON list, not an object"):
        prepare([str(tmp_path / "bad.jsonl")], tmp_path / "y", tokenizer)
    (tmp_path / "nofield.jsonl").write_text('{"text": "fine"}\n{"body": "no text field"}\n')
    assert prepare([str(tmp_path / "nofield.jsonl")], tmp_path / "n", tokenizer)["empty_rows"] == 1  # counted
    (tmp_path / "empty.txt").write_text("   \n")
    with pytest.raises(ValueError, match="no documents to write"):
        prepare([str(tmp_path / "empty.txt")], tmp_path / "z", tokenizer)
