"""Sharded preparation under an output directory: a plan, shards cut by input files or by tokens, a manifest.

``--shard-size`` is a number of input files (``8``, ``8files``) or of tokens (``500M``, ``2G``,
``100000tokens``; K/M/G/T = 10^3/10^6/10^9/10^12). Layout of ``OUT/``::

    plan.json                        the inputs split into groups, the shard size, the tokenizer identity
    shard-00000.bin/.idx/.meta.json  by files: one Megatron shard per group of N files
    shard-00003-00001.bin/...        by tokens: part 1 of input file 3 (each file is cut into parts)
    shard-00003.parts.json           by tokens: file 3 is finished, its parts and read report
    manifest.json                    written last, by :func:`finalize`, after every shard checked: complete

By tokens, every input file's documents are cut, in order, into shards of at most N tokens (EOD included):
a shard takes whole documents while they fit, a document longer than N gets a shard of its own, the last
shard of a file holds the rest. The cut depends only on the documents, so it is the same for any number of
workers or array tasks, and a file's shards never wait on another file's tokens.

The plan is written once (by the first run, or by the submitter of a Slurm array) and every later run
or array task must agree with it, so the grouping, hence the output, never depends on how many
processes or tasks did the work. Re-running skips finished shards and redoes the partial one (its stale
temporary files are removed first; by tokens, the documents of the file's finished shards are read again
but not tokenized). Task ``t`` of ``T`` builds groups ``i`` with ``i % T == t``.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterable, Iterator, List, Optional, Sequence, Union

from lmforge.data.file_lock import file_lock
from lmforge.data.formats import ReadReport, file_format, input_bytes, iter_file, list_files
from lmforge.data.indexed_shard import ShardFormatError, ensure_shard, meta_path, read_index, write_shard
from lmforge.data.tokenize_pool import tokenize_docs, worker_pool
from lmforge.data.tokenizer import Tokenizer

PLAN = "plan.json"
MANIFEST = "manifest.json"
PLAN_VERSION = 1


class PlanMismatch(ValueError):
    pass


class IncompletePrefix(ValueError):
    pass


_SCALE = {"": 1, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}


@dataclass(frozen=True)
class ShardSize:
    """``--shard-size``: ``count`` input files or tokens per shard."""

    count: int
    unit: str = "files"  # files | tokens

    @classmethod
    def parse(cls, text: str) -> "ShardSize":
        """``8`` / ``8files``: files; ``500M`` / ``2G`` / ``1.5G`` / ``100000tokens``: tokens (K/M/G/T decimal)."""
        t = text.strip()
        files = re.fullmatch(r"(\d+)(?:files?)?", t, re.IGNORECASE)
        tokens = re.fullmatch(r"(\d+(?:\.\d+)?)([KMGT]?)(tokens?)?", t, re.IGNORECASE)
        if files:
            size = cls(int(files[1]), "files")
        elif tokens and (tokens[2] or tokens[3]):
            size = cls(int(float(tokens[1]) * _SCALE[tokens[2].upper()]), "tokens")
        else:
            raise ValueError(
                f"--shard-size {text!r} is not a shard size. Fix: give input files per shard (8 or "
                "8files) or tokens per shard (500M, 2G, 100000tokens; K/M/G/T = 10^3/10^6/10^9/10^12)"
            )
        if size.count < (1 if size.unit == "files" else 2):
            raise ValueError(
                f"--shard-size {text!r} is too small. Fix: at least 1 file, or 2 tokens (a document "
                "and its end-of-document token), per shard"
            )
        return size


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
    parts = (
        [(p.relative_to(path).as_posix(), p) for p in sorted(path.rglob("*")) if p.is_file()]
        if path.is_dir()
        else [("", path)]
    )
    for name, p in parts:
        if name:
            h.update(name.encode() + b"\0")
        with open(p, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()


def make_plan(
    inputs: Sequence[str], tokenizer: Tokenizer, shard_size: Union[int, ShardSize], text_key: str, on_error: str
) -> dict:
    """The groups of input files: by files, N per shard; by tokens, one per file (cut into shards when built)."""
    size = shard_size if isinstance(shard_size, ShardSize) else ShardSize(int(shard_size))
    if size.count < 1:
        raise ValueError(f"--shard-size must be >= 1 file per shard, got {size.count}")
    if any(i.startswith("embedded:") for i in inputs):
        raise ValueError(
            "embedded: corpora are prepared as one prefix; give files, directories or globs for a "
            "sharded --out directory"
        )
    files = list_files(inputs)
    if not files:
        raise FileNotFoundError(
            f"no input files in {', '.join(inputs)}. Fix: check the paths and suffixes "
            "(.parquet, .jsonl[.gz|.zst], datasets save_to_disk dirs, text files)"
        )
    per = size.count if size.unit == "files" else 1
    groups = [files[i : i + per] for i in range(0, len(files), per)]
    plan = {
        "version": PLAN_VERSION,
        "inputs": list(inputs),
        "text_key": text_key,
        "on_error": on_error,
        "shard_files": size.count if size.unit == "files" else None,
        "tokenizer": tokenizer.identity,
        "shards": [
            {
                "name": f"shard-{i:05d}",
                "files": [{"path": str(f), "format": file_format(f), "bytes": input_bytes(f)} for f in g],
            }
            for i, g in enumerate(groups)
        ],
    }
    if size.unit == "tokens":
        plan["shard_tokens"] = size.count
    return plan


def write_or_check_plan(out: Path, plan: dict) -> dict:
    """Write OUT/plan.json, or check that the one there describes the same work."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / PLAN
    if not path.exists():
        _write_json_atomic(path, plan)
        return plan
    have = json.loads(path.read_text())
    for key in ("inputs", "text_key", "on_error", "shard_files", "shard_tokens", "tokenizer", "shards"):
        if have.get(key) != plan.get(key):
            what = {"shards": "the input files or their sizes"}.get(key, key)
            raise PlanMismatch(
                f"{path} was made for other work ({what} differ): this output directory belongs to "
                "another preparation. Fix: use another --out, or --force to start it again"
            )
    return have


def load_plan(out: Path) -> dict:
    path = out / PLAN
    if not path.exists():
        raise FileNotFoundError(
            f"{path} does not exist: {out} is not a sharded preparation. Fix: run "
            "`lmforge data prepare INPUTS --out DIR --shard-size N` first"
        )
    return json.loads(path.read_text())


def _shard_docs(files: List[dict], text_key: str, on_error: str, report: ReadReport) -> Iterator[str]:
    return itertools.chain.from_iterable(iter_file(Path(f["path"]), text_key, on_error, report) for f in files)


def part_name(group: str, part: int) -> str:
    return f"{group}-{part:05d}"


def parts_path(out: Path, group: str) -> Path:
    return out / f"{group}.parts.json"


class _TokenCut:
    """Documents' ids (without EOD) cut into consecutive parts of at most ``limit`` tokens each, EOD included:
    a part takes whole documents while they fit; a document longer than ``limit`` is a part of its own."""

    def __init__(self, token_docs: Iterable[Sequence[int]], limit: int):
        self._it, self._limit = iter(token_docs), limit
        self._next = next(self._it, None)

    def __bool__(self) -> bool:
        return self._next is not None

    def part(self) -> Iterator[Sequence[int]]:
        tokens = 0
        while self._next is not None and (tokens == 0 or tokens + len(self._next) + 1 <= self._limit):
            ids, tokens = self._next, tokens + len(self._next) + 1
            self._next = next(self._it, None)  # the next document decides whether this part is full
            yield ids


def build_shards(
    out: Path,
    plan: dict,
    tokenizer: Tokenizer,
    workers: int = 1,
    task_index: int = 0,
    num_tasks: int = 1,
    progress: bool = False,
) -> Dict[str, str]:
    """Build this task's groups that are not finished yet; returns group name -> "built" | "done before"."""
    if not 0 <= task_index < num_tasks:
        raise ValueError(f"task index {task_index} is outside 0..{num_tasks - 1}")
    mine = [s for i, s in enumerate(plan["shards"]) if i % num_tasks == task_index]
    build = _build_token_group if plan.get("shard_tokens") else _build_file_group
    status: Dict[str, str] = {}
    with worker_pool(tokenizer, workers) as pool:
        for group in mine:
            status[group["name"]] = build(out, plan, group, tokenizer, workers, progress, pool)
    return status


def _read_group(
    plan: dict, group: dict, tokenizer: Tokenizer, workers: int, progress: bool, pool, skip_documents: int = 0
):
    """(token ids of the group's documents after the first ``skip_documents``, read report, stats, inputs)."""
    inputs = [{**f, "sha256": file_sha256(Path(f["path"]))} for f in group["files"]]
    report = ReadReport()
    stats: dict = {}
    docs = _shard_docs(group["files"], plan["text_key"], plan["on_error"], report)
    if skip_documents:  # read again (cheap), not tokenized again
        docs = itertools.islice(docs, skip_documents, None)
    ids = tokenize_docs(docs, tokenizer, workers, progress, sum(f["bytes"] for f in group["files"]), stats, pool=pool)
    return ids, report, stats, inputs


def _build_file_group(
    out: Path, plan: dict, group: dict, tokenizer: Tokenizer, workers: int, progress: bool, pool
) -> str:
    prefix = out / group["name"]
    if meta_path(prefix).exists():
        return "done before"

    def build() -> dict:
        for stale in out.glob(f"{group['name']}.tmp*"):  # a killed build's partial files
            stale.unlink()
        ids, report, stats, inputs = _read_group(plan, group, tokenizer, workers, progress, pool)

        def extra() -> dict:  # called by write_shard after the documents were read
            for line in report.empty_lines(plan["text_key"]):
                print(line, file=sys.stderr, flush=True)
            return {"workers": workers, "inputs": inputs, "files": report.as_json()}

        return write_shard(prefix, ids, tokenizer, ",".join(f["path"] for f in group["files"]), extra, stats)

    ensure_shard(prefix, build)
    return "built"


def _build_token_group(
    out: Path, plan: dict, group: dict, tokenizer: Tokenizer, workers: int, progress: bool, pool
) -> str:
    """Cut the group's documents into shards of at most ``plan["shard_tokens"]`` tokens; finished ones are kept."""
    name, marker = group["name"], parts_path(out, group["name"])
    if marker.exists():
        return "done before"
    with file_lock(out / f"{name}.lock"):
        if marker.exists():
            return "done before"
        done: List[dict] = []  # the finished parts, in order (a sidecar is renamed into place last)
        while meta_path(out / part_name(name, len(done))).exists():
            done.append(json.loads(meta_path(out / part_name(name, len(done))).read_text()))
        for stale in out.glob(f"{name}-*"):  # the killed part's temporary (or renamed, sidecar-less) files
            m = re.fullmatch(rf"{re.escape(name)}-(\d+)\..*", stale.name)
            if m and int(m[1]) >= len(done):
                stale.unlink()
        for stale in out.glob(f"{marker.name}.tmp*"):  # killed while writing the marker
            stale.unlink()
        first = sum(m["documents"] for m in done)
        ids, report, _, inputs = _read_group(plan, group, tokenizer, workers, progress, pool, first)
        cut = _TokenCut(ids, plan["shard_tokens"])
        source = ",".join(f["path"] for f in group["files"])
        while cut:
            part = len(done)
            meta = write_shard(
                out / part_name(name, part),
                cut.part(),
                tokenizer,
                source,
                {"workers": workers, "group": name, "part": part, "first_document": first},
            )
            done.append(meta)
            first += meta["documents"]
        for line in report.empty_lines(plan["text_key"]):
            print(line, file=sys.stderr, flush=True)
        if not done:
            raise ValueError(
                f"no documents to write for {out / name} (inputs: {source}): every input was empty. "
                "Fix: check the input paths, the text field (--text-key), and the file suffixes"
            )
        _write_json_atomic(
            marker,
            {
                "parts": [part_name(name, k) for k in range(len(done))],
                "documents": first,
                "inputs": inputs,
                "files": report.as_json(),
            },
        )
    return "built"


def _check_shard(out: Path, plan: dict, name: str) -> tuple:
    """(sidecar, index, problem) of one shard; problem is None when its files agree with its sidecar."""
    prefix = out / name
    meta = json.loads(meta_path(prefix).read_text())
    try:
        index = read_index(Path(f"{prefix}.idx"))
    except (OSError, ShardFormatError) as e:
        return meta, None, f"{name}: {e}"
    bin_bytes = os.path.getsize(f"{prefix}.bin") if Path(f"{prefix}.bin").exists() else -1
    if (index.num_documents, index.num_tokens, bin_bytes) != (meta["documents"], meta["tokens"], meta["bin_bytes"]):
        return (
            meta,
            index,
            (
                f"{name}: .bin/.idx hold {index.num_documents} documents, {index.num_tokens} tokens, "
                f"{bin_bytes} bytes; its sidecar recorded {meta['documents']}, {meta['tokens']}, "
                f"{meta['bin_bytes']}"
            ),
        )
    if meta["tokenizer"] != plan["tokenizer"]:
        return (
            meta,
            index,
            (
                f"{name}: tokenized with fingerprint {meta['tokenizer'].get('fingerprint')}, the "
                f"plan's tokenizer is {plan['tokenizer'].get('fingerprint')}"
            ),
        )
    return meta, index, None


def _shard_entry(name: str, meta: dict, inputs: List[str], **more) -> dict:
    return {
        "name": name,
        "documents": meta["documents"],
        "tokens": meta["tokens"],
        "bin_bytes": meta["bin_bytes"],
        "dtype": meta["dtype"],
        "max_token_id": meta["max_token_id"],
        **more,
        "inputs": inputs,
    }


def _check_cut(name: str, metas: List[dict], indexes: list, limit: int) -> Optional[str]:
    """The parts are the cut :class:`_TokenCut` makes: each within ``limit`` (or one document), each full."""
    for k, (meta, _index) in enumerate(zip(metas, indexes)):
        if meta["tokens"] > limit and meta["documents"] != 1:
            return (
                f"{part_name(name, k)}: {meta['tokens']} tokens in {meta['documents']} documents, over the "
                f"shard size {limit}"
            )
        following = int(indexes[k + 1].lengths[0]) if k + 1 < len(indexes) else None
        if following is not None and meta["tokens"] + following <= limit:
            return (
                f"{part_name(name, k)}: {meta['tokens']} tokens, the next document ({following} tokens) would "
                f"have fit in the shard size {limit}"
            )
    return None


def finalize(out: Path) -> dict:
    """Check every planned shard against its sidecar and index, then write OUT/manifest.json (complete)."""
    plan = load_plan(out)
    limit = plan.get("shard_tokens")
    missing, bad, shards = [], [], []
    inputs, skipped = [], []
    empty_rows = 0
    for group in plan["shards"]:
        gname, paths = group["name"], [f["path"] for f in group["files"]]
        if limit:
            if not parts_path(out, gname).exists():
                missing.append(gname)
                continue
            record = json.loads(parts_path(out, gname).read_text())
            names = record["parts"]
        else:
            if not meta_path(out / gname).exists():
                missing.append(gname)
                continue
            record, names = None, [gname]
        checked = [(n, *_check_shard(out, plan, n)) for n in names if meta_path(out / n).exists()]
        problems = [p for _, _, _, p in checked if p] or [
            f"{n}: its sidecar is missing" for n in names if not meta_path(out / n).exists()
        ]
        if not problems and limit:
            cut = _check_cut(gname, [m for _, m, _, _ in checked], [i for _, _, i, _ in checked], limit)
            problems += [cut] if cut else []
            if sum(m["documents"] for _, m, _, _ in checked) != record["documents"]:
                problems.append(
                    f"{gname}: its parts hold {sum(m['documents'] for _, m, _, _ in checked)} documents, "
                    f"{parts_path(out, gname).name} recorded {record['documents']}"
                )
        if problems:
            bad += problems
            continue
        record = record or checked[0][1]  # by files the shard's sidecar holds the inputs and the read report
        files = record.get("files", {})
        for f in record["inputs"]:
            inputs.append({k: f[k] for k in ("path", "format", "bytes", "sha256")})
        group_empty = sum(r["empty_rows"] for r in files.values())
        empty_rows += group_empty
        skipped += [s for r in files.values() for s in r["skipped"]]
        for n, meta, _, _ in checked:
            more = {"first_document": meta["first_document"]} if limit else {"empty_rows": group_empty}
            shards.append(_shard_entry(n, meta, paths, **more))
    if missing or bad:
        what = "input file(s) not fully prepared" if limit else "shard(s) not built"
        lines = (
            [
                f"{len(missing)} of {len(plan['shards'])} {what}: {', '.join(missing[:8])}"
                + (" ..." if len(missing) > 8 else "")
            ]
            if missing
            else []
        ) + bad
        raise IncompletePrefix(
            f"{out} is not complete: {'; '.join(lines)}. Fix: run the same `lmforge data "
            "prepare` again (finished shards are kept), then finalize"
        )
    manifest = {
        "complete": True,
        "version": PLAN_VERSION,
        "tokenizer": plan["tokenizer"],
        "text_key": plan["text_key"],
        "on_error": plan["on_error"],
        "inputs": inputs,
        "shards": shards,
        "documents": sum(s["documents"] for s in shards),
        "tokens": sum(s["tokens"] for s in shards),
        "empty_rows": empty_rows,
        "skipped": skipped,
    }
    if limit:
        manifest["shard_tokens"] = limit
    _write_json_atomic(out / MANIFEST, manifest)
    return manifest


def read_manifest(out: Path) -> Optional[dict]:
    path = out / MANIFEST
    if not path.exists():
        return None
    manifest = json.loads(path.read_text())
    return manifest if manifest.get("complete") else None
