"""Every input format public corpora ship in, written by its own library here, read to the tokenizer's exact ids.

Parquet (pyarrow), .jsonl / .jsonl.gz / .jsonl.zst (json, gzip, zstandard), a ``datasets`` save_to_disk
directory, text files, globs and directories; empty texts are counted and reported; a malformed row or file
stops with its file and row, or is skipped and reported with --on-error skip.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pytest

from lmforge.data.embedded import iter_documents
from lmforge.data.formats import MalformedInput, ReadReport, iter_file, list_files
from lmforge.data.prepare import main as prepare_main
from lmforge.data.prepare import prepare
from lmforge.data.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def tokenizer(data_cache):
    return load_tokenizer("embedded", data_cache)


def chapters(n):
    return [d[:3000] for _, d in zip(range(n), iter_documents("books"))]


def write_jsonl(path: Path, rows, opener=open) -> Path:
    with opener(path, "wt", encoding="utf-8") as fh:
        for r in rows:
            fh.write((r if isinstance(r, str) else json.dumps(r)) + "\n")
    return path


def write_zst(path: Path, rows) -> Path:
    import zstandard

    text = "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows)
    path.write_bytes(zstandard.ZstdCompressor(level=3).compress(text.encode()))
    return path


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """The same 12 real documents split over every format; each file also holds one empty and one null text."""
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    root = tmp_path_factory.mktemp("formats")
    docs = chapters(12)
    pq.write_table(
        pa.table({"id": [0, 1, 2, 3], "content": [docs[0], "", docs[1], None]}), root / "a.parquet", row_group_size=2
    )
    write_jsonl(root / "b.jsonl", [{"content": docs[2]}, {"content": "  "}, {"content": docs[3]}])
    write_jsonl(root / "c.jsonl.gz", [{"content": docs[4]}, {"other": 1}, {"content": docs[5]}], opener=gzip.open)
    write_zst(root / "d.jsonl.zst", [{"content": docs[6]}, {"content": docs[7]}, {"content": None}])
    datasets.Dataset.from_dict({"content": [docs[8], docs[9], ""]}).save_to_disk(str(root / "e_hf"))
    (root / "f.txt").write_text(docs[10] + docs[11], encoding="utf-8")
    return root, docs[:10] + [docs[10] + docs[11]]


def test_every_format_reads_to_the_same_documents_and_counts_empty_rows(tmp_path, tokenizer, corpus, capsys):
    root, expected = corpus
    files = list_files([str(root)])
    assert [f.name for f in files] == ["a.parquet", "b.jsonl", "c.jsonl.gz", "d.jsonl.zst", "e_hf", "f.txt"]
    report = ReadReport()
    got = [t for f in files for t in iter_file(f, "content", "stop", report)]
    assert got == expected
    assert {Path(p).name: (r.documents, r.empty_rows) for p, r in report.files.items()} == {
        "a.parquet": (2, 2),
        "b.jsonl": (2, 1),
        "c.jsonl.gz": (2, 1),
        "d.jsonl.zst": (2, 1),
        "e_hf": (2, 1),
        "f.txt": (1, 0),
    }
    # Through the CLI: exact ids, empty rows reported on stderr and in the sidecar.
    assert (
        prepare_main(
            [
                str(root / "*.parquet"),
                str(root / "b.jsonl"),
                str(root / "e_hf"),
                "--out",
                str(tmp_path / "p"),
                "--text-key",
                "content",
                "--workers",
                "1",
            ]
        )
        == 0
    )
    err = capsys.readouterr().err
    assert f"data prepare: {root / 'a.parquet'}: 2 row(s) with no or empty 'content' (counted, not written)" in err
    assert f"data prepare: {root / 'e_hf'}: 1 row(s) with no or empty 'content' (counted, not written)" in err
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    ds = IndexedDataset(str(tmp_path / "p"))
    want = [expected[i] for i in (0, 1, 2, 3, 8, 9)]
    assert [np.asarray(ds[i]).tolist() for i in range(len(ds))] == [tokenizer.encode(t) + [tokenizer.eod] for t in want]
    meta = json.loads((tmp_path / "p.meta.json").read_text())
    assert meta["empty_rows"] == 4 and meta["skipped"] == [] and meta["documents"] == 6


def test_malformed_rows_and_files_stop_with_file_and_row_or_are_skipped_and_reported(tmp_path, tokenizer, capsys):
    docs = chapters(3)
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"text": docs[0]}, '{"text": "cut', {"text": docs[1]}])
    zst = write_zst(tmp_path / "num.jsonl.zst", [{"text": docs[2]}, {"text": 7}])
    with pytest.raises(MalformedInput) as e:
        list(iter_file(bad))
    assert str(e.value) == (
        f"{bad}:2: not valid JSON (Invalid control character at, column 14). Fix: write one "
        "JSON object per line, or pass --on-error skip to skip it (it is then reported)"
    )
    with pytest.raises(MalformedInput, match=r"num\.jsonl\.zst:2: field 'text' is int, not a string"):
        list(iter_file(zst))
    # Truncated compressed files (a cut download) name the file and the row where they end, never a silent EOF.
    rows = [{"text": f"{docs[0][:200]} {i}"} for i in range(3000)]
    for name, blob in (
        ("cut.jsonl.gz", gzip.compress(write_jsonl(tmp_path / "full.jsonl", rows).read_bytes())),
        ("cut.jsonl.zst", write_zst(tmp_path / "full.jsonl.zst", rows).read_bytes()),
    ):
        (tmp_path / name).write_bytes(blob[: len(blob) // 2])
        with pytest.raises(MalformedInput, match=rf"{name}:\d+: cannot be read as {name[4:]} \(EOFError: "):
            list(iter_file(tmp_path / name))
    assert len(list(iter_file(tmp_path / "full.jsonl.zst"))) == 3000  # negative control: the whole file reads
    corrupt = tmp_path / "corrupt.parquet"
    corrupt.write_bytes(b"PAR1 this is not parquet")
    # Through the CLI: one line naming file and row, exit 2, nothing written.
    assert prepare_main([str(bad), "--out", str(tmp_path / "s"), "--workers", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        f"lmforge data prepare: {bad}:2: not valid JSON (Invalid control character at, column 14). "
        "Fix: write one JSON object per line, or pass --on-error skip to skip it (it is then reported)"
    ]
    assert not (tmp_path / "s.bin").exists() and not (tmp_path / "s.meta.json").exists()
    assert prepare_main([str(corrupt), "--out", str(tmp_path / "c"), "--workers", "1"]) == 2
    assert f"lmforge data prepare: {corrupt}: is not a readable Parquet file" in capsys.readouterr().err
    # --on-error skip: the bad row / file is left out, announced, and recorded in the sidecar.
    assert (
        prepare_main(
            [str(bad), str(zst), str(corrupt), "--out", str(tmp_path / "k"), "--workers", "1", "--on-error", "skip"]
        )
        == 0
    )
    err = capsys.readouterr().err
    assert f"data prepare: skipped {bad}:2: not valid JSON" in err
    assert f"data prepare: skipped {zst}:2: field 'text' is int, not a string" in err
    assert f"data prepare: skipped {corrupt}: is not a readable Parquet file" in err
    meta = json.loads((tmp_path / "k.meta.json").read_text())
    assert meta["documents"] == 3 and len(meta["skipped"]) == 3
    # A Parquet file without the text column names the columns it has.
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"body": ["x"]}), tmp_path / "nocol.parquet")
    with pytest.raises(
        MalformedInput,
        match=r"nocol\.parquet: has no column 'text' \(columns: body\)\. Fix: choose "
        r"the text column with --text-key",
    ):
        list(iter_file(tmp_path / "nocol.parquet"))
    pq.write_table(pa.table({"text": [1, 2]}), tmp_path / "ints.parquet")
    with pytest.raises(MalformedInput, match=r"ints\.parquet: column 'text' has type int64, not a string"):
        list(iter_file(tmp_path / "ints.parquet"))
    # Negative control: a well-formed file raises nothing and skips nothing.
    report = ReadReport()
    assert list(iter_file(write_jsonl(tmp_path / "ok.jsonl", [{"text": docs[0]}]), report=report)) == [docs[0]]
    assert report.skipped == [] and report.empty_rows == 0
    with pytest.raises(FileNotFoundError, match="input glob '.*/nothing-\\*.parquet' matches nothing"):
        prepare([str(tmp_path / "nothing-*.parquet")], tmp_path / "z", tokenizer)
