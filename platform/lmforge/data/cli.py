"""``lmforge data prepare|train-tokenizer|export-tiktoken|debian ...``."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Sequence

USAGE = """usage: lmforge data COMMAND ...

  prepare          tokenize Parquet / JSONL(.gz/.zst) / datasets dirs / text into Megatron shards (one prefix,
                   or --shard-size: a directory of shards + manifest, resumable, --launcher slurm-array)
  train-tokenizer  train a byte-level BPE tokenizer.json on files, directories, JSONL or embedded:NAME
  export-tiktoken  write a byte-level BPE tokenizer.json as a tiktoken rank file (same ids)
  debian           download Debian text packages (KJV, fortunes) and prepare them as shards

Run `lmforge data COMMAND --help` for the options of each."""


def train_tokenizer_main(argv: Sequence[str]) -> int:
    # deferred: a subcommand's module loads only when it runs (`--help` stays light)
    from lmforge.data.prepare import iter_inputs

    # deferred: a subcommand's module loads only when it runs (`--help` stays light)
    from lmforge.data.tokenizer import train_bpe

    ap = argparse.ArgumentParser(prog="lmforge data train-tokenizer")
    ap.add_argument("inputs", nargs="+", help="files, directories, globs (any prepare format), or embedded:NAME")
    ap.add_argument("--vocab-size", type=int, default=8192)
    ap.add_argument(
        "--text-key",
        "--json-key",
        dest="json_key",
        default="text",
        help="the JSONL field / Parquet or Arrow column holding the document text",
    )
    ap.add_argument("--out", required=True, help="path of the tokenizer.json to write")
    args = ap.parse_args(argv)
    path = train_bpe(iter_inputs(args.inputs, args.json_key), args.vocab_size, Path(args.out))
    print(f"wrote {path}")
    return 0


def export_tiktoken_main(argv: Sequence[str]) -> int:
    # deferred: a subcommand's module loads only when it runs (`--help` stays light)
    from lmforge.data.tokenizer import export_tiktoken

    ap = argparse.ArgumentParser(prog="lmforge data export-tiktoken")
    ap.add_argument("tokenizer_json", help="a byte-level BPE tokenizer.json")
    ap.add_argument("--out", required=True, help="the .tiktoken file to write (load it as tiktoken:/path/FILE)")
    args = ap.parse_args(argv)
    print(f"wrote {export_tiktoken(Path(args.tokenizer_json), Path(args.out))}")
    return 0


def main(argv: Sequence[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    sub, rest = argv[0], list(argv[1:])
    if sub == "prepare":
        # deferred: a subcommand's module loads only when it runs (`--help` stays light)
        from lmforge.data.prepare import main as prepare_main

        return prepare_main(rest)
    if sub == "train-tokenizer":
        return train_tokenizer_main(rest)
    if sub == "export-tiktoken":
        return export_tiktoken_main(rest)
    if sub == "debian":
        # deferred: a subcommand's module loads only when it runs (`--help` stays light)
        from lmforge.data.debian import main as debian_main

        return debian_main(rest)
    print(f"lmforge data: unknown command '{sub}' (prepare, train-tokenizer, export-tiktoken, debian)")
    return 2
