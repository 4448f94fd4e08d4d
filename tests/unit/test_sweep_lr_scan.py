"""benchmarks/sweep_lr_scan.py's choice of a rate per size and benchmarks/sweep_compare.py's verdict, on tables whose
answers are known (the scan's and the comparison's training runs are benchmarks, not tests)."""

from __future__ import annotations

import math

import pytest

from benchmarks.sweep_compare import compare
from benchmarks.sweep_lr_scan import tune

GRID = [0.005, 0.01, 0.02, 0.04]


def _rows(best: dict, budgets: int = 1) -> list:
    """Final losses whose minimum over the grid is at ``best[size]``: a parabola in log2(lr)."""
    return [
        {"n_layers": n, "d_model": w, "scan_lr": lr, "final_val_loss": 3.0 + 0.1 * math.log2(lr / best[(n, w)]) ** 2}
        for (n, w) in best
        for lr in GRID
        for _ in range(budgets)
    ]


def test_each_size_takes_its_best_rate_and_unscanned_sizes_follow_the_power_law():
    # lr = 0.16 / width * layers^-1: the law the scan fits through the tuned sizes
    best = {(1, 8): 0.02, (1, 16): 0.01, (2, 16): 0.005, (2, 8): 0.01, (1, 32): 0.005}
    out = tune(_rows(best, budgets=2), GRID, [*best, (2, 32)])
    assert out["tuned"] == {f"l{n}-d{w}": lr for (n, w), lr in best.items()}
    assert out["extrapolated"] == ["l2-d32"]
    assert out["power_law"]["p"] == pytest.approx(1.0) and out["power_law"]["q"] == pytest.approx(1.0)
    assert out["lr_by_size"]["l2-d32"] == pytest.approx(0.0025)
    assert sorted(out["edge"]) == ["l1-d32", "l2-d16"]  # at the grid's low end: widen it


def _fit(a2, b2, a3, b3, alpha=(1.0, 0.5, 1.5), beta=(0.5, 0.3, 0.7)):
    def iv(t):
        return {"low": t[1], "high": t[2]}

    return {
        "approach2": {"a": a2[0], "b": b2[0]},
        "approach3": {"a": a3[0], "b": b3[0], "alpha": alpha[0], "beta": beta[0]},
        "bootstrap": {
            "2": {"params": {"a": iv(a2), "b": iv(b2)}},
            "3": {"params": {"a": iv(a3), "b": iv(b3), "alpha": iv(alpha), "beta": iv(beta)}},
        },
    }


def test_the_comparison_passes_overlapping_intervals_at_most_half_again_as_wide():
    ref = _fit((0.5, 0.4, 0.6), (0.5, 0.4, 0.6), (0.4, 0.3, 0.5), (0.6, 0.5, 0.7))
    same_width = _fit((0.55, 0.45, 0.65), (0.45, 0.35, 0.55), (0.4, 0.3, 0.5), (0.6, 0.5, 0.7))
    assert compare(ref, same_width, 1.5)[1]
    wider = _fit((0.5, 0.38, 0.62), (0.5, 0.4, 0.6), (0.4, 0.25, 0.55), (0.6, 0.5, 0.7))  # Approach 3's a: 1.5x
    rows, ok = compare(ref, wider, 1.5)
    assert ok and [r["width_ratio"] for r in rows][2] == pytest.approx(1.5)
    # Negative controls: too wide (1.6x), and disjoint
    assert not compare(ref, _fit((0.5, 0.34, 0.66), (0.5, 0.4, 0.6), (0.4, 0.3, 0.5), (0.6, 0.5, 0.7)), 1.5)[1]
    assert not compare(ref, _fit((0.7, 0.61, 0.79), (0.5, 0.4, 0.6), (0.4, 0.3, 0.5), (0.6, 0.5, 0.7)), 1.5)[1]
    # alpha and beta are shown, not judged: a disjoint alpha does not fail the comparison
    assert compare(ref, _fit((0.5, 0.4, 0.6), (0.5, 0.4, 0.6), (0.4, 0.3, 0.5), (0.6, 0.5, 0.7), (3, 2.5, 3.5)), 1.5)[1]
