"""Reading documents from the formats public corpora ship in, through the libraries made for them.

One document per: text file (``.txt``, ``.md``, source code, ...); line of a ``.jsonl`` / ``.jsonl.gz``
(stdlib gzip) / ``.jsonl.zst`` (zstandard) file; row of a ``.parquet`` file (pyarrow.parquet) or of a
Hugging Face ``datasets`` directory written by ``save_to_disk`` (Arrow IPC stream files listed in its
``state.json``, read with pyarrow). The text lives in the field/column ``text_key``. Inputs may be files,
directories (searched recursively for the suffixes above) and globs.

Rows with no text (a missing field, null, or only whitespace) are counted per file (:class:`ReadReport`),
never silently dropped. A malformed file or row (bad JSON, a non-string text, a file pyarrow cannot read)
raises :class:`MalformedInput` naming the file and row, or, with ``on_error="skip"``, is skipped and
recorded (the row, or the rest of an unreadable file) and announced on stderr.
"""

from __future__ import annotations

import glob
import gzip
import io
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Dict, Iterator, List, Optional, Sequence

TEXT_SUFFIXES = {".txt", ".md", ".rst", ".py", ".go", ".c", ".h", ".json", ".html", ".tex", ""}
JSONL_SUFFIXES = (".jsonl", ".jsonl.gz", ".jsonl.zst")
ON_ERROR = ("stop", "skip")
BATCH_ROWS = 1024


class MalformedInput(ValueError):
    """A file or row that cannot be read: the message names the file (and row) and the fix."""


@dataclass
class FileReport:
    documents: int = 0
    empty_rows: int = 0
    skipped: List[str] = field(default_factory=list)  # "FILE:ROW: reason" for each row/file left out


@dataclass
class ReadReport:
    """What was read from each input file: documents, rows with no text, malformed rows skipped."""

    files: Dict[str, FileReport] = field(default_factory=dict)

    def file(self, path: Path) -> FileReport:
        return self.files.setdefault(str(path), FileReport())

    @property
    def empty_rows(self) -> int:
        return sum(f.empty_rows for f in self.files.values())

    @property
    def skipped(self) -> List[str]:
        return [s for f in self.files.values() for s in f.skipped]

    def as_json(self) -> Dict[str, dict]:
        return {
            path: {"documents": f.documents, "empty_rows": f.empty_rows, "skipped": list(f.skipped)}
            for path, f in self.files.items()
        }

    def empty_lines(self, text_key: str) -> List[str]:
        """One line per file with empty rows (skipped rows were announced when they were met)."""
        return [
            f"data prepare: {path}: {f.empty_rows} row(s) with no or empty '{text_key}' (counted, not written)"
            for path, f in self.files.items()
            if f.empty_rows
        ]


def file_format(path: Path) -> str:
    """parquet | arrow-dataset | jsonl | jsonl.gz | jsonl.zst | text."""
    name = path.name
    if path.is_dir():
        return "arrow-dataset"
    if name.endswith(".parquet"):
        return "parquet"
    for suffix in JSONL_SUFFIXES:
        if name.endswith(suffix):
            return suffix[1:]
    return "text"


def is_hf_dataset_dir(path: Path) -> bool:
    return path.is_dir() and (path / "state.json").is_file() and (path / "dataset_info.json").is_file()


def _wanted(path: Path) -> bool:
    return (
        path.suffix in TEXT_SUFFIXES
        or path.name.endswith(".parquet")
        or any(path.name.endswith(s) for s in JSONL_SUFFIXES)
    )


def _walk(root: Path) -> List[Path]:
    if is_hf_dataset_dir(root):
        return [root]
    out: List[Path] = []
    for child in sorted(root.iterdir()):
        if child.is_dir():
            out += _walk(child)
        elif (
            child.is_file()
            and _wanted(child)
            and not (child.name in ("state.json", "dataset_info.json") and is_hf_dataset_dir(root))
        ):
            out.append(child)
    return out


def list_files(inputs: Sequence[str]) -> List[Path]:
    """Every input file (an HF dataset directory counts as one), in argument order then sorted paths."""
    files: List[Path] = []
    for item in inputs:
        if item.startswith("embedded:"):
            continue
        if glob.has_magic(item):
            matches = sorted(glob.glob(item, recursive=True))
            if not matches:
                raise FileNotFoundError(
                    f"input glob '{item}' matches nothing. Fix: check the pattern (quote it so "
                    "the shell does not expand it)"
                )
            files += [p for m in matches for p in ([Path(m)] if not Path(m).is_dir() else _walk(Path(m)))]
            continue
        path = Path(item)
        if not path.exists():
            raise FileNotFoundError(
                f"input '{item}' does not exist. Fix: give existing files, directories, globs "
                "or embedded:books|code|reference"
            )
        files += _walk(path) if path.is_dir() else [path]
    return files


def input_bytes(path: Path) -> int:
    if path.is_dir():
        return sum(p.stat().st_size for p in sorted(path.rglob("*")) if p.is_file())
    return path.stat().st_size


# ---- readers -------------------------------------------------------------------------------------------
def _open_jsonl(path: Path, fmt: str) -> IO[str]:
    if fmt == "jsonl.gz":
        return gzip.open(path, "rt", encoding="utf-8")
    if fmt == "jsonl.zst":
        return io.TextIOWrapper(io.BufferedReader(_ZstdFrames(open(path, "rb"))), encoding="utf-8")
    return open(path, encoding="utf-8")


class _ZstdFrames(io.RawIOBase):
    """The decompressed bytes of every zstd frame in a file, through zstandard's decompressobj.

    zstandard's ``stream_reader`` returns a truncated file's end as a silent EOF; here a file that ends inside
    a frame raises EOFError (reported with the file and row), and concatenated frames are all read.
    """

    def __init__(self, fh):
        import zstandard

        self._fh, self._dctx = fh, zstandard.ZstdDecompressor()
        self._dobj, self._in_frame = self._dctx.decompressobj(), False
        self._out, self._pos = b"", 0  # decompressed bytes not yet handed out: self._out[self._pos:]

    def readable(self) -> bool:
        return True

    def _fill(self) -> bool:
        if self._pos >= len(self._out):
            self._out, self._pos = b"", 0
        while not self._out:
            block = self._fh.read(1 << 20)
            if not block:
                if self._in_frame:
                    raise EOFError("the file ends inside a zstd frame (truncated)")
                return False
            while block:
                self._in_frame = True
                self._out += self._dobj.decompress(block)
                if not self._dobj.eof:
                    break
                block, self._in_frame = self._dobj.unused_data, False
                self._dobj = self._dctx.decompressobj()
        return True

    def readinto(self, buffer) -> int:
        if not self._fill():
            return 0
        n = min(len(buffer), len(self._out) - self._pos)
        buffer[:n] = memoryview(self._out)[self._pos : self._pos + n]
        self._pos += n
        return n

    def close(self) -> None:
        self._fh.close()
        super().close()


class _Reader:
    def __init__(self, path: Path, text_key: str, on_error: str, report: ReadReport):
        if on_error not in ON_ERROR:
            raise ValueError(f"on_error must be one of {ON_ERROR}, got {on_error!r}")
        self.path, self.key, self.on_error = path, text_key, on_error
        self.rep = report.file(path)

    def bad(self, where: str, reason: str, fix: str) -> None:
        msg = f"{where}: {reason}"
        if self.on_error == "stop":
            raise MalformedInput(f"{msg}. Fix: {fix}, or pass --on-error skip to skip it (it is then reported)")
        self.rep.skipped.append(msg)
        print(f"data prepare: skipped {msg}", file=sys.stderr, flush=True)

    def keep(self, where: str, text: object) -> Optional[str]:
        if text is None:
            self.rep.empty_rows += 1
            return None
        if not isinstance(text, str):
            self.bad(
                where,
                f"field '{self.key}' is {type(text).__name__}, not a string",
                f"give '{self.key}' a string, or choose the text field with --text-key",
            )
            return None
        if not text.strip():
            self.rep.empty_rows += 1
            return None
        self.rep.documents += 1
        return text

    def jsonl(self, fmt: str) -> Iterator[str]:
        n = 0
        try:
            with _open_jsonl(self.path, fmt) as fh:
                for n, line in enumerate(fh, 1):
                    if not line.strip():
                        self.rep.empty_rows += 1
                        continue
                    try:
                        obj = json.loads(line)
                    except ValueError as e:
                        self.bad(
                            f"{self.path}:{n}",
                            f"not valid JSON ({e.msg}, column {e.colno})",
                            "write one JSON object per line",
                        )
                        continue
                    if not isinstance(obj, dict):
                        self.bad(
                            f"{self.path}:{n}",
                            f"a JSON {type(obj).__name__}, not an object",
                            "write one JSON object per line",
                        )
                        continue
                    text = self.keep(f"{self.path}:{n}", obj.get(self.key))
                    if text is not None:
                        yield text
        except (OSError, EOFError, UnicodeDecodeError) as e:  # corrupt gzip/zstd stream, bad UTF-8
            self.bad(
                f"{self.path}:{n + 1}",
                f"cannot be read as {fmt} ({type(e).__name__}: {e})",
                f"re-create or re-download {self.path.name}",
            )

    def _batches(self, batches: Iterator, where: str) -> Iterator[str]:
        row = 0
        try:
            for batch in batches:
                if self.key not in batch.schema.names:
                    self.bad(
                        where,
                        f"has no column '{self.key}' (columns: {', '.join(batch.schema.names)})",
                        "choose the text column with --text-key",
                    )
                    return
                column = batch.column(self.key)
                import pyarrow as pa

                if not (pa.types.is_string(column.type) or pa.types.is_large_string(column.type)):
                    self.bad(
                        where,
                        f"column '{self.key}' has type {column.type}, not a string",
                        "choose the text column with --text-key",
                    )
                    return
                for text in column.to_pylist():
                    row += 1
                    text = self.keep(f"{where} row {row}", text)
                    if text is not None:
                        yield text
        except (OSError, ValueError) as e:  # pyarrow.ArrowInvalid is a ValueError, ArrowIOError an OSError
            self.bad(
                f"{where} row {row + 1}",
                f"cannot be read ({type(e).__name__}: {e})",
                f"re-create or re-download {Path(where).name}",
            )

    def parquet(self) -> Iterator[str]:
        import pyarrow.parquet as pq

        try:
            pf = pq.ParquetFile(self.path)
        except (OSError, ValueError) as e:
            self.bad(
                str(self.path),
                f"is not a readable Parquet file ({type(e).__name__}: {e})",
                f"re-create or re-download {self.path.name}",
            )
            return
        if self.key not in pf.schema_arrow.names:
            self.bad(
                str(self.path),
                f"has no column '{self.key}' (columns: {', '.join(pf.schema_arrow.names)})",
                "choose the text column with --text-key",
            )
            return
        yield from self._batches(pf.iter_batches(batch_size=BATCH_ROWS, columns=[self.key]), str(self.path))

    def arrow_dataset(self) -> Iterator[str]:
        import pyarrow as pa

        try:
            state = json.loads((self.path / "state.json").read_text())
            names = [d["filename"] for d in state["_data_files"]]
        except (OSError, ValueError, KeyError, TypeError) as e:
            self.bad(
                str(self.path / "state.json"),
                f"is not a datasets save_to_disk state ({e})",
                "save the dataset with datasets.Dataset.save_to_disk",
            )
            return
        for name in names:
            arrow = self.path / name
            try:
                reader = pa.ipc.open_stream(pa.memory_map(str(arrow)))
            except (OSError, ValueError) as e:
                self.bad(
                    str(arrow),
                    f"is not a readable Arrow stream ({type(e).__name__}: {e})",
                    "save the dataset again with save_to_disk",
                )
                continue
            yield from self._batches(iter(reader), str(arrow))

    def text(self) -> Iterator[str]:
        t = self.keep(str(self.path), self.path.read_text(encoding="utf-8", errors="replace"))
        if t is not None:
            yield t


def iter_file(
    path: Path, text_key: str = "text", on_error: str = "stop", report: Optional[ReadReport] = None
) -> Iterator[str]:
    """The documents of one input file, in file order."""
    reader = _Reader(path, text_key, on_error, report if report is not None else ReadReport())
    fmt = file_format(path)
    if fmt == "parquet":
        return reader.parquet()
    if fmt == "arrow-dataset":
        return reader.arrow_dataset()
    if fmt.startswith("jsonl"):
        return reader.jsonl(fmt)
    return reader.text()
