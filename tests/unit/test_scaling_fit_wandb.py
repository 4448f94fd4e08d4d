"""``lmforge scaling fit --wandb``: the fitted law with its intervals as a table and the plots as images, in one
offline W&B run of the sweep's group, read back with W&B's own reader (``wandb leet inspect``)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from wandb_read import leet

from lmforge.cli import main as lmforge
from lmforge.scaling.laws import CHINCHILLA_LAW as LAW
from lmforge.scaling.plan import Rules, plan, write_sweep
from lmforge.scaling.shapes import ShapeFamily


def isoflop_grid(path: Path) -> Path:
    """Three IsoFLOP profiles of seven sizes around the law's optimum, 0.5% log-loss noise."""
    rng = np.random.default_rng(3)
    lines = ["name,params,tokens,loss"]
    for c in (1e18, 1e19, 1e20):
        n_opt = LAW.optimal(c)[0]
        for i, f in enumerate(np.geomspace(1 / 6, 6, 7)):
            n = n_opt * f
            d = c / (6 * n)
            lines.append(
                f"c{c:.0e}-{i},{float(n)!r},{float(d)!r},{float(LAW.loss(n, d) * np.exp(rng.normal(0, 0.005)))!r}"
            )
    path.write_text("\n".join(lines) + "\n")
    return path


def sweep_folder(tmp_path: Path) -> Path:
    """A folder holding a sweep's plan (sweep.json), where the runs' table is fitted."""
    family = ShapeFamily(
        head_dim=8, aspect_min=8, aspect_max=64, max_width=128, min_layers=1, max_layers=4, vocab_size=512, seq_len=64
    )
    sweep = plan("fitsweep", [1e10], family, Rules(tpp_min=0.5, tpp_max=100), str(tmp_path / "runs"))
    folder = tmp_path / "runs" / "fitsweep"
    write_sweep(sweep, folder)
    return folder


def fit_args(table: Path, out: Path) -> list:
    return ["scaling", "fit", str(table), "--n-col", "params", "--d-col", "tokens", "--loss-col", "loss"] + [
        "--id-col",
        "name",
        "--bootstrap",
        "8",
        "--targets",
        "1e21",
        "--out",
        str(out),
    ]


@pytest.mark.timeout(180)
def test_fit_logs_law_intervals_and_plots_in_the_sweeps_group(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("WANDB_MODE")  # the suite's `disabled`: this test asks for W&B (auto: no key -> offline)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    folder = sweep_folder(tmp_path)
    table = isoflop_grid(folder / "grid.csv")
    out = tmp_path / "fit"
    capsys.readouterr()
    assert lmforge(fit_args(table, out) + ["--wandb"]) == 0
    printed = capsys.readouterr().out
    (line,) = [s for s in printed.splitlines() if "W&B logging offline" in s]
    (run_dir,) = list((out / "wandb").glob("offline-run-*"))
    assert line.endswith(f"Sync later with `wandb sync {out}/wandb/offline-run-*-{run_dir.name.split('-')[-1]}*`")
    records = leet(run_dir)
    run = next(r["run"] for r in records if r.get("type") == "run")
    assert run["run_group"] == "fitsweep" and run["job_type"] == "scaling-fit"
    (row,) = [r["history"]["item"] for r in records if r.get("type") == "history"]
    assert {k.removesuffix("._type"): v for k, v in row.items() if k.endswith("._type")} == {
        "scaling/law": "table-file",
        "scaling/predictions": "table-file",
        "scaling/points": "table-file",
        "scaling/isoflop": "image-file",
        "scaling/frontier": "image-file",
        "scaling/residuals": "image-file",
    }
    law = json.loads((run_dir / "files" / row["scaling/law.path"]).read_text())
    assert law["columns"] == ["approach", "parameter", "value", "low", "high", "level"]
    by_name = {(r[0], r[1]): r for r in law["data"]}
    assert {"E", "A", "alpha", "B", "beta", "a", "b"} <= {name for approach, name in by_name if approach == "3"}
    assert {"a", "k_N", "b", "k_D"} <= {name for approach, name in by_name if approach == "2"}
    _, _, a, low, high, level = by_name[("3", "a")]
    assert low <= a <= high and low < high and level == 0.95 and abs(a - LAW.a) < 0.1
    preds = json.loads((run_dir / "files" / row["scaling/predictions.path"]).read_text())
    assert [r[:2] for r in preds["data"]] == [["2", 1e21], ["3", 1e21]]
    for r in preds["data"]:
        assert r[3] <= r[2] <= r[4], r  # N* inside its interval
    for name in ("isoflop", "frontier", "residuals"):
        png = run_dir / "files" / row[f"scaling/{name}.path"]
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.timeout(120)
def test_bare_wandb_flag_logs_nothing_under_the_suites_wandb_mode(tmp_path, capsys):
    """Negative control: the same fit with --wandb under WANDB_MODE=disabled (tests/conftest.py) writes no W&B run."""
    table = isoflop_grid(tmp_path / "grid.csv")
    assert lmforge(fit_args(table, tmp_path / "fit") + ["--wandb"]) == 0
    assert (tmp_path / "fit" / "fit.json").is_file() and not (tmp_path / "fit" / "wandb").exists()
    assert "W&B" not in capsys.readouterr().out
