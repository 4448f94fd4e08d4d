"""train.precision=fp8 through the real entry point (``python -m lmforge.train``), on the CPU.

A tiny run trains 4 steps in fp8 with the numerics check every 2 steps (``kind: fp8_check`` records in
metrics.jsonl), then the same run resumes its step-4 checkpoint under bf16-mixed to step 6: fp8 is a compute
format, the checkpoint holds the same fp32 tensors. A rowwise recipe with the float8 FSDP all-gather is refused in
one line, exit 2. The in-process checks (conversion, filter, curve, negative control): tests/unit/test_float8.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

COMMON = [
    "model=tiny",
    "train.micro_batch_size=2",
    "train.global_batch_size=2",
    "train.eval_every=0",
    "train.threads=1",
    "train.device=cpu",
    "logging.console=plain",
    "logging.every_steps=1",
    "run.name=r",
]


def launch(root: Path, *extra: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "lmforge.train", f"run.root={root}", *COMMON, *extra]
    return subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=300)


@pytest.mark.timeout(600)
def test_an_fp8_run_checks_its_numerics_and_resumes_in_bf16(tmp_path, data_cache):
    fp8 = launch(
        tmp_path,
        "train.max_steps=4",
        "train.precision=fp8",
        "train.fp8.shape_filter=false",
        "train.fp8.check_every=2",
    )
    assert fp8.returncode == 0, fp8.stderr[-3000:]
    assert "lmforge: fp8 (tensorwise): 28 of 28 linears in float8" in fp8.stdout
    assert fp8.stdout.count("lmforge: warning: train.precision=fp8 without parallelism.compile=true") == 1
    rows = [json.loads(line) for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    checks = [r for r in rows if r.get("kind") == "fp8_check"]
    assert [r["step"] for r in checks] == [2, 4]
    assert all(0 < abs(r["fp8/loss_gap"]) < 0.05 for r in checks)
    assert all(r["fp8/loss_gap"] == pytest.approx(r["fp8/loss"] - r["fp8/bf16_loss"]) for r in checks)
    bf16 = launch(tmp_path, "train.max_steps=6", "train.precision=bf16-mixed")
    assert bf16.returncode == 0, bf16.stderr[-3000:]
    assert "linears in float8" not in bf16.stdout
    rows = [json.loads(line) for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r.get("kind") == "train"][-2:] == [5, 6] and (tmp_path / "r" / "DONE").is_file()
    assert "resume step=4" in bf16.stdout


def test_rowwise_with_the_float8_all_gather_is_refused_in_one_line(tmp_path):
    proc = launch(
        tmp_path,
        "train.precision=fp8",
        "train.fp8.recipe=rowwise",
        "train.fp8.enable_fsdp_float8_all_gather=true",
    )
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines[-1].endswith(
        "config key 'train.fp8.enable_fsdp_float8_all_gather': the float8 all-gather needs one scale per weight "
        "tensor: train.fp8.recipe=tensorwise. Fix: set train.fp8.recipe=tensorwise or "
        "train.fp8.enable_fsdp_float8_all_gather=false"
    )
    assert "Traceback" not in proc.stderr
