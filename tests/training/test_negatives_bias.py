"""The negatives' bias of a contrastive gradient at a fixed batch: exact on a batch small
enough to enumerate, zero for a supervised cross-entropy, positive for InfoNCE at few
negatives and falling to zero at the whole batch (float64 embeddings)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from smallbatch.losses import build_loss
from smallbatch.training.negatives_bias import cross_entropy_gradient, grouped_gradient, negatives_bias

TAU = 0.2


def _views(n: int, d: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    z1 = torch.randn(n, d, dtype=torch.float64, generator=gen)
    z2 = z1 + 0.7 * torch.randn(n, d, dtype=torch.float64, generator=gen)
    return z1.requires_grad_(True), z2.requires_grad_(True)


def _infonce_of_partition(z1, z2, groups: list[list[int]]) -> torch.Tensor:
    """The test's own InfoNCE: every view of every image an anchor, its other view the
    positive, the other views of its group's images the negatives; mean over the 2N anchors."""
    z = F.normalize(torch.stack([z1, z2]), dim=2)  # (2, N, D): view, image
    terms = []
    for grp in groups:
        for v in (0, 1):
            for i in grp:
                a = z[v, i]
                pos = a @ z[1 - v, i] / TAU
                negs = [a @ z[w, j] / TAU for w in (0, 1) for j in grp if (w, j) not in ((v, i), (1 - v, i))]
                terms.append(torch.logsumexp(torch.stack([pos, *negs]), dim=0) - pos)
    return torch.stack(terms).mean()


def _grad(loss, z1, z2) -> torch.Tensor:
    return torch.cat([g.reshape(-1) for g in torch.autograd.grad(loss, (z1, z2))])


def test_the_bias_matches_an_exact_enumeration_on_four_images():
    """Four images in groups of two (K = 2): a random order groups them as {01|23}, {02|13} or
    {03|12}, each with probability 1/3, so E g_2 is the mean of three gradients; the whole
    batch (K = 6) is one group."""
    z1, z2 = _views(4, 3, seed=0)
    partitions = [[[0, 1], [2, 3]], [[0, 2], [1, 3]], [[0, 3], [1, 2]]]
    expected = torch.stack([_grad(_infonce_of_partition(z1, z2, p), z1, z2) for p in partitions]).mean(dim=0)
    full = _grad(_infonce_of_partition(z1, z2, [[0, 1, 2, 3]]), z1, z2)
    exact = float(torch.linalg.vector_norm(expected - full) / torch.linalg.vector_norm(full))
    grad_at = grouped_gradient(build_loss("infonce"), z1, z2, (z1, z2), TAU)
    (k2, k6) = negatives_bias(grad_at, 4, [2, 4], draws=600, seed=0)
    assert (k2.k, k6.k) == (2, 6)
    assert exact > 0.05  # a bias to find
    assert k2.bias == pytest.approx(exact, abs=4 * k2.floor)
    assert k2.debiased == pytest.approx(exact, abs=4 * k2.floor)
    assert k2.debiased < k2.bias
    assert k6.bias == 0.0


def test_a_supervised_cross_entropy_has_no_negatives_bias():
    z1, z2 = _views(16, 8, seed=1)
    gen = torch.Generator().manual_seed(2)
    head = torch.randn(8, 10, dtype=torch.float64, generator=gen, requires_grad=True)
    labels = torch.randint(0, 10, (16,), generator=gen)
    grad_at = cross_entropy_gradient(z1 @ head, labels, (z1, z2, head))
    for b in negatives_bias(grad_at, 16, [2, 4, 8, 16], draws=20, seed=3):
        assert b.bias < 1e-12, b


def test_infonce_bias_is_positive_at_few_negatives_and_falls_to_zero_at_the_whole_batch():
    z1, z2 = _views(16, 8, seed=4)
    grad_at = grouped_gradient(build_loss("infonce"), z1, z2, (z1, z2), TAU)
    got = negatives_bias(grad_at, 16, [2, 4, 8, 16], draws=60, seed=5)
    assert [b.k for b in got] == [2, 6, 14, 30]
    assert got[0].bias > 5 * got[0].floor  # a bias, not Monte Carlo noise
    assert got[0].bias > got[1].bias > got[2].bias > got[3].bias == 0.0


@pytest.mark.parametrize("groups, draws, word", [([3], 10, "divide"), ([2], 1, "2 draws")])
def test_bad_groups_or_draws_are_refused(groups, draws, word):
    z1, z2 = _views(4, 3, seed=6)
    grad_at = grouped_gradient(build_loss("infonce"), z1, z2, (z1, z2), TAU)
    with pytest.raises(ValueError, match=word):
        negatives_bias(grad_at, 4, groups, draws=draws)
