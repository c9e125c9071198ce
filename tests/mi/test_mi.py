"""Tests of the correlated-Gaussian MI benchmark (smallbatch.mi.toy, pipeline.mi_job, the report's mi section)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from smallbatch.mi import toy as mi
from smallbatch.mi import training
from smallbatch.pipeline.mi_job import validate_section


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


# --------------------------------------------------------------------------- analytic part
def test_true_mi_closed_form():
    assert mi.true_mi(0.0, 7) == 0.0
    assert mi.true_mi(0.5, 1) == pytest.approx(-0.5 * math.log(0.75), rel=1e-12)
    assert mi.true_mi(-0.5, 1) == pytest.approx(mi.true_mi(0.5, 1), rel=1e-12)
    # d independent coordinate pairs: MI adds up
    assert mi.true_mi(0.9, 20) == pytest.approx(20 * mi.true_mi(0.9, 1), rel=1e-12)
    # strongly correlated pairs carry a lot of information
    assert mi.true_mi(0.999, 1) == pytest.approx(-0.5 * math.log(1 - 0.999**2), rel=1e-12)


@pytest.mark.parametrize("d", [1, 5, 20])
@pytest.mark.parametrize("target", [0.0, 0.5, 2.0, 4.0, 6.0, 8.0, 10.0])
def test_rho_for_mi_round_trip(d, target):
    rho = mi.rho_for_mi(target, d)
    assert 0.0 <= rho < 1.0
    # (rho near 1 is ill-conditioned: 10 nats in d=1 is rho = 1 - 1e-9)
    assert mi.true_mi(rho, d) == pytest.approx(target, rel=1e-7, abs=1e-9)


def test_rho_round_trip_from_rho():
    for rho in (0.01, 0.3, 0.7, 0.95, 0.999):
        assert mi.rho_for_mi(mi.true_mi(rho, 3), 3) == pytest.approx(rho, rel=1e-9)
    # the default grid: per-dimension correlation for 2..10 nats in 20 dimensions
    rhos = [mi.rho_for_mi(v, 20) for v in (2, 4, 6, 8, 10)]
    assert rhos == sorted(rhos)
    assert rhos[-1] == pytest.approx(math.sqrt(1 - math.exp(-1)), rel=1e-12)


def test_log_density_ratio_matches_multivariate_normal():
    """The closed-form ratio against torch's joint Gaussian density (an independent computation)."""
    d, rho = 3, 0.6
    x, y = mi.sample_correlated_gaussians(50, d, rho, torch.Generator().manual_seed(1), dtype=torch.float64)
    eye = torch.eye(d, dtype=torch.float64)
    cov = torch.cat([torch.cat([eye, rho * eye], 1), torch.cat([rho * eye, eye], 1)], 0)
    joint = torch.distributions.MultivariateNormal(torch.zeros(2 * d, dtype=torch.float64), cov)
    marg = torch.distributions.MultivariateNormal(torch.zeros(d, dtype=torch.float64), eye)
    ref = joint.log_prob(torch.cat([x, y], 1)) - marg.log_prob(x) - marg.log_prob(y)
    assert torch.allclose(mi.log_density_ratio(x, y, rho), ref, atol=1e-10)


def test_monte_carlo_mi_matches_analytic():
    """E_{p(x,y)}[log p(x,y)/(p(x)p(y))] over samples is the true MI (within 4 standard errors)."""
    d, rho = 4, 0.8
    x, y = mi.sample_correlated_gaussians(200_000, d, rho, torch.Generator().manual_seed(0), dtype=torch.float64)
    r = mi.log_density_ratio(x, y, rho)
    se = float(r.std()) / math.sqrt(r.numel())
    assert abs(float(r.mean()) - mi.true_mi(rho, d)) < 4 * se
    # and independent pairs (the product of marginals) have mean log ratio -KL(p(x)p(y) || p(x,y)) < 0
    y_shuffled = y[torch.randperm(y.shape[0], generator=torch.Generator().manual_seed(1))]
    assert float(mi.log_density_ratio(x, y_shuffled, rho).mean()) < -1.0


def test_sampling_reproducible_and_correlated():
    a = mi.sample_correlated_gaussians(1000, 6, 0.7, torch.Generator().manual_seed(3))
    b = mi.sample_correlated_gaussians(1000, 6, 0.7, torch.Generator().manual_seed(3))
    c = mi.sample_correlated_gaussians(1000, 6, 0.7, torch.Generator().manual_seed(4))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[0], c[0])
    x, y = mi.sample_correlated_gaussians(100_000, 2, 0.7, torch.Generator().manual_seed(5))
    corr = float(((x - x.mean(0)) * (y - y.mean(0))).mean(0).div(x.std(0) * y.std(0)).mean())
    assert corr == pytest.approx(0.7, abs=0.01)
    assert float(y.std(0).mean()) == pytest.approx(1.0, abs=0.01)


# --------------------------------------------------------------------------- estimators
def _random_scores(k, scale, seed=0, b=64):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, generator=g) * scale + scale, torch.randn(b, k, generator=g) * scale


@pytest.mark.parametrize("k", [1, 4, 64, 1024])
@pytest.mark.parametrize("scale", [0.1, 3.0, 100.0])
def test_infonce_estimate_never_exceeds_log_k_plus_1(k, scale):
    pos, neg = _random_scores(k, scale, seed=k)
    ceiling = mi.mi_ceiling("infonce", k)
    assert ceiling == pytest.approx(math.log(k + 1))
    for est in ("infonce", "flatnce"):
        assert float(mi.mi_estimate(est, pos, neg)) <= ceiling + 1e-6
    # a perfectly separating critic reaches the ceiling, a constant critic reports 0
    assert float(mi.mi_estimate("infonce", torch.full((8,), 1e4), torch.zeros(8, k))) == pytest.approx(ceiling)
    assert float(mi.mi_estimate("infonce", torch.zeros(8), torch.zeros(8, k))) == pytest.approx(0.0, abs=1e-6)


def test_eqco_estimate_ceiling_depends_on_alpha_not_k():
    pos, neg = _random_scores(16, 5.0)
    for alpha in (4.0, 16.0, 65536.0):
        ceil = mi.mi_ceiling("eqco", 16, alpha)
        assert ceil == pytest.approx(math.log(alpha + 1))
        assert mi.mi_ceiling("eqco", 1024, alpha) == ceil
        assert float(mi.mi_estimate("eqco", pos, neg, alpha=alpha)) <= ceil + 1e-6
        big = float(mi.mi_estimate("eqco", torch.full((4,), 1e4), torch.zeros(4, 16), alpha=alpha))
        assert big == pytest.approx(ceil)
    # alpha = K gives back the InfoNCE estimate exactly
    nce = float(mi.mi_estimate("infonce", pos, neg))
    assert float(mi.mi_estimate("eqco", pos, neg, alpha=16)) == pytest.approx(nce, abs=1e-5)
    # EqCo with alpha >> K can exceed the InfoNCE ceiling log(K+1)
    assert float(mi.mi_estimate("eqco", torch.full((4,), 30.0), torch.zeros(4, 16), alpha=65536)) > math.log(17) + 1


def test_estimates_match_plain_formulas():
    pos, neg = _random_scores(8, 2.0, seed=7, b=32)
    lse_all = torch.logsumexp(torch.cat([pos[:, None], neg], 1), 1)
    ref_nce = math.log(9) - float((lse_all - pos).mean())
    assert float(mi.mi_estimate("infonce", pos, neg)) == pytest.approx(ref_nce, abs=1e-5)
    assert float(mi.mi_estimate("flatnce", pos, neg)) == pytest.approx(ref_nce, abs=1e-5)
    alpha = 100.0
    ref_eq = math.log(alpha + 1) - float(torch.log1p(alpha / 8 * torch.exp(neg - pos[:, None]).sum(1)).mean())
    assert float(mi.mi_estimate("eqco", pos, neg, alpha=alpha)) == pytest.approx(ref_eq, abs=1e-4)
    ref_dual = math.log(8) - float(torch.logsumexp(neg - pos[:, None], 1).mean())
    assert float(mi.dual_estimate(pos, neg)) == pytest.approx(ref_dual, abs=1e-5)


def test_oracle_critic_saturates_and_is_tight_when_mi_small():
    """With the true log ratio as critic the InfoNCE bound is tight for MI << log K and saturates otherwise."""
    d = 20
    for true, k, lo, hi in ((1.0, 1024, 0.9, 1.05), (8.0, 4, 1.5, math.log(5) + 1e-6)):
        rho = mi.rho_for_mi(true, d)
        ev = mi.evaluate_estimator("infonce", mi.GaussianRatioCritic(rho), k, rho, d, 8, 0)
        assert lo <= ev["estimate"] <= hi, (true, k, ev["estimate"])


# --------------------------------------------------------------------------- critics
@pytest.mark.parametrize("name", ["separable", "concat", "oracle"])
def test_group_scores_layout_matches_pairwise_forward(name):
    """Column m of anchor i's scores is s(x_i, y_{(i+m) mod n}); concat equals the MLP on cat([x, y])."""
    torch.manual_seed(0)
    d, g, n, a = 3, 2, 5, 4
    critic = mi.build_critic(name, d, hidden=8, embed=4, rho=0.5)
    x, y = torch.randn(g, n, d), torch.randn(g, n, d)
    with torch.no_grad():
        s = critic.group_scores(x[:, :a], y)
    assert s.shape == (g, a, n)
    for gi in range(g):
        for i in range(a):
            for m in range(n):
                with torch.no_grad():
                    ref = critic(x[gi, i], y[gi, (i + m) % n])
                assert float(s[gi, i, m]) == pytest.approx(float(ref), abs=1e-5)
    pos, neg = mi.batch_scores(critic, x, y, a)
    assert pos.shape == (g * a,) and neg.shape == (g * a, n - 1)
    assert torch.allclose(pos, s.reshape(-1, n)[:, 0])


def test_group_layout_and_train_anchors():
    assert mi.group_layout(4, 128) == (26, 5, 5)
    assert mi.group_layout(1024, 128) == (1, 1025, 128)
    assert mi.train_anchors(1024, 128, 8192) == 7
    assert mi.train_anchors(16, 128, 8192) == 128
    assert mi.train_anchors(1024, 128, None) == 128
    assert mi.train_anchors(100_000, 128, 8192) == 1


# --------------------------------------------------------------------------- training
def test_short_training_learns_mi_below_log_k():
    """MI = 1 nat << log 65: a short InfoNCE run estimates it closely (measured over seeds 0-3,
    d = 2, 200 steps: 0.90-0.97; the oracle critic gives 0.95 on the same evaluation batches)."""
    res = mi.train_estimator("infonce", "separable", 64, 1.0, 2, 200, 5e-3, 0, hidden=32, embed=16)
    assert len(res.trace) == 200 and not res.diverged
    ev = mi.evaluate_estimator("infonce", res.critic, 64, mi.rho_for_mi(1.0, 2), 2, 8, 0)
    assert 0.8 <= ev["estimate"] <= 1.1
    assert ev["std"] < 0.2
    # the untrained critic knows nothing: training moved the estimate up from about 0
    assert res.trace[0] < 0.3


def test_training_saturates_at_log_k_plus_1():
    """MI = 8 nats with K = 4: the InfoNCE estimate climbs to, but never past, log 5."""
    res = mi.train_estimator("infonce", "separable", 4, 8.0, 2, 100, 5e-3, 0, hidden=32, embed=16)
    ev = mi.evaluate_estimator("infonce", res.critic, 4, mi.rho_for_mi(8.0, 2), 2, 4, 0)
    assert max(res.trace) <= math.log(5) + 1e-6
    assert math.log(5) - 0.25 <= ev["estimate"] <= math.log(5) + 1e-6


def test_training_reproducible_under_seed():
    kw = dict(hidden=8, embed=4)
    a = mi.train_estimator("flatnce", "concat", 8, 2.0, 4, 20, 1e-2, 3, **kw)
    b = mi.train_estimator("flatnce", "concat", 8, 2.0, 4, 20, 1e-2, 3, **kw)
    c = mi.train_estimator("flatnce", "concat", 8, 2.0, 4, 20, 1e-2, 4, **kw)
    assert a.trace == b.trace
    assert a.trace != c.trace


def _alike(together: mi.TrainResult, alone: mi.TrainResult) -> None:
    assert (together.steps, together.diverged) == (alone.steps, alone.diverged)
    assert together.trace == pytest.approx(alone.trace, rel=0, abs=2e-4)  # rounding, grown over 30 Adam steps
    # The critics agree as functions, up to what no loss sees: a constant per anchor (g's last
    # bias has an exactly zero gradient, so Adam walks it on rounding noise by up to lr a step)
    x, y = mi.sample_correlated_gaussians(8, 4, 0.5, torch.Generator().manual_seed(0))
    a, b = (c.group_scores(x[None], y[None])[0] for c in (together.critic, alone.critic))
    torch.testing.assert_close(a - a.mean(1, keepdim=True), b - b.mean(1, keepdim=True), rtol=0, atol=1e-3)
    rho = mi.rho_for_mi(3.0, 4)
    assert mi.evaluate_estimator("infonce", together.critic, 8, rho, 4, 2, 0, anchors=32)["estimate"] == pytest.approx(
        mi.evaluate_estimator("infonce", alone.critic, 8, rho, 4, 2, 0, anchors=32)["estimate"], abs=2e-4
    )


def test_estimators_trained_together_equal_each_trained_alone():
    """train_estimators (one stacked separable critic for the estimators of one K, MI and
    seed) gives every estimator its train_estimator result: traces and weights to float
    rounding.  The oracle critic (no parameters) goes through train_estimator itself."""
    kw = dict(alpha=64, hidden=16, embed=8, anchors=32)
    ests = ["infonce", "flatnce", "eqco"]
    together = mi.train_estimators(ests, "separable", 8, 3.0, 4, 30, 5e-3, 1, **kw)
    for est, res in zip(ests, together):
        _alike(res, mi.train_estimator(est, "separable", 8, 3.0, 4, 30, 5e-3, 1, **kw))
    assert len({id(r.critic) for r in together}) == 3 and together[0].trace != together[1].trace
    oracle = mi.train_estimators(ests, "oracle", 8, 3.0, 4, 30, 5e-3, 1, alpha=64)
    assert all(r.steps == 0 and isinstance(r.critic, mi.GaussianRatioCritic) for r in oracle)


def test_an_estimator_that_diverges_together_stops_as_it_would_alone(monkeypatch):
    """FlatNCE's loss made non-finite from its 6th batch on: trained together it stops
    there with the critic of that step, exactly as alone, and the others train on."""
    real = mi.estimator_loss

    def failing(estimator, alpha=None):
        loss = real(estimator, alpha)
        if estimator != "flatnce":
            return loss
        calls = {"n": 0}

        class Failing:
            def from_scores(self, pos, neg, *, temperature):
                calls["n"] += 1
                out = loss.from_scores(pos, neg, temperature=temperature)
                if calls["n"] > 5:
                    out.loss = out.loss * float("nan")
                return out

        return Failing()

    monkeypatch.setattr(training, "estimator_loss", failing)  # where training looks it up
    kw = dict(hidden=16, embed=8, anchors=32)
    together = mi.train_estimators(["infonce", "flatnce"], "separable", 8, 3.0, 4, 20, 5e-3, 1, **kw)
    alone = [mi.train_estimator(e, "separable", 8, 3.0, 4, 20, 5e-3, 1, **kw) for e in ("infonce", "flatnce")]
    assert (together[1].steps, together[1].diverged, together[0].steps) == (5, True, 20)
    for a, b in zip(together, alone):
        _alike(a, b)


# --------------------------------------------------------------------------- bounded scores, eval_k, failures
@pytest.mark.parametrize("name", ["separable", "concat"])
def test_bounded_critic_scores_stay_within_one_over_temperature(name):
    """With a temperature the scores are cos/t (separable) or tanh/t (concat): never beyond 1/t,
    however large the weights grow; the stacked critics of train_estimators score the same."""
    torch.manual_seed(0)
    critic = mi.build_critic(name, 3, hidden=8, embed=4, temperature=0.05)
    with torch.no_grad():
        for p in critic.parameters():
            p.mul_(1e3)
    x, y = mi.sample_correlated_gaussians(6, 3, 0.9, torch.Generator().manual_seed(1))
    s = critic.group_scores(x[None], y[None]).detach()
    assert float(s.abs().max()) <= 20.0 + 1e-4 and float(s.abs().max()) > 10.0
    if name == "separable":
        stacked = training._StackedSeparable([critic])
        torch.testing.assert_close(stacked.group_scores(x[None], y[None])[0], s, rtol=1e-5, atol=1e-4)
        fx = torch.nn.functional.normalize(critic.f(x), dim=-1)
        gy = torch.nn.functional.normalize(critic.g(y), dim=-1)
        torch.testing.assert_close(critic(x, y), (fx * gy).sum(-1) / 0.05, rtol=1e-5, atol=1e-4)


def test_flatnce_critic_blows_up_unbounded_and_trains_stably_bounded():
    """FlatNCE's logsumexp has no lower bound for an unbounded critic: at K = 4 and 8 nats the
    dot-product critic's scores run away (its InfoNCE readout falls below 0, a setup failure);
    the bounded critic of the default trains to a finite readout near log 5, and is no failure."""
    kw = dict(hidden=32, embed=16, anchors=64)
    rho = mi.rho_for_mi(8.0, 4)
    free = mi.train_estimator("flatnce", "separable", 4, 8.0, 4, 150, 5e-3, 0, **kw)
    bounded = mi.train_estimator("flatnce", "separable", 4, 8.0, 4, 150, 5e-3, 0, temperature=0.05, **kw)
    ev_free = mi.evaluate_estimator("flatnce", free.critic, 4, rho, 4, 4, 0, anchors=64)["estimate"]
    ev_bounded = mi.evaluate_estimator("flatnce", bounded.critic, 4, rho, 4, 4, 0, anchors=64)["estimate"]
    assert ev_free < 0 and mi.failed(free.diverged, ev_free, bounded=False)
    assert 1.0 < ev_bounded <= math.log(5) + 1e-6 and not mi.failed(bounded.diverged, ev_bounded, bounded=True)


def test_failed_is_a_non_finite_loss_or_an_unbounded_critic_below_zero():
    assert mi.failed(True, 1.0, bounded=True)
    assert mi.failed(False, float("nan"), bounded=True)
    assert mi.failed(False, -0.1, bounded=False)
    assert not mi.failed(False, -0.1, bounded=True)  # a bounded critic's readout is a measurement
    assert not mi.failed(False, 0.0, bounded=False)


def test_eval_k_readout_is_not_capped_by_the_training_k():
    """The oracle critic read with eval_k negatives: its InfoNCE bound is capped by log(eval_k+1),
    not by the K of the rows it belongs to (6 nats in d=4: well above log 5 at eval_k = 256)."""
    rho = mi.rho_for_mi(6.0, 4)
    ev = mi.evaluate_estimator("infonce", mi.GaussianRatioCritic(rho), 4, rho, 4, 4, 0, eval_k=256)
    assert ev["estimate"] <= math.log(5) + 1e-6
    assert math.log(5) + 1.5 < ev["estimate_eval_k"] <= math.log(257) + 1e-6
    again = mi.eval_k_estimate(mi.GaussianRatioCritic(rho), 256, rho, 4, 4, 0)
    assert again["estimate_eval_k"] == ev["estimate_eval_k"]  # same batches: seeded by (seed, eval_k, rho, d)


# --------------------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    "call, word",
    [
        (lambda: mi.true_mi(1.0, 3), "rho"),
        (lambda: mi.true_mi(-1.0, 3), "rho"),
        (lambda: mi.true_mi(1.5, 3), "rho"),
        (lambda: mi.true_mi(0.5, 0), "d"),
        (lambda: mi.rho_for_mi(-1.0, 3), "mi"),
        (lambda: mi.rho_for_mi(2.0, 0), "d"),
        (lambda: mi.sample_correlated_gaussians(4, 3, 1.0), "rho"),
        (lambda: mi.sample_correlated_gaussians(4, 0, 0.5), "d"),
        (lambda: mi.sample_correlated_gaussians(0, 3, 0.5), "n"),
        (lambda: mi.mi_ceiling("infonce", 0), "K"),
        (lambda: mi.mi_ceiling("eqco", 4), "alpha"),
        (lambda: mi.mi_ceiling("nce", 4), "estimator"),
        (lambda: mi.train_estimator("infonce", "separable", 0, 2.0, 4, 1, 1e-3, 0), "K"),
        (lambda: mi.train_estimator("infonce", "separable", 4, 2.0, 0, 1, 1e-3, 0), "d"),
        (lambda: mi.train_estimator("infonce", "mlp", 4, 2.0, 4, 1, 1e-3, 0), "critic"),
        (lambda: mi.train_estimator("eqco", "separable", 4, 2.0, 4, 1, 1e-3, 0), "alpha"),
        (lambda: mi.SeparableCritic(0), "d"),
        (lambda: mi.SeparableCritic(3, temperature=0), "critic_temperature"),
        (lambda: validate_section({"critic_temperature": -1}), "critic_temperature"),
        (lambda: validate_section({"eval_k": 0}), "eval_k"),
        (lambda: validate_section({"dim": 0}), "dim"),
        (lambda: validate_section({"ks": [4, 0]}), "ks"),
        (lambda: validate_section({"mi_values": [2, -1]}), "mi_values"),
        (lambda: validate_section({"estimators": ["infonce", "dcl"]}), "estimators"),
        (lambda: validate_section({"critics": ["bilinear"]}), "critics"),
        (lambda: validate_section({"eqco_alpha": 0}), "eqco_alpha"),
        (lambda: validate_section({"stepz": 3}), "stepz"),
    ],
)
def test_bad_input_names_the_argument(call, word):
    with pytest.raises(ValueError, match=word):
        call()


def test_concat_max_k_restricts_the_grid():
    sec = validate_section(
        {
            "ks": [4, 64, 1024],
            "critics": ["separable", "concat"],
            "concat_max_k": 64,
            "estimators": ["infonce"],
            "mi_values": [2],
            "seeds": [0, 1, 2],
        }
    )
    keys = [(r["critic"], r["K"]) for r in mi.grid(sec) if r["seed"] == 0]
    assert keys == [("separable", 4), ("separable", 64), ("separable", 1024), ("concat", 4), ("concat", 64)]
    with pytest.raises(ValueError, match="concat_max_k"):
        validate_section({"concat_max_k": 0})


def test_validate_section_fills_the_schemas_defaults():
    from smallbatch.study.schema import load_schema

    props = load_schema()["properties"]["experiments"]["properties"]["mi"]["properties"]
    sec = validate_section({"ks": [16], "enabled": True})
    assert sec["ks"] == [16] and sec["enabled"] is True
    assert sec["dim"] == props["dim"]["default"] == 20
    assert sec["eqco_alpha"] == 1024.0 and props["eqco_alpha"]["default"] == 1024
    assert validate_section(None)["mi_values"] == [2.0, 4.0, 6.0, 8.0, 10.0]
    # by default the learned critics' scores are bounded (FlatNCE's critic diverges unbounded) and
    # every setting has three seeds, so that the findings have seed intervals
    assert validate_section(None)["critic_temperature"] == 0.05
    assert len(validate_section(None)["seeds"]) >= 3
    assert validate_section({"critic_temperature": None})["critic_temperature"] is None
    with pytest.raises(ValueError, match="experiments.mi.ks"):
        validate_section({"ks": 16})  # a list, as the schema says


def test_the_schemas_estimators_and_critics_are_the_benchmarks():
    from smallbatch.study.schema import load_schema

    props = load_schema()["properties"]["experiments"]["properties"]["mi"]["properties"]
    assert tuple(props["estimators"]["items"]["enum"]) == mi.ESTIMATORS
    assert tuple(props["critics"]["items"]["enum"]) == mi.CRITICS


# --------------------------------------------------------------------------- pipeline step + report
TINY = {
    "dim": 4,
    "mi_values": [1, 6],
    "ks": [4, 64],
    "estimators": ["infonce", "flatnce", "eqco"],
    "critics": ["separable", "oracle"],
    "steps": 40,
    "lr": 5e-3,
    "hidden": 16,
    "embed": 8,
    "anchors": 32,
    "max_pairs": 1024,
    "eval_batches": 2,
    "trace_points": 10,
    "eqco_alpha": 1024,
    "seeds": [0, 1, 2],  # the section's least (its findings' intervals are over seeds)
}


def test_run_mi_experiment_rows():
    rows = mi.run_mi_experiment(validate_section(TINY), progress=False)
    assert len(rows) == 3 * 2 * 2 * 2 * 3
    for r in rows:
        assert r["eval_k"] == 64 and r["estimate_eval_k"] <= math.log(65) + 1e-6
        assert r["failed"] is False and r["critic_temperature"] == 0.05
        assert r["bias"] == pytest.approx(r["estimate"] - r["true_mi"])
        assert r["variance"] == pytest.approx(r["std"] ** 2)
        if r["estimator"] != "eqco":
            assert r["estimate"] <= math.log(r["K"] + 1) + 1e-6
            assert r["ceiling"] == pytest.approx(math.log(r["K"] + 1))
        else:
            assert r["ceiling"] == pytest.approx(math.log(1025))
        assert (r["train_final"] is None) == (r["critic"] == "oracle")


def test_mi_step_logs_runs_and_report_section(tmp_path):
    pytest.importorskip("mlflow")
    import pandas as pd
    from mlflow.tracking import MlflowClient

    from smallbatch import report
    from smallbatch.pipeline import mi_job as mi_step

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    out = tmp_path / "mi" / "results.json"
    section = dict(TINY, critics=["separable", "oracle"], estimators=["infonce", "eqco"], ks=[4], mi_values=[1, 6])
    res = mi_step.run_mi_step(section, out, uri, "study", progress=False)
    data = json.loads(out.read_text())
    assert len(data["rows"]) == 8 * 3 and data["rows"] == res["rows"]
    assert data["rows"][0]["cell_id"] == "mi/infonce/separable/K4-mi1-s0"
    assert data["section"]["eqco_alpha"] == 1024

    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name("study")
    runs = client.search_runs([exp.experiment_id])
    parents = [r for r in runs if r.data.tags["smallbatch.kind"] == "parent"]
    runs = [r for r in runs if r not in parents]
    assert len(runs) == 8 * 3 and len(parents) == 1  # the rows nested under one parent run, not beside the cells
    assert parents[0].info.run_name == "mi" and parents[0].info.status == "FINISHED"
    assert {r.data.tags.get("mlflow.parentRunId") for r in runs} == {parents[0].info.run_id}
    r0 = next(r for r in runs if r.data.tags["smallbatch.cell_id"] == "mi/eqco/separable/K4-mi6-s0")
    assert r0.data.tags["smallbatch.kind"] == "mi" and r0.data.tags["smallbatch.experiment"] == "mi"
    assert r0.data.tags["smallbatch.status"] == "finished"
    assert r0.data.params["K"] == "4" and r0.data.params["estimator"] == "eqco"
    assert r0.data.params["alpha"] == "1024.0" and r0.data.params["negatives"] == "4"
    row = next(r for r in data["rows"] if r["cell_id"] == "mi/eqco/separable/K4-mi6-s0")
    assert r0.data.metrics["mi/estimate"] == pytest.approx(row["estimate"])
    assert r0.data.metrics["mi/bias"] == pytest.approx(row["estimate"] - 6)
    assert r0.data.metrics["mi/ceiling"] == pytest.approx(math.log(1025))
    hist = client.get_metric_history(r0.info.run_id, "mi/train_estimate")
    assert sorted(m.step for m in hist) == [4 * i for i in range(1, 11)]
    # the hash changes with a setting that changes the numbers, not with the grid lists
    sec = validate_section(section)
    assert mi_step.row_hash(sec, row) == mi_step.row_hash(dict(sec, ks=[4, 16], seeds=[0, 1]), row)
    assert mi_step.row_hash(sec, row) != mi_step.row_hash(dict(sec, steps=41), row)

    # a re-run resumes the same runs and logs nothing twice
    mi_step.run_mi_step(section, out, uri, "study", progress=False)
    assert len(client.search_runs([exp.experiment_id])) == 8 * 3 + 1  # and the same parent
    assert len(client.get_metric_history(r0.info.run_id, "mi/train_estimate")) == 10
    assert len(client.get_metric_history(r0.info.run_id, "mi/estimate")) == 1

    index = report.build_report(uri, tmp_path / "report", experiment="study")
    text = index.read_text()
    assert "## Mutual information bounds on correlated Gaussians" in text
    tables = tmp_path / "report" / "tables"
    for suffix in ("csv", "md", "tex"):
        assert (tables / f"mi_bias_variance.{suffix}").is_file()
        assert (tables / f"mi_claims.{suffix}").is_file()
    for suffix in ("png", "svg"):
        assert (tmp_path / "report" / "figures" / f"mi_estimate_vs_true.{suffix}").is_file()
    assert "figures/mi_estimate_vs_true.png" in text
    # every row's wall and CPU seconds reach the cost table: no blank for the MI toy
    assert r0.data.metrics["mi/cpu_s"] > 0 and r0.data.metrics["mi/seconds"] > 0
    cost = pd.read_csv(tables / "cost_study.csv").set_index("section").loc["mi"]
    assert cost["other_wall_s"] > 0 and cost["other_cpu_s"] > 0 and cost["cpu_s"] == cost["other_cpu_s"]
    table = pd.read_csv(tables / "mi_bias_variance.csv")
    assert len(table) == 8  # the report finds the nested rows, and reads no row from the parent
    t_row = table[(table["estimator"] == "eqco") & (table["critic"] == "separable") & (table["true_mi"] == 6)].iloc[0]
    seeds = [r for r in data["rows"] if r["cell_id"].rsplit("-s", 1)[0] == "mi/eqco/separable/K4-mi6"]
    assert len(seeds) == 3  # the table's row is its setting's three seeds
    assert t_row["estimate_mean"] == pytest.approx(np.mean([r["estimate"] for r in seeds]))
    assert t_row["variance"] == pytest.approx(np.mean([r["std"] ** 2 for r in seeds]))
    # findings are computed from the numbers: the oracle's InfoNCE estimate at K=4, 6 nats appears in them
    oracle = next(r for r in data["rows"] if r["cell_id"] == "mi/infonce/oracle/K4-mi6-s0")
    assert oracle["estimate"] <= math.log(5)
    assert f"InfoNCE still reads {oracle['estimate']:.2f}" in text
    claims = pd.read_csv(tables / "mi_claims.csv")
    assert set(claims["source"].str.split(" ").str[0]) >= {"van", "Zhu"}
    nce = [r for r in data["rows"] if r["estimator"] == "infonce" and r["critic"] == "separable"]
    means = {}  # each setting's estimate is the mean of its seeds
    for r in nce:
        means.setdefault((r["K"], r["true_mi"]), []).append(r["estimate"])
    ratio = max(float(np.mean(v)) / math.log(k + 1) for (k, _), v in means.items())
    assert f"largest estimate / log(K+1) = {ratio:.3f}" in claims.loc[0, "measured"]


def test_seed_interval_is_the_student_t_interval():
    """mean ± t_{0.975, n-1} sd/sqrt(n) (evidence.t_interval), against the numbers by hand (t_{0.975, 2} = 4.3027)."""
    from smallbatch.report.sections.mi_findings import seed_interval

    mean, lo, hi, n = seed_interval([1.0, 2.0, 3.0, float("nan")])
    half = 4.302652729749464 * 1.0 / math.sqrt(3)
    assert (mean, n) == (2.0, 3)
    assert lo == pytest.approx(2.0 - half, rel=1e-9) and hi == pytest.approx(2.0 + half, rel=1e-9)
    assert math.isnan(seed_interval([5.0])[1]) and seed_interval([])[3] == 0


def _small_k_runs(flat_minus_nce: float, spread: float):
    """Per-run frame: InfoNCE and FlatNCE critics at K 4 and 1024, true MI 6, three seeds; FlatNCE's
    readout at eval_k is InfoNCE's + flat_minus_nce (+ a seed-dependent spread)."""
    import pandas as pd

    rows = []
    for seed in (0, 1, 2):
        for k in (4, 1024):
            nce = 3.0 + (0.5 if k == 1024 else 0.0) + 0.1 * seed
            for est, v in (("infonce", nce), ("flatnce", nce + flat_minus_nce + spread * (seed - 1))):
                rows.append(
                    {
                        "estimator": est,
                        "critic": "separable",
                        "K": k,
                        "true_mi": 6.0,
                        "seed": seed,
                        "estimate": 1.0,
                        "estimate_eval_k": v,
                        "eval_k": 1024,
                        "failed": False,
                        "dual_estimate": 2.0,
                    }
                )
    return pd.DataFrame(rows)


@pytest.mark.parametrize(
    "diff, spread, verdict",
    [(0.3, 0.01, "supported"), (-0.3, 0.01, "not supported"), (0.01, 0.5, "neither supported nor refuted")],
)
def test_flatnce_small_k_claim_can_fail(diff, spread, verdict):
    """The FlatNCE verdict follows the seed interval of FlatNCE − InfoNCE at the smallest K: better,
    worse, or within noise; the sentence quotes the paired difference and its interval."""
    import pandas as pd

    from smallbatch.report.sections.mi_findings import flatnce_small_k

    sent, claim = flatnce_small_k(pd.DataFrame(), _small_k_runs(diff, spread))
    assert claim["verdict"].startswith(verdict)
    assert f"FlatNCE − InfoNCE = {diff:+.2f} [" in sent and "(paired t, 3 seeds" in sent
    failed = _small_k_runs(diff, spread)
    failed["failed"] = True
    assert "not tested" in flatnce_small_k(pd.DataFrame(), failed)[0]


class _FigureContext:
    """What the MI figures need of a ReportContext: save PNG + SVG, link them."""

    def __init__(self, out):
        self.out = out

    def save_figure(self, fig, stem):
        import matplotlib.pyplot as plt

        files = [self.out / f"{stem}.png", self.out / f"{stem}.svg"]
        for f in files:
            fig.savefig(f)
        plt.close(fig)
        return files

    def figure_md(self, files, alt):
        return f"![{alt}]({files[0].name})\n"


def test_mi_figure_marks_extreme_values_and_failures_instead_of_clamping(tmp_path):
    """A readout of -1.08e8 (an unbounded critic) is drawn at a marked edge with its value written,
    not silently clamped; a failed run is a marker with its legend entry; PNG and SVG both written."""
    import pandas as pd

    from smallbatch.report.sections import mi as report_mi

    rows = []
    for seed in (0, 1, 2):
        for k in (4, 64):
            for est in ("infonce", "flatnce"):
                v = -1.08e8 if (est, k, seed) == ("flatnce", 4, 0) else 1.0 + 0.1 * seed
                rows.append(
                    {
                        "estimator": est,
                        "critic": "separable",
                        "K": k,
                        "true_mi": 2.0,
                        "seed": seed,
                        "estimate": v,
                        "variance": 0.01,
                        "ceiling": math.log(k + 1),
                        "dual_estimate": 1.0,
                        "eval_k": 64,
                        "estimate_eval_k": 1.2,
                        "alpha": math.nan,
                        "failed": (est, k, seed) == ("infonce", 64, 2),
                    }
                )
    df = pd.DataFrame(rows)
    a = report_mi.aggregate_mi(df)
    files, md = report_mi._figure_vs_true(a, df, _FigureContext(tmp_path))
    assert [f.suffix for f in files] == [".png", ".svg"] and all(f.stat().st_size > 0 for f in files)
    assert "drawn on the dotted red line with their value written" in md
    svg = files[1].read_text()
    assert "-1.08e+08" in svg and "setup failure (no value)" in svg
    assert a.loc[(a["estimator"] == "infonce") & (a["K"] == 64), "failed"].item() == 1


def test_report_section_absent_without_mi_runs():
    import pandas as pd

    from smallbatch.report.sections import mi as report_mi

    runs = pd.DataFrame(
        {"kind": ["cell"], "run_id": ["r"], "cell_id": ["c"], "start_time": [0], "status": ["finished"]}
    )
    assert report_mi.build(runs, ctx=None) is None
