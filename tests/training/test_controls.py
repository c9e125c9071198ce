"""The training-side controls of the instrument, in float64:

* grouped negatives (``train.neg_group``): G = B is the ungrouped loss; each group's loss
  is the loss of that group alone (with the oracle mask too); G must divide B;
* ghost BatchNorm (``train.bn_group``): G = B is plain BatchNorm; G < B is running the
  groups one after the other, each as its own batch;
* the oracle false-negative mask (``train.mask_same_class``): masked negatives do not
  count; with all-distinct labels it is the plain loss;
* budgets and learning rates: ``train.steps`` against epochs, ``lr`` per batch size
  (a batch-size entry) and as an axis; the cell ids and hashes tell every arm apart;
* the step stays one graph with every control on.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from loss_at_tau import at_tau

from smallbatch.losses import (
    REGISTRY,
    build_loss,
    grouped_in_batch_scores,
    in_batch_columns,
    in_batch_scores,
    same_view_mask,
)
from smallbatch.study import checks
from smallbatch.study.cell import Cell
from smallbatch.study.cells import expand_cells, make_cell
from smallbatch.study.config import ConfigError, load_config
from smallbatch.training import loop as train
from smallbatch.training.ghostbn import GhostBatchNorm, ghost_batchnorm
from smallbatch.training.models import ContrastiveModel, build_backbone
from smallbatch.training.negatives import InBatch, in_batch_mask

N, D, TAU = 8, 5, 0.3

#: the losses that contrast negatives (the methods without negatives have none to group or mask)
CONTRASTIVE = [n for n, cls in REGISTRY.items() if cls.spec.contrastive]


def _views(n: int = N, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, D, generator=g, dtype=torch.float64), torch.randn(n, D, generator=g, dtype=torch.float64)


def _rows_loss(name, pos, neg, mask):
    """Per-anchor loss rows (with their gradient) of loss ``name``; SogCLR: its gamma = 1 form."""
    loss = at_tau(build_loss(name), TAU)
    p, n, m = pos, neg, mask
    from smallbatch.losses import prepare_scores

    p, n, m = prepare_scores(p, n, m)
    return loss._rows(p, n, m, TAU, None)[0]


# --------------------------------------------------------------------------- grouped negatives
@pytest.mark.parametrize("name", CONTRASTIVE)
def test_one_group_of_the_whole_batch_is_the_ungrouped_loss(name):
    z1, z2 = _views()
    pos, neg, _ = in_batch_scores(z1, z2)
    gpos, gneg, mask = grouped_in_batch_scores(z1, z2, N)
    assert mask is None and gneg.shape == neg.shape
    torch.testing.assert_close(gpos, pos, rtol=0, atol=1e-15)
    torch.testing.assert_close(gneg, neg, rtol=0, atol=1e-15)
    loss = at_tau(build_loss(name), TAU)
    a, b = loss.from_scores(pos, neg), loss.from_scores(gpos, gneg)
    torch.testing.assert_close(b.loss, a.loss, rtol=1e-14, atol=1e-14)
    torch.testing.assert_close(b.value, a.value, rtol=1e-14, atol=1e-14)


def _group_rows(rows: torch.Tensor, g: int, group: int) -> torch.Tensor:
    """Group g's 2G anchors among the batch's 2N rows (view 1 of its images, then view 2)."""
    return torch.cat([rows[g * group : (g + 1) * group], rows[N + g * group : N + (g + 1) * group]])


#: losses that are a mean over anchors (align_uniform's uniformity is a log of the mean over
#: every pair: grouped, it is taken over the groups' pairs together, not group by group)
PER_ANCHOR = [n for n, cls in REGISTRY.items() if cls.per_anchor]


@pytest.mark.parametrize("name", [n for n in PER_ANCHOR if n != "dclw"])
@pytest.mark.parametrize("group", [2, 4])
def test_each_groups_loss_is_the_loss_of_that_group_alone(name, group):
    """Grouped, anchor r's loss (and its gradient w.r.t. every embedding) is its loss in a
    batch of its group's images alone.  (DCLW's positive weights stay normalised over the
    whole batch: grouping restricts the negatives and nothing else.)"""
    z1, z2 = _views()
    a, b = z1.clone().requires_grad_(True), z2.clone().requires_grad_(True)
    pos, neg, _ = grouped_in_batch_scores(a, b, group)
    assert neg.shape == (2 * N, 2 * group - 2)
    rows = _rows_loss(name, pos, neg, None)
    for g in range(N // group):
        sl = slice(g * group, (g + 1) * group)
        ga, gb = z1[sl].clone().requires_grad_(True), z2[sl].clone().requires_grad_(True)
        gp, gn, _ = in_batch_scores(ga, gb)
        alone = _rows_loss(name, gp, gn, None)
        mine = _group_rows(rows, g, group)
        torch.testing.assert_close(mine, alone, rtol=1e-12, atol=1e-12)
        grad = torch.autograd.grad(mine.sum(), (a, b), retain_graph=True)
        grad_alone = torch.autograd.grad(alone.sum(), (ga, gb))
        for full, part in zip(grad, grad_alone):
            torch.testing.assert_close(full[sl], part, rtol=1e-12, atol=1e-12)
            outside = torch.ones(N, dtype=torch.bool)
            outside[sl] = False
            assert (full[outside] == 0).all()  # no other group's image gets a gradient


def test_grouped_loss_is_the_mean_of_the_groups_losses():
    z1, z2 = _views()
    pos, neg, _ = grouped_in_batch_scores(z1, z2, 4)
    whole = at_tau(build_loss("infonce"), TAU).from_scores(pos, neg).loss
    parts = [at_tau(build_loss("infonce"), TAU)(z1[s], z2[s]).loss for s in (slice(0, 4), slice(4, 8))]
    assert float(whole) == pytest.approx(float(sum(parts) / 2), rel=1e-13)


def test_a_group_that_does_not_divide_the_batch_is_one_line():
    z1, z2 = _views()
    with pytest.raises(ValueError, match="group of 3 images must be >= 2 and divide the batch of 8"):
        grouped_in_batch_scores(z1, z2, 3)
    cell = _cell(batch_size=24, neg_group=16, bn_group=16)
    problem = checks.control_problem(Cell.of(cell))
    assert problem.startswith("train.neg_group = 16 does not divide batch_size 24") and "\n" not in problem
    with pytest.raises(ValueError, match="does not divide batch_size 24"):
        train.pretrain(
            Cell.of(cell), torch.zeros(64, 1, 8, 8, dtype=torch.uint8), [0.5], [0.2], Path("unused"), device="cpu"
        )
    with pytest.raises(ConfigError, match=r"^cell 'digits/infonce/bs24-t0.1-s0-ng16': train.neg_group = 16 does not"):
        load_config(None, {"datasets": {"digits": {}}, "grid": {"batch_sizes": [16, 24], "axes": {"neg_group": [16]}}})


def test_the_in_batch_source_groups_and_masks_and_passes_the_image_index():
    z1, z2 = _views()
    idx = torch.tensor([5, 2, 7, 0, 9, 1, 3, 4])
    labels = torch.arange(10) % 3
    sc = InBatch(group=4, labels=labels).scores(z1, z2, idx)
    assert torch.equal(sc.neg, grouped_in_batch_scores(z1, z2, 4)[1])
    assert torch.equal(sc.mask, in_batch_mask(N, labels[idx], 4))
    assert torch.equal(sc.index, torch.stack([idx, idx]))
    plain = InBatch().scores(z1, z2, idx)
    assert plain.mask is None and torch.equal(plain.neg, in_batch_scores(z1, z2)[1])
    # a loss of same-view negatives: the other view's masked too, grouped as the scores are
    sv = InBatch(group=4, labels=labels, same_view=True).scores(z1, z2, idx)
    assert torch.equal(sv.mask, in_batch_mask(N, labels[idx], 4) & same_view_mask(N, 4))
    cols = in_batch_columns(torch.arange(8), 4)  # a group's negatives: views 0..7 of its 4 images
    own_view = (cols >= 4) == (torch.arange(8) >= 4)[:, None]
    assert torch.equal(same_view_mask(N, 4), torch.cat([own_view[:4], own_view[:4], own_view[4:], own_view[4:]]))
    assert torch.equal(InBatch(same_view=True).rescore(z1, z2)[2], same_view_mask(N))


# --------------------------------------------------------------------------- oracle mask
LABELS = torch.tensor([0, 1, 0, 2, 1, 3, 0, 2])


@pytest.mark.parametrize("name", CONTRASTIVE)
def test_same_class_negatives_do_not_count(name):
    """The mask is False exactly where a negative's image has the anchor's class; masked
    entries get no gradient, and any value there leaves loss and value unchanged; the
    other view of the anchor's image stays its positive."""
    z1, z2 = _views()
    pos, neg, _ = in_batch_scores(z1, z2)
    mask = in_batch_mask(N, LABELS)
    cols = in_batch_columns(torch.arange(2 * N), N) % N
    assert torch.equal(mask, LABELS[torch.arange(2 * N) % N][:, None] != LABELS[cols])
    outs = []
    for fill in (0.0, 0.99):
        n = neg.masked_fill(~mask, fill).requires_grad_(True)
        out = at_tau(build_loss(name), TAU).from_scores(pos, n, mask)
        (g,) = torch.autograd.grad(out.loss, n)
        assert (g[~mask] == 0).all()
        outs.append((out.loss.detach(), out.value))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


@pytest.mark.parametrize("name", [n for n in PER_ANCHOR if n != "dclw"])
def test_the_oracle_within_groups_is_each_groups_oracle_alone(name):
    z1, z2 = _views()
    pos, neg, _ = grouped_in_batch_scores(z1, z2, 4)
    rows = _rows_loss(name, pos, neg, in_batch_mask(N, LABELS, 4))
    for g in range(2):
        sl = slice(4 * g, 4 * g + 4)
        gp, gn, _ = in_batch_scores(z1[sl], z2[sl])
        alone = _rows_loss(name, gp, gn, in_batch_mask(4, LABELS[sl]))
        torch.testing.assert_close(_group_rows(rows, g, 4), alone, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name", CONTRASTIVE)
def test_all_distinct_labels_are_the_plain_loss(name):
    z1, z2 = _views()
    pos, neg, _ = in_batch_scores(z1, z2)
    mask = in_batch_mask(N, torch.arange(N) * 7)
    assert mask.all()
    a, b = (
        at_tau(build_loss(name), TAU).from_scores(pos, neg),
        at_tau(build_loss(name), TAU).from_scores(pos, neg, mask),
    )
    assert torch.equal(a.loss, b.loss) and torch.equal(a.value, b.value)


def test_the_oracle_needs_labelled_pretraining_images(tmp_path):
    cell = _cell(mask_same_class=True)
    images = torch.zeros(64, 1, 8, 8, dtype=torch.uint8)
    with pytest.raises(ValueError, match="mask_same_class but its pretraining images have no labels"):
        train.build_training(Cell.of(cell), images, [0.5], [0.2], torch.device("cpu"), tmp_path)
    t = train.build_training(
        Cell.of(cell), images, [0.5], [0.2], torch.device("cpu"), tmp_path, labels=torch.arange(64) % 10
    )
    assert torch.equal(t.step_fn.source.labels, torch.arange(64) % 10)
    plain = train.build_training(
        Cell.of(_cell()), images, [0.5], [0.2], torch.device("cpu"), tmp_path, labels=torch.arange(64) % 10
    )
    assert plain.step_fn.source.labels is None  # labels reach the mask only when asked


# --------------------------------------------------------------------------- ghost BatchNorm
def _net(seed: int = 0) -> ContrastiveModel:
    torch.manual_seed(seed)
    backbone, feat = build_backbone("small_cnn", 1, 8, width=2)
    return ContrastiveModel(backbone, feat, 6, 4).double()


def _batch(n: int = N):
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, 1, 8, 8, generator=g, dtype=torch.float64), torch.randn(
        n, 1, 8, 8, generator=g, dtype=torch.float64
    )


def _grads(model):
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def _stats(model):
    return {k: v for k, v in model.state_dict().items() if "running" in k or "num_batches" in k}


def test_ghost_batchnorm_of_the_whole_batch_is_batchnorm():
    v1, v2 = _batch()
    plain, ghost = _net(), ghost_batchnorm(_net(), group=N, views=2)
    assert sum(isinstance(m, GhostBatchNorm) for m in ghost.modules()) == 4
    za, zb = plain(torch.cat([v1, v2])), ghost(torch.cat([v1, v2]))
    torch.testing.assert_close(zb, za, rtol=1e-12, atol=1e-12)
    za.square().sum().backward()
    zb.square().sum().backward()
    torch.testing.assert_close(_grads(ghost), _grads(plain), rtol=1e-10, atol=1e-12)
    for k, v in _stats(plain).items():
        torch.testing.assert_close(_stats(ghost)[k], v, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("group", [2, 4])
def test_ghost_batchnorm_is_the_groups_run_one_after_the_other(group):
    """Output, parameter gradient and running statistics (momentum applied group after
    group) are those of running each group of G images (both views) as its own batch."""
    v1, v2 = _batch()
    sep, ghost = _net(), ghost_batchnorm(_net(), group=group, views=2)
    z = ghost(torch.cat([v1, v2]))
    z.square().sum().backward()
    parts = []
    for g in range(N // group):
        sl = slice(g * group, (g + 1) * group)
        zg = sep(torch.cat([v1[sl], v2[sl]]))
        zg.square().sum().backward()
        parts.append(zg)
    z1 = torch.cat([p[:group] for p in parts])
    z2 = torch.cat([p[group:] for p in parts])
    torch.testing.assert_close(z, torch.cat([z1, z2]), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(_grads(ghost), _grads(sep), rtol=1e-10, atol=1e-12)
    for k, v in _stats(sep).items():
        torch.testing.assert_close(_stats(ghost)[k], v, rtol=1e-12, atol=1e-14)


def test_ghost_batchnorm_keeps_the_state_dict_and_is_plain_batchnorm_in_eval_mode():
    v1, _ = _batch()
    ghost = ghost_batchnorm(_net(), group=2, views=1)
    ghost(v1)  # a train-mode step (one view: MoCo's queries)
    plain = _net(5)
    plain.load_state_dict(ghost.state_dict())  # what the probes do with a checkpoint
    ghost.eval(), plain.eval()
    assert torch.equal(ghost(v1), plain(v1))
    ghost.train()
    with pytest.raises(ValueError, match="not 1 views of whole groups of 2"):
        ghost(v1[:3])


def test_bn_group_reaches_the_networks_and_equal_to_the_batch_is_plain(tmp_path):
    images = torch.zeros(64, 1, 8, 8, dtype=torch.uint8)
    t = train.build_training(Cell.of(_cell(bn_group=4)), images, [0.5], [0.2], torch.device("cpu"), tmp_path)
    bns = [m for m in t.step_fn.model.modules() if isinstance(m, GhostBatchNorm)]
    assert bns and all((m.group, m.views) == (4, 2) for m in bns)
    q = train.build_training(
        Cell.of(_cell(bn_group=4, queue_size=16)), images, [0.5], [0.2], torch.device("cpu"), tmp_path
    )
    assert all(m.views == 1 for m in q.step_fn.source.key_model.modules() if isinstance(m, GhostBatchNorm))
    same = train.build_training(Cell.of(_cell(bn_group=8)), images, [0.5], [0.2], torch.device("cpu"), tmp_path)
    assert not any(isinstance(m, GhostBatchNorm) for m in same.step_fn.model.modules())
    assert "chunk_size" in checks.control_problem(Cell.of(_cell(bn_group=4, chunk_size=4)))
    assert "queue_size" in checks.control_problem(Cell.of(_cell(neg_group=4, queue_size=16)))


# --------------------------------------------------------------------------- budgets, lr, ids
TINY = {"width": 2, "proj_hidden": 8, "proj_dim": 4}


def _cell(batch_size: int = 8, loss: str = "infonce", **train_opts):
    """A cell with ``train_opts`` set as an override (so also a combination validation refuses)."""
    cfg = load_config(None, {"datasets": {"digits": {}}, "train": TINY})
    return make_cell(
        cfg,
        dataset="digits",
        loss=loss,
        loss_params={},
        batch_size=batch_size,
        temperature=0.2,
        seed=0,
        train_overrides=train_opts,
    )


def test_the_two_budgets_and_a_learning_rate_per_batch_size(tmp_path):
    images = torch.zeros(64, 1, 8, 8, dtype=torch.uint8)
    dev = torch.device("cpu")
    epochs = train.build_training(Cell.of(_cell(epochs=2)), images, [0.5], [0.2], dev, tmp_path)
    steps = train.build_training(Cell.of(_cell(epochs=2, steps=5)), images, [0.5], [0.2], dev, tmp_path)
    assert (epochs.total, steps.total) == (2 * 64 // 8, 5)
    cfg = load_config(
        None,
        {
            "datasets": {"digits": {}},
            "train": TINY,
            "grid": {
                "losses": ["infonce"],
                "temperatures": [0.1],
                "seeds": [0],
                "batch_sizes": [{"size": 16, "train": {"lr": 3e-4}}, {"size": 256, "train": {"lr": 2e-3}}],
            },
        },
    )
    cells = expand_cells(cfg)
    assert {c["batch_size"]: c["train"]["lr"] for c in cells.values()} == {16: 3e-4, 256: 2e-3}
    small = next(c for c in cells.values() if c["batch_size"] == 16)
    t = train.build_training(Cell.of(small), images, [0.5], [0.2], dev, tmp_path)
    assert t.peak_lr == pytest.approx(3e-4)


def test_every_control_is_an_axis_with_its_own_cell_id_and_hash():
    cfg = load_config(
        None,
        {
            "datasets": {"digits": {}},
            "train": TINY,
            "grid": {
                "losses": ["infonce"],
                "temperatures": [0.1],
                "seeds": [0],
                "batch_sizes": [256],
                "axes": {
                    "neg_group": [None, 16],
                    "bn_group": [16],
                    "mask_same_class": [False, True],
                    "steps": [None, 300],
                    "lr": [1e-3, 3e-3],
                },
            },
        },
    )
    cells = expand_cells(cfg)
    assert len(cells) == 16 and len({c["hash"] for c in cells.values()}) == 16
    assert "digits/infonce/bs256-t0.1-s0-bn16-lr0.001" in cells
    c = cells["digits/infonce/bs256-t0.1-s0-bn16-lr0.003-oracle-ng16-st300"]
    assert (
        c["train"]["neg_group"],
        c["train"]["bn_group"],
        c["train"]["mask_same_class"],
        c["train"]["steps"],
        c["train"]["lr"],
    ) == (16, 16, True, 300, 3e-3)
    with pytest.raises(ConfigError, match="neg_group"):
        load_config(None, {"datasets": {"digits": {}}, "grid": {"axes": {"neg_group": [1]}}})


# --------------------------------------------------------------------------- one graph
@pytest.mark.parametrize(
    "loss,opts",
    [
        ("infonce", {"neg_group": 4, "bn_group": 4, "mask_same_class": True}),
        ("sogclr", {"neg_group": 4, "mask_same_class": True}),
    ],
    ids=["infonce-controls", "sogclr-controls"],
)
def test_the_step_with_every_control_is_one_graph(loss, opts, tmp_path):
    torch.set_num_threads(1)
    images = (torch.rand(64, 1, 8, 8, generator=torch.Generator().manual_seed(0)) * 255).to(torch.uint8)
    t = train.build_training(
        Cell.of(_cell(loss=loss, **opts)),
        images,
        [0.5],
        [0.25],
        torch.device("cpu"),
        tmp_path,
        labels=torch.arange(64) % 10,
    )
    idx = torch.arange(8) * 3
    u = t.step_fn.aug.draw(16, torch.Generator().manual_seed(0))
    before = copy.deepcopy(t.step_fn.loss_fn.state_dict())
    fwd = torch._dynamo.explain(t.step_fn.forward)(images[idx], u, idx)
    assert fwd.graph_break_count == 0 and fwd.graph_count == 1, [str(r.reason) for r in fwd.break_reasons]
    if loss == "sogclr":  # the graph wrote u where the batch's images are
        after = t.step_fn.loss_fn.log_u
        assert torch.isfinite(after[idx]).all() and torch.isneginf(before["log_u"]).all()


def test_the_oracle_masks_same_class_keys_of_a_queue(tmp_path):
    images = torch.zeros(64, 1, 8, 8, dtype=torch.uint8)
    labels = torch.arange(64) % 4
    t = train.build_training(
        Cell.of(_cell(queue_size=16, mask_same_class=True)),
        images,
        [0.5],
        [0.2],
        torch.device("cpu"),
        tmp_path,
        labels=labels,
    )
    src = t.step_fn.source
    g = torch.Generator().manual_seed(0)
    z1, z2 = torch.randn(8, 4, generator=g), torch.randn(8, 4, generator=g)
    idx = torch.arange(8) + 10
    first = src.scores(z1, z2, idx)  # an empty queue: in-batch negatives, same-class views masked
    assert torch.equal(first.mask, in_batch_mask(8, labels[idx]))
    key_idx = torch.arange(16) + 30
    src.queue.enqueue(torch.randn(16, 4, generator=g), key_idx)
    sc = src.scores(z1, z2, idx)
    assert torch.equal(sc.mask, labels[idx][:, None] != labels[key_idx][None, :])
    assert torch.equal(sc.index, idx[None])


def test_the_gradient_norms_of_a_grouped_cell_are_measured_on_its_grouped_scores(tmp_path):
    from smallbatch.losses.diagnostics import embedding_grad_norm

    images = (torch.rand(64, 1, 8, 8, generator=torch.Generator().manual_seed(0)) * 255).to(torch.uint8)
    t = train.build_training(Cell.of(_cell(neg_group=4)), images, [0.5], [0.2], torch.device("cpu"), tmp_path)
    out, _ = train.one_step(t, torch.arange(8), watch=False)
    m = train.mechanism_metrics(t, out, None)
    grouped = embedding_grad_norm(
        build_loss("dcl"), out.z1, out.z2, lambda a, b: grouped_in_batch_scores(a, b, 4), temperature=out.tau
    )
    whole = embedding_grad_norm(build_loss("dcl"), out.z1, out.z2, None, temperature=out.tau)
    assert m["diag/grad_norm_dcl"] == pytest.approx(float(grouped), rel=1e-6)
    assert float(whole) != pytest.approx(float(grouped), rel=1e-3)
