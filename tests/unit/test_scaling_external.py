"""``lmforge scaling fit`` on an external table: every run at its own budget, as in published tables.

The table is drawn from a known law (Hoffmann et al.'s constants) with log-loss noise and three diverged
runs; parameters are in millions (stated with --n-scale). The intervals must be non-degenerate and contain
the generating law; the old within-budget resampling (zero-width intervals on such a table) is refused.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from lmforge.cli import main as lmforge
from lmforge.scaling.downstream import SigmoidLink
from lmforge.scaling.laws import CHINCHILLA_LAW as LAW

RUNS, DIVERGED = 40, ("run03", "run17", "run29")


def published_table(seed: int = 4):
    rng = np.random.default_rng(seed)
    c = np.exp(rng.uniform(np.log(1e18), np.log(1e20), RUNS))
    n = LAW.optimal(c)[0] * np.exp(rng.uniform(-np.log(6), np.log(6), RUNS))
    d = c / (6 * n)
    loss = LAW.loss(n, d) * np.exp(rng.normal(0, 0.01, RUNS))
    rows = [
        {
            "name": f"run{i:02d}",
            "params_M": float(n[i] / 1e6),
            "tokens": float(d[i]),
            "flops": float(c[i]),
            "loss": float(loss[i] * (1.5 if f"run{i:02d}" in DIVERGED else 1.0)),
        }
        for i in range(RUNS)
    ]
    return rows


def write_csv(rows, path):
    keys = list(rows[0])
    path.write_text(
        ",".join(keys)
        + "\n"
        + "".join(",".join(repr(r[k]) if not isinstance(r[k], str) else r[k] for k in keys) + "\n" for r in rows)
    )
    return path


@pytest.mark.timeout(300)
def test_scattered_table_gets_non_degenerate_intervals_that_contain_the_law(tmp_path, capsys):
    table = write_csv(published_table(), tmp_path / "chinchilla_like.csv")
    out = tmp_path / "fit"
    capsys.readouterr()
    rc = lmforge(
        [
            "scaling",
            "fit",
            str(table),
            "--n-col",
            "params_M",
            "--n-scale",
            "1e6",
            "--d-col",
            "tokens",
            "--loss-col",
            "loss",
            "--id-col",
            "name",
            "--drop-highest-loss",
            "3",
            "--bootstrap",
            "60",
            "--targets",
            "1e21",
            "--bins",
            "3",
            "--out",
            str(out),
        ]
    )
    text = capsys.readouterr().out
    fit = json.loads((out / "fit.json").read_text())
    assert rc == 0, (text, fit["errors"])
    # The design is recognised and named; the summary gives the budget range, not 37 budgets.
    assert fit["design"] == "scattered" and fit["approach2_bins"] == 3
    assert text.splitlines()[0] == (
        "37 runs at 37 budget(s) in 1.85e+18..9.3e+19 FLOPs (scattered: Approach 2 on 3 log-spaced budget bins)"
    )
    assert "Approach 3 intervals: 95% percentile, bootstrap 'runs' (60 replicates," in text
    assert len(text.splitlines()) < 15
    # The filter is recorded with the runs it removed (the three diverged ones).
    (flt,) = fit["source"]["filters"]
    assert flt["filter"] == "drop_highest_loss=3" and sorted(flt["dropped"]) == list(DIVERGED)
    assert fit["source"]["columns"]["n"] == "params_M x 1e+06 = parameters"
    b3 = fit["bootstrap"]["3"]
    assert b3["method"] == "runs" and b3["design"] == "scattered" and b3["failed"] < 6
    truth = {"E": LAW.E, "alpha": LAW.alpha, "beta": LAW.beta, "a": LAW.a, "b": LAW.b}
    for name, value in truth.items():
        iv = b3["params"][name]
        assert iv["high"] - iv["low"] > 0.01 * abs(iv["median"]), (name, iv)  # non-degenerate
        assert iv["low"] <= value <= iv["high"], (name, value, iv)
    n_true, d_true, l_true = LAW.optimal(1e21)
    ci = b3["predictions"]["1e+21"]
    for key, value in (("n_opt", n_true), ("d_opt", d_true), ("loss_opt", l_true)):
        assert ci[key]["low"] < value < ci[key]["high"], (key, value, ci[key])
        assert ci[key]["high"] > ci[key]["low"] * 1.01
    # Approach 2 on 3 budget bins (more bins leave too few runs per profile here): within-bin resampling,
    # failed refits counted, and an interval for a that contains the truth.
    b2 = fit["bootstrap"]["2"]
    assert b2["method"] == "within-budget" and 0 < b2["failed"] < 30
    assert b2["params"]["a"]["low"] < LAW.a < b2["params"]["a"]["high"]
    assert len(fit["approach2"]["minima"]) == 3

    # Negative control: resampling within budgets (the old default) on this table is refused, exit 2.
    rc = lmforge(
        [
            "scaling",
            "fit",
            str(table),
            "--n-col",
            "params_M",
            "--n-scale",
            "1e6",
            "--d-col",
            "tokens",
            "--loss-col",
            "loss",
            "--bootstrap",
            "10",
            "--bootstrap-method",
            "within-budget",
            "--out",
            str(tmp_path / "bad"),
        ]
    )
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and "zero width" in err


def test_jsonl_with_flops_column_downstream_metric_and_bad_input_fail_with_one_line(tmp_path, capsys):
    rows = published_table(seed=6)
    link = SigmoidLink(0.25, 0.8, -12.0, 2.45, "loss")  # a 4-way task's accuracy, a sigmoid of the loss
    for r in rows:
        r["acc"] = float(link(r["loss"]))
    jsonl = tmp_path / "runs.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows))
    # C given, D derived as C / (6N); no bootstrap: the point fits alone, the metric's link among them.
    assert (
        lmforge(
            [
                "scaling",
                "fit",
                str(jsonl),
                "--n-col",
                "params_M",
                "--n-scale",
                "1e6",
                "--c-col",
                "flops",
                "--loss-col",
                "loss",
                "--approach",
                "3",
                "--bootstrap",
                "0",
                "--targets",
                "1e21",
                "--metric-col",
                "acc",
                "--metric-chance",
                "0.25",
                "--out",
                str(tmp_path / "j"),
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    fit = json.loads((tmp_path / "j" / "fit.json").read_text())
    assert fit["approach3"]["a"] == pytest.approx(LAW.a, abs=0.08) and fit["source"]["columns"]["d"] == "C / (6 N)"
    ds = fit["downstream"]
    assert ds["metric"] == "acc" and ds["floor"] == 0.25 and ds["slope"] == pytest.approx(-12.0, rel=0.05)
    assert ds["mid"] == pytest.approx(2.45, abs=0.01) and ds["predictions"][0]["x"] == pytest.approx(
        fit["predictions"][0]["loss_opt"]
    )
    assert "Downstream acc: 0.25 + (0.8 - 0.25) * sigmoid(-12" in out
    capsys.readouterr()
    csv = write_csv(rows, tmp_path / "runs.csv")
    five = write_csv(rows[:5], tmp_path / "five.csv")
    base = ["scaling", "fit", "--bootstrap", "0", "--out", str(tmp_path / "x")]
    cases = [
        (
            [str(csv), "--n-col", "params", "--d-col", "tokens", "--loss-col", "loss"],
            "--n-col params: is not a column of",
        ),
        (
            [str(csv), "--n-col", "params_M", "--d-col", "tokens", "--loss-col", "loss"],  # millions, unscaled
            "tokens per parameter, outside 0.01..100000: a column is in the wrong unit",
        ),
        (
            [
                str(csv),
                "--n-col",
                "params_M",
                "--n-scale",
                "1e6",
                "--d-col",
                "tokens",
                "--c-col",
                "flops",
                "--c-scale",
                "1e-3",
                "--loss-col",
                "loss",
            ],
            "C / (6 N D) is 0.001",
        ),
        (
            [str(five), "--n-col", "params_M", "--n-scale", "1e6", "--d-col", "tokens", "--loss-col", "loss"],
            "has 5 usable run(s) after filters; a fit needs at least 6",
        ),
        ([str(csv), "--n-col", "params_M", "--n-scale", "1e6", "--loss-col", "loss"], "neither --d-col nor --c-col"),
    ]
    for args, expected in cases:
        assert lmforge(base[:2] + args + base[2:]) == 2, args
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and err.startswith("lmforge scaling: ") and expected in err, (args, err)
        assert "Fix:" in err
