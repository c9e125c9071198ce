"""SimCo's dual temperature (Zhang et al. 2022) and debiased / hard-negative InfoNCE (Chuang
et al. 2020; Robinson et al. 2021) against float64 loop references written from their
reference code (``ChaoningZhang/Dual-temperature`` ``dual_temperature_loss_func``,
``joshr17/HCL`` ``criterion``): value, gradient, and their limits (m = 1; tau+ = beta = 0)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from loss_at_tau import at_tau
from test_losses import _fd_grad, _views, ref_in_batch, ref_loss

from smallbatch.losses import build_loss, in_batch_scores

torch.set_num_threads(1)


# --------------------------------------------------------------------------- references
def _softmax_pos(logits: list[float]) -> float:
    top = max(logits)
    e = [math.exp(x - top) for x in logits]
    return e[0] / sum(e)


def ref_simco(rows, tau: float, m: float, weights=None) -> float:
    """dual_temperature_loss_func on (pos, negs) rows: sg[(1 - p_inter)/(1 - p_intra)] (-log p_intra)."""
    total = 0.0
    for i, (sp, negs) in enumerate(rows):
        logits = [sp, *negs]
        intra = _softmax_pos([x / tau for x in logits])
        inter = _softmax_pos([x / (tau * m) for x in logits])
        w = (1 - inter) / (1 - intra) if weights is None else weights[i]
        total += w * -math.log(intra)
    return total / len(rows)


def ref_hcl(rows, tau: float, tau_plus: float, beta: float) -> float:
    """joshr17/HCL's criterion ('hard'; beta = 0 is Chuang et al.'s debiased estimator)."""
    total = 0.0
    for sp, negs in rows:
        pos = math.exp(sp / tau)
        neg = [math.exp(s / tau) for s in negs]
        k = len(neg)
        imp = [math.exp(beta * math.log(x)) for x in neg]
        reweight = sum(a * x for a, x in zip(imp, neg)) / (sum(imp) / k)
        ng = max((-tau_plus * k * pos + reweight) / (1 - tau_plus), k * math.exp(-1 / tau))
        total += -math.log(pos / (pos + ng))
    return total / len(rows)


# --------------------------------------------------------------------------- SimCo
@pytest.mark.parametrize("n,d,tau,m", [(2, 3, 0.1, 10.0), (6, 8, 0.1, 10.0), (9, 16, 0.5, 3.0)])
def test_simco_value_matches_the_loop_reference(n, d, tau, m):
    z1, z2 = _views(n, d, seed=n + 1)
    out = at_tau(build_loss("simco", m=m), tau)(z1, z2)
    ref = ref_simco(ref_in_batch(z1.numpy(), z2.numpy()), tau, m)
    assert out.loss.item() == pytest.approx(ref, rel=1e-12) and out.value.item() == pytest.approx(ref, rel=1e-12)


def test_simco_on_query_key_scores_is_the_reference_function():
    """The reference scores queries against keys (positive: the diagonal, negatives: the
    rest of the row): those scores give its loss."""
    g = torch.Generator().manual_seed(3)
    q = torch.nn.functional.normalize(torch.randn(6, 5, generator=g, dtype=torch.float64), dim=1)
    k = torch.nn.functional.normalize(q + 0.5 * torch.randn(6, 5, generator=g, dtype=torch.float64), dim=1)
    s = q @ k.T
    off = ~torch.eye(6, dtype=torch.bool)
    rows = [(float(s[i, i]), [float(x) for x in s[i][off[i]]]) for i in range(6)]
    out = at_tau(build_loss("simco"), 0.1).from_scores(s.diagonal(), s[off].reshape(6, 5))
    assert out.loss.item() == pytest.approx(ref_simco(rows, 0.1, 10.0), rel=1e-12)


@pytest.mark.parametrize("n,d,tau", [(2, 2, 0.5), (3, 4, 0.2)])
def test_simco_gradient_matches_finite_differences_with_its_weight_held(n, d, tau):
    z1, z2 = _views(n, d, seed=5 * n)
    a, b = z1.clone().requires_grad_(), z2.clone().requires_grad_()
    at_tau(build_loss("simco", m=4.0), tau)(a, b).loss.backward()
    x1, x2 = z1.numpy().copy(), z2.numpy().copy()
    rows = ref_in_batch(x1, x2)
    w = []
    for sp, negs in rows:  # the stop-gradient weights, at the unperturbed scores
        logits = [sp, *negs]
        w.append((1 - _softmax_pos([x / (tau * 4) for x in logits])) / (1 - _softmax_pos([x / tau for x in logits])))
    g1, g2 = _fd_grad(lambda: ref_simco(ref_in_batch(x1, x2), tau, 4.0, weights=w), [x1, x2])
    np.testing.assert_allclose(a.grad.numpy(), g1, rtol=1e-5, atol=1e-8)
    np.testing.assert_allclose(b.grad.numpy(), g2, rtol=1e-5, atol=1e-8)


def test_simco_puts_the_coupling_at_the_large_temperature_and_m_one_is_infonce():
    z1, z2 = _views(5, 6, seed=9)
    pos, neg, _ = in_batch_scores(z1, z2)
    tau, m = 0.1, 10.0
    p = pos.clone().requires_grad_()
    at_tau(build_loss("simco", m=m), tau).from_scores(p, neg).loss.backward()
    inter = torch.softmax(torch.cat([pos[:, None], neg], 1) / (tau * m), dim=1)[:, 0]
    torch.testing.assert_close(p.grad, -(1 - inter) / tau / pos.shape[0], rtol=1e-10, atol=1e-14)
    a, b = (z.clone().requires_grad_() for z in (z1, z2))
    c, d = (z.clone().requires_grad_() for z in (z1, z2))
    one = at_tau(build_loss("simco", m=1.0), tau)(a, b)
    info = at_tau(build_loss("infonce"), tau)(c, d)
    assert one.loss.item() == pytest.approx(info.loss.item(), rel=1e-14)
    one.loss.backward()
    info.loss.backward()
    torch.testing.assert_close(a.grad, c.grad, rtol=1e-12, atol=1e-15)
    with pytest.raises(ValueError, match="m must be a finite number >= 1"):
        build_loss("simco", m=0.5)


# --------------------------------------------------------------------------- debiased / hard negatives
@pytest.mark.parametrize("name,tau_plus,beta", [("debiased", 0.1, 0.0), ("hcl", 0.1, 1.0), ("hcl", 0.01, 3.0)])
@pytest.mark.parametrize("n,d,tau", [(2, 3, 0.5), (6, 8, 0.5), (9, 16, 0.2)])
def test_debiased_and_hard_negatives_match_hcls_criterion(name, tau_plus, beta, n, d, tau):
    z1, z2 = _views(n, d, seed=n + d)
    params = {"tau_plus": tau_plus} if name == "debiased" else {"tau_plus": tau_plus, "beta": beta}
    out = at_tau(build_loss(name, **params), tau)(z1, z2)
    ref = ref_hcl(ref_in_batch(z1.numpy(), z2.numpy()), tau, tau_plus, beta)
    assert out.loss.item() == pytest.approx(ref, rel=1e-12) and out.value.item() == pytest.approx(ref, rel=1e-12)


def test_the_clamp_holds_where_the_correction_overshoots():
    """Positives far above the negatives: the corrected sum goes below its floor K e^{-1/tau}
    (or below 0), and the floor is the negatives' term, as in HCL's code."""
    pos = torch.tensor([1.0, 0.99], dtype=torch.float64)
    neg = torch.tensor([[-0.9, -0.95, 0.2], [-1.0, -0.99, -0.98]], dtype=torch.float64)
    rows = [(1.0, [-0.9, -0.95, 0.2]), (0.99, [-1.0, -0.99, -0.98])]
    for tau_plus in (0.3, 0.9):
        out = at_tau(build_loss("debiased", tau_plus=tau_plus), 0.5).from_scores(pos, neg)
        assert out.loss.item() == pytest.approx(ref_hcl(rows, 0.5, tau_plus, 0.0), rel=1e-12)
    floor = math.log(1 + 3 * math.exp(-1 / 0.5) / math.exp(0.99 / 0.5))
    row = build_loss("debiased", tau_plus=0.9)._rows(pos, neg, None, 0.5, None)[0][1].item()
    assert row == pytest.approx(floor, rel=1e-12)


@pytest.mark.parametrize("name,params", [("debiased", {"tau_plus": 0.1}), ("hcl", {"tau_plus": 0.05, "beta": 1.5})])
@pytest.mark.parametrize("n,d,tau", [(2, 2, 0.5), (3, 4, 0.5)])
def test_debiased_gradient_matches_finite_differences(name, params, n, d, tau):
    z1, z2 = _views(n, d, seed=11 * n)
    a, b = z1.clone().requires_grad_(), z2.clone().requires_grad_()
    at_tau(build_loss(name, **params), tau)(a, b).loss.backward()
    x1, x2 = z1.numpy().copy(), z2.numpy().copy()
    beta = params.get("beta", 0.0)
    g1, g2 = _fd_grad(lambda: ref_hcl(ref_in_batch(x1, x2), tau, params["tau_plus"], beta), [x1, x2])
    np.testing.assert_allclose(a.grad.numpy(), g1, rtol=1e-5, atol=1e-8)
    np.testing.assert_allclose(b.grad.numpy(), g2, rtol=1e-5, atol=1e-8)


def test_no_prior_and_no_hardness_is_infonce():
    z1, z2 = _views(7, 5, seed=1)
    for loss in (build_loss("debiased", tau_plus=0.0), build_loss("hcl", tau_plus=0.0, beta=0.0)):
        a, b = z1.clone().requires_grad_(), z2.clone().requires_grad_()
        out = at_tau(loss, 0.2)(a, b)
        assert out.loss.item() == pytest.approx(ref_loss("infonce", ref_in_batch(z1.numpy(), z2.numpy()), 0.2))
        out.loss.backward()
        c, d = z1.clone().requires_grad_(), z2.clone().requires_grad_()
        at_tau(build_loss("infonce"), 0.2)(c, d).loss.backward()
        torch.testing.assert_close(a.grad, c.grad, rtol=1e-10, atol=1e-14)
    with pytest.raises(ValueError, match=r"tau_plus must be a finite number in \[0, 1\)"):
        build_loss("debiased", tau_plus=1.0)
    with pytest.raises(ValueError, match="beta must be a finite number >= 0"):
        build_loss("hcl", beta=-1.0)
