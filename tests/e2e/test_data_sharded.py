"""Sharded preparation: one shard per input group under a directory, a manifest, resume after kill -9.

The killed run is a real subprocess, killed with SIGKILL while it writes its third shard; re-running keeps
the two finished shards untouched (same inode and mtime), redoes the partial one, and the whole directory
(.bin, .idx, manifest.json) is byte-identical to an uninterrupted run with another worker count.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from lmforge.data.embedded import iter_documents
from lmforge.data.indexed_shard import read_index
from lmforge.data.prepare import main as prepare_main
from lmforge.data.tokenizer import load_tokenizer

REPO = Path(__file__).resolve().parents[2]
FILES, PER_SHARD = 8, 2
DOCS = [8, 8, 24, 8]  # documents per shard


def kill_9_while_writing(out: Path, shard: str, argv: list, env: dict) -> None:
    """Run ``lmforge data prepare ARGV`` (tests/e2e/pausing_prepare.py) and ``kill -9`` it while it writes ``shard``,
    after the shard's first document went into its temporary file (and every earlier shard was finished)."""
    ready = out.parent / f"{out.name}.writing"
    proc = subprocess.Popen(
        [sys.executable, str(Path(__file__).with_name("pausing_prepare.py")), shard, str(ready), *argv],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    deadline = time.monotonic() + 240
    try:
        while time.monotonic() < deadline and proc.poll() is None and not ready.exists():
            time.sleep(0.01)
        assert ready.exists() and proc.poll() is None, f"prepare did not reach {shard}: {proc.stderr.read().decode()}"
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait(30)
        ready.unlink(missing_ok=True)
    assert list(out.glob(f"{shard}.tmp*.bin")), f"no temporary file of {shard} was left by the kill"


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """8 JSONL files of real chapters, every other one with an empty row; the third shard's two files hold 12
    chapters each (the others 4), so the kill lands while it is being written, not between shards."""
    root = tmp_path_factory.mktemp("sharded-in")
    docs = iter(iter_documents("books"))
    for i in range(FILES):
        rows = [{"text": next(docs)} for _ in range(DOCS[i // PER_SHARD] // PER_SHARD)]
        rows += [{"text": ""}] if i % 2 else []
        (root / f"part-{i:03d}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root


def outputs(out: Path):
    return {
        p.name: p.read_bytes()
        for p in sorted(out.iterdir())
        if p.suffix in (".bin", ".idx") or p.name == "manifest.json"
    }


@pytest.fixture(scope="module")
def reference(inputs, data_cache, tmp_path_factory):
    """The uninterrupted preparation (2 worker processes) every other output is compared with."""
    ref = tmp_path_factory.mktemp("sharded") / "ref"
    assert (
        prepare_main(
            [
                str(inputs),
                "--shard-size",
                f"{PER_SHARD}files",
                "--cache-dir",
                str(data_cache),
                "--out",
                str(ref),
                "--workers",
                "2",
            ]
        )
        == 0
    )
    return ref


def test_shards_manifest_and_resume_after_kill_9_are_byte_identical(tmp_path, inputs, reference, data_cache, capsys):
    tok = load_tokenizer("embedded", data_cache)
    ref = reference
    args = [str(inputs), "--shard-size", f"{PER_SHARD}files", "--cache-dir", str(data_cache)]
    manifest = json.loads((ref / "manifest.json").read_text())
    assert manifest["complete"] is True and [s["name"] for s in manifest["shards"]] == [
        f"shard-{i:05d}" for i in range(FILES // PER_SHARD)
    ]
    assert manifest["tokenizer"] == tok.identity and manifest["empty_rows"] == FILES // 2
    assert [s["inputs"] for s in manifest["shards"]][1] == [
        str(inputs / "part-002.jsonl"),
        str(inputs / "part-003.jsonl"),
    ]
    for s in manifest["shards"]:
        index = read_index(ref / f"{s['name']}.idx")
        assert (s["documents"], s["tokens"]) == (index.num_documents, index.num_tokens)
    assert [s["documents"] for s in manifest["shards"]] == DOCS
    import hashlib

    first = manifest["inputs"][0]
    assert first["bytes"] == (inputs / "part-000.jsonl").stat().st_size and first["format"] == "jsonl"
    assert first["sha256"] == hashlib.sha256((inputs / "part-000.jsonl").read_bytes()).hexdigest()
    assert manifest["tokens"] == sum(s["tokens"] for s in manifest["shards"])

    # kill -9 while the third shard is being written.
    out = tmp_path / "killed"
    env = {**os.environ, "PYTHONPATH": str(REPO / "platform")}
    kill_9_while_writing(out, "shard-00002", [*args, "--out", str(out), "--workers", "1"], env)
    assert not (out / "shard-00002.meta.json").exists() and not (out / "manifest.json").exists()
    finished = {n: os.stat(out / n) for n in ("shard-00000.bin", "shard-00000.idx", "shard-00001.bin")}
    # The incomplete directory is refused by the final check, with what is missing.
    assert prepare_main(["--finalize", "--out", str(out)]) == 2
    assert (
        f"lmforge data prepare: {out} is not complete: 2 of 4 shard(s) not built: shard-00002, shard-00003. Fix: "
        "run the same `lmforge data prepare` again" in capsys.readouterr().err
    )
    # Another plan over the same directory is refused (it would mix two preparations).
    assert prepare_main([str(inputs), "--shard-size", "3", "--cache-dir", str(data_cache), "--out", str(out)]) == 2
    assert f"{out / 'plan.json'} was made for other work (shard_files differ)" in capsys.readouterr().err

    capsys.readouterr()
    assert prepare_main([*args, "--out", str(out), "--workers", "1"]) == 0
    captured = capsys.readouterr()
    status = json.loads(captured.out.split("\n}\n")[0] + "\n}")
    # The redone shards announce their empty rows (parts 5 and 7 each hold one).
    assert (
        f"data prepare: {inputs / 'part-005.jsonl'}: 1 row(s) with no or empty 'text' (counted, not written)"
        in captured.err
    )
    assert status == {
        "shard-00000": "done before",
        "shard-00001": "done before",
        "shard-00002": "built",
        "shard-00003": "built",
    }
    for name, st in finished.items():  # untouched: same file, same mtime
        now = os.stat(out / name)
        assert (now.st_ino, now.st_mtime_ns) == (st.st_ino, st.st_mtime_ns), name
    assert not list(out.glob("*.tmp*")), "the killed build's partial files are removed"
    assert outputs(out) == outputs(ref)  # byte-identical .bin/.idx/manifest.json
    # Negative control: the comparison sees a one-byte change.
    changed = outputs(out)
    changed["shard-00003.bin"] = changed["shard-00003.bin"][:-1] + bytes([changed["shard-00003.bin"][-1] ^ 1])
    assert changed != outputs(ref)


def test_a_many_shard_source_is_blended_by_tokens_and_a_training_run_reports_its_tokens(
    tmp_path, reference, data_cache
):
    from data_support import ensure_world

    from lmforge.config.data import DataConfig, DataSourceConfig
    from lmforge.config.errors import ConfigError
    from lmforge.data.mixture import build_mixture

    ensure_world()
    tok = load_tokenizer("embedded", data_cache)
    manifest = json.loads((reference / "manifest.json").read_text())
    cfg = DataConfig(
        sources={"books": DataSourceConfig("embedded:books", 0.4), "many": DataSourceConfig(str(reference), 0.6)},
        tokenizer="embedded",
        cache_dir=str(data_cache),
        valid_fraction=0.25,
    )
    mix = build_mixture(
        cfg, tok, seq_len=64, seed=1234, num_train_samples=4000, num_valid_samples=8, cache_dir=data_cache
    )
    assert mix.sources == ["books", "many"] and len(mix.train.datasets) == 1 + len(manifest["shards"])
    counts = np.bincount(np.asarray(mix.train.dataset_index), minlength=1 + len(manifest["shards"])) / 4000
    total = manifest["tokens"]
    for k, shard in enumerate(manifest["shards"], start=1):  # each shard's share: 0.6 x its share of the tokens
        assert abs(counts[k] - 0.6 * shard["tokens"] / total) < 0.01, (shard["name"], counts)
    ids = [mix.train_text(i)[1] for i in range(400)]
    assert set(ids) == {0, 1} and abs(ids.count(1) / 400 - 0.6) < 0.08  # shard ids map back to the source
    # A directory whose preparation did not finish is refused.
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "plan.json").write_text("{}")
    cfg.sources["many"] = DataSourceConfig(str(tmp_path / "half"), 0.6)
    with pytest.raises(
        ConfigError,
        match=r"data\.sources\.many\.path.*is a directory, but its preparation has not "
        r"finished \(plan\.json but no complete manifest\.json\)",
    ):
        build_mixture(
            cfg, tok, seq_len=64, seed=1234, num_train_samples=4000, num_valid_samples=8, cache_dir=data_cache
        )

    # A tiny training run over it reports tokens per source at every logged step.
    cmd = [
        sys.executable,
        "-m",
        "lmforge.train",
        f"run.root={tmp_path}",
        "run.name=many",
        "model=tiny",
        "train.max_steps=3",
        "train.micro_batch_size=4",
        "train.global_batch_size=4",
        "train.eval_every=0",
        "train.threads=1",
        "train.device=cpu",
        "logging.every_steps=1",
        "logging.console=plain",
        "checkpoint.every_steps=0",
        "data.valid_fraction=0.25",
        "data.sources.books.weight=0.4",
        "data.sources.reference.weight=0",
        f"data.sources.code.path={reference}",
        "data.sources.code.weight=0.6",
    ]
    # (source 'code' of the default preset, pointed at the shard directory)
    env = {**os.environ, "PYTHONPATH": str(REPO / "platform"), "LMFORGE_DATA_CACHE": str(data_cache)}
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    train = [
        r
        for r in map(json.loads, (tmp_path / "many" / "metrics.jsonl").read_text().splitlines())
        if r.get("kind") == "train"
    ]
    assert [r["step"] for r in train] == [1, 2, 3]
    last = train[-1]
    assert last["tokens/books"] + last["tokens/code"] == last["tokens_seen"] == 3 * 4 * 64
    assert last["tokens/code"] > 0 and last["tokens/books"] > 0 and last.get("tokens/reference", 0) == 0


TOKENS = 8000  # --shard-size 8K: the big files (4, 5) cut into several shards; file 5 opens with a 9158-token document


def test_shards_cut_by_tokens_are_exact_deterministic_split_across_tasks_and_resume_after_kill_9(
    tmp_path, inputs, data_cache, capsys
):
    tok = load_tokenizer("embedded", data_cache)
    args = [str(inputs), "--shard-size", "8K", "--cache-dir", str(data_cache)]
    ref = tmp_path / "ref"
    assert prepare_main([*args, "--out", str(ref), "--workers", "2"]) == 0
    manifest = json.loads((ref / "manifest.json").read_text())
    assert manifest["complete"] is True and manifest["shard_tokens"] == TOKENS and manifest["empty_rows"] == FILES // 2
    # The cut: per input file, its documents' ids (each + EOD) in order, split greedily at TOKENS.
    want = []
    for i, path in enumerate(sorted(inputs.glob("*.jsonl"))):
        docs = [json.loads(line)["text"] for line in path.read_text().splitlines()]
        parts, part = [], []
        for ids in (tok.encode(d) + [tok.eod] for d in docs if d):
            if part and sum(map(len, part)) + len(ids) > TOKENS:
                parts.append(part)
                part = []
            part.append(ids)
        want += [(f"shard-{i:05d}-{k:05d}", p, str(path)) for k, p in enumerate(parts + [part])]
    assert [s["name"] for s in manifest["shards"]] == [n for n, _, _ in want]
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    for s, (name, part, path) in zip(manifest["shards"], want):
        ds = IndexedDataset(str(ref / name))
        assert [np.asarray(ds[j]).tolist() for j in range(len(ds))] == part, name  # exact ids, exact cut
        assert (s["documents"], s["tokens"], s["inputs"]) == (len(part), sum(map(len, part)), [path])
        assert s["tokens"] <= TOKENS or s["documents"] == 1
    assert max(s["tokens"] for s in manifest["shards"]) > TOKENS  # the one-document shard over the limit
    assert len([s for s in manifest["shards"] if s["name"].startswith("shard-00004-")]) >= 3

    # Two tasks by hand (as a Slurm array runs them, from the plan), then the final check: byte-identical.
    split = tmp_path / "split"
    assert prepare_main([*args, "--out", str(split), "--task-index", "1", "--num-tasks", "2", "--workers", "1"]) == 0
    assert (
        prepare_main(
            [
                "--out",
                str(split),
                "--task-index",
                "0",
                "--num-tasks",
                "2",
                "--cache-dir",
                str(data_cache),
                "--workers",
                "1",
            ]
        )
        == 0
    )
    assert prepare_main(["--finalize", "--out", str(split)]) == 0
    assert outputs(split) == outputs(ref)

    # kill -9 while a file's middle shard is being written (an earlier shard of the same file finished).
    parts = {}
    for s in manifest["shards"]:
        parts.setdefault(s["name"][:-6], []).append(s["name"])
    middle = {n for names in parts.values() for n in names[1:-1]}
    assert middle, parts
    out = tmp_path / "killed"
    env = {**os.environ, "PYTHONPATH": str(REPO / "platform")}
    kill_9_while_writing(out, min(middle), [*args, "--out", str(out), "--workers", "1"], env)
    assert not (out / "manifest.json").exists()
    finished = {p.name: os.stat(p) for p in out.glob("shard-*-*.bin") if (out / f"{p.name[:-4]}.meta.json").exists()}
    partial = [g for g in parts if not (out / f"{g}.parts.json").exists() and any(n.startswith(g) for n in finished)]
    assert len(partial) == 1, (partial, sorted(finished))  # one file left half done: its finished shards are kept
    assert prepare_main(["--finalize", "--out", str(out)]) == 2
    assert f"lmforge data prepare: {out} is not complete: " in capsys.readouterr().err
    # Another shard size over the same directory is refused.
    assert (
        prepare_main([str(inputs), "--shard-size", "9000tokens", "--cache-dir", str(data_cache), "--out", str(out)])
        == 2
    )
    assert f"{out / 'plan.json'} was made for other work (shard_tokens differ)" in capsys.readouterr().err
    assert prepare_main([*args, "--out", str(out), "--workers", "1"]) == 0
    status = json.loads(capsys.readouterr().out.split("\n}\n")[0] + "\n}")
    assert status[partial[0]] == "built"
    assert [g for g, st in status.items() if st == "done before"] == [g for g in parts if g < partial[0]]
    for name, st in finished.items():  # untouched: same file, same mtime
        now = os.stat(out / name)
        assert (now.st_ino, now.st_mtime_ns) == (st.st_ino, st.st_mtime_ns), name
    assert not list(out.glob("*.tmp*")), "the killed build's partial files are removed"
    assert outputs(out) == outputs(ref)  # byte-identical .bin/.idx/manifest.json

    # The final check verifies the cut: a shard size the shards were not cut at is refused (negative control).
    plan = json.loads((out / "plan.json").read_text())
    (out / "plan.json").write_text(json.dumps({**plan, "shard_tokens": 2 * TOKENS}))
    assert prepare_main(["--finalize", "--out", str(out)]) == 2
    assert re.search(
        r"shard-00001-00000: 7668 tokens, the next document \(2768 tokens\) would have fit in the shard "
        r"size 16000",
        capsys.readouterr().err,
    )
    # A bad --shard-size fails in one line, exit 2.
    for bad, why in (("5X", "is not a shard size"), ("0", "is too small")):
        assert prepare_main([str(inputs), "--out", str(tmp_path / "bad"), "--shard-size", bad]) == 2
        assert capsys.readouterr().err.splitlines() == [
            f"lmforge data prepare: --shard-size '{bad}' {why}. Fix: "
            + (
                "give input files per shard (8 or 8files) or tokens per shard (500M, 2G, 100000tokens; K/M/G/T = "
                "10^3/10^6/10^9/10^12)"
                if bad == "5X"
                else "at least 1 file, or 2 tokens (a document and its end-of-document token), per shard"
            )
        ]
    assert not (tmp_path / "bad").exists()
