"""The first hour's output: a first start says what it builds, a refused start leaves no directory, a run with
process saves prints no INFO lines, and every file a run writes follows the mode policy (runtime/file_modes.py).

Two launches of `lmforge train` share the refusal checks (the README's gpt_125m line on a fresh data cache, then
the same line against a run directory that was there before); one tiny run with checkpoint.async_mode=process
carries the output and mode checks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import List

import pytest
from file_modes_check import umask, wrong_modes

REFUSAL = "lmforge: config key 'data.max_epochs': the run plans 5,242,880,000 tokens, which would read source "
NOTICE = "(first use; cached for later runs in "


def lmforge_train(args: List[str], cache: Path, cwd: Path, timeout: int = 240) -> subprocess.CompletedProcess:
    env = {**os.environ, "LMFORGE_DATA_CACHE": str(cache)}
    env.pop("LMFORGE_RUN_DIR", None)
    return subprocess.run(
        [sys.executable, "-m", "lmforge.cli", "train", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def why(proc) -> str:
    return f"exit {proc.returncode}\n{proc.stdout[-2500:]}\n--- stderr ---\n{proc.stderr[-4000:]}"


@pytest.mark.timeout(400)
def test_the_readme_gpt_125m_line_on_a_fresh_clone_says_what_it_builds_and_leaves_no_run_directory(tmp_path):
    from lmforge.data.embedded import VERSION

    cache, root = tmp_path / "cache", tmp_path / "runs"
    proc = lmforge_train(["+exp=gpt_125m", "run.name=my-run", f"run.root={root}"], cache, tmp_path)
    assert proc.returncode == 2, why(proc)
    shards = {
        c: next((cache / "shards").glob(f"embedded-{c}-v{VERSION}-*.bin")) for c in ("books", "code", "reference")
    }
    tokenizer = cache / "tokenizers" / f"embedded-bpe-8192-v{VERSION}.json"
    lines = proc.stderr.splitlines()
    assert lines[:4] == [
        f"lmforge: training the embedded tokenizer, a byte-level BPE of 8192 tokens {NOTICE}{tokenizer})",
        *(f"lmforge: tokenizing the embedded corpus {c} {NOTICE}{shards[c]})" for c in ("books", "code", "reference")),
    ], why(proc)
    assert len(lines) == 5 and lines[4].startswith(REFUSAL) and "`lmforge data prepare`" in lines[4], why(proc)
    assert proc.stdout == "", why(proc)
    assert not root.exists(), sorted(str(p) for p in root.rglob("*"))  # neither runs/my-run nor the runs/ it made

    # Negative control: a run directory that was there keeps every file; the warm cache builds nothing, says nothing.
    kept = root / "kept"
    (kept / "checkpoints" / "step-00000010").mkdir(parents=True)
    (kept / "checkpoints" / "step-00000010" / "COMPLETE").write_text("10")
    (kept / "notes.txt").write_text("mine")
    again = lmforge_train(["+exp=gpt_125m", "run.name=kept", f"run.root={root}"], cache, tmp_path)
    assert again.returncode == 2 and len(again.stderr.splitlines()) == 1, why(again)
    assert again.stderr.startswith(REFUSAL) and again.stdout == "", why(again)
    assert (kept / "notes.txt").read_text() == "mine"
    assert (kept / "checkpoints" / "step-00000010" / "COMPLETE").read_text() == "10"
    assert json.loads((kept / "verdicts" / "rank0.json").read_text())["kind"] == "data_error"


@pytest.mark.timeout(400)
def test_process_saves_print_no_info_lines_and_every_run_file_follows_the_mode_policy(tmp_path, data_cache):
    args = [
        "model=tiny",
        "train.max_steps=4",
        "train.eval_every=0",
        "checkpoint.every_steps=2",
        "checkpoint.async_mode=process",
        "logging.console=plain",
        f"run.root={tmp_path}",
        "run.name=ap",
    ]
    with umask(0o002):  # a group-writable umask: the run's modes are set, not inherited
        proc = lmforge_train(args, data_cache, tmp_path)
    assert proc.returncode == 0, why(proc)
    run = tmp_path / "ap"
    assert [p.name for p in sorted((run / "checkpoints").iterdir())] == ["step-00000002", "step-00000004"]
    events = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [e["step"] for e in events if e.get("event") == "checkpoint_commit"] == [2, 4]
    # stderr: nothing, or the first-use notices when the test run's data cache is new (no DCP INFO line)
    noise = [line for line in proc.stderr.splitlines() if not (line.startswith("lmforge: ") and NOTICE in line)]
    assert noise == [], why(proc)
    assert not [line for line in proc.stdout.splitlines() if " - INFO - " in line], why(proc)
    assert wrong_modes(run) == []
