"""Tokenize text into Megatron shards: ``lmforge data prepare`` / ``python -m lmforge.data.prepare``.

Inputs (read by :mod:`lmforge.data.formats`): Parquet, JSONL / .jsonl.gz / .jsonl.zst, ``datasets``
save_to_disk directories, text files; directories and globs of them; or ``embedded:NAME``. The text is the
``--text-key`` field/column. With ``--shard-size`` the output is a directory of shards, one per N input
files (``8``) or of at most N tokens each (``500M``), with a manifest, resumable, and splittable across a
Slurm array (:mod:`lmforge.data.sharded_prepare`).
Documents are tokenized in worker processes (``--workers``), reassembled in input order, given an
end-of-document token, and written with megatron-core's ``IndexedDatasetBuilder`` as PREFIX.bin/.idx
(uint16 when the vocabulary fits, else int32) plus PREFIX.meta.json recording the tokenizer identity.
The output does not depend on the number of workers.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Iterator, Optional, Sequence

from lmforge.data import sharded_prepare
from lmforge.data.embedded import iter_documents
from lmforge.data.formats import ON_ERROR, ReadReport, input_bytes, iter_file, list_files
from lmforge.data.indexed_shard import ensure_shard, meta_path, write_shard
from lmforge.data.prepare_slurm import submit_array
from lmforge.data.tokenize_pool import tokenize_docs
from lmforge.data.tokenizer import Tokenizer, load_tokenizer
from lmforge.runtime.env_vars import read, read_int


def iter_inputs(
    inputs: Sequence[str], text_key: str = "text", on_error: str = "stop", report: Optional[ReadReport] = None
) -> Iterator[str]:
    """Every document of the inputs, in a fixed order (argument order, then sorted paths)."""
    for item in inputs:
        if item.startswith("embedded:"):
            yield from iter_documents(item.split(":", 1)[1])
            continue
        for f in list_files([item]):
            yield from iter_file(f, text_key, on_error, report)


def _total_chars(inputs: Sequence[str]) -> Optional[int]:
    if any(i.startswith("embedded:") for i in inputs):
        return None
    return sum(input_bytes(f) for f in list_files(inputs))


def prepare(
    inputs: Sequence[str],
    prefix: Path,
    tokenizer: Tokenizer,
    source: str = "",
    workers: int = 1,
    progress: bool = False,
    json_key: str = "text",
    on_error: str = "stop",
) -> dict:
    """Tokenize ``inputs`` into PREFIX.bin/.idx/.meta.json unless a complete shard is already there."""
    list_files(inputs)  # fail on a missing input before taking the lock

    def build() -> dict:
        stats: dict = {}
        report = ReadReport()
        docs = tokenize_docs(
            iter_inputs(inputs, json_key, on_error, report), tokenizer, workers, progress, _total_chars(inputs), stats
        )

        def extra() -> dict:
            for line in report.empty_lines(json_key):
                print(line, file=sys.stderr, flush=True)
            return {"workers": workers, "empty_rows": report.empty_rows, "skipped": report.skipped}

        return write_shard(prefix, docs, tokenizer, source or ",".join(inputs), extra, stats)

    return ensure_shard(prefix, build)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="lmforge data prepare", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "inputs",
        nargs="*",
        help="files, directories, globs (*.parquet, *.jsonl[.gz|.zst], datasets "
        "save_to_disk dirs, text), or embedded:books|code|reference",
    )
    ap.add_argument(
        "--out",
        required=True,
        help="output prefix (PREFIX.bin/.idx/.meta.json), or with --shard-size "
        "an output directory (shards + manifest.json)",
    )
    ap.add_argument(
        "--tokenizer",
        default="embedded",
        help="embedded | path/to/tokenizer.json | tiktoken:/path/NAME.tiktoken | tiktoken:NAME",
    )
    ap.add_argument(
        "--cache-dir",
        default=read("LMFORGE_DATA_CACHE", ".cache/lmforge-data"),
        help="where the embedded tokenizer lives (default $LMFORGE_DATA_CACHE)",
    )
    ap.add_argument(
        "--workers",
        type=int,
        default=max(1, min(8, (os.cpu_count() or 2) // 2)),
        help="tokenizer processes (default: half the cores, at most 8)",
    )
    ap.add_argument(
        "--text-key",
        "--json-key",
        dest="text_key",
        default="text",
        help="the JSONL field / Parquet or Arrow column holding the document text",
    )
    ap.add_argument(
        "--on-error",
        choices=ON_ERROR,
        default="stop",
        help="a malformed file or row: stop with its name and row (default), or skip it and report it",
    )
    ap.add_argument(
        "--shard-size",
        default=None,
        metavar="SIZE",
        help="write shards under the --out directory, with a manifest: SIZE input files per shard (8, "
        "8files) or at most SIZE tokens per shard, each file cut in order (500M, 2G, 100000tokens); "
        "re-running resumes (finished shards are kept)",
    )
    ap.add_argument(
        "--launcher",
        choices=("local", "slurm-array"),
        default="local",
        help="slurm-array: submit slurm/prepare_array.sh as an array job plus a finalize job",
    )
    ap.add_argument("--array-tasks", type=int, default=2, help="array tasks for --launcher slurm-array")
    ap.add_argument(
        "--sbatch-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="an extra sbatch argument for the array and finalize jobs (repeatable), e.g. --partition=cpu",
    )
    ap.add_argument(
        "--task-index",
        type=int,
        default=None,
        help="build only shards i %% NUM_TASKS == INDEX (default $SLURM_ARRAY_TASK_ID); no finalize",
    )
    ap.add_argument("--num-tasks", type=int, default=None, help="(default $SLURM_ARRAY_TASK_COUNT)")
    ap.add_argument(
        "--finalize",
        action="store_true",
        help="only check the shards under --out and write manifest.json (the array's final step)",
    )
    ap.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=sys.stderr.isatty(),
        help="show a progress bar (default: when stderr is a terminal)",
    )
    ap.add_argument("--force", action="store_true", help="rebuild even if a complete shard exists")
    args = ap.parse_args(argv)
    try:
        return _run(args)
    except (FileNotFoundError, ValueError) as e:  # MalformedInput, PlanMismatch, IncompletePrefix, bad values
        print(f"lmforge data prepare: {e}", file=sys.stderr, flush=True)
        return 2


def _run(args: argparse.Namespace) -> int:
    out = Path(args.out)
    size = sharded_prepare.ShardSize.parse(args.shard_size) if args.shard_size is not None else None
    if args.finalize:
        print(json.dumps(_summary(sharded_prepare.finalize(out)), indent=1))
        return 0
    tok = load_tokenizer(args.tokenizer, Path(args.cache_dir))
    if not args.inputs:  # an array task (or a re-run): the plan already under --out says what to do
        if not (out / sharded_prepare.PLAN).exists():
            raise ValueError("no inputs. Fix: give files, directories, globs or embedded:NAME")
        plan = sharded_prepare.load_plan(out)
        if plan["tokenizer"] != tok.identity:
            raise ValueError(
                f"{out / sharded_prepare.PLAN} was made with tokenizer {plan['tokenizer'].get('fingerprint')}, "
                f"--tokenizer {args.tokenizer} is {tok.fingerprint}. Fix: pass the plan's --tokenizer"
            )
    elif args.shard_size is None:
        if args.launcher != "local":
            raise ValueError("--launcher slurm-array needs --shard-size (the array splits the shards)")
        if out.suffix in (".bin", ".idx"):
            raise ValueError(f"--out is a prefix, without .bin/.idx: use --out {out.with_suffix('')}")
        if args.force:
            meta_path(out).unlink(missing_ok=True)
        meta = prepare(
            args.inputs,
            out,
            tok,
            workers=args.workers,
            progress=args.progress,
            json_key=args.text_key,
            on_error=args.on_error,
        )
        print(json.dumps(meta, indent=1))
        return 0
    else:
        if args.force:
            for name in (sharded_prepare.PLAN, sharded_prepare.MANIFEST):
                (out / name).unlink(missing_ok=True)
            for done in [*out.glob("shard-*.meta.json"), *out.glob("shard-*.parts.json")]:
                done.unlink()
        plan = sharded_prepare.write_or_check_plan(
            out, sharded_prepare.make_plan(args.inputs, tok, size, args.text_key, args.on_error)
        )
    if args.launcher == "slurm-array":
        print(submit_array(out, args.tokenizer, args.cache_dir, args.workers, args.array_tasks, args.sbatch_arg))
        return 0
    task = args.task_index if args.task_index is not None else read_int("SLURM_ARRAY_TASK_ID")
    tasks = args.num_tasks if args.num_tasks is not None else read_int("SLURM_ARRAY_TASK_COUNT")
    status = sharded_prepare.build_shards(out, plan, tok, args.workers, task or 0, tasks or 1, args.progress)
    print(json.dumps(status, indent=1))
    if task is None:  # a local run does all the shards, then marks the directory complete
        print(json.dumps(_summary(sharded_prepare.finalize(out)), indent=1))
    return 0


def _summary(manifest: dict) -> dict:
    keys = ("complete", "documents", "tokens", "empty_rows", "skipped")
    return {**{k: manifest[k] for k in keys}, "shards": len(manifest["shards"])}


if __name__ == "__main__":
    raise SystemExit(main())
