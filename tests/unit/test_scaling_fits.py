"""Scaling-law fits on points generated from a known law (Hoffmann et al.'s published constants)."""

from __future__ import annotations

import numpy as np
import pytest

from lmforge.scaling.approach2 import fit_approach2
from lmforge.scaling.approach3 import fit_approach3
from lmforge.scaling.bootstrap import bootstrap
from lmforge.scaling.data import Observations
from lmforge.scaling.errors import ScalingError
from lmforge.scaling.laws import CHINCHILLA, CHINCHILLA_LAW, Law

BUDGETS = [1e18, 3e18, 1e19, 3e19, 1e20, 3e20]


def synthetic(
    law: Law = CHINCHILLA_LAW, budgets=BUDGETS, sizes: int = 9, span: float = 8.0, noise: float = 0.005, seed: int = 0
) -> Observations:
    """IsoFLOP grids centred on the law's optimum, ln-loss noise with standard deviation ``noise``."""
    rng = np.random.default_rng(seed)
    rows = []
    for c in budgets:
        n_opt, _, _ = law.optimal(c)
        for f in np.geomspace(1 / span, span, sizes):
            n = n_opt * f
            d = c / (6 * n)
            rows.append((c, n, d, float(law.loss(n, d)) * float(np.exp(rng.normal(0, noise)))))
    c, n, d, loss = map(np.array, zip(*rows))
    return Observations(c, n, d, loss)


def test_approach3_recovers_the_known_law():
    fit = fit_approach3(synthetic())
    law = fit.law
    assert law.E == pytest.approx(1.69, abs=0.05)
    assert law.alpha == pytest.approx(0.34, abs=0.03)
    assert law.beta == pytest.approx(0.28, abs=0.03)
    assert np.log(law.A) == pytest.approx(np.log(406.4), abs=0.5)
    assert np.log(law.B) == pytest.approx(np.log(410.7), abs=0.5)
    assert law.a == pytest.approx(0.28 / 0.62, abs=0.02)
    # Compute-optimal predictions at a budget far beyond the grid agree with the true law within 15%.
    n_true, d_true, l_true = CHINCHILLA_LAW.optimal(1e23)
    n_fit, d_fit, l_fit = law.optimal(1e23)
    assert n_fit == pytest.approx(n_true, rel=0.15) and d_fit == pytest.approx(d_true, rel=0.15)
    assert l_fit == pytest.approx(l_true, rel=0.01)


def test_approach2_recovers_the_exponent_beta_over_alpha_plus_beta():
    fit = fit_approach2(synthetic())
    expected_a = 0.28 / (0.34 + 0.28)
    assert fit.n_law.exponent == pytest.approx(expected_a, abs=0.02)
    assert fit.d_law.exponent == pytest.approx(1 - expected_a, abs=0.02)
    # The minima lie near the true optima (the parabola is only an approximation of the profile).
    for m in fit.minima:
        n_true, _, _ = CHINCHILLA_LAW.optimal(m.budget)
        assert m.n_opt == pytest.approx(n_true, rel=0.25)


def test_huber_is_robust_to_outliers_where_least_squares_is_not():
    obs = synthetic(noise=0.002, seed=1)
    rng = np.random.default_rng(7)
    bad = rng.choice(len(obs), size=len(obs) // 10, replace=False)  # 10% of runs: loss 30% too high (diverged)
    obs.loss[bad] *= 1.3
    huber = fit_approach3(obs).law
    squares = fit_approach3(obs, delta=None).law
    assert huber.alpha == pytest.approx(0.34, abs=0.04)
    assert huber.beta == pytest.approx(0.28, abs=0.04)
    assert huber.E == pytest.approx(1.69, abs=0.1)
    err_h = abs(huber.alpha - 0.34) + abs(huber.beta - 0.28) + abs(huber.E - 1.69)
    err_s = abs(squares.alpha - 0.34) + abs(squares.beta - 0.28) + abs(squares.E - 1.69)
    assert err_s > 2 * err_h, (huber, squares)


def test_bootstrap_intervals_cover_the_truth():
    obs = synthetic(budgets=BUDGETS[:4], sizes=7, noise=0.01, seed=3)
    b2 = bootstrap(obs, "2", replicates=30, targets=[1e22], seed=0)
    assert b2.params["a"].low < 0.28 / 0.62 < b2.params["a"].high
    fit3 = fit_approach3(obs)
    b3 = bootstrap(obs, "3", replicates=8, targets=[1e22], seed=0, point_law=fit3.law)
    iv = b3.params["alpha"]
    assert iv.low <= fit3.law.alpha <= iv.high and iv.high - iv.low < 0.3
    n_true, _, _ = CHINCHILLA_LAW.optimal(1e22)
    p = b3.predictions["1e+22"]["n_opt"]
    assert p.low < p.high and p.low < n_true * 1.5 and p.high > n_true / 1.5


def test_too_few_points_per_budget_names_the_budget():
    obs = synthetic(budgets=[1e18, 1e19], sizes=5)
    keep = [i for i in range(len(obs)) if not (obs.budget[i] == 1e19 and i % 5 > 1)]
    with pytest.raises(ScalingError) as e:
        fit_approach2(obs.subset(keep))
    msg = str(e.value)
    assert "budget C=1e+19" in msg and "2 distinct model size(s)" in msg and "at least 3" in msg
    assert "Fix:" in msg


def test_non_positive_losses_are_refused_with_the_run_named():
    obs = synthetic(budgets=[1e18, 1e19], sizes=5)
    obs.loss[3] = 0.0
    obs.ids[3] = "c1e18-l4-d256"
    for fit in (fit_approach2, fit_approach3):
        with pytest.raises(ScalingError) as e:
            fit(obs)
        assert "run 'c1e18-l4-d256'" in str(e.value) and "finite positive" in str(e.value)
    obs.loss[3] = float("nan")
    with pytest.raises(ScalingError, match="finite positive"):
        fit_approach2(obs)


def test_budget_without_interior_minimum_says_which_and_how_to_extend():
    good = synthetic(budgets=[1e18], sizes=7)
    # At 1e20 only models far smaller than the optimum: the loss falls monotonically towards the grid's edge.
    c = 1e20
    n_opt, _, _ = CHINCHILLA_LAW.optimal(c)
    n = n_opt * np.geomspace(1 / 400, 1 / 20, 6)
    d = c / (6 * n)
    edge = Observations([c] * 6, n, d, CHINCHILLA_LAW.loss(n, d))
    obs = Observations(
        np.r_[good.budget, edge.budget], np.r_[good.n, edge.n], np.r_[good.d, edge.d], np.r_[good.loss, edge.loss]
    )
    with pytest.raises(ScalingError) as e:
        fit_approach2(obs)
    msg = str(e.value)
    assert msg.startswith("budget C=1e+20") and "not inside the grid" in msg or "no minimum inside the grid" in msg
    assert "extend the grid for this budget towards larger N" in msg


# A real tiny sweep (10 runs at 3e9 and 1e10 FLOPs) whose within-budget resamples include one that fits a
# degenerate law: alpha ~1.2e4 with ln A ~ -1400, so A = exp(ln A) underflows to 0.
DEGENERATE_RESAMPLE_TABLE = [
    (3e9, 5952, 83968, 4.1940),
    (3e9, 13568, 36864, 4.7967),
    (3e9, 18944, 26624, 5.0390),
    (3e9, 22272, 22528, 5.0745),
    (3e9, 33024, 15360, 5.0958),
    (1e10, 5952, 280064, 3.9726),
    (1e10, 13568, 122880, 3.8819),
    (1e10, 22272, 74752, 4.0249),
    (1e10, 42240, 39424, 4.9823),
    (1e10, 73920, 22528, 4.8425),
]


def test_law_without_finite_positive_coefficients_has_no_optimum():
    assert CHINCHILLA_LAW.has_optimum
    for bad in (dict(A=0.0), dict(B=float("inf")), dict(alpha=0.0), dict(beta=-0.1)):
        law = Law(**{**CHINCHILLA, **bad})
        assert not law.has_optimum
        with pytest.raises(ScalingError, match="does not decrease in both N and D"):
            law.optimal(1e21)


def test_approach3_bootstrap_counts_a_degenerate_replicate_as_failed_and_keeps_the_intervals():
    budget, n, d, loss = (np.array(col, dtype=float) for col in zip(*DEGENERATE_RESAMPLE_TABLE))
    obs = Observations(budget, n, d, loss)
    result = bootstrap(obs, "3", replicates=100, targets=[1e11], seed=0)
    # The degenerate replicate (and the unconverged ones) are counted, not fatal to every other replicate.
    assert 1 <= result.failed < 100
    assert result.method == "within-budget"
    for key in ("alpha", "beta", "a"):
        assert np.isfinite([result.params[key].low, result.params[key].high]).all()
    n_opt = result.predictions["1e+11"]["n_opt"]
    assert 0 < n_opt.low <= n_opt.median <= n_opt.high < np.inf
