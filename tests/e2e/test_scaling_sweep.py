"""End to end on CPU: plan a tiny IsoFLOP grid, train it for real, collect, fit, plot.

The losses are real (tiny GPTs on the embedded Austen corpus); recovering a known law is the synthetic
tests' job (tests/unit/test_scaling_fits.py). This test proves the plumbing and the FLOPs accounting:
every run's realised training FLOPs (flops_seen in its metrics.jsonl) must be within 5% of its budget.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lmforge.cli import main as lmforge
from lmforge.scaling.collect import read_metrics
from lmforge.scaling.data import read_csv
from lmforge.scaling.plan import load_sweep

BUDGETS = "3e9,1e10"


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_tiny_isoflop_sweep_end_to_end(tmp_path, data_cache, capsys, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    root = tmp_path / "runs"
    assert (
        lmforge(
            ["sweep", "plan", "--preset", "tiny_cpu", "--name", "e2e", "--budgets", BUDGETS, "--run-root", str(root)]
        )
        == 0
    )
    sweep_dir = root / "e2e"
    sweep = load_sweep(sweep_dir)
    assert len(sweep.points) == 10 and {p.budget for p in sweep.points} == {3e9, 1e10}

    # One point that cannot train (a head count that does not divide d_model) must be listed as failed
    # without stopping the others.
    data = json.loads((sweep_dir / "sweep.json").read_text())
    bad = json.loads(json.dumps(data["points"][0]))
    bad["id"] = "broken"
    bad["sweep_point"] = "e2e/broken"
    bad["run_dir"] = str(sweep_dir / "broken")
    bad["overrides"] = [o for o in bad["overrides"] if not o.startswith(("model.n_heads=", "run.sweep_point="))] + [
        "model.n_heads=3",
        "run.sweep_point=e2e/broken",
    ]
    data["points"].append(bad)
    (sweep_dir / "sweep.json").write_text(json.dumps(data))

    capsys.readouterr()
    assert lmforge(["sweep", "run", str(sweep_dir)]) == 1
    out = capsys.readouterr().out
    assert "10 done, 1 failed" in out and "FAILED broken:" in out and "n_heads" in out

    sweep = load_sweep(sweep_dir)
    for p in sweep.points[:-1]:
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

    verdict = json.loads((sweep_dir / "broken" / "verdicts" / "rank0.json").read_text())
    assert verdict["kind"] == "config_error" and "model.n_heads" in verdict["message"]

    # Re-running skips finished runs (no new records) and does not retry the deterministic failure.
    sizes = {p.id: (Path(p.run_dir) / "metrics.jsonl").stat().st_size for p in sweep.points[:-1]}
    assert lmforge(["sweep", "run", str(sweep_dir)]) == 1
    out = capsys.readouterr().out
    assert "10 done, 1 failed" in out
    assert "FAILED broken: config_error on rank 0 at step 0 (exit 2): config key 'model.n_heads'" in out
    assert "; not retried (" in out
    assert sizes == {p.id: (Path(p.run_dir) / "metrics.jsonl").stat().st_size for p in sweep.points[:-1]}

    assert lmforge(["sweep", "collect", str(sweep_dir)]) == 0
    rows = read_csv(sweep_dir / "results.csv")
    assert len(rows) == 10 and "broken" not in {r["id"] for r in rows}
    for r in rows:
        assert abs(float(r["flops_error"])) < 0.05
        assert float(r["final_val_loss"]) == pytest.approx(float(r["val/books/loss"]))

    rc = lmforge(["scaling", "fit", str(sweep_dir), "--targets", "1e11,1e12", "--bootstrap", "4", "--wandb", "offline"])
    out = capsys.readouterr().out
    fit = json.loads((sweep_dir / "fit" / "fit.json").read_text())
    assert fit["approach3"] is not None and fit["approach3"]["alpha"] >= 0 and fit["approach3"]["E"] > 0
    preds = [p for p in fit["predictions"] if p["approach"] == "3"]
    assert [p["budget"] for p in preds] == [1e11, 1e12] and preds[1]["n_opt"] > preds[0]["n_opt"]
    if rc == 0:
        assert fit["approach2"] is not None and len(fit["approach2"]["minima"]) == 2
    else:
        # Real tiny runs may put a budget's minimum at the grid's edge: then the error must say which budget.
        assert rc == 1 and set(fit["errors"]) == {"2"}, fit["errors"]
        assert fit["errors"]["2"].startswith("budget C=") and "extend the grid" in fit["errors"]["2"]
    for name in ("isoflop", "frontier", "residuals"):
        png = sweep_dir / "fit" / f"{name}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    # W&B (offline): the plots as images and the runs/predictions as tables, in one run of the sweep's group.
    (wandb_run,) = list((sweep_dir / "fit" / "wandb").glob("offline-run-*"))
    media = wandb_run / "files" / "media"
    assert sorted(p.name.split("_")[0] for p in (media / "images" / "scaling").glob("*.png")) == [
        "frontier",
        "isoflop",
        "residuals",
    ]
    (points,) = list((media / "table" / "scaling").glob("points_*.table.json"))
    table = json.loads(points.read_text())
    assert table["columns"] == ["id", "budget", "N", "D", "loss"] and len(table["data"]) == 10
    print(out)
