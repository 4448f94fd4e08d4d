"""End to end on CPU: the README's IsoFLOP demo exactly as printed, then failure and re-run handling.

The demo line is read from README.md and run by bash in a fresh directory (the `lmforge` it calls is this
interpreter's ``-m lmforge.cli``): plan the tiny_cpu grid, train it for real, collect, fit both approaches with
bootstrap intervals. It must exit 0 with every budget's IsoFLOP minimum inside its grid; the losses are real
(tiny GPTs on the embedded Austen corpus). Recovering a known law is the synthetic tests' job
(tests/unit/test_scaling_fits.py, which also holds the negative control: a minimum at the grid's edge is an
error naming the budget). The FLOPs accounting is checked too: every run's realised training FLOPs
(flops_seen in its metrics.jsonl) must be within 5% of its budget.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lmforge.cli import main as lmforge
from lmforge.scaling.collect import read_metrics
from lmforge.scaling.data import read_csv
from lmforge.scaling.plan import load_sweep

README = Path(__file__).resolve().parents[2] / "README.md"


def readme_demo_command() -> str:
    """The README's sweep demo as one shell line (continuation lines joined, the trailing comment dropped)."""
    lines = README.read_text().splitlines()
    i = next(k for k, line in enumerate(lines) if line.startswith("lmforge sweep plan --preset tiny_cpu --name demo"))
    command = lines[i].rstrip()
    while command.endswith("\\"):
        i += 1
        command = command[:-1].rstrip() + " " + lines[i].strip()
    return command.split(" #", 1)[0].strip()


def finite_interval(interval: dict) -> bool:
    return math.isfinite(interval["low"]) and math.isfinite(interval["high"]) and interval["low"] < interval["high"]


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_readme_isoflop_demo_brackets_every_optimum_and_fits_both_approaches(tmp_path, data_cache, capsys):
    command = readme_demo_command()
    assert command.endswith("lmforge scaling fit runs/demo"), command  # both approaches (the default)
    shell = f'lmforge() {{ "{sys.executable}" -m lmforge.cli "$@"; }}; {command}'
    env = {**os.environ, "WANDB_MODE": "offline"}
    env.pop("LMFORGE_SCALING_WANDB", None)
    proc = subprocess.run(["bash", "-c", shell], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=1100)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    out = proc.stdout
    # The planner's own check: the expected optimum is interior at both budgets.
    checks = [line for line in out.splitlines() if line.startswith("C=") and "expected optimum" in line]
    assert len(checks) == 2 and all(line.endswith(": interior") for line in checks), checks
    assert "Approach 2: N* =" in out and "Approach 3: L =" in out and "FAILED" not in out

    sweep_dir = tmp_path / "runs" / "demo"
    sweep = load_sweep(sweep_dir)
    assert len(sweep.points) == 14 and {p.budget for p in sweep.points} == {1e10, 3e10}
    for p in sweep.points:
        records = read_metrics(Path(p.run_dir) / "metrics.jsonl")
        tag = [r for r in records if r.get("event") == "sweep_point"]
        assert len(tag) == 1 and tag[0]["budget"] == p.budget and tag[0]["tokens"] == p.tokens
        assert tag[0]["n_flops"] == p.n_flops
        final = [r for r in records if r.get("kind") == "train"][-1]
        assert final["step"] == p.max_steps and final["tokens_seen"] == p.tokens
        # The realised training FLOPs match the planned budget within 5%.
        assert abs(final["flops_seen"] / p.budget - 1) < 0.05, (p.id, final["flops_seen"], p.budget)
        evals = [r for r in records if r.get("kind") == "eval"]
        assert evals and evals[-1]["step"] == p.max_steps and 0 < evals[-1]["val/books/loss"] < 10

    rows = read_csv(sweep_dir / "results.csv")
    assert len(rows) == 14
    fit = json.loads((sweep_dir / "fit" / "fit.json").read_text())
    assert fit["errors"] == {} and fit["warnings"] == [] and fit["design"] == "isoflop-grid"
    # Every budget's optimum inside its grid: the lowest measured loss is not at either end of its sizes, and
    # Approach 2's parabola vertex lies strictly between the smallest and the largest size.
    minima = {m["budget"]: m for m in fit["approach2"]["minima"]}
    assert sorted(minima) == [1e10, 3e10]
    for budget, m in minima.items():
        runs = sorted((float(r["n_flops"]), float(r["final_val_loss"])) for r in rows if float(r["budget"]) == budget)
        best = min(range(len(runs)), key=lambda k: runs[k][1])
        assert 0 < best < len(runs) - 1, (budget, runs)
        assert runs[0][0] < m["n_opt"] < runs[-1][0], (budget, m, runs)
    # Both approaches' exponents, with finite bootstrap intervals from the default 100 replicates.
    b2, b3 = fit["bootstrap"]["2"], fit["bootstrap"]["3"]
    assert b2["replicates"] == b3["replicates"] == 100 and b2["failed"] < 50 and b3["failed"] < 50
    assert all(finite_interval(b2["params"][k]) for k in ("a", "b"))
    assert all(finite_interval(b3["params"][k]) for k in ("alpha", "beta", "a", "b"))
    assert 0 < fit["approach2"]["a"] < 1 and fit["approach2"]["a"] + fit["approach2"]["b"] == pytest.approx(1, abs=0.2)
    assert fit["approach3"]["alpha"] > 0 and fit["approach3"]["beta"] > 0 and 0 < fit["approach3"]["a"] < 1
    for approach in ("2", "3"):
        preds = [p for p in fit["predictions"] if p["approach"] == approach]
        assert [p["budget"] for p in preds] == [1e11, 1e12] and preds[1]["n_opt"] > preds[0]["n_opt"]
        assert all(finite_interval(p["ci"]["n_opt"]) for p in preds)
    for name in ("isoflop", "frontier", "residuals"):
        png = sweep_dir / "fit" / f"{name}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000

    # One point that cannot train (a head count that does not divide d_model) must be listed as failed
    # without stopping the others.
    data = json.loads((sweep_dir / "sweep.json").read_text())
    bad = json.loads(json.dumps(data["points"][0]))
    bad["id"] = "broken"
    bad["sweep_point"] = "demo/broken"
    bad["run_dir"] = str(sweep_dir / "broken")
    bad["overrides"] = [o for o in bad["overrides"] if not o.startswith(("model.n_heads=", "run.sweep_point="))] + [
        "model.n_heads=3",
        "run.sweep_point=demo/broken",
    ]
    data["points"].append(bad)
    (sweep_dir / "sweep.json").write_text(json.dumps(data))
    sizes = {p.id: (Path(p.run_dir) / "metrics.jsonl").stat().st_size for p in sweep.points}

    capsys.readouterr()
    assert lmforge(["sweep", "run", str(sweep_dir)]) == 1
    out = capsys.readouterr().out
    assert "14 done, 1 failed" in out and "FAILED broken:" in out and "n_heads" in out
    verdict = json.loads((sweep_dir / "broken" / "verdicts" / "rank0.json").read_text())
    assert verdict["kind"] == "config_error" and "model.n_heads" in verdict["message"]

    # Re-running skips finished runs (no new records) and does not retry the deterministic failure.
    assert lmforge(["sweep", "run", str(sweep_dir)]) == 1
    out = capsys.readouterr().out
    assert "14 done, 1 failed" in out
    assert "FAILED broken: config_error on rank 0 at step 0 (exit 2): config key 'model.n_heads'" in out
    assert "; not retried (" in out
    assert sizes == {p.id: (Path(p.run_dir) / "metrics.jsonl").stat().st_size for p in sweep.points}

    assert lmforge(["sweep", "collect", str(sweep_dir)]) == 0
    rows = read_csv(sweep_dir / "results.csv")
    assert len(rows) == 14 and "broken" not in {r["id"] for r in rows}
    for r in rows:
        assert abs(float(r["flops_error"])) < 0.05
        assert float(r["final_val_loss"]) == pytest.approx(float(r["val/books/loss"]))

    # W&B (offline): the plots as images and the runs/predictions as tables, in one run of the sweep's group.
    wandb_fit = ["scaling", "fit", str(sweep_dir), "--bootstrap", "4", "--wandb", "offline", "--out"]
    assert lmforge([*wandb_fit, str(tmp_path / "fit-wandb")]) == 0
    (wandb_run,) = list((tmp_path / "fit-wandb" / "wandb").glob("offline-run-*"))
    media = wandb_run / "files" / "media"
    assert sorted(p.name.split("_")[0] for p in (media / "images" / "scaling").glob("*.png")) == [
        "frontier",
        "isoflop",
        "residuals",
    ]
    (points,) = list((media / "table" / "scaling").glob("points_*.table.json"))
    table = json.loads(points.read_text())
    assert table["columns"] == ["id", "budget", "N", "D", "loss"] and len(table["data"]) == 14
    print(proc.stdout[-3000:])
