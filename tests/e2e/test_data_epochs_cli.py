"""Data refusals through lmforge.train, each in one line before any process group: gpt_1b on the embedded mixture
(data.max_epochs), and gpt_1b on its own corpus preset before that corpus is prepared."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


def train(args, tmp_path, data_cache):
    env = {**os.environ, "LMFORGE_DATA_CACHE": str(data_cache)}
    return subprocess.run(
        [sys.executable, "-m", "lmforge.train", *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.timeout(300)
def test_gpt_1b_on_the_embedded_mixture_is_refused_in_one_line_before_any_process_group(tmp_path, data_cache):
    # one process: a layout of 1 (the 8-rank default would be refused first, as a layout error)
    proc = train(
        ["+exp=gpt_1b", "data=default", "parallelism.dp_shard=1", f"run.root={tmp_path}", "run.name=big"],
        tmp_path,
        data_cache,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    # (a cold session cache first says what it builds, once per corpus: data/notices.py)
    lines = [line for line in proc.stderr.splitlines() if line.strip() and "(first use; cached" not in line]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert lines[0].startswith(
        "lmforge: config key 'data.max_epochs': the run plans 52,428,800,000 tokens, "
        "which would read source 'reference' ("
    ), lines[0]
    assert "50,161.0 times, more than data.max_epochs=4" in lines[0]
    for fix in ("data=<preset>", "`lmforge data prepare`", "data.max_epochs=50162"):
        assert fix in lines[0]
    # Refused before the Trainer, on a fresh cache too: no run files, no process group (it writes comm_env.json),
    # no rank output.
    assert not (tmp_path / "big" / "config.yaml").exists() and not (tmp_path / "big" / "metrics.jsonl").exists()
    assert not (tmp_path / "big" / "comm_env.json").exists()
    assert "gloo" not in proc.stderr.lower() and proc.stdout.strip() == ""


@pytest.mark.timeout(300)
def test_gpt_1b_before_its_corpus_is_prepared_is_refused_in_one_line_naming_the_path(tmp_path, data_cache):
    corpora = tmp_path / "corpora"
    env = {**os.environ, "LMFORGE_DATA_CACHE": str(data_cache), "LMFORGE_CORPORA": str(corpora)}
    proc = subprocess.run(
        [sys.executable, "-m", "lmforge.train", "+exp=gpt_1b", "parallelism.dp_shard=1", f"run.root={tmp_path}"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.splitlines() == [
        f"lmforge: config key 'data.sources.pretrain.path': no Megatron shard at prefix {corpora}/pretrain (neither "
        "pretrain.bin nor pretrain.idx exists). Fix: fix the prefix, or create it: re-run `lmforge data prepare "
        "INPUTS --out PREFIX` (see docs/data.md)"
    ]
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no run directory, no tokenizer trained
