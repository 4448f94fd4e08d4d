"""The real-text corpora every lmforge install has, offline, without a hub.

- ``books``: six Jane Austen novels (public domain), shipped xz-compressed in ``data/embedded/``
  (extracted from Debian's r-cran-janeaustenr data).
- ``code``: the Python standard library's own ``.py`` source, read from the running interpreter.
- ``reference``: the Python language reference topics that ship with every CPython (``pydoc_data``),
  consecutive topics joined into documents of >= 6k characters, the last one >= 20k, so that the 2%
  validation split (the last of its 25 documents) still holds a 4096-token sequence.

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
REFERENCE_DOC_CHARS = 6_000
REFERENCE_TAIL_CHARS = 20_000
# Bumped whenever the documents a corpus yields change: it is part of the prepared shards' names.
VERSION = 2


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

    texts = [topics.topics[name].strip() for name in sorted(topics.topics)]
    groups: list = [[]]
    for text in (t for t in texts if t):
        if sum(map(len, groups[-1])) >= REFERENCE_DOC_CHARS:
            groups.append([])
        groups[-1].append(text)
    while len(groups) > 1 and sum(map(len, groups[-1])) < REFERENCE_TAIL_CHARS:
        tail = groups.pop()  # the last document (the validation split) takes in the ones before it
        groups[-1] += tail
    for group in groups:
        yield "\n\n".join(group)


def iter_documents(name: str) -> Iterator[str]:
    if name == "books":
        return _books()
    if name == "code":
        return _code()
    if name == "reference":
        return _reference()
    raise ValueError(f"unknown embedded corpus '{name}'; embedded corpora are: {', '.join(SOURCES)}")
