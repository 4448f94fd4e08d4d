"""End to end on CPU: a tiny sweep laid out as WSD stable runs plus cooldown branches (``sweep plan --wsd-branches``),
trained by ``sweep run``, read by ``sweep collect`` and fitted by ``scaling fit``, all through ``lmforge``'s own
entry point on the embedded Austen corpus.

Five one-layer sizes (tiny_cpu's family up to width 24) at two budgets: five stable runs, ten branches. Each stable
run stops at its last branch start with a checkpoint at every start; each branch resumes one of them and trains
only its decay (to the floor at its own last step); the collected rows name the stable run, the step and the
checkpoint each branch actually resumed, and the fit's bootstrap resamples stable runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lmforge.checkpoint.layout import complete_checkpoints, step_dir, step_of
from lmforge.cli import main as lmforge
from lmforge.runtime.rundir import RunPaths
from lmforge.scaling.collect import read_metrics
from lmforge.scaling.data import read_csv
from lmforge.scaling.plan import load_sweep

PLAN = [
    "sweep", "plan", "--preset", "tiny_cpu", "--name", "wsd", "--budgets", "4e9,8e9", "--family", "max_width=24",
    "--tpp", "0.5,2000", "--sizes", "5", "--rule", "min_steps=10", "--rule", "micro_batch_size=4",
    "--rule", "eval_batches=2", "--wsd-branches",
]  # fmt: skip


def train_records(run_dir: str) -> list:
    return [r for r in read_metrics(Path(run_dir) / "metrics.jsonl") if r.get("kind") == "train"]


@pytest.mark.timeout(900)
def test_a_branched_sweep_plans_trains_collects_and_fits_with_provenance(tmp_path, data_cache, capsys):
    root = tmp_path / "runs"
    assert lmforge([*PLAN, "--run-root", str(root)]) == 0
    out = capsys.readouterr().out
    assert "as 5 stable runs + 10 cooldown branches" in out
    sweep_dir = root / "wsd"
    sweep = load_sweep(sweep_dir)

    assert lmforge(["sweep", "run", str(sweep_dir)]) == 0
    assert "sweep wsd (5 stable runs, 10 cooldown branches): 15 done, 0 failed" in capsys.readouterr().out

    for r in sweep.stable_runs:
        # Stopped at its last branch start, at the peak rate throughout the stable phase; a checkpoint kept at
        # every branch start, and no DONE (it is done when those exist).
        steps = train_records(r.run_dir)  # logged every logging.every_steps
        every = int(next(o for o in r.overrides if o.startswith("logging.every_steps=")).split("=")[1])
        assert r.max_steps - every < steps[-1]["step"] <= r.max_steps
        assert all(s["lr"] == pytest.approx(r.lr) for s in steps if s["step"] > r.warmup_steps)
        kept = [step_of(p) for p in complete_checkpoints(RunPaths(Path(r.run_dir)).checkpoints)]
        assert set(r.branch_starts) <= set(kept) and not RunPaths(Path(r.run_dir)).done_marker.exists()
        tag = [x for x in read_metrics(Path(r.run_dir) / "metrics.jsonl") if x.get("event") == "sweep_stable_run"]
        assert len(tag) == 1 and tag[0]["branch_starts"] == r.branch_starts and tag[0]["branches"] == r.branches

    floor = float(sweep.rules["min_lr_ratio"])
    for p in sweep.points:
        # Only the decay: from the step after its branch start to its own last step, ending at the floor.
        steps = train_records(p.run_dir)
        assert steps[-1]["step"] == p.max_steps and min(s["step"] for s in steps) > p.branch_start
        assert steps[-1]["lr"] == pytest.approx(p.lr * floor) and steps[-1]["tokens_seen"] == p.tokens
        assert abs(steps[-1]["flops_seen"] / p.budget - 1) < 0.05  # the stable part counts towards the budget
        tag = [x for x in read_metrics(Path(p.run_dir) / "metrics.jsonl") if x.get("event") == "sweep_point"][0]
        assert (tag["stable_run"], tag["branch_start"], tag["decay_steps"]) == (
            p.stable_run,
            p.branch_start,
            p.decay_steps,
        )

    # Re-running trains nothing.
    sizes = {u.id: (Path(u.run_dir) / "metrics.jsonl").stat().st_size for u in sweep.units()}
    assert lmforge(["sweep", "run", str(sweep_dir)]) == 0
    assert sizes == {u.id: (Path(u.run_dir) / "metrics.jsonl").stat().st_size for u in sweep.units()}

    assert lmforge(["sweep", "collect", str(sweep_dir)]) == 0
    rows = {r["id"]: r for r in read_csv(sweep_dir / "results.csv")}
    assert json.loads((sweep_dir / "results.json").read_text())[0]["stable_run"]
    assert sorted(rows) == sorted(p.id for p in sweep.points)
    for p in sweep.points:
        row, stable = rows[p.id], sweep.stable(p.stable_run)
        assert (row["stable_run"], row["stable_run_dir"]) == (stable.id, stable.run_dir)
        assert (int(row["branch_start"]), int(row["decay_steps"])) == (p.branch_start, p.decay_steps)
        # The checkpoint its launch really resumed, as the launch record names it.
        assert row["resumed_from"] == str(step_dir(RunPaths(Path(stable.run_dir)).checkpoints, p.branch_start))
        assert 0 < float(row["final_val_loss"]) < 10

    capsys.readouterr()
    assert lmforge(["scaling", "fit", str(sweep_dir), "--bootstrap", "20"]) == 0
    fit = json.loads((sweep_dir / "fit" / "fit.json").read_text())
    assert fit["bootstrap"]["2"]["method"] == fit["bootstrap"]["3"]["method"] == "stable-runs"
    assert "bootstrap 'stable-runs'" in capsys.readouterr().out
