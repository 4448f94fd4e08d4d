"""The real-text corpora every lmforge install has, offline, without a hub.

- ``books``: six Jane Austen novels (public domain), shipped xz-compressed in ``data/embedded/``
  (extracted from Debian's r-cran-janeaustenr data).
- ``code``: the Python standard library's own ``.py`` source, read from the running interpreter.
- ``reference``: the Python language reference topics that ship with every CPython (``pydoc_data``).

Documents are yielded in a fixed order so that everything built from them is reproducible.
"""
from __future__ import annotations

import lzma
import sysconfig
from pathlib import Path
from typing import Iterator

EMBEDDED_DIR = Path(__file__).resolve().parent / "embedded"
SOURCES = ("books", "code", "reference")
# The code source is capped so preparing it stays quick (the stdlib has ~30 MB of source).
CODE_BYTES_LIMIT = 6_000_000


def _books() -> Iterator[str]:
    for path in sorted(EMBEDDED_DIR.glob("*.txt.xz")):
        text = lzma.decompress(path.read_bytes()).decode("utf-8")
        # One document per chapter keeps documents a realistic size for packing and splitting.
        chapters = [c.strip() for c in text.split("\n\n\n\n") if c.strip()]
        yield from chapters


def _code() -> Iterator[str]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    total = 0
    for path in sorted(stdlib.glob("*.py")) + sorted(stdlib.glob("[a-z]*/*.py")):
        if "test" in path.parts[-2:-1] or path.name.startswith("test_") or "site-packages" in path.parts:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if not text.strip():
            continue
        yield text
        total += len(text)
        if total >= CODE_BYTES_LIMIT:
            return


def _reference() -> Iterator[str]:
    from pydoc_data import topics

    for name in sorted(topics.topics):
        text = topics.topics[name].strip()
        if text:
            yield text


def iter_documents(name: str) -> Iterator[str]:
    if name == "books":
        return _books()
    if name == "code":
        return _code()
    if name == "reference":
        return _reference()
    raise ValueError(f"unknown embedded corpus '{name}'; embedded corpora are: {', '.join(SOURCES)}")
