"""Fresh negatives (``train.extra_negatives``): N images with gradient, E more encoded without
gradient by the current weights, serving only as negatives (K = 2(N+E)-2 at the step count of
batch N).  In float64: the loss is the whole batch's InfoNCE on the anchors' rows when the
extra images are the rest of the batch, no gradient reaches an extra image, BatchNorm treats
the extras as the groups of a bn_group batch without touching the running statistics; the
arm is paired with the plain batch-N cell of its seed, resumes bitwise and stays one graph.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hooks import crash_after

from smallbatch.losses import build_loss
from smallbatch.study import checks
from smallbatch.study.cell import Cell
from smallbatch.study.cells import expand_cells, make_cell
from smallbatch.study.config import ConfigError, load_config
from smallbatch.training import loop as train
from smallbatch.training.ghostbn import ghost_batchnorm
from smallbatch.training.models import ContrastiveModel, build_backbone
from smallbatch.training.negatives import FreshNegatives, fresh_window, running_stats, with_extra_views

pytestmark = pytest.mark.usefixtures("one_thread")
N, E, TAU = 4, 8, 0.3
TINY = {"width": 2, "proj_hidden": 8, "proj_dim": 4}


def _net() -> ContrastiveModel:
    torch.manual_seed(0)
    backbone, feat = build_backbone("small_cnn", 1, 8, width=2)
    return ghost_batchnorm(ContrastiveModel(backbone, feat, 6, 4).double(), group=N, views=2)


def _images(n: int = N + E):
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, 1, 8, 8, generator=g, dtype=torch.float64), torch.randn(
        n, 1, 8, 8, generator=g, dtype=torch.float64
    )


def _infonce_rows(z: torch.Tensor, rows: torch.Tensor, tau: float) -> torch.Tensor:
    """Float64 reference: InfoNCE of the anchors ``rows`` of the 2M views ``z`` (view i's
    positive is view (i + M) mod 2M, its negatives every other view but itself)."""
    m = z.shape[0]
    z = F.normalize(z, dim=1)
    logits = (z @ z.T / tau).masked_fill(torch.eye(m, dtype=torch.bool), float("-inf"))
    partner = (torch.arange(m) + m // 2) % m
    lse = torch.logsumexp(logits, dim=1)
    return (lse - logits[torch.arange(m), partner])[rows]


def _anchor_rows() -> torch.Tensor:
    return torch.cat([torch.arange(N), torch.arange(N) + N + E])


def test_the_loss_is_the_whole_batch_infonce_on_the_anchors_rows():
    """The N anchors then E extra images through the source equal the batch of N+E images
    through the network in one pass (BatchNorm in groups of N both ways), and the loss is the
    float64 InfoNCE of that whole batch restricted to the anchors' 2N rows."""
    v1, v2 = _images()
    whole, fresh = _net(), _net()
    z_ref = whole(torch.cat([v1, v2]))
    ref = _infonce_rows(z_ref, _anchor_rows(), TAU).mean()
    src = FreshNegatives(E)
    z1, z2 = src.embed(fresh, v1, v2)
    torch.testing.assert_close(torch.cat([z1, z2]), z_ref, rtol=1e-12, atol=1e-13)
    idx = torch.arange(N + E) + 100
    sc = src.scores(z1, z2, idx)
    assert sc.neg.shape == (2 * N, 2 * (N + E) - 2) and sc.mask is None  # K = 2(N+E) - 2
    assert torch.equal(sc.index, torch.stack([idx[:N], idx[:N]]))  # a per-image loss state sees the anchors
    out = build_loss("infonce").from_scores(sc.pos, sc.neg, temperature=TAU)
    torch.testing.assert_close(out.loss, ref, rtol=1e-13, atol=1e-13)


def test_no_gradient_reaches_an_extra_image_and_the_anchors_get_the_detached_batch_gradient():
    """The parameters' gradient is the whole batch's loss gradient with the extras' embeddings
    held constant; the extras' input views get none."""
    v1, v2 = (v.clone().requires_grad_(True) for v in _images())
    fresh, whole = _net(), _net()
    src = FreshNegatives(E)
    z1, z2 = src.embed(fresh, v1, v2)
    sc = src.scores(z1, z2, torch.arange(N + E))
    build_loss("infonce").from_scores(sc.pos, sc.neg, temperature=TAU).loss.backward()
    for v in (v1, v2):
        assert v.grad[:N].abs().sum() > 0 and (v.grad[N:] == 0).all()
    # the reference: one pass of the whole batch, the extras' embeddings detached
    z = whole(torch.cat([v1.detach(), v2.detach()]))
    keep = torch.zeros(2 * (N + E), 1, dtype=torch.bool)
    keep[_anchor_rows()] = True
    z = torch.where(keep, z, z.detach())
    _infonce_rows(z, _anchor_rows(), TAU).mean().backward()
    for (name, a), b in zip(fresh.named_parameters(), whole.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-10, atol=1e-12, msg=name)


def test_the_extras_pass_leaves_the_running_statistics_to_the_anchors():
    v1, v2 = _images()
    fresh, plain = _net(), _net()
    FreshNegatives(E).embed(fresh, v1, v2)
    plain(torch.cat([v1[:N], v2[:N]]))  # the plain batch-N step's forward
    for a, b in zip(running_stats(fresh), running_stats(plain)):
        assert torch.equal(a, b)
    assert int(running_stats(fresh)[2]) == 1  # one batch counted: the anchors'


# --------------------------------------------------------------------------- the step's images
def test_the_window_holds_the_anchors_and_the_rest_of_the_larger_batch():
    perm = torch.randperm(100, generator=torch.Generator().manual_seed(0))
    for pos in range(100 // N):
        idx = fresh_window(perm, pos, N, 12)  # W = 16: a batch-16 step's images
        assert torch.equal(idx[:N], perm[pos * N : (pos + 1) * N])  # the plain batch-N step's
        assert idx.unique().numel() == N + 12
        w = min(pos * N // 16 * 16, 100 - 16)
        assert set(idx.tolist()) == set(perm[w : w + 16].tolist())
    odd = [fresh_window(perm, pos, N, 7) for pos in range(25)]  # W = 11, not a multiple of N
    for pos, idx in enumerate(odd):
        assert torch.equal(idx[:N], perm[pos * N : (pos + 1) * N]) and idx.unique().numel() == N + 7
        places = sorted(int((perm == i).nonzero()) for i in idx)
        assert places == list(range(places[0], places[0] + N + 7))  # consecutive in the data order
    with pytest.raises(ValueError, match="exceed the 100 pretraining images"):
        fresh_window(perm, 0, N, 97)


def test_the_views_are_view_one_of_every_image_then_view_two():
    ua, ue = torch.arange(2 * N)[:, None], 100 + torch.arange(2 * E)[:, None]
    u = with_extra_views(ua, ue)
    assert u[:, 0].tolist() == [*range(N), *range(100, 100 + E), *range(N, 2 * N), *range(100 + E, 100 + 2 * E)]


def _cell(batch_size: int = 8, **train_opts):
    cfg = load_config(None, {"datasets": {"digits": {}}, "train": {**TINY, "bn_group": 8}})
    return make_cell(
        cfg,
        dataset="digits",
        loss="infonce",
        loss_params={},
        batch_size=batch_size,
        temperature=0.2,
        seed=3,
        train_overrides=train_opts,
    )


class _Seen:
    """Records what a step's ``run`` was given."""

    def __init__(self, step_fn):
        self.step_fn, self.calls = step_fn, []
        self.run = step_fn.run
        step_fn.run = self

    def __call__(self, x, u, idx):
        self.calls.append((x.clone(), u.clone(), idx.clone()))
        return self.run(x, u, idx)


def test_the_arm_is_paired_with_the_plain_cell_of_its_seed(tmp_path):
    """Step by step, the anchors and their views' uniforms are those of the plain batch-N cell."""
    images = (torch.rand(96, 1, 8, 8, generator=torch.Generator().manual_seed(0)) * 255).to(torch.uint8)
    seen = {}
    for name, opts in (("plain", {}), ("fresh", {"extra_negatives": 24})):
        t = train.build_training(
            Cell.of(_cell(**opts, epochs=1)), images, [0.5], [0.25], torch.device("cpu"), tmp_path / name
        )
        seen[name] = _Seen(t.step_fn)
        train.run_loop(t, train.Hooks(progress=False), 0.0)
    plain, fresh = seen["plain"].calls, seen["fresh"].calls
    assert len(plain) == len(fresh) == 96 // 8
    for (xp, up, ip), (xf, uf, i_f) in zip(plain, fresh):
        assert i_f.shape == (32,) and torch.equal(i_f[:8], ip) and torch.equal(xf[:8], xp)
        assert torch.equal(uf[:8], up[:8]) and torch.equal(uf[32:40], up[8:])


# --------------------------------------------------------------------------- the cell
def test_the_arm_is_a_control_with_its_id_k_and_hash_and_its_refusals_are_one_line():
    cfg = load_config(
        None,
        {
            "datasets": {"digits": {}},
            "train": TINY,
            "grid": {
                "losses": ["infonce"],
                "temperatures": [0.1],
                "seeds": [0],
                "batch_sizes": [16, {"size": 16, "train": {"extra_negatives": 240}}, 256],
            },
        },
    )
    cells = expand_cells(cfg)
    fresh, plain = cells["digits/infonce/bs16-t0.1-s0-xn240"], cells["digits/infonce/bs16-t0.1-s0"]
    assert (fresh["negatives"], plain["negatives"], cells["digits/infonce/bs256-t0.1-s0"]["negatives"]) == (
        510,
        30,
        510,
    )
    assert fresh["hash"] != plain["hash"] and plain["train"]["extra_negatives"] is None
    for opts, key in (
        ({"neg_group": 4}, "neg_group"),
        ({"queue_size": 16}, "queue_size"),
        ({"mask_same_class": True}, "mask_same_class"),
        ({"bn_group": None, "chunk_size": 4}, "chunk_size"),
    ):
        problem = checks.control_problem(Cell.of(_cell(extra_negatives=16, **opts)))
        assert f"train.{key}" in problem and "\n" not in problem
    assert "does not divide train.extra_negatives = 12" in checks.control_problem(Cell.of(_cell(extra_negatives=12)))
    with pytest.raises(ConfigError, match="with 1500 extra negatives is larger than the 1,437 pretraining images"):
        load_config(None, {"datasets": {"digits": {}}, "train": {**TINY, "extra_negatives": 1500}})


def test_the_step_with_fresh_negatives_is_one_graph(tmp_path):
    images = (torch.rand(64, 1, 8, 8, generator=torch.Generator().manual_seed(0)) * 255).to(torch.uint8)
    t = train.build_training(Cell.of(_cell(extra_negatives=16)), images, [0.5], [0.25], torch.device("cpu"), tmp_path)
    idx = torch.arange(24) * 2
    u = t.step_fn.aug.draw(48, torch.Generator().manual_seed(0))
    fwd = torch._dynamo.explain(t.step_fn.forward)(images[idx], u, idx)
    assert fwd.graph_break_count == 0 and fwd.graph_count == 1, [str(r.reason) for r in fwd.break_reasons]


def test_a_fresh_negatives_cell_resumes_bitwise(tmp_path, digits):
    cell = _cell(batch_size=16, extra_negatives=48, bn_group=16, epochs=2)
    run = lambda out, **kw: train.pretrain(  # noqa: E731
        Cell.of(cell), digits.pretrain_x, digits.mean, digits.std, Path(out), device="cpu", progress=False, **kw
    )
    ref = run(tmp_path / "ref")
    spe = digits.pretrain_x.shape[0] // 16
    with pytest.raises(KeyboardInterrupt):
        run(tmp_path / "cut", after_step=crash_after(spe + 5))
    res = run(tmp_path / "cut")
    assert res.steps == ref.steps == 2 * spe
    a = train.load_checkpoint(tmp_path / "ref" / "checkpoint.pt")["model"]
    b = train.load_checkpoint(tmp_path / "cut" / "checkpoint.pt")["model"]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
