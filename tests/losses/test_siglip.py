"""SigLIP's pairwise sigmoid loss (and SigCLR, its two-view use) against float64 loop
references written from big_vision's ``siglip.py`` loss: value, gradient (embeddings, t', b)
and its b -> -inf limit."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from test_losses import _fd_grad, _unit, _views, ref_in_batch

from smallbatch.losses import build_loss, in_batch_scores

torch.set_num_threads(1)


def _log_sigmoid(x: float) -> float:
    return -math.log1p(math.exp(-x)) if x >= 0 else x - math.log1p(math.exp(x))


def ref_siglip(rows, t: float, b: float) -> float:
    """-(1/|B|) sum_i sum_j log sigmoid(z_ij (t s_ij + b)): each row's positive (z = +1)
    and negatives (z = -1), python floats."""
    total = 0.0
    for sp, negs in rows:
        total -= _log_sigmoid(t * sp + b) + sum(_log_sigmoid(-(t * s + b)) for s in negs)
    return total / len(rows)


def ref_big_vision(zimg: np.ndarray, ztxt: np.ndarray, t: float, b: float) -> float:
    """big_vision's image-text loss: logits = t zimg ztxt^T + b, labels 2I - 1, -log_sigmoid
    summed over a row, averaged over rows (loops)."""
    n = zimg.shape[0]
    total = 0.0
    for i in range(n):
        for j in range(n):
            logit = t * float(np.dot(_unit(zimg[i]), _unit(ztxt[j]))) + b
            total -= _log_sigmoid(logit if i == j else -logit)
    return total / n


def _siglip(tau: float, b: float):
    loss = build_loss("siglip", bias_init=b).double()
    loss.init_temperature(tau)
    return loss


@pytest.mark.parametrize("n,d,tau,b", [(2, 1, 0.1, -10.0), (5, 8, 0.1, -10.0), (9, 16, 0.5, -2.0), (4, 3, 1.0, 1.0)])
def test_two_view_value_matches_the_loop_reference(n, d, tau, b):
    """SigCLR: the 2N views, each with its positive and 2N-2 negatives."""
    z1, z2 = _views(n, d, seed=n + d)
    out = _siglip(tau, b)(z1, z2)
    ref = ref_siglip(ref_in_batch(z1.numpy(), z2.numpy()), 1 / tau, b)
    assert out.loss.item() == pytest.approx(ref, rel=1e-12) and out.value.item() == pytest.approx(ref, rel=1e-12)


@pytest.mark.parametrize("n,tau,b", [(3, 0.1, -10.0), (8, 0.25, -3.0)])
def test_image_text_layout_is_big_visions_loss(n, tau, b):
    """Scores of an image-text batch (positive: the diagonal, negatives: the rest of its row)
    give big_vision's loss."""
    g = torch.Generator().manual_seed(n)
    zimg, ztxt = (
        torch.randn(n, 6, generator=g, dtype=torch.float64),
        torch.randn(n, 6, generator=g, dtype=torch.float64),
    )
    s = torch.nn.functional.normalize(zimg, dim=1) @ torch.nn.functional.normalize(ztxt, dim=1).T
    off = ~torch.eye(n, dtype=torch.bool)
    out = _siglip(tau, b).from_scores(s.diagonal(), s[off].reshape(n, n - 1))
    assert out.loss.item() == pytest.approx(ref_big_vision(zimg.numpy(), ztxt.numpy(), 1 / tau, b), rel=1e-12)


@pytest.mark.parametrize("n,d,tau,b", [(2, 2, 0.5, -2.0), (3, 3, 0.2, -1.0)])
def test_gradient_in_embeddings_scale_and_bias_matches_finite_differences(n, d, tau, b):
    z1, z2 = _views(n, d, seed=7 * n)
    loss = _siglip(tau, b)
    a, c = z1.clone().requires_grad_(), z2.clone().requires_grad_()
    loss(a, c).loss.backward()
    x1, x2 = z1.numpy().copy(), z2.numpy().copy()
    tb = np.array([-math.log(tau), b])  # t' and b

    def f():
        return ref_siglip(ref_in_batch(x1, x2), math.exp(tb[0]), tb[1])

    g1, g2, gtb = _fd_grad(f, [x1, x2, tb])
    np.testing.assert_allclose(a.grad.numpy(), g1, rtol=1e-5, atol=1e-8)
    np.testing.assert_allclose(c.grad.numpy(), g2, rtol=1e-5, atol=1e-8)
    assert loss.log_scale.grad.item() == pytest.approx(gtb[0], rel=1e-6)
    assert loss.bias.grad.item() == pytest.approx(gtb[1], rel=1e-6)


def test_as_b_goes_to_minus_infinity_one_negative_gives_infonces_denominator():
    """With one negative: log(L + b + t s_p) - b -> logsumexp(t s_p, t s_n), the error
    shrinking like e^b (L = -(t s_p + b) + e^b (e^{t s_p} + e^{t s_n}) + O(e^{2b}))."""
    t, pos, neg = 2.0, torch.tensor([0.3], dtype=torch.float64), torch.tensor([[-0.4]], dtype=torch.float64)
    lse = math.log(math.exp(t * 0.3) + math.exp(t * -0.4))
    errs = []
    for b in (-5.0, -10.0, -20.0):
        loss = _siglip(1 / t, b).from_scores(pos, neg).loss.item()
        errs.append(abs(math.log(loss + b + t * 0.3) - b - lse))
    assert errs[0] > 1e-3 and errs[1] < errs[0] * 1e-1 and errs[2] < 1e-6, errs
    # InfoNCE at tau = 1/t is that denominator less the positive's logit
    info = build_loss("infonce").from_scores(pos, neg, temperature=1 / t).loss.item()
    assert info == pytest.approx(lse - t * 0.3, rel=1e-12)


def test_its_learnt_scale_and_bias_start_where_siglip_starts():
    loss = build_loss("siglip")
    assert loss.bias.item() == -10.0 and loss.log_scale.item() == pytest.approx(math.log(10))
    assert build_loss("sigclr").name == "siglip"
    assert sorted(n for n, _ in loss.named_parameters()) == ["bias", "log_scale"]
    with pytest.raises(ValueError, match="bias_init must be a finite number"):
        build_loss("siglip", bias_init=float("inf"))
    # a given τ is used; the learnt bias still is
    z1, z2 = _views(4, 5, seed=2)
    pos, neg, _ = in_batch_scores(z1, z2)
    out = _siglip(0.3, -1.0).from_scores(pos, neg, temperature=0.5)
    assert out.loss.item() == pytest.approx(ref_siglip(ref_in_batch(z1.numpy(), z2.numpy()), 2.0, -1.0), rel=1e-12)
