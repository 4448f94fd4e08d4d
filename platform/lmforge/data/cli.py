"""``lmforge data prepare ...`` and ``lmforge data train-tokenizer ...``."""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Sequence


def train_tokenizer_main(argv: Sequence[str]) -> int:
    from lmforge.data.prepare import iter_inputs
    from lmforge.data.tokenizer import train_bpe

    ap = argparse.ArgumentParser(prog="lmforge data train-tokenizer")
    ap.add_argument("inputs", nargs="+", help="files, directories, *.jsonl, or embedded:NAME")
    ap.add_argument("--vocab-size", type=int, default=8192)
    ap.add_argument("--out", required=True, help="path of the tokenizer.json to write")
    args = ap.parse_args(argv)
    path = train_bpe(iter_inputs(args.inputs), args.vocab_size, Path(args.out))
    print(f"wrote {path}")
    return 0


def main(argv: Sequence[str]) -> int:
    from lmforge.data.prepare import main as prepare_main

    if not argv or argv[0] in ("-h", "--help"):
        print("usage: lmforge data {prepare,train-tokenizer} ...")
        return 0
    sub, rest = argv[0], list(argv[1:])
    if sub == "prepare":
        return prepare_main(rest)
    if sub == "train-tokenizer":
        return train_tokenizer_main(rest)
    print(f"lmforge data: unknown command '{sub}' (prepare, train-tokenizer)")
    return 2
