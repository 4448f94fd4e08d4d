"""Sharded preparation under an output directory: a plan, one shard per input group, a manifest; resumable.

Layout of ``OUT/``::

    plan.json                      inputs split into groups of --shard-size files; tokenizer identity
    shard-00000.bin/.idx/.meta.json one Megatron shard per group (sidecar renamed last: no sidecar = partial)
    manifest.json                  written last, by :func:`finalize`, after every shard checked: complete

The plan is written once (by the first run, or by the submitter of a Slurm array) and every later run
or array task must agree with it, so the grouping, hence the output, never depends on how many
processes or tasks did the work. Re-running skips shards with a sidecar and redoes the others (their
stale temporary files are removed first). Task ``t`` of ``T`` builds shards ``i`` with ``i % T == t``.
"""
from __future__ import annotations

import hashlib
import itertools
import json
import os
import sys
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Sequence

from lmforge.data.formats import ReadReport, file_format, input_bytes, iter_file, list_files
from lmforge.data.shards import ShardFormatError, ensure_shard, meta_path, read_index, write_shard
from lmforge.data.tokenizer import Tokenizer

PLAN = "plan.json"
MANIFEST = "manifest.json"
PLAN_VERSION = 1


class PlanMismatch(ValueError):
    pass


class IncompletePrefix(ValueError):
    pass


def _write_json_atomic(path: Path, obj: dict) -> None:
    tmp = Path(f"{path}.tmp{os.getpid()}")
    with open(tmp, "w") as fh:
        fh.write(json.dumps(obj, indent=1, sort_keys=True) + "\n")
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def file_sha256(path: Path) -> str:
    """sha256 of a file, or of an HF dataset directory's files (relative names and contents, sorted)."""
    h = hashlib.sha256()
    parts = [(p.relative_to(path).as_posix(), p) for p in sorted(path.rglob("*")) if p.is_file()] \
        if path.is_dir() else [("", path)]
    for name, p in parts:
        if name:
            h.update(name.encode() + b"\0")
        with open(p, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()


def make_plan(inputs: Sequence[str], tokenizer: Tokenizer, shard_files: int, text_key: str, on_error: str) -> dict:
    if shard_files < 1:
        raise ValueError(f"--shard-size must be >= 1 file per shard, got {shard_files}")
    if any(i.startswith("embedded:") for i in inputs):
        raise ValueError("embedded: corpora are prepared as one prefix; give files, directories or globs for a "
                         "sharded --out directory")
    files = list_files(inputs)
    if not files:
        raise FileNotFoundError(f"no input files in {', '.join(inputs)}. Fix: check the paths and suffixes "
                                "(.parquet, .jsonl[.gz|.zst], datasets save_to_disk dirs, text files)")
    groups = [files[i:i + shard_files] for i in range(0, len(files), shard_files)]
    return {"version": PLAN_VERSION, "inputs": list(inputs), "text_key": text_key, "on_error": on_error,
            "shard_files": shard_files, "tokenizer": tokenizer.identity,
            "shards": [{"name": f"shard-{i:05d}",
                        "files": [{"path": str(f), "format": file_format(f), "bytes": input_bytes(f)} for f in g]}
                       for i, g in enumerate(groups)]}


def write_or_check_plan(out: Path, plan: dict) -> dict:
    """Write OUT/plan.json, or check that the one there describes the same work."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / PLAN
    if not path.exists():
        _write_json_atomic(path, plan)
        return plan
    have = json.loads(path.read_text())
    for key in ("inputs", "text_key", "on_error", "shard_files", "tokenizer", "shards"):
        if have.get(key) != plan.get(key):
            what = {"shards": "the input files or their sizes"}.get(key, key)
            raise PlanMismatch(f"{path} was made for other work ({what} differ): this output directory belongs to "
                               "another preparation. Fix: use another --out, or --force to start it again")
    return have


def load_plan(out: Path) -> dict:
    path = out / PLAN
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist: {out} is not a sharded preparation. Fix: run "
                                "`lmforge data prepare INPUTS --out DIR --shard-size N` first")
    return json.loads(path.read_text())


def _shard_docs(files: List[dict], text_key: str, on_error: str, report: ReadReport) -> Iterator[str]:
    return itertools.chain.from_iterable(iter_file(Path(f["path"]), text_key, on_error, report) for f in files)


def build_shards(out: Path, plan: dict, tokenizer: Tokenizer, workers: int = 1, task_index: int = 0,
                 num_tasks: int = 1, progress: bool = False) -> Dict[str, str]:
    """Build this task's shards that are not finished yet; returns name -> "built" | "done before"."""
    from lmforge.data.prepare import tokenize_docs, worker_pool

    if not 0 <= task_index < num_tasks:
        raise ValueError(f"task index {task_index} is outside 0..{num_tasks - 1}")
    mine = [s for i, s in enumerate(plan["shards"]) if i % num_tasks == task_index]
    status: Dict[str, str] = {}
    with worker_pool(tokenizer, workers) as pool:
        for shard in mine:
            prefix = out / shard["name"]
            if meta_path(prefix).exists():
                status[shard["name"]] = "done before"
                continue

            def build(shard=shard, prefix=prefix) -> dict:
                for stale in out.glob(f"{shard['name']}.tmp*"):  # a killed build's partial files
                    stale.unlink()
                inputs = [{**f, "sha256": file_sha256(Path(f["path"]))} for f in shard["files"]]
                report = ReadReport()
                stats: dict = {}
                docs = tokenize_docs(_shard_docs(shard["files"], plan["text_key"], plan["on_error"], report),
                                     tokenizer, workers, progress, sum(f["bytes"] for f in shard["files"]), stats,
                                     pool=pool)
                def extra() -> dict:  # called by write_shard after the documents were read
                    for line in report.empty_lines(plan["text_key"]):
                        print(line, file=sys.stderr, flush=True)
                    return {"workers": workers, "inputs": inputs, "files": report.as_json()}

                source = ",".join(f["path"] for f in shard["files"])
                return write_shard(prefix, docs, tokenizer, source, extra, stats)

            ensure_shard(prefix, build)
            status[shard["name"]] = "built"
    return status


def finalize(out: Path) -> dict:
    """Check every planned shard against its sidecar and index, then write OUT/manifest.json (complete)."""
    plan = load_plan(out)
    missing, bad, shards = [], [], []
    inputs, skipped = [], []
    for shard in plan["shards"]:
        prefix = out / shard["name"]
        if not meta_path(prefix).exists():
            missing.append(shard["name"])
            continue
        meta = json.loads(meta_path(prefix).read_text())
        try:
            index = read_index(Path(f"{prefix}.idx"))
        except (OSError, ShardFormatError) as e:
            bad.append(f"{shard['name']}: {e}")
            continue
        bin_bytes = os.path.getsize(f"{prefix}.bin") if Path(f"{prefix}.bin").exists() else -1
        if (index.num_documents, index.num_tokens, bin_bytes) != (meta["documents"], meta["tokens"],
                                                                   meta["bin_bytes"]):
            bad.append(f"{shard['name']}: .bin/.idx hold {index.num_documents} documents, {index.num_tokens} "
                       f"tokens, {bin_bytes} bytes; its sidecar recorded {meta['documents']}, {meta['tokens']}, "
                       f"{meta['bin_bytes']}")
            continue
        if meta["tokenizer"] != plan["tokenizer"]:
            bad.append(f"{shard['name']}: tokenized with fingerprint {meta['tokenizer'].get('fingerprint')}, the "
                       f"plan's tokenizer is {plan['tokenizer'].get('fingerprint')}")
            continue
        files = meta.get("files", {})
        for f in meta["inputs"]:
            inputs.append({k: f[k] for k in ("path", "format", "bytes", "sha256")})
        empty = sum(r["empty_rows"] for r in files.values())
        skipped += [s for r in files.values() for s in r["skipped"]]
        shards.append({"name": shard["name"], "documents": meta["documents"], "tokens": meta["tokens"],
                       "bin_bytes": meta["bin_bytes"], "dtype": meta["dtype"], "max_token_id": meta["max_token_id"],
                       "empty_rows": empty, "inputs": [f["path"] for f in shard["files"]]})
    if missing or bad:
        lines = ([f"{len(missing)} of {len(plan['shards'])} shard(s) not built: {', '.join(missing[:8])}"
                  + (" ..." if len(missing) > 8 else "")] if missing else []) + bad
        raise IncompletePrefix(f"{out} is not complete: {'; '.join(lines)}. Fix: run the same `lmforge data "
                               "prepare` again (finished shards are kept), then finalize")
    manifest = {"complete": True, "version": PLAN_VERSION, "tokenizer": plan["tokenizer"],
                "text_key": plan["text_key"], "on_error": plan["on_error"], "inputs": inputs, "shards": shards,
                "documents": sum(s["documents"] for s in shards), "tokens": sum(s["tokens"] for s in shards),
                "empty_rows": sum(s["empty_rows"] for s in shards), "skipped": skipped}
    _write_json_atomic(out / MANIFEST, manifest)
    return manifest


def read_manifest(out: Path) -> Optional[dict]:
    path = out / MANIFEST
    if not path.exists():
        return None
    manifest = json.loads(path.read_text())
    return manifest if manifest.get("complete") else None
