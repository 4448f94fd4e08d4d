"""Collecting losses from run directories and the fit report's partial-failure behaviour."""

from __future__ import annotations

import json

import numpy as np
import pytest

from lmforge.scaling.collect import summarise_run
from lmforge.scaling.data import Observations, observations_from_rows
from lmforge.scaling.errors import ScalingError
from lmforge.scaling.laws import CHINCHILLA_LAW
from lmforge.scaling.report import fit_all


def test_final_and_smoothed_losses_use_the_mixture_weights():
    records = [{"kind": "event", "event": "sweep_point", "budget": 1e10}]
    for step in range(10, 101, 10):
        records.append(
            {
                "kind": "train",
                "step": step,
                "loss": 5.0 - step / 100,
                "tokens_seen": step * 100,
                "flops_seen": step * 100 * 7,
            }
        )
    for step, books, code in ((50, 4.0, 3.0), (95, 3.6, 2.6), (100, 3.5, 2.5)):
        records.append(
            {
                "kind": "eval",
                "step": step,
                "tokens_seen": step * 100,
                "val/books/loss": books,
                "val/code/loss": code,
                "val/books/ppl": 1.0,
                "eval/arc/acc": step / 200,
            }
        )
    out = summarise_run(records, {"books": 0.75, "code": 0.25}, smooth_fraction=0.1)
    assert out["final_step"] == 100 and out["flops_seen"] == 70000
    assert out["final_val_loss"] == pytest.approx(0.75 * 3.5 + 0.25 * 2.5)
    # Evaluations within the last 10% of tokens: steps 95 and 100.
    assert out["smoothed_val_loss"] == pytest.approx((0.75 * 3.6 + 0.25 * 2.6 + 0.75 * 3.5 + 0.25 * 2.5) / 2)
    assert out["final_train_loss"] == pytest.approx(4.0)
    assert out["smoothed_train_loss"] == pytest.approx(np.mean([4.1, 4.0]))
    assert out["val/code/loss"] == 2.5
    assert out["eval/arc/acc"] == 0.5  # the last evaluation's other metrics ride along (downstream fits)


def test_rows_without_a_loss_column_or_with_bad_values_are_refused():
    rows = [{"id": "a", "budget": "1e10", "n_flops": "100", "tokens": "1000"}]
    with pytest.raises(ScalingError, match="has no column"):
        observations_from_rows(rows, "final_val_loss", "n_flops")
    rows[0]["final_val_loss"] = "nan"
    with pytest.raises(ScalingError, match="run 'a'.*finite positive"):
        observations_from_rows(rows, "final_val_loss", "n_flops").check()


def test_fit_report_keeps_approach3_and_plots_when_approach2_fails(tmp_path):
    rows = []
    for c, factors in ((1e18, np.geomspace(1 / 8, 8, 7)), (1e20, np.geomspace(1 / 400, 1 / 20, 6))):
        n_opt, _, _ = CHINCHILLA_LAW.optimal(c)
        for f in factors:
            n = n_opt * f
            rows.append((c, n, c / (6 * n)))
    c, n, d = map(np.array, zip(*rows))
    obs = Observations(c, n, d, CHINCHILLA_LAW.loss(n, d))
    report = fit_all(obs, targets=[1e22], out_dir=tmp_path)
    assert set(report.errors) == {"2"} and "budget C=1e+20" in report.errors["2"]
    assert report.approach3 is not None and report.approach3.law.alpha == pytest.approx(0.34, abs=0.02)
    saved = json.loads((tmp_path / "fit.json").read_text())
    assert saved["approach2"] is None and saved["predictions"][0]["approach"] == "3"
    for name in ("isoflop", "frontier", "residuals"):
        assert (tmp_path / f"{name}.png").read_bytes()[:4] == b"\x89PNG"
