"""Real text from Debian packages, without a model hub: ``lmforge data debian --out DIR``.

Downloads packages with ``apt-get download`` (no root, no install), unpacks them with ``dpkg-deb -x``,
turns each into JSONL documents, and prepares Megatron shards ``DIR/<name>.bin/.idx`` with the given
tokenizer. ``conf/data/debian_mix.yaml`` trains on them (set ``LMFORGE_CORPORA=DIR``).

Corpora (each with its licence):

- ``kjv``: the King James Bible (sword-text-kjv, public domain). SWORD zText modules keep one
  zlib-compressed block per book (``*.bzz``), located by 12-byte records (offset, size, raw size) in
  ``*.bzs``; the text carries OSIS markup, stripped here. One document per chapter.
- ``fortunes``: the fortune-mod quotation files (fortunes, mixed free licences). Entries are separated
  by lines holding a single ``%``; one document per entry.
"""

from __future__ import annotations

import argparse
import html
import json
import os
import re
import struct
import subprocess
import sys
import zlib
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Sequence

from lmforge.data.tokenizer import load_tokenizer
from lmforge.runtime.env_vars import read

PACKAGES: Dict[str, str] = {"kjv": "sword-text-kjv", "fortunes": "fortunes"}


def fetch_package(package: str, work: Path) -> Path:
    """``apt-get download`` + ``dpkg-deb -x``; returns the unpacked root (reused when present)."""
    root = work / package
    if (root / ".unpacked").exists():
        return root
    work.mkdir(parents=True, exist_ok=True)
    subprocess.run(["apt-get", "download", package], cwd=work, check=True, capture_output=True, text=True)
    debs = sorted(work.glob(f"{package}_*.deb"))
    if not debs:
        raise FileNotFoundError(f"apt-get download {package} left no .deb in {work}")
    subprocess.run(["dpkg-deb", "-x", str(debs[-1]), str(root)], check=True)
    (root / ".unpacked").write_text(debs[-1].name)
    return root


def _osis_to_text(markup: str) -> str:
    markup = re.sub(r"<note\b.*?</note>", "", markup, flags=re.S)  # footnotes and cross references
    text = html.unescape(re.sub(r"<[^>]+>", "", markup))
    return re.sub(r"[ \t]+", " ", text).strip()


def kjv_documents(root: Path) -> Iterator[str]:
    """One document per chapter of every book, Genesis to Revelation."""
    mods = sorted(root.glob("usr/share/sword/modules/texts/ztext/*"))
    if not mods:
        raise FileNotFoundError(f"no SWORD zText module under {root}")
    for testament in ("ot", "nt"):
        bzs = (mods[0] / f"{testament}.bzs").read_bytes()
        bzz = (mods[0] / f"{testament}.bzz").read_bytes()
        for rec in range(len(bzs) // 12):
            offset, size, _raw = struct.unpack_from("<III", bzs, rec * 12)
            block = zlib.decompress(bzz[offset : offset + size]).decode("utf-8", errors="replace")
            for chapter in re.split(r'<chapter\b[^>]*\bsID="[^"]*"[^>]*/>', block):
                text = _osis_to_text(chapter)
                if len(text) > 40:
                    yield text


def fortune_documents(root: Path) -> Iterator[str]:
    """Every entry of the (non-offensive) fortune files."""
    files = sorted(
        p
        for p in (root / "usr/share/games/fortunes").glob("*")
        if p.is_file() and p.suffix not in (".dat", ".u8") and not p.is_symlink()
    )
    if not files:
        raise FileNotFoundError(f"no fortune files under {root}")
    for path in files:
        text = path.read_text(encoding="utf-8", errors="replace")
        for entry in re.split(r"^%\s*$", text, flags=re.M):
            entry = entry.strip("\n")
            if entry.strip():
                yield entry


EXTRACTORS: Dict[str, Callable[[Path], Iterator[str]]] = {"kjv": kjv_documents, "fortunes": fortune_documents}


def write_jsonl(docs: Iterator[str], path: Path) -> int:
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    n = 0
    with open(tmp, "w", encoding="utf-8") as fh:
        for doc in docs:
            fh.write(json.dumps({"text": doc}, ensure_ascii=False) + "\n")
            n += 1
    os.replace(tmp, path)
    return n


def build(out: Path, names: Sequence[str], tokenizer_spec: str, cache_dir: Path, workers: int) -> List[dict]:
    from lmforge.data.prepare import prepare  # deferred: imports numpy; this module imports without it

    tok = load_tokenizer(tokenizer_spec, cache_dir)
    out.mkdir(parents=True, exist_ok=True)
    metas = []
    for name in names:
        root = fetch_package(PACKAGES[name], out / "debs")
        jsonl = out / f"{name}.jsonl"
        if not jsonl.exists():
            write_jsonl(EXTRACTORS[name](root), jsonl)
        metas.append(
            prepare(
                [str(jsonl)],
                out / name,
                tok,
                source=f"debian:{PACKAGES[name]}",
                workers=workers,
                progress=sys.stderr.isatty(),
            )
        )
    return metas


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="lmforge data debian", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--out",
        default=read("LMFORGE_CORPORA", ".cache/lmforge-corpora"),
        help="directory for the .deb files, JSONL and shards (default $LMFORGE_CORPORA)",
    )
    ap.add_argument("--corpora", nargs="+", default=list(PACKAGES), choices=list(PACKAGES))
    ap.add_argument("--tokenizer", default="embedded", help="the tokenizer the run will use (default: embedded)")
    ap.add_argument(
        "--cache-dir",
        default=read("LMFORGE_DATA_CACHE", ".cache/lmforge-data"),
        help="data cache holding the embedded tokenizer (default $LMFORGE_DATA_CACHE)",
    )
    ap.add_argument("--workers", type=int, default=min(4, os.cpu_count() or 1))
    args = ap.parse_args(argv)
    for meta in build(Path(args.out).absolute(), args.corpora, args.tokenizer, Path(args.cache_dir), args.workers):
        print(f"{meta['source']}: {meta['documents']} documents, {meta['tokens']} tokens")
    print(
        f"shards in {Path(args.out).absolute()}; train with: LMFORGE_CORPORA={Path(args.out).absolute()} "
        "lmforge train data=debian_mix"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
