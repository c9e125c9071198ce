"""SogCLR (Yuan et al. 2022): the registry's sixth loss, against a plain-loop float64
transliteration of LibAUC's ``GCLoss_v1``, its gamma = 1 identity with DCL, its per-image
``u`` (read and written only by the training step, saved in ``state.pt``), and a tiny run
through the real entry points."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hooks import crash_after
from loss_at_tau import at_tau

from smallbatch.losses import REGISTRY, SogCLR, build_loss, display_name, in_batch_scores
from smallbatch.study import checks
from smallbatch.study.cell import Cell
from smallbatch.study.cells import expand_cells, make_cell
from smallbatch.study.config import ConfigError, load_config
from smallbatch.study.schema import load_schema
from smallbatch.training import loop as train

TAU = 0.3


def _views(n: int, d: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, d, generator=g, dtype=torch.float64), torch.randn(n, d, generator=g, dtype=torch.float64)


def gcloss_v1_loop(h1, h2, index, u: dict, tau: float, gamma: float, per_image_init: bool = False):
    """LibAUC ``GCLoss_v1.forward`` (one process, iSogCLR off) as plain loops in float64:
    the loss (sum of the two views' losses, mean over images; scores not divided by tau)
    and ``u`` updated in place.  ``per_image_init``: an image with ``u = 0`` starts from the
    batch estimate (ours) instead of GCLoss_v1's whole-batch ``u[index].sum() == 0`` test."""
    a_all, b_all = F.normalize(h1, dim=1), F.normalize(h2, dim=1)
    n = a_all.shape[0]
    k = 2 * (n - 1)
    batch_new = sum(u.get(int(i), 0.0) for i in index) == 0
    total, new_u = 0.0, {}
    for a, b in ((a_all, b_all), (b_all, a_all)):
        for i in range(n):
            img = int(index[i])
            negs = [a[i] @ b[j] for j in range(n) if j != i] + [a[i] @ a[j] for j in range(n) if j != i]
            mean = sum(torch.exp(s.detach() / tau) for s in negs) / k
            old = u.get(img, 0.0)
            fresh = old == 0 if per_image_init else batch_new
            ui = mean if fresh else (1 - gamma) * old + gamma * mean
            weighted = sum((torch.exp(s.detach() / tau) / ui) * s for s in negs) / k
            total = total + (-(a[i] @ b[i]) + weighted) / n
            new_u.setdefault(img, []).append(float(ui))
    for img, vals in new_u.items():
        u[img] = sum(vals) / len(vals)
    return total


def ours(loss: SogCLR, z1, z2, idx, tau: float | None = TAU):
    pos, neg, mask = in_batch_scores(z1, z2)
    return loss.from_scores(pos, neg, mask, temperature=tau, index=torch.stack([idx, idx]))


def _grads(fn, z1, z2):
    a, b = z1.clone().requires_grad_(True), z2.clone().requires_grad_(True)
    out = fn(a, b)
    loss = out.loss if hasattr(out, "loss") else out
    return loss.detach(), torch.autograd.grad(loss, (a, b))


@pytest.mark.parametrize("gamma", [0.9, 0.5, 1.0])
def test_sogclr_is_gcloss_v1_over_two_tau_step_after_step(gamma):
    """Three steps over images seen and unseen: loss and gradient are GCLoss_v1's / (2 tau),
    and u is GCLoss_v1's, entry by entry."""
    loss = at_tau(SogCLR(gamma=gamma), TAU)
    loss.init_state(12, dtype=torch.float64)
    u: dict = {}
    batches = [torch.tensor([3, 7, 1, 9, 0]), torch.tensor([7, 3, 9, 0, 1]), torch.tensor([1, 0, 3, 7, 9])]
    for step, idx in enumerate(batches):  # step 0: all new; then all seen, in other orders
        z1, z2 = _views(5, 4, seed=step)
        ref_val, ref_g = _grads(lambda a, b, idx=idx: gcloss_v1_loop(a, b, idx, u, TAU, gamma), z1, z2)
        val, g = _grads(lambda a, b, idx=idx: ours(loss, a, b, idx), z1, z2)
        assert float(val) * 2 * TAU == pytest.approx(float(ref_val), rel=1e-12, abs=1e-12)
        for gr, go in zip(ref_g, g):
            torch.testing.assert_close(go * 2 * TAU, gr, rtol=1e-10, atol=1e-12)
        stored = torch.exp(loss.log_u)
        for img, value in u.items():
            assert float(stored[img]) == pytest.approx(value, rel=1e-12)
        assert torch.isneginf(loss.log_u[[2, 4, 5, 6, 8, 10, 11]]).all()  # never seen: u = 0


def test_a_batch_mixing_new_and_seen_images_starts_each_new_image_from_its_batch_estimate():
    """The one documented difference from GCLoss_v1 (whose whole-batch test would give the
    new images u = gamma g): u = 0 means 'never seen' per image."""
    gamma = 0.7
    loss = at_tau(SogCLR(gamma=gamma), TAU)
    loss.init_state(10, dtype=torch.float64)
    u_ours: dict = {}
    u_libauc: dict = {}
    for step, idx in enumerate([torch.tensor([0, 1, 2, 3]), torch.tensor([2, 3, 4, 5])]):
        z1, z2 = _views(4, 3, seed=10 + step)
        ref_val, ref_g = _grads(
            lambda a, b, idx=idx: gcloss_v1_loop(a, b, idx, u_ours, TAU, gamma, per_image_init=True), z1, z2
        )
        lib_val = gcloss_v1_loop(z1, z2, idx, u_libauc, TAU, gamma)
        val, g = _grads(lambda a, b, idx=idx: ours(loss, a, b, idx), z1, z2)
        assert float(val) * 2 * TAU == pytest.approx(float(ref_val), rel=1e-12)
        for gr, go in zip(ref_g, g):
            torch.testing.assert_close(go * 2 * TAU, gr, rtol=1e-10, atol=1e-12)
    assert float(lib_val) != pytest.approx(float(ref_val), rel=1e-6)  # GCLoss_v1 differs on a mixed batch
    for img, value in u_ours.items():
        assert float(torch.exp(loss.log_u[img])) == pytest.approx(value, rel=1e-12)


def test_gamma_one_is_dcl_whatever_u_held_before():
    """gamma = 1: u_r is the batch's own estimate, so the gradient is DCL's exactly and the
    value is DCL's minus log K (K = 2N - 2), whatever earlier steps stored."""
    z1, z2 = _views(6, 5, seed=3)
    idx = torch.arange(6)
    pos, neg, _ = in_batch_scores(z1, z2)
    fresh, used = at_tau(SogCLR(gamma=1.0), TAU), at_tau(SogCLR(gamma=1.0), TAU)
    for lo in (fresh, used):
        lo.init_state(6, dtype=torch.float64)
    w1, w2 = _views(6, 5, seed=99)
    ours(used, w1, w2, idx)  # an earlier step with other embeddings
    _, g_dcl = _grads(lambda a, b: at_tau(build_loss("dcl"), TAU)(a, b), z1, z2)
    dcl_value = at_tau(build_loss("dcl"), TAU)(z1, z2).value
    for lo in (fresh, used, at_tau(SogCLR(gamma=1.0), TAU)):  # the last: no index, no state
        call = (lambda a, b, lo=lo: ours(lo, a, b, idx)) if lo.log_u.numel() else (lambda a, b, lo=lo: lo(a, b))
        _, g = _grads(call, z1, z2)
        for gd, go in zip(g_dcl, g):
            torch.testing.assert_close(go, gd, rtol=1e-12, atol=1e-14)
        value = call(z1, z2).value
        assert float(value) == pytest.approx(float(dcl_value) - math.log(2 * 6 - 2), rel=1e-12)
    assert torch.equal(fresh.log_u, used.log_u)


def test_calls_without_index_change_nothing_and_are_the_gamma_one_form():
    loss = at_tau(SogCLR(gamma=0.5), TAU)
    loss.init_state(8, dtype=torch.float64)
    z1, z2 = _views(4, 3, seed=5)
    ours(loss, z1, z2, torch.arange(4))
    before = loss.log_u.clone()
    out = loss(z1, z2)  # diagnostics, gradient-norm and rounding-error measurements call it so
    assert torch.equal(loss.log_u, before)
    one = at_tau(SogCLR(gamma=1.0), TAU)(z1, z2)
    assert torch.equal(out.loss, one.loss) and torch.equal(out.value, one.value)


def test_masked_negatives_do_not_enter_u_or_the_gradient():
    """With a mask, g averages the valid negatives only; a masked negative's score has no
    gradient, and changing it changes nothing."""
    z1, z2 = _views(4, 3, seed=6)
    pos, neg, _ = in_batch_scores(z1, z2)
    mask = torch.rand(neg.shape, generator=torch.Generator().manual_seed(0)) > 0.4
    mask[:, 0] = True
    idx = torch.stack([torch.arange(4), torch.arange(4)])
    res = []
    for fill in (0.0, 0.9):
        loss = at_tau(SogCLR(gamma=0.6), TAU)
        loss.init_state(4, dtype=torch.float64)
        n = neg.masked_fill(~mask, fill).requires_grad_(True)
        out = loss.from_scores(pos, n, mask, index=idx)
        (gn,) = torch.autograd.grad(out.loss, n)
        assert (gn[~mask] == 0).all()
        res.append((out.loss.detach(), out.value, loss.log_u.clone()))
        g = torch.where(mask, torch.exp(neg / TAU), torch.zeros_like(neg)).sum(1) / mask.sum(1)
        assert torch.allclose(torch.exp(loss.log_u), (g[:4] + g[4:]) / 2, rtol=1e-12)
    for a, b in zip(*res):
        assert torch.equal(a, b)


def test_queue_anchors_index_is_one_view():
    """MoCo: the N queries are the anchors; index (1, N)."""
    loss = at_tau(SogCLR(gamma=0.5), TAU)
    loss.init_state(10, dtype=torch.float64)
    g = torch.Generator().manual_seed(1)
    pos, neg = torch.rand(3, dtype=torch.float64, generator=g), torch.rand(3, 7, dtype=torch.float64, generator=g)
    loss.from_scores(pos, neg, index=torch.tensor([[4, 0, 9]]))
    expect = torch.logsumexp(neg / TAU, 1) - math.log(7)
    torch.testing.assert_close(loss.log_u[[4, 0, 9]], expect, rtol=1e-14, atol=0)
    with pytest.raises(ValueError, match=r"index must be \(V, N\)"):
        loss.from_scores(pos, neg, index=torch.tensor([4, 0, 9]))
    with pytest.raises(ValueError, match="init_state"):
        at_tau(SogCLR(), TAU).from_scores(pos, neg, index=torch.tensor([[4, 0, 9]]))


@pytest.mark.parametrize("bad", [0, -0.1, 1.5, float("nan"), "x"])
def test_bad_gamma_is_one_line(bad):
    with pytest.raises(ValueError, match=r"gamma must be a finite number in \(0, 1\]"):
        at_tau(build_loss("sogclr", gamma=bad), 0.1)


def test_sogclr_is_in_the_registry_schema_cells_and_labels():
    assert "sogclr" in REGISTRY and display_name("sogclr") == "SogCLR"
    schema = load_schema()
    assert schema["properties"]["loss_params"]["properties"]["sogclr"]["properties"]["gamma"]["default"] == 0.9
    cfg = load_config(
        None,
        {
            "datasets": {"digits": {}},
            "grid": {
                "losses": ["sogclr", {"name": "sogclr", "gamma": [1.0, 0.5]}, {"name": "flatnce", "gamma": 2.0}],
                "batch_sizes": [16],
                "temperatures": [0.1],
                "seeds": [0],
            },
        },
    )
    assert set(expand_cells(cfg)) == {
        "digits/sogclr/bs16-t0.1-s0",
        "digits/sogclr-gamma1/bs16-t0.1-s0",
        "digits/sogclr-gamma0.5/bs16-t0.1-s0",
        "digits/flatnce-gamma2/bs16-t0.1-s0",
    }
    with pytest.raises(ConfigError, match="gamma"):
        load_config(None, {"datasets": {"digits": {}}, "grid": {"losses": [{"name": "sogclr", "gamma": 2.0}]}})


# --------------------------------------------------------------------------- training
TINY = {"width": 4, "proj_hidden": 16, "proj_dim": 8, "lr": 3e-3, "log_every": 5}


@pytest.fixture(scope="module")
def digits():
    from smallbatch.data.load import load_dataset

    return load_dataset("digits", None, train_subset=256)


def _cell(**train_opts):
    cfg = load_config(None, {"datasets": {"digits": {}}, "train": {**TINY, **train_opts}})
    return make_cell(
        cfg, dataset="digits", loss="sogclr", loss_params={"gamma": 0.8}, batch_size=32, temperature=0.5, seed=0
    )


def test_resume_restores_u_and_ends_bitwise_like_an_uninterrupted_run(tmp_path, digits):
    """u goes through the real save path (state.pt) and back: a run crashed in epoch 2 and
    resumed ends with the uninterrupted run's weights, bit for bit (without u restored the
    weights differ: gamma < 1 makes the gradient depend on u)."""
    torch.set_num_threads(1)
    cell = _cell(epochs=2)
    spe = digits.pretrain_x.shape[0] // 32

    def run(out, **kw):
        return train.pretrain(
            Cell.of(cell), digits.pretrain_x, digits.mean, digits.std, out, device="cpu", progress=False, **kw
        )

    ref = run(tmp_path / "ref")
    with pytest.raises(KeyboardInterrupt):
        run(tmp_path / "cut", after_step=crash_after(spe + 3))
    state = train.read_state(tmp_path / "cut" / "state.pt", Cell.of(cell))
    log_u = state["loss"]["log_u"]
    assert log_u.shape == (digits.pretrain_x.shape[0],) and torch.isfinite(log_u).sum() == spe * 32
    res = run(tmp_path / "cut")
    assert (res.status, res.steps) == (ref.status, ref.steps) == ("finished", 2 * spe)
    a = train.load_checkpoint(tmp_path / "ref" / "checkpoint.pt")["model"]
    b = train.load_checkpoint(tmp_path / "cut" / "checkpoint.pt")["model"]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_tiny_sogclr_cell_trains_through_the_command_line(tmp_path):
    from smallbatch.pipeline import cli

    out = tmp_path / "cell"
    rc = cli.main(
        [
            "pretrain",
            "--dataset",
            "digits",
            "--loss",
            "sogclr",
            "--loss-param",
            "gamma=0.5",
            "--batch-size",
            "32",
            "--temperature",
            "0.5",
            "--steps",
            "6",
            "--tracking-uri",
            "none",
            "--no-progress",
            "--out",
            str(out),
            "--threads",
            "1",
        ]
    )
    assert rc in (0, None)
    ck = train.load_checkpoint(out / "checkpoint.pt")
    assert ck["status"] == "finished" and ck["cell"]["loss"] == "sogclr" and ck["cell"]["loss_params"] == {"gamma": 0.5}


def test_sogclr_on_several_processes_is_refused_in_one_line():
    cell = _cell(devices=2)
    assert "one process" in checks.control_problem(Cell.of(cell))


# --------------------------------------------------------------------------- iSogCLR
def isogclr_loop(h1, h2, index, state: dict, gamma, rho, eta, beta, tau_min, tau_max):
    """LibAUC ``GCLoss_v1(enable_isogclr=True).forward`` (one process) as plain loops in float64,
    with u set per image on its first visit (as ours): the loss (views summed, images
    averaged; scores not divided by tau), and ``state`` (u, tau, its momentum per image)
    updated in place -- tau after the loss is taken, from each view's own u."""
    a_all, b_all = F.normalize(h1, dim=1), F.normalize(h2, dim=1)
    n = a_all.shape[0]
    k = 2 * (n - 1)
    u, tau, mom = state["u"], state["tau"], state["mom"]
    total, new_u, grads = 0.0, {}, {}
    for a, b in ((a_all, b_all), (b_all, a_all)):
        for i in range(n):
            img = int(index[i])
            t = tau[img]
            negs = [a[i] @ b[j] for j in range(n) if j != i] + [a[i] @ a[j] for j in range(n) if j != i]
            mean = sum(torch.exp(s.detach() / t) for s in negs) / k
            old = u.get(img, 0.0)
            ui = mean if old == 0 else (1 - gamma) * old + gamma * mean
            w = [torch.exp(s.detach() / t) / ui for s in negs]
            total = total + (-(a[i] @ b[i]) + sum(wj * s for wj, s in zip(w, negs)) / k) / n
            new_u.setdefault(img, []).append(float(ui))
            d = math.log(float(ui)) + rho - float(sum(wj * s.detach() / t for wj, s in zip(w, negs)) / k)
            grads.setdefault(img, []).append(d)
    for img, vals in new_u.items():
        u[img] = sum(vals) / len(vals)
        mom[img] = (1 - beta) * mom.get(img, 0.0) + beta * sum(grads[img]) / 2
        tau[img] = min(max(tau[img] - eta * mom[img], tau_min), tau_max)
    return total


ISO = {"gamma": 0.8, "rho": 0.4, "eta": 0.05, "beta": 0.9, "tau_min": 0.05, "tau_max": 0.7}


def test_isogclr_is_libaucs_enable_isogclr_step_after_step():
    """Three steps over 5 of 12 images (new, then seen in other orders): loss and gradient are
    half LibAUC's, and u, every image's tau and its momentum are LibAUC's, entry by entry."""
    loss = build_loss("isogclr", **ISO)
    loss.init_state(12, dtype=torch.float64)
    loss.init_temperature(0.3)
    state = {"u": {}, "tau": {i: 0.3 for i in range(12)}, "mom": {}}
    batches = [torch.tensor([3, 7, 1, 9, 0]), torch.tensor([7, 3, 9, 0, 1]), torch.tensor([1, 0, 3, 7, 9])]
    moved = 0
    for step, idx in enumerate(batches):
        z1, z2 = _views(5, 4, seed=20 + step)
        ref_val, ref_g = _grads(lambda a, b, idx=idx: isogclr_loop(a, b, idx, state, **ISO), z1, z2)
        val, g = _grads(lambda a, b, idx=idx: ours(loss, a, b, idx, tau=None), z1, z2)
        assert float(val) * 2 == pytest.approx(float(ref_val), rel=1e-12, abs=1e-12)
        for gr, go in zip(ref_g, g):
            torch.testing.assert_close(go * 2, gr, rtol=1e-10, atol=1e-12)
        for img, value in state["u"].items():
            assert float(torch.exp(loss.log_u[img])) == pytest.approx(value, rel=1e-12)
        for img, value in state["tau"].items():
            assert float(loss.tau_i[img]) == pytest.approx(value, rel=1e-12)
            moved += value != 0.3
        for img, value in state["mom"].items():
            assert float(loss.tau_momentum[img]) == pytest.approx(value, rel=1e-10, abs=1e-14)
    assert moved and float(loss.learnt_temperature()) == pytest.approx(sum(state["tau"].values()) / 12, rel=1e-12)


def test_isogclr_at_fixed_temperatures_is_tau_times_sogclr():
    """eta = 0: the temperatures never move, and at tau the gradient is tau times SogCLR's, u the same."""
    iso, sog = build_loss("isogclr", **{**ISO, "eta": 0.0}), build_loss("sogclr", gamma=ISO["gamma"])
    for lo in (iso, sog):
        lo.init_state(8, dtype=torch.float64)
    iso.init_temperature(TAU)
    for step, idx in enumerate([torch.tensor([0, 1, 2, 3]), torch.tensor([2, 3, 4, 5])]):
        z1, z2 = _views(4, 3, seed=30 + step)
        _, gi = _grads(lambda a, b, idx=idx: ours(iso, a, b, idx, tau=None), z1, z2)
        _, gs = _grads(lambda a, b, idx=idx: ours(sog, a, b, idx), z1, z2)
        for a, b in zip(gi, gs):
            torch.testing.assert_close(a, TAU * b, rtol=1e-12, atol=1e-14)
    assert torch.equal(iso.log_u, sog.log_u) and (iso.tau_i == TAU).all()


def test_isogclr_bad_parameters_are_one_line():
    with pytest.raises(ValueError, match="tau_min must be below tau_max"):
        build_loss("isogclr", tau_min=0.5, tau_max=0.1)
    with pytest.raises(ValueError, match=r"beta must be a finite number in \(0, 1\]"):
        build_loss("isogclr", beta=0.0)
    with pytest.raises(ValueError, match="rho must be a finite number >= 0"):
        build_loss("isogclr", rho=-1)
    assert list(build_loss("isogclr").parameters()) == []  # its temperatures are state, not parameters


def test_an_isogclr_cell_logs_its_mean_temperature_and_resumes_bitwise(tmp_path, digits, capfd):
    cfg = load_config(
        None,
        {
            "datasets": {"digits": {}},
            "train": {"width": 4, "proj_hidden": 16, "proj_dim": 8, "epochs": 2, "log_every": 5, "precision": "fp64"},
        },
    )
    cell = make_cell(cfg, dataset="digits", loss="isogclr", loss_params={}, batch_size=32, temperature=0.5, seed=0)
    logs: list = []

    def run(out, **kw):
        return train.pretrain(
            Cell.of(cell), digits.pretrain_x, digits.mean, digits.std, out, device="cpu", progress=False, **kw
        )

    run(tmp_path / "ref", log_fn=lambda m, s: logs.append(m))
    taus = [m["train/tau"] for m in logs]
    assert taus[0] != taus[-1] and all(0.05 <= t <= 0.7 for t in taus)
    spe = digits.pretrain_x.shape[0] // 32
    with pytest.raises(KeyboardInterrupt):
        run(tmp_path / "cell", after_step=crash_after(spe + 3))
    run(tmp_path / "cell")
    a, b = (train.load_checkpoint(tmp_path / f / "state.pt") for f in ("ref", "cell"))
    assert set(a["loss"]) == {"log_u", "tau_i", "tau_momentum"}
    for part in ("loss", "model"):
        for k, v in a[part].items():
            assert torch.equal(v, b[part][k]), (part, k)
    assert float(a["loss"]["tau_i"].mean()) == pytest.approx(taus[-1], abs=0.05)
