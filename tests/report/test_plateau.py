"""The plateau rule (:mod:`smallbatch.report.plateau`) on designed curves, each with the budget it
must give written by hand: a probe's plateau is where doubling the budget stopped moving its mean
by what the seeds can detect, and a still-rising curve has none."""

from __future__ import annotations

import math

import pytest

from smallbatch.report.plateau import MOVING, NO_DOUBLING, PLATEAU, doublings, plateau

#: per-seed noise shared by every budget of a seed (one run's snapshots: pairing removes it)
SHARED = [1.5, -2.0, 0.5, -0.5, 1.0, -0.5]
#: each budget's own noise, a different order of the same six numbers (mean 0, so a budget's mean
#: is exactly the designed one); paired differences of two budgets then have an sd of about 0.3,
#: an MDE (6 seeds, 80 % power) of about 0.5 points
OWN = [
    [0.3, -0.3, 0.2, -0.2, 0.1, -0.1],
    [-0.1, 0.2, 0.3, -0.3, -0.2, 0.1],
    [0.2, 0.1, -0.3, 0.3, -0.1, -0.2],
    [-0.3, -0.1, 0.1, 0.2, 0.3, -0.2],
    [0.1, 0.3, -0.2, -0.1, -0.3, 0.2],
]
BUDGETS = [2.0, 4.0, 8.0, 16.0]


def _curve(means, scale=1.0, budgets=BUDGETS, seeds=6):
    """budget -> {seed: designed mean + the seed's shared noise + scale × the budget's own noise}."""
    return {
        b: {s: m + SHARED[s] + scale * OWN[i][s] for s in range(seeds)} for i, (b, m) in enumerate(zip(budgets, means))
    }


@pytest.mark.parametrize(
    "name, means, expected",
    [
        ("flat from the start: flat at the first doubling", [70, 70, 70, 70], 4.0),
        ("rising, then flat from 4 to 8 and 8 to 16", [60, 66, 66, 66], 8.0),
        ("rising until 8, flat over the last doubling", [60, 64, 67, 67], 16.0),
    ],
)
def test_a_curve_that_stopped_moving_has_its_plateau_where_it_stopped(name, means, expected):
    p = plateau(_curve(means))
    assert p.status == PLATEAU, name
    assert p.epochs == expected, name
    assert p.reached and f"plateau at {expected:g} epochs" in p.text()


@pytest.mark.parametrize(
    "name, means",
    [
        ("still rising by 3 points a doubling", [60, 63, 66, 69]),
        ("rising by 1 point over the last doubling only (MDE about 0.5)", [66, 66, 66, 67]),
        ("falling over the last doubling", [66, 66, 66, 64]),
    ],
)
def test_a_curve_still_moving_over_its_last_doubling_has_no_plateau(name, means):
    p = plateau(_curve(means))
    assert p.status == MOVING and not p.reached, name
    assert math.isnan(p.epochs), name
    assert p.text().startswith("no plateau yet"), name


def test_noise_decides_through_the_mde_the_same_means_flat_with_wide_seeds_moving_with_tight_ones():
    """Means 70, 70.8, 70.2, 71.0: a change of 0.6-0.8 points a doubling.  With seeds ten times as
    spread (MDE about 5) none is detectable, so the curve is flat from the first doubling; with the
    tight seeds (MDE about 0.5) every one is, so there is no plateau yet."""
    means = [70.0, 70.8, 70.2, 71.0]
    wide = plateau(_curve(means, scale=10.0))
    assert wide.status == PLATEAU and wide.epochs == 4.0
    assert all(d.mde > 2.0 for d in wide.steps)
    tight = plateau(_curve(means, scale=1.0))
    assert tight.status == MOVING
    assert [round(d.change, 6) for d in tight.steps] == [0.8, -0.6, 0.8]


def test_one_seed_cannot_be_judged_and_gives_no_plateau():
    p = plateau(_curve([70, 70, 70, 70], seeds=1))
    assert p.status == MOVING and all(d.flat is None for d in p.steps)


def test_only_doublings_are_read():
    # the instrument's small-batch snapshots: fixed-steps budgets, then fixed-epochs ones
    assert doublings([0.1248, 0.2496, 0.4992, 2, 4, 8]) == [(0.1248, 0.2496), (0.2496, 0.4992), (2.0, 4.0), (4.0, 8.0)]
    p = plateau(_curve([60, 61, 62], budgets=[2.0, 3.0, 5.0]))
    assert p.status == NO_DOUBLING and math.isnan(p.epochs)
    assert p.text() == "no doubling of the budget measured"
