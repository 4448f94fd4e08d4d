"""Resume is exact, through the real entry point (``python -m lmforge.train``) in subprocesses.

Run A trains N steps straight. Run B trains to N/2 (``train.stop_at_step``, which changes neither the LR
schedule nor the data index), stops, and a second launch resumes it to N. In fp32 with deterministic
algorithms the per-step losses, grad norms, LRs, data positions and per-source token counts, and the eval
losses, must be bit-identical. Run B also saves asynchronously (thread mode) and logs to W&B offline with fake
secrets planted in its environment, so the same three launches check the metrics JSONL fields, the W&B run
(read back with ``wandb leet inspect``; same run id after resume) and that no secret leaks into any file.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from wandb_read import leet, updates

N = 6
FIELDS_TRAIN = (
    "loss",
    "lr",
    "grad_norm",
    "tokens_per_s",
    "tokens_per_s_per_device",
    "tflops_per_device",
    "mfu",
    "step_time_s",
    "data_wait_s",
    "peak_memory_gib",
    "tokens_seen",
    "flops_seen",
    "consumed_samples",
)
SOURCES = ("books", "code", "reference")
SECRETS = {
    "WANDB_API_KEY": "fake-secret-wandb-0123456789abcdef",
    "HF_TOKEN": "fake-secret-hf-token-9876543210",
    "LMFORGE_SERVICE_TOKEN": "fake-secret-service-token-42",
}
COMMON = [
    "model=tiny",
    f"train.max_steps={N}",
    "train.micro_batch_size=4",
    "train.global_batch_size=8",
    "train.eval_every=3",
    "train.eval_batches=1",
    "train.threads=1",
    "train.deterministic=true",
    "train.precision=fp32",
    "train.device=cpu",
    "optim.warmup_steps=2",
    "optim.lr=3e-3",
    "logging.every_steps=1",
    "logging.console=plain",
    "checkpoint.every_steps=2",
    "checkpoint.keep_last=5",
]


def launch(root: Path, name: str, extra, env_extra=None) -> subprocess.Popen:
    env = {**os.environ, **(env_extra or {}), "WANDB_SILENT": "true"}
    log = open(root / f"{name}-{len(list(root.glob(name + '-*.log')))}.log", "w")
    cmd = [sys.executable, "-m", "lmforge.train", f"run.root={root}", f"run.name={name}", *COMMON, *extra]
    return subprocess.Popen(cmd, cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT)


def records(run: Path, kind: str):
    return [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if r.get("kind") == kind]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, data_cache):
    root = tmp_path_factory.mktemp("resume")
    straight = launch(root, "straight", [])
    # Start the split run once the straight run trains, so the two never build the data cache at the same time.
    deadline = time.monotonic() + 240
    while not (root / "straight" / "metrics.jsonl").exists():
        assert straight.poll() is None and time.monotonic() < deadline, _tail(root)
        time.sleep(0.2)
    first = launch(
        root,
        "split",
        [
            "train.stop_at_step=3",
            "checkpoint.async_mode=thread",
            "logging.wandb.mode=offline",
            "logging.wandb.project=resume-test",
        ],
        SECRETS,
    )
    for p in (straight, first):
        assert p.wait(timeout=240) == 0, (p.args, _tail(root))
    assert not (root / "split" / "DONE").exists()  # stopped, not finished
    second = launch(
        root,
        "split",
        ["checkpoint.async_mode=thread", "logging.wandb.mode=offline", "logging.wandb.project=resume-test"],
        SECRETS,
    )
    assert second.wait(timeout=240) == 0, (second.args, _tail(root))
    return root


def _tail(root: Path) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(root.glob("*.log")))


@pytest.mark.timeout(400)
def test_split_run_matches_straight_run_bit_for_bit(runs):
    a, b = records(runs / "straight", "train"), records(runs / "split", "train")
    assert [r["step"] for r in a] == list(range(1, N + 1)) == [r["step"] for r in b]
    keys = (
        "loss",
        "grad_norm",
        "lr",
        "consumed_samples",
        "tokens_seen",
        "flops_seen",
        *(f"tokens/{s}" for s in SOURCES),
    )
    for ra, rb in zip(a, b):
        assert {k: ra[k] for k in keys} == {k: rb[k] for k in keys}, ra["step"]
    ea, eb = records(runs / "straight", "eval"), records(runs / "split", "eval")
    assert [e["step"] for e in ea] == [3, 6] == [e["step"] for e in eb]
    assert ea == [{**e, "time": x["time"]} for e, x in zip(eb, ea)]
    resumed = [e for e in records(runs / "split", "event") if e["event"] == "resume"]
    assert [e["step"] for e in resumed] == [3]
    assert (runs / "split" / "DONE").exists()


@pytest.mark.timeout(60)
def test_metrics_jsonl_has_every_field(runs):
    train = records(runs / "straight", "train")
    for r in train:
        missing = [k for k in FIELDS_TRAIN if k not in r] + [f"tokens/{s}" for s in SOURCES if f"tokens/{s}" not in r]
        assert not missing, f"step {r['step']} lacks {missing}"
        assert r["loss"] > 0 and r["tokens_per_s"] > 0 and 0 < r["mfu"] < 1 and r["peak_memory_gib"] > 0
        assert r["tokens_per_s_per_device"] == r["tokens_per_s"]  # one device
        assert sum(r[f"tokens/{s}"] for s in SOURCES) == r["tokens_seen"]
    for e in records(runs / "straight", "eval"):
        for s in SOURCES:
            assert e[f"val/{s}/loss"] > 0 and e[f"val/{s}/ppl"] == pytest.approx(
                2.718281828459045 ** e[f"val/{s}/loss"]
            )
    saves = [e for e in records(runs / "split", "event") if e["event"] == "checkpoint_save"]
    assert saves and all(e["async_mode"] == "thread" and e["stall_s"] >= 0 for e in saves)
    commits = [e["step"] for e in records(runs / "split", "event") if e["event"] == "checkpoint_commit"]
    assert commits == [2, 3, 4, 6]


@pytest.mark.timeout(120)
def test_wandb_offline_run_continues_with_same_id(runs):
    run = runs / "split"
    offline = sorted((run / "wandb").glob("offline-run-*"))
    assert len(offline) == 2, offline  # one per launch
    sidecar = json.loads((run / "checkpoints" / f"step-{N:08d}" / "state.json").read_text())
    run_id = sidecar["wandb_run_id"]
    assert run_id and all(p.name.split("-")[3] == run_id for p in offline)  # offline-run-<time>-<id>[-<n>]
    jsonl = {r["step"]: r for r in records(run, "train")}
    seen = {}
    for part in offline:
        recs = leet(part)
        head = next(r["run"] for r in recs if r.get("type") == "run")
        assert head["run_id"] == run_id and head["project"] == "resume-test" and head["resume"] is True
        for r in recs:
            if r.get("type") == "history":
                item = r["history"]["item"]
                if "train/loss" in item:
                    seen[item["trainer/step"]] = item
    assert sorted(seen) == list(range(1, N + 1))
    for step, item in seen.items():
        assert item["train/loss"] == jsonl[step]["loss"] and item["train/mfu"] == jsonl[step]["mfu"]
        assert item["tokens_seen"] == jsonl[step]["tokens_seen"] and item["flops_seen"] == jsonl[step]["flops_seen"]


@pytest.mark.timeout(120)
def test_wandb_holds_each_launchs_run_info_the_planners_prediction_and_goodput(runs):
    """Per launch: the layout, size and versions in the run config and summary (``run_info``); beside every
    measured interval the planner's prediction as its own series; at the launch's end the run's goodput so far,
    equal to the ``goodput`` records of metrics.jsonl."""
    run = runs / "split"
    goodput = records(run, "goodput")
    assert [g["step"] for g in goodput] == [3, N] and [g["launches"] for g in goodput] == [1, 2]
    predictions = {r["step"]: r["predicted_step_time_s"] for r in records(run, "train") if "step_time_s" in r}
    assert predictions and len(set(predictions.values())) == 1  # planned once: the same config and device
    for launch, part in enumerate(sorted((run / "wandb").glob("offline-run-*"))):
        recs = leet(part)
        (info,) = updates(recs, "config", "run_info")
        summary = updates(recs, "summary", "run_info")
        assert summary == [info] and info["resumed_from"] == (None, 3)[launch] and info["launch"] == launch
        assert (info["model"], info["world_size"], info["mesh"], info["torch"]) == (
            "tiny",
            1,
            "single",
            torch_version(),
        )
        assert info["tokens_planned"] == N * 8 * 64 and info["nodes"] and info["parameters"] > 0
        items = [r["history"]["item"] for r in recs if r.get("type") == "history"]
        logged = {i["trainer/step"]: i["train/predicted_step_time_s"] for i in items if "train/step_time_s" in i}
        assert logged and all(predictions[step] == value for step, value in logged.items())
        (end,) = [i for i in items if "goodput/fraction" in i]
        assert (end["trainer/step"], end["goodput/fraction"]) == (goodput[launch]["step"], goodput[launch]["fraction"])


def torch_version() -> str:
    import torch

    return torch.__version__


@pytest.mark.timeout(60)
def test_no_planted_secret_in_any_file(runs):
    files = [p for p in runs.rglob("*") if p.is_file()]  # run dirs, W&B runs and logs (symlinks followed), stdout
    assert any(p.suffix == ".wandb" for p in files) and any(p.name.startswith("split-") for p in files)
    for path in files:
        data = path.read_bytes()
        for name, value in SECRETS.items():
            assert value.encode() not in data, f"{name} leaked into {path}"


@pytest.mark.timeout(60)
def test_sidecar_holds_scheduler_data_and_config(runs):
    side = json.loads((runs / "split" / "checkpoints" / "step-00000004" / "state.json").read_text())
    assert side["step"] == 4 and side["data"]["consumed_samples"] == 32 and side["world_size"] == 1
    assert side["scheduler"]["step"] == 4 and side["scheduler"]["max_steps"] == N and side["scheduler"]["next_lr"] > 0
    assert "grad_scaler" not in side  # no fp16 path, so no gradient scaler state
    assert side["config"]["model"]["name"] == "tiny"
    assert sorted(p.name for p in (runs / "split" / "checkpoints").iterdir()) == [
        "step-00000002",
        "step-00000003",
        "step-00000004",
        "step-00000006",
    ]
