"""The full training entry point (``lmforge.train``: Hydra, validation, Trainer, data mixture, metrics,
checkpoints) under 2 real ranks with an interleaved pipeline: loss logged from the last stage on rank 0,
evaluation through the pipeline, a DCP checkpoint of both stages, data sharded by data-parallel rank only."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from harness import run_ranks

pytestmark = pytest.mark.distributed


@pytest.mark.timeout(400)
def test_train_entry_point_runs_interleaved_pipeline_on_two_ranks(data_cache, tmp_path):
    argv = [
        "model=tiny",
        "model.seq_len=32",
        "parallelism=pp2_interleaved",
        "comm=cpu_gloo",
        "train.device=cpu",
        "train.max_steps=4",
        "train.micro_batch_size=2",
        "train.global_batch_size=8",
        "train.eval_every=4",
        "train.eval_batches=1",
        "logging.every_steps=1",
        "logging.console=plain",
        "checkpoint.every_steps=0",
        "~data.sources.code",
        "~data.sources.reference",
        f"run.root={tmp_path}",
        "run.name=pp",
        # downstream evaluation in the loop (lmforge.evaluation), logged to JSONL and an offline W&B run
        "eval.tasks=[stdlib_next_line]",
        "eval.limit=4",
        "eval.batch_size=4",
        "logging.wandb.mode=offline",
    ]
    run_ranks(
        "distributed.parallel_worker:train_entry",
        2,
        {"argv": argv},
        timeout=320,
        env={"LMFORGE_DATA_CACHE": str(data_cache), "HOME": str(tmp_path), "WANDB_SILENT": "true"},
    )
    run = tmp_path / "pp"
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    train = [r for r in records if r.get("kind") == "train"]
    evals = [r for r in records if r.get("kind") == "eval"]
    assert [r["step"] for r in train] == [1, 2, 3, 4]
    assert all(math.isfinite(r["loss"]) and 5.0 < r["loss"] < 10.0 for r in train)
    assert train[-1]["loss"] < train[0]["loss"]
    assert all(r["grad_norm"] > 0 for r in train)
    # One data-parallel rank (pp=2 x dp=1): every step consumed exactly the global batch.
    assert train[-1]["consumed_samples"] == 4 * 8
    assert evals and math.isfinite(evals[-1]["val/books/loss"])
    # bits per byte next to the loss; the task's accuracies (4 documents: a multiple of 1/4) and per-choice lls
    assert 0.5 < evals[-1]["val/books/bpb"] < evals[-1]["val/books/loss"] / math.log(2)
    assert {evals[-1]["eval/stdlib_next_line/acc"] * 4, evals[-1]["eval/stdlib_next_line/acc_norm"] * 4} <= {
        0,
        1,
        2,
        3,
        4,
    }
    lls = [
        json.loads(line) for line in (run / "evals" / "stdlib_next_line-step-00000004.jsonl").read_text().splitlines()
    ]
    assert len(lls) == 4 and all(len(r["lls"]) == 4 and max(r["lls"]) < 0 for r in lls)
    wandb_run = next((run / "wandb").glob("offline-run-*"))
    out = subprocess.run(
        [str(Path(sys.executable).parent / "wandb"), "leet", "inspect", "--json", str(wandb_run)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    history = [
        json.loads(line)["history"]["item"]
        for line in out.stdout.splitlines()
        if line.startswith("{") and json.loads(line).get("type") == "history"
    ]
    logged = [h for h in history if "eval/stdlib_next_line/acc" in h]
    assert len(logged) == 1 and logged[0]["eval/stdlib_next_line/acc"] == evals[-1]["eval/stdlib_next_line/acc"]
    assert logged[0]["val/books/bpb"] == pytest.approx(evals[-1]["val/books/bpb"])
    ckpt = run / "checkpoints" / "step-00000004"
    assert (ckpt / "state.json").exists()
    provenance = json.loads((run / "provenance.json").read_text())
    assert json.dumps(provenance).count('"pp": 2') >= 1
    assert (run / "DONE").exists()
