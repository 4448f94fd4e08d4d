"""Calibration of the bootstrap: over 100 synthetic tables drawn from a known law, do the 95% intervals of
a, b, N*(C) and D*(C) cover the truth in 90-99% of them, on an IsoFLOP grid and on a scattered design?

Noise is realistic for final losses: Gaussian log-loss noise (sd 0.01) plus, for 10% of the runs, a
positive exponential excess of mean 0.08 (runs that trained worse: a bad seed, a loss spike), which the
Huber loss must absorb. Each table is fitted and bootstrapped with the defaults ``lmforge scaling fit``
uses (``method='auto'``), all tables in one batch (``fit_approach3_many``, ``bootstrap_approach3_many``).
39 replicates per table: the 2.5% and 97.5% percentiles of 39 draws are (nearly) their extremes, whose
coverage is 38/40 = 95% for exchangeable draws, so this small count does not bias the check; the
coverage estimate's own binomial error over 100 tables is about 2 points.
"""

from __future__ import annotations

import numpy as np
import pytest

from lmforge.scaling.approach3 import fit_approach3_many
from lmforge.scaling.bootstrap import SCATTERED, _approach3_draws, bootstrap, bootstrap_approach3_many, design_of
from lmforge.scaling.data import Observations
from lmforge.scaling.errors import ScalingError
from lmforge.scaling.laws import CHINCHILLA_LAW as LAW

TABLES, REPLICATES, TARGET = 100, 39, 1e21  # the target: 10x beyond the largest budget


def log_noise(rng, n, sd=0.01, outliers=0.1, excess=0.08):
    e = rng.normal(0.0, sd, n)
    bad = rng.random(n) < outliers
    e[bad] += rng.exponential(excess, int(bad.sum()))
    return e


def grid_table(rng, budgets=(1e18, 3e18, 1e19, 3e19, 1e20), sizes=7, span=6.0) -> Observations:
    """An IsoFLOP grid: 7 sizes per budget, spread x/÷ 6 around the law's optimum."""
    c = np.repeat(budgets, sizes)
    n = np.concatenate([LAW.optimal(b)[0] * np.geomspace(1 / span, span, sizes) for b in budgets])
    d = c / (6 * n)
    return Observations(c, n, d, LAW.loss(n, d) * np.exp(log_noise(rng, len(n))))


def scattered_table(rng, runs=35, lo=1e18, hi=1e20, span=6.0) -> Observations:
    """Every run at its own budget (log-uniform), its size log-uniform within x/÷ 6 of that budget's optimum."""
    c = np.exp(rng.uniform(np.log(lo), np.log(hi), runs))
    n = LAW.optimal(c)[0] * np.exp(rng.uniform(-np.log(span), np.log(span), runs))
    d = c / (6 * n)
    return Observations(c, n, d, LAW.loss(n, d) * np.exp(log_noise(rng, runs)))


def coverage(make, seed) -> tuple[dict, int, set]:
    rng = np.random.default_rng(seed)
    tables = [make(rng) for _ in range(TABLES)]
    fits = fit_approach3_many(tables, top_k=2)
    results = bootstrap_approach3_many(tables, [f.law for f in fits], REPLICATES, [TARGET], seed=seed)
    n_true, d_true, _ = LAW.optimal(TARGET)
    truth = {"a": LAW.a, "b": LAW.b}
    hits = {"a": 0, "b": 0, "N*(1e21)": 0, "D*(1e21)": 0}
    for r in results:
        for k in ("a", "b"):
            hits[k] += r.params[k].low <= truth[k] <= r.params[k].high
        p = r.predictions[f"{TARGET:.6g}"]
        hits["N*(1e21)"] += p["n_opt"].low <= n_true <= p["n_opt"].high
        hits["D*(1e21)"] += p["d_opt"].low <= d_true <= p["d_opt"].high
    return (
        {k: v / TABLES for k, v in hits.items()},
        sum(r.failed for r in results),
        {(r.method, r.design) for r in results},
    )


@pytest.mark.timeout(900)
def test_95_percent_intervals_cover_the_truth_in_90_to_99_percent_of_tables(capsys):
    table = {}
    for name, make, seed, method in (
        ("IsoFLOP grid", grid_table, 1, ("within-budget", "isoflop-grid")),
        ("scattered", scattered_table, 2, ("runs", SCATTERED)),
    ):
        cov, failed, methods = coverage(make, seed)
        assert methods == {method}, methods  # the default follows the design
        table[name] = (cov, failed)
    with capsys.disabled():
        print(f"\ncoverage of 95% intervals over {TABLES} tables ({REPLICATES} bootstrap replicates each):")
        for name, (cov, failed) in table.items():
            print(
                f"  {name:<13} "
                + "  ".join(f"{k} {v:.2f}" for k, v in cov.items())
                + f"  (failed refits {failed}/{TABLES * REPLICATES})"
            )
    for name, (cov, failed) in table.items():
        for k, v in cov.items():
            assert 0.90 <= v <= 0.99, (name, k, v)
        assert failed < 0.1 * TABLES * REPLICATES, (name, failed)


def test_within_budget_resampling_of_a_scattered_table_is_refused_not_collapsed():
    """The negative control: on a table with one run per budget, resampling within budgets redraws every
    run onto itself (all multiplicities 1, so every replicate is the original fit and every interval has
    zero width, the bug this replaces). Asked for explicitly, it is refused with the fix named."""
    obs = scattered_table(np.random.default_rng(5))
    assert design_of(obs) == SCATTERED and len(obs.budgets()) == len(obs)
    _, weights = _approach3_draws(obs, "within-budget", 5, LAW, 6, np.random.default_rng(0))
    assert (weights == 1).all()
    with pytest.raises(ScalingError) as e:
        bootstrap(obs, "3", 5, method="within-budget", point_law=LAW)
    assert "every budget of this table holds one run" in str(e.value) and "zero width" in str(e.value)
    assert "--bootstrap-method auto" in str(e.value)
