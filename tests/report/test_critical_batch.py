"""The critical-batch fit: S(B) = S_min (1 + B_noise / B) recovered from synthetic
steps-to-target curves (float64), its bootstrap interval, the derived critical batches,
and a curve without diminishing returns reported as such."""

from __future__ import annotations

import numpy as np
import pytest

from smallbatch.report.critical_batch import (
    bootstrap_fit,
    fit_steps,
    images_to_target,
    overhead_batch,
    steps_to_target,
)

BATCHES = [16, 32, 64, 128, 256, 512, 1024]
S_MIN, B_NOISE = 1000.0, 200.0
SIGMA = 0.05  # multiplicative noise: log S has standard deviation 0.05 (5 % per run)


def _curve(seeds: int, sigma: float, rng_seed: int = 7) -> dict[int, list[float]]:
    """Each seed's steps at each batch: the model's value times exp(sigma * N(0, 1))."""
    rng = np.random.default_rng(rng_seed)
    return {b: list(S_MIN * (1 + B_NOISE / b) * np.exp(sigma * rng.standard_normal(seeds))) for b in BATCHES}


def test_the_model_and_its_critical_batches_by_hand():
    assert steps_to_target(50, 1000, 200) == pytest.approx(5000)  # 1000 (1 + 4)
    assert images_to_target(50, 1000, 200) == pytest.approx(250_000)  # 50 * 5000
    # Zhang et al.: 20 % above perfect scaling S_lin = 1000 * 200 / B; at B = 40: S = 6000, S_lin = 5000
    assert overhead_batch(200) == pytest.approx(40)
    assert steps_to_target(40, 1000, 200) / 5000 == pytest.approx(1.2)


def test_a_noiseless_curve_is_recovered_exactly():
    fit = fit_steps(_curve(seeds=1, sigma=0.0))
    assert fit.s_min == pytest.approx(S_MIN, rel=1e-6)
    assert fit.b_noise == pytest.approx(B_NOISE, rel=1e-6)
    assert fit.where == "within" and fit.b_crit == pytest.approx(200, rel=1e-6)
    assert fit.b_zhang == pytest.approx(40, rel=1e-6)


def test_the_fit_recovers_b_noise_and_s_min_from_noisy_seeds():
    """4 seeds, 5 % noise per run: over repeated draws the fit's spread is about 3.5 % of
    B_noise and 2 % of S_min (28 points); 15 % and 8 % are 4 of those spreads."""
    fit = fit_steps(_curve(seeds=4, sigma=SIGMA))
    assert fit.b_noise == pytest.approx(B_NOISE, rel=0.15)
    assert fit.s_min == pytest.approx(S_MIN, rel=0.08)


def test_the_bootstrap_interval_over_seeds_covers_the_truth():
    """30 synthetic studies of 4 seeds: the 95 % interval holds the true B_noise and S_min in
    most of them.  Resampling 4 seeds per batch makes the percentile interval narrower than
    its level (simulated here: it covers about 82 % of the time at 4 seeds, 89 % at 6), so
    the bar is 2/3: three binomial standard deviations below 0.82 at 30 studies."""
    covered_b = covered_s = 0
    for study in range(30):
        steps = _curve(seeds=4, sigma=SIGMA, rng_seed=100 + study)
        iv = bootstrap_fit(steps, replicas=200, level=0.95, seed=study)
        covered_b += iv.b_noise[0] < B_NOISE < iv.b_noise[1]
        covered_s += iv.s_min[0] < S_MIN < iv.s_min[1]
        assert iv.b_noise[1] - iv.b_noise[0] < 0.5 * B_NOISE  # an interval, not the whole axis
        assert iv.above == 0.0
    assert covered_b >= 20 and covered_s >= 20


def test_pure_linear_scaling_is_reported_above_the_largest_batch():
    rng = np.random.default_rng(3)
    steps = {b: list(1e5 / b * np.exp(SIGMA * rng.standard_normal(3))) for b in BATCHES}
    fit = fit_steps(steps)
    assert fit.where == "above"
    assert fit.b_crit is None and fit.b_zhang is None
    assert fit.describe().startswith("B_noise above the largest batch measured (1024)")


def test_a_flat_curve_is_reported_below_the_smallest_batch():
    rng = np.random.default_rng(4)
    steps = {b: list(3000 * np.exp(SIGMA * rng.standard_normal(3))) for b in BATCHES}
    fit = fit_steps(steps)
    assert fit.where == "below" and fit.b_crit is None
    assert "below the smallest batch measured (16)" in fit.describe()


@pytest.mark.parametrize(
    "steps, word",
    [({16: [100.0], 32: [-1.0]}, "positive"), ({16: [100.0, 90.0]}, "two or more batch sizes")],
)
def test_bad_steps_are_refused_in_one_line(steps, word):
    with pytest.raises(ValueError, match=word):
        fit_steps(steps)
