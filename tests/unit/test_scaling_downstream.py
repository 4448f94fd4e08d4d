"""The downstream link: an eval metric as a sigmoid of loss or of compute, recovered from synthetic runs."""

from __future__ import annotations

import numpy as np
import pytest

from lmforge.scaling.downstream import SigmoidLink, bootstrap_link, fit_link
from lmforge.scaling.errors import ScalingError


def test_sigmoidal_link_parameters_are_recovered_against_loss_and_compute():
    rng = np.random.default_rng(0)
    # Against loss: four-way multiple choice, chance 0.25, ceiling 0.85, the mid-point at loss 2.6.
    truth = SigmoidLink(0.25, 0.85, -6.0, 2.6, "loss")
    loss = rng.uniform(2.0, 3.3, 40)
    acc = truth(loss) + rng.normal(0, 0.01, 40)
    fit = fit_link(loss, acc, "loss", name="eval/arc/acc")
    assert fit.link.floor == pytest.approx(0.25, abs=0.03) and fit.link.ceiling == pytest.approx(0.85, abs=0.03)
    assert fit.link.slope == pytest.approx(-6.0, rel=0.15) and fit.link.mid == pytest.approx(2.6, abs=0.03)
    assert fit.rms == pytest.approx(0.01, rel=0.3)
    # Chance level fixed: three parameters, the same answer; intervals by resampling runs contain the truth.
    fixed = bootstrap_link(fit_link(loss, acc, "loss", floor=0.25), loss, acc, replicates=40, at=[2.0])
    assert fixed.link.floor == 0.25 and fixed.intervals["mid"]["low"] < 2.6 < fixed.intervals["mid"]["high"]
    assert fixed.intervals["slope"]["low"] < -6.0 < fixed.intervals["slope"]["high"]
    (pred,) = fixed.predictions
    assert pred["low"] < float(truth(2.0)) < pred["high"]
    # Against compute: the metric rises with ln C.
    truth_c = SigmoidLink(0.0, 0.6, 1.5, np.log(1e21), "compute")
    c = np.exp(rng.uniform(np.log(1e19), np.log(1e23), 30))
    fit_c = fit_link(c, truth_c(c) + rng.normal(0, 0.005, 30), "compute")
    assert fit_c.link.slope == pytest.approx(1.5, rel=0.15) and fit_c.link.mid == pytest.approx(np.log(1e21), abs=0.2)
    assert fit_c.link.ceiling == pytest.approx(0.6, abs=0.03)


def test_a_constant_metric_or_too_few_runs_is_refused():
    with pytest.raises(ScalingError, match="every run scores 0.25: a constant has no link"):
        fit_link(np.linspace(2, 3, 8), np.full(8, 0.25))
    with pytest.raises(ScalingError, match="needs at least 5"):
        fit_link([2.0, 2.5, 3.0], [0.5, 0.4, 0.3])
    # Negative control: a straight line is not mistaken for the truth's S-curve (its slope is far off).
    loss = np.linspace(2.0, 3.3, 30)
    wrong = fit_link(loss, 0.9 - 0.2 * loss, "loss")
    assert abs(wrong.link.slope - (-6.0)) > 2.0
