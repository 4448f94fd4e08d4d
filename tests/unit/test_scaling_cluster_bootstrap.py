"""The cluster bootstrap of a wsd-branches sweep: cooldown branches of one stable run share its trajectory, so the
bootstrap draws whole stable runs (``stable-runs``), and ``auto`` picks it whenever the table names stable runs.

Synthetic data with that structure: 7 sizes, each one stable run, branched at 6 budgets; every size's losses share
one offset (its stable run's luck) on top of a small per-run noise. Resampling runs as if independent (``runs``,
``within-budget``) reports intervals far narrower than drawing the 7 stable runs does (the negative control)."""

from __future__ import annotations

import numpy as np
import pytest

from lmforge.scaling.approach3 import fit_approach3
from lmforge.scaling.bootstrap import _approach3_draws, bootstrap, check_method, default_method, design_of
from lmforge.scaling.data import Observations, observations_from_rows
from lmforge.scaling.errors import ScalingError
from lmforge.scaling.laws import CHINCHILLA_LAW as LAW

SIZES = 7


def branched_table(seed: int, run_offset: float = 0.02, noise: float = 0.001) -> Observations:
    rng = np.random.default_rng(seed)
    mid = LAW.optimal(3e19)[0]
    sizes = np.geomspace(mid / 5, mid * 5, SIZES)
    offset = rng.normal(0, run_offset, SIZES)  # one per stable run, shared by all its branches
    rows = []
    for c in np.geomspace(1e19, 1e20, 6):
        for k, n in enumerate(sizes):
            d = c / (6 * n)
            loss = float(LAW.loss(n, d)) * float(np.exp(offset[k] + rng.normal(0, noise)))
            rows.append((c, n, d, loss, f"stable-{k}"))
    c, n, d, loss, stable = zip(*rows)
    return Observations(c, n, d, loss, groups=list(stable))


def test_each_replicate_draws_whole_stable_runs():
    obs = branched_table(0)
    labels = np.asarray(obs.groups)
    law = fit_approach3(obs).law
    rng = np.random.default_rng(0)
    _, weights = _approach3_draws(obs, "stable-runs", 50, law, 6, rng)
    for w in weights:  # every branch of a stable run is drawn as often as its siblings
        assert all(len(set(w[labels == g].tolist())) == 1 for g in set(obs.groups))
    assert any(len(set(w.tolist())) > 1 for w in weights)  # and the draws differ between stable runs
    _, iid = _approach3_draws(obs, "runs", 50, law, 6, np.random.default_rng(0))
    split = [any(len(set(w[labels == g].tolist())) > 1 for g in set(obs.groups)) for w in iid]
    assert all(split)  # control: drawing runs breaks the stable runs apart


def test_iid_resampling_understates_the_exponents_spread_on_clustered_losses():
    widths = {"stable-runs": [], "runs": [], "within-budget": []}
    for seed in range(3):
        obs = branched_table(seed)
        law = fit_approach3(obs).law
        for method in widths:
            res = bootstrap(obs, "3", replicates=60, seed=1, method=method, point_law=law)
            widths[method].append(res.params["a"].high - res.params["a"].low)
    cluster = float(np.mean(widths["stable-runs"]))
    assert cluster > 1.3 * float(np.mean(widths["runs"])), widths
    assert cluster > 1.3 * float(np.mean(widths["within-budget"])), widths


def test_auto_resamples_stable_runs_when_the_table_names_them():
    obs = branched_table(1)
    assert design_of(obs) == "isoflop-grid" and default_method(design_of(obs), "2", obs) == "stable-runs"
    assert bootstrap(obs, "2", replicates=10, seed=0).method == "stable-runs"
    law = fit_approach3(obs).law
    assert bootstrap(obs, "3", replicates=10, seed=0, point_law=law).method == "stable-runs"
    plain = Observations(obs.budget, obs.n, obs.d, obs.loss)  # control: runs from scratch, no provenance
    assert default_method(design_of(plain), "2", plain) == "within-budget"


def test_collected_rows_carry_the_stable_run_into_the_observations():
    rows = [
        {"id": f"c{c}-{k}", "budget": c, "n_flops": n, "tokens": c / (6 * n), "final_val_loss": 3.0, "stable_run": k}
        for c in (1e10, 2e10)
        for k, n in (("stable-a", 1e4), ("stable-b", 2e4))
    ]
    obs = observations_from_rows(rows)
    assert obs.groups == ["stable-a", "stable-b", "stable-a", "stable-b"] and obs.clustered()
    assert obs.subset([1, 3]).groups == ["stable-b", "stable-b"]
    scratch = observations_from_rows([{k: v for k, v in r.items() if k != "stable_run"} for r in rows])
    assert scratch.groups is None and not scratch.clustered()


def test_stable_runs_method_needs_three_stable_runs():
    obs = branched_table(0)
    two = obs.subset([i for i, g in enumerate(obs.groups) if g in ("stable-0", "stable-1")])
    with pytest.raises(ScalingError, match="names 2 stable run"):
        check_method(two, "stable-runs", 6)
    with pytest.raises(ScalingError, match="names 0 stable run"):
        check_method(Observations(obs.budget, obs.n, obs.d, obs.loss), "stable-runs", 6)
