"""A WSD cooldown branch through the real entry point (``python -m lmforge.train``, tiny model): a stable run planned
for 8 steps is checkpointed at step 3; a branch resumes that checkpoint into its own run directory with
``train.max_steps=5`` and a 2-step ``1-sqrt`` decay. Its steps 4 and 5 equal, bit for bit (loss and rate), those of
a run planned for 5 steps from the start with the same data plan (``train.planned_tokens``): one stable run gives
the budgets of its branches (Hagele et al. 2024). The branch's launch record names the stable checkpoint it came
from, and the changed schedule is announced in one line."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import yaml

COMMON = [
    "model=tiny",
    "train.micro_batch_size=2",
    "train.global_batch_size=2",
    "train.planned_tokens=1024",  # 8 steps x 2 x 64 tokens: one data plan for the stable run and every branch
    "train.eval_every=0",
    "train.threads=1",
    "train.device=cpu",
    "logging.every_steps=1",
    "logging.console=plain",
    "checkpoint.keep_last=5",
    "optim.schedule=wsd",
    "optim.warmup_steps=1",
    "optim.decay_steps=2",
    "optim.decay_shape=1-sqrt",
]


def train(root, *extra):
    cmd = [sys.executable, "-m", "lmforge.train", f"run.root={root}", *COMMON, *extra]
    proc = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def steps(run) -> dict:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: (r["loss"], r["lr"]) for r in rows if r.get("kind") == "train"}


@pytest.mark.timeout(600)
def test_a_branch_of_a_stable_checkpoint_trains_like_a_run_planned_for_its_budget(tmp_path):
    train(tmp_path, "run.name=stable", "train.max_steps=8", "checkpoint.every_steps=3")
    point = tmp_path / "stable" / "checkpoints" / "step-00000003"
    branch = train(tmp_path, "run.name=branch-5", "train.max_steps=5", f"train.resume={point}")
    train(tmp_path, "run.name=planned-5", "train.max_steps=5")
    stable, got, want = steps(tmp_path / "stable"), steps(tmp_path / "branch-5"), steps(tmp_path / "planned-5")
    assert sorted(got) == [4, 5] and {s: want[s] for s in (4, 5)} == got  # bit for bit: loss and learning rate
    assert {s: stable[s] for s in (1, 2, 3)} == {s: want[s] for s in (1, 2, 3)}  # the shared stable phase
    assert got[4][1] < stable[4][1] == 3e-4  # the branch decays where the stable run stays at lr
    record = yaml.safe_load((tmp_path / "branch-5" / "launches" / "launch-000.yaml").read_text())
    assert (record["start_step"], record["resumed_from"]) == (3, str(point))
    assert "the LR schedule differs from the checkpoint's: max_steps: checkpoint 8 -> now 5" in branch.stdout
