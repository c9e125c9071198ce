"""InfoNCE at a learnt temperature (``infonce_lt``, CLIP's τ = exp(-t')) against the float64
loop reference of InfoNCE, value and gradient (w.r.t. the embeddings and t')."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from test_losses import _fd_grad, _views, ref_in_batch, ref_loss

from smallbatch.losses import build_loss, in_batch_scores

torch.set_num_threads(1)


def _loss(tau: float):
    loss = build_loss("infonce_lt").double()
    loss.init_temperature(tau)
    return loss


@pytest.mark.parametrize("n,d,tau", [(2, 3, 0.05), (5, 8, 0.3), (9, 16, 2.0)])
def test_its_value_is_infonce_at_its_learnt_temperature(n, d, tau):
    z1, z2 = _views(n, d, seed=n)
    loss = _loss(tau)
    assert loss.log_scale.item() == pytest.approx(-math.log(tau), rel=1e-15)
    out = loss(z1, z2)
    ref = ref_loss("infonce", ref_in_batch(z1.numpy(), z2.numpy()), tau)
    assert out.loss.item() == pytest.approx(ref, rel=1e-12) and out.value.item() == pytest.approx(ref, rel=1e-12)
    assert out.infonce.item() == pytest.approx(ref, rel=1e-12)


@pytest.mark.parametrize("n,d,tau", [(2, 2, 0.5), (3, 4, 0.1)])
def test_its_gradient_in_the_embeddings_and_in_t_prime_matches_finite_differences(n, d, tau):
    z1, z2 = _views(n, d, seed=3 * n)
    loss = _loss(tau)
    a, b = z1.clone().requires_grad_(), z2.clone().requires_grad_()
    loss(a, b).loss.backward()
    x1, x2 = z1.numpy().copy(), z2.numpy().copy()
    t = np.array([-math.log(tau)])
    g1, g2, gt = _fd_grad(lambda: ref_loss("infonce", ref_in_batch(x1, x2), math.exp(-t[0])), [x1, x2, t])
    np.testing.assert_allclose(a.grad.numpy(), g1, rtol=1e-5, atol=1e-8)
    np.testing.assert_allclose(b.grad.numpy(), g2, rtol=1e-5, atol=1e-8)
    assert loss.log_scale.grad.item() == pytest.approx(gt[0], rel=1e-6)
    # the closed form: dL/dt' = -(1/B) sum_i (s_p,i - E_softmax_i[s]) / tau
    pos, neg, _ = in_batch_scores(z1, z2)
    s = torch.cat([pos[:, None], neg], dim=1)
    w = torch.softmax(s / tau, dim=1)
    closed = -((pos - (w * s).sum(1)) / tau).mean()
    assert loss.log_scale.grad.item() == pytest.approx(closed.item(), rel=1e-10)


def test_a_given_temperature_is_used_and_t_prime_gets_no_gradient():
    z1, z2 = _views(4, 5, seed=1)
    loss = _loss(0.7)
    out = loss(z1, z2, temperature=0.2)
    assert out.loss.item() == pytest.approx(ref_loss("infonce", ref_in_batch(z1.numpy(), z2.numpy()), 0.2), rel=1e-12)
    assert not out.loss.requires_grad  # nothing of it is learnt at a given τ


def test_only_a_loss_that_owns_its_temperature_learns_one():
    with pytest.raises(ValueError, match="'dcl' does not learn its temperature"):
        build_loss("dcl").init_temperature(0.1)
    with pytest.raises(ValueError, match="'dcl' takes its temperature per call"):
        build_loss("dcl")(*_views(3, 2, seed=0))
    with pytest.raises(ValueError, match="positive finite"):
        build_loss("infonce_lt").init_temperature(0.0)
    assert list(build_loss("dcl").parameters()) == []
    assert [n for n, _ in build_loss("infonce_lt").named_parameters()] == ["log_scale"]
