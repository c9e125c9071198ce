"""FlatNCE's numerical claim, measured: float32 vs float64 gradients of InfoNCE and FlatNCE.

Claim (Chen et al. 2021, FlatNCE, Sec. 3): when positives dominate, InfoNCE's gradient is
q_B * (FlatNCE's gradient) with q_B = 1 - softmax_pos ~ 0, and the framework computes
q_B as 1 - p (p ~ 1), so in float32 its relative precision is ~ u/q_B (u = 2^-24) and the
positive's pull is lost entirely once q_B < u; FlatNCE (= DCL in gradient) has no such factor.

Measured on these machines with the batch below (seed 0, D = 128, positives at cos 0.995,
negatives near cos 0), float32-vs-float64 relative error of d loss / d(z1, z2):

    K   tau   q_B      InfoNCE   FlatNCE
    2   0.05  2.6e-09  1.0e-01   6.0e-07     effect present: positive pull lost in float32
    6   0.05  1.8e-08  1.3e-01   3.3e-07
    30  0.05  3.1e-07  1.7e-01   6.1e-07
    2   0.10  7.2e-05  3.0e-04   2.0e-07     intermediate: error ~ u/q_B, shrinks as K grows
    30  0.10  2.2e-03  3.0e-05   4.6e-07
    2   0.50  2.1e-01  1.8e-07   1.5e-07     absent: q_B >> u, no cancellation
    6   0.02  8.1e-21  1.1e-06   1.0e-06     float64 saturates too (q_B < 2^-53): the f32~f64
                                             measure misses it; against the exact gradient both
                                             float32 and float64 InfoNCE are off by 9e-2.

The assertions below are written from these measurements (with margins), and each
failure message prints the errors.  ``benchmarks/loss_precision.py`` prints the full table.
"""

from __future__ import annotations

import pytest
import torch
from loss_at_tau import at_tau

from smallbatch.losses import build_loss, in_batch_scores
from smallbatch.losses.diagnostics import diagnostics
from smallbatch.training.negatives import MomentumQueue

torch.set_num_threads(1)
U32 = 2.0**-24


def saturated_views(n: int, d: int = 128, spread: float = 0.05, seed: int = 0):
    """Views base ± spread·noise: positives near cos 1 (0.995 at spread 0.05), negatives near cos 0."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(n, d, generator=g, dtype=torch.float64)
    noise = torch.randn(n, d, generator=g, dtype=torch.float64)
    return base + spread * noise, base - spread * noise


def grad(name: str, tau: float, z1, z2, dtype) -> torch.Tensor:
    """d loss / d(z1, z2) computed in ``dtype``; name 'exact_infonce' is InfoNCE's gradient computed
    stably as q_B * grad(l) with l = logsumexp_j (s_j - s_p)/tau and q_B = sigmoid(l) (no 1 - p)."""
    a = z1.detach().to(dtype).clone().requires_grad_()
    b = z2.detach().to(dtype).clone().requires_grad_()
    pos, neg, _ = in_batch_scores(a, b)
    if name == "exact_infonce":
        l = torch.logsumexp((neg - pos[:, None]) / tau, dim=1)
        (torch.sigmoid(l).detach() * l).mean().backward()
    else:
        at_tau(build_loss(name), tau)(a, b).loss.backward()
    return torch.cat([a.grad.flatten(), b.grad.flatten()]).double()


def rel(g, ref) -> float:
    return float((g - ref).norm() / ref.norm())


def errors(k: int, tau: float, spread: float = 0.05) -> dict[str, float]:
    z1, z2 = saturated_views(k // 2 + 1, spread=spread)
    f64 = {n: grad(n, tau, z1, z2, torch.float64) for n in ("infonce", "flatnce", "dcl")}
    f32 = {n: grad(n, tau, z1, z2, torch.float32) for n in ("infonce", "flatnce", "dcl")}
    exact = grad("exact_infonce", tau, z1, z2, torch.float64)
    pos, neg, _ = in_batch_scores(z1, z2)
    return {
        "infonce": rel(f32["infonce"], f64["infonce"]),
        "flatnce": rel(f32["flatnce"], f64["flatnce"]),
        "dcl": rel(f32["dcl"], f64["dcl"]),
        "infonce32_exact": rel(f32["infonce"], exact),
        "infonce64_exact": rel(f64["infonce"], exact),
        "qb": diagnostics(pos, neg, tau)["qb_mean"],
    }


def _msg(k, tau, e) -> str:
    return (
        f"K={k} tau={tau} q_B={e['qb']:.2e}: float32-vs-float64 gradient rel. error InfoNCE={e['infonce']:.2e} "
        f"FlatNCE={e['flatnce']:.2e} DCL={e['dcl']:.2e}; vs exact: InfoNCE32={e['infonce32_exact']:.2e} "
        f"InfoNCE64={e['infonce64_exact']:.2e}"
    )


@pytest.mark.parametrize("tau", [0.2, 0.5, 1.0])
def test_exact_reference_is_infonce_gradient(tau):
    """The reference used below: grad InfoNCE_i = q_B,i * grad FlatNCE_i (FlatNCE paper), q_B = sigmoid(l)."""
    z1, z2 = saturated_views(5, spread=0.3)
    torch.testing.assert_close(
        grad("exact_infonce", tau, z1, z2, torch.float64),
        grad("infonce", tau, z1, z2, torch.float64),
        rtol=1e-12,
        atol=1e-15,
    )


@pytest.mark.parametrize("k", [2, 6, 30])
def test_saturated_batch_float32_infonce_gradient_is_wrong_flatnce_is_not(k):
    """Effect present: tau = 0.05, q_B < ~3e-7.  Measured InfoNCE 0.10-0.17, FlatNCE <= 6e-7."""
    tau = 0.05
    e = errors(k, tau)
    msg = _msg(k, tau, e)
    assert e["infonce"] > 1e-2, msg
    assert e["flatnce"] < 1e-5 and e["dcl"] < 1e-5, msg
    assert e["infonce"] > 1e4 * e["flatnce"], msg
    assert e["infonce64_exact"] < 4e-7, msg  # float64 is a valid reference here (measured <= 4.4e-8, at K=2)


def test_positive_pull_is_exactly_zero_in_float32_when_qb_below_roundoff():
    """Score space, K = 2, tau = 0.05 (q_B = 2.6e-9 < u): float32 InfoNCE's d/ds_pos is exactly 0;
    FlatNCE's is -1/(tau * 2N) per anchor in both precisions."""
    z1, z2 = saturated_views(2)
    tau = 0.05
    res = {}
    for name in ("infonce", "flatnce"):
        for dt in (torch.float32, torch.float64):
            pos, neg, _ = in_batch_scores(z1.to(dt), z2.to(dt))
            pos = pos.detach().requires_grad_()
            at_tau(build_loss(name), tau).from_scores(pos, neg).loss.backward()
            res[name, dt] = pos.grad.double()
    msg = f"d/ds_pos: { ({f'{n}/{d}': g.tolist() for (n, d), g in res.items()}) }"
    assert torch.all(res["infonce", torch.float32] == 0), msg
    assert torch.all(res["infonce", torch.float64] < 0), msg  # float64 still sees the pull (~ -1.3e-8)
    expected = torch.full((4,), -1.0 / (tau * 4), dtype=torch.float64)
    # measured relative error 7.6e-7 (float32) and 1.4e-15 (float64): held to ~7x that
    for dt, rtol in ((torch.float32, 5e-6), (torch.float64, 1e-14)):
        torch.testing.assert_close(res["flatnce", dt], expected, rtol=rtol, atol=0, msg=msg)


def test_intermediate_saturation_error_scales_like_roundoff_over_qb():
    """tau = 0.1: measured InfoNCE 3.0e-4 (K=2), 9.5e-5 (K=6), 3.0e-5 (K=30), i.e. 0.4-1.1 x u/q_B;
    the error shrinks as K grows (more negatives, larger q_B) — the small-K regime is the bad one."""
    tau = 0.1
    errs = {k: errors(k, tau) for k in (2, 6, 30)}
    msg = "; ".join(_msg(k, tau, e) for k, e in errs.items())
    for e in errs.values():
        assert 0.1 < e["infonce"] / (U32 / e["qb"]) < 10, msg
        assert e["infonce"] > 10 * e["flatnce"], msg
        assert e["flatnce"] < 1e-5, msg
    assert errs[2]["infonce"] > errs[6]["infonce"] > errs[30]["infonce"], msg


@pytest.mark.parametrize("k,tau", [(2, 0.5), (30, 0.5), (6, 1.0)])
def test_no_effect_without_saturation(k, tau):
    """Effect absent: q_B >= 0.2 >> u, so 1 - p has no cancellation; both errors are float32 roundoff
    (measured 1.7e-7 to 4.7e-7, ratio 0.8-1.3)."""
    e = errors(k, tau)
    msg = _msg(k, tau, e)
    assert e["qb"] > 0.1, msg
    assert e["infonce"] < 2e-6 and e["flatnce"] < 2e-6, msg
    assert 0.2 < e["infonce"] / e["flatnce"] < 5, msg


def test_extreme_saturation_float64_infonce_saturates_too():
    """tau = 0.02, K = 6: q_B = 8e-21 < 2^-53, so float64 InfoNCE also loses the positive's pull and
    float32-vs-float64 shows no difference (measured 1.1e-6) although both are ~9e-2 off the exact
    gradient.  The 'float32 vs float64' measure is blind in this regime; FlatNCE stays exact."""
    tau, k = 0.02, 6
    e = errors(k, tau)
    msg = _msg(k, tau, e)
    assert e["qb"] < 2.0**-53, msg
    assert e["infonce"] < 1e-4, msg
    assert e["infonce32_exact"] > 1e-2 and e["infonce64_exact"] > 1e-2, msg
    assert e["flatnce"] < 1e-5, msg


# --------------------------------------------------------------------------- low precision
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", ["infonce", "flatnce", "dcl", "dclw", "eqco"])
def test_half_precision_inputs_are_finite_at_small_tau(dtype, name):
    """tau = 0.01 (logits up to +-100, beyond float16's exp range): computed in float32 internally.
    On a random batch the half-input gradient matches float64 on the same (rounded) inputs to the
    half type's precision; on a saturated batch everything stays finite."""
    g = torch.Generator().manual_seed(0)
    loss = at_tau(build_loss(name), 0.01)
    # random (unsaturated) batch: compare with float64 on the same rounded inputs
    h1 = (torch.randn(8, 32, generator=g) * 10).to(dtype)
    h2 = (torch.randn(8, 32, generator=g) * 10).to(dtype)
    grads = {}
    for dt in (dtype, torch.float64):
        a, b = h1.to(dt).clone().requires_grad_(), h2.to(dt).clone().requires_grad_()
        out = loss(a, b)
        assert out.loss.dtype == (torch.float32 if dt == dtype else torch.float64)
        assert torch.isfinite(out.loss) and torch.isfinite(out.value) and torch.isfinite(out.infonce)
        out.loss.backward()
        assert a.grad.dtype == dt and torch.isfinite(a.grad).all() and torch.isfinite(b.grad).all()
        grads[dt] = torch.cat([a.grad.flatten(), b.grad.flatten()]).double()
    err = rel(grads[dtype], grads[torch.float64])
    # the half type's precision is its machine epsilon (bf16 7.8e-3, fp16 9.8e-4); measured 1.7e-3 (bf16) and
    # 2.1e-4 (fp16) for every loss: eps is 4.6x the measured error
    eps = torch.finfo(dtype).eps
    assert err < eps, f"{name} {dtype}: gradient rel. error vs float64 {err:.2e} above the type's epsilon {eps:.1e}"
    # saturated batch (views nearly identical): finite loss, value and gradient
    z1 = h1.clone().requires_grad_()
    z2 = (h1.float() + 0.01 * torch.randn(8, 32, generator=g)).to(dtype).requires_grad_()
    out = loss(z1, z2)
    out.loss.backward()
    assert torch.isfinite(out.loss) and torch.isfinite(out.value) and torch.isfinite(out.infonce)
    assert torch.isfinite(z1.grad).all() and torch.isfinite(z2.grad).all()
    # queue negatives in half precision as well
    queue = MomentumQueue(16, 32, dtype=dtype)
    queue.enqueue(torch.randn(16, 32, generator=g).to(dtype), torch.arange(16))
    q = h1.clone().requires_grad_()
    out = loss(q, z2.detach(), queue=queue, q_index=torch.arange(8))
    out.loss.backward()
    assert torch.isfinite(out.loss) and torch.isfinite(q.grad).all()
    pos, neg, _ = in_batch_scores(z1.detach(), z2.detach())
    d = diagnostics(pos, neg, 0.01, z1=z1.detach(), z2=z2.detach())
    assert all(v == v and abs(v) != float("inf") for v in d.values()), d


def test_float64_is_never_downcast_and_float32_not_upcast():
    z1, z2 = saturated_views(3)
    for dt in (torch.float32, torch.float64):
        pos, neg, _ = in_batch_scores(z1.to(dt), z2.to(dt))
        assert pos.dtype == dt and neg.dtype == dt
        for name in ("infonce", "flatnce", "dcl", "dclw", "eqco"):
            out = at_tau(build_loss(name), 0.1)(z1.to(dt), z2.to(dt))
            assert out.loss.dtype == dt and out.value.dtype == dt
    # a float32 queue with float64 queries computes in float64
    out = at_tau(build_loss("infonce"), 0.1)(z1, z2, queue=torch.randn(5, 128))
    assert out.loss.dtype == torch.float64
    # mixed half/float32 views compute in float32
    assert in_batch_scores(z1.half(), z2.float())[0].dtype == torch.float32
