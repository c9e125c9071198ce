"""The linear probe of frozen features: :func:`linear_eval` trains a multinomial logistic
regression on frozen, standardised features (preconditioned L-BFGS by default)."""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
import torch
from torch import nn

from smallbatch.evaluation.embed import check_features, check_pair, mean_std, rowwise_float32

LINEAR_OPTIMIZERS = ("lbfgs-precond", "lbfgs", "adam")

# Preconditioner of 'lbfgs-precond': the second moment of (a strided subset of) the
# standardised train rows plus PRECOND_MU * I.  The smallest row count and the mu that left the
# objective as close to its minimum as all rows and the best mu did (the solver's record).
PRECOND_ROWS = 2500
PRECOND_MU = 1.0


class LinearFit(NamedTuple):
    """A fitted probe on standardised features: logits = x @ weight.T + bias."""

    weight: torch.Tensor  # (C, F)
    bias: torch.Tensor  # (C,)
    iterations: int  # L-BFGS iterations, or Adam optimizer steps


def _check_linear_args(epochs, optimizer, lr, weight_decay, batch_size, tol) -> float:
    """Validate the probe's settings; returns lr with its per-optimizer default filled in."""
    if isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 1:
        raise ValueError(f"epochs must be a positive integer, got {epochs!r}")
    if optimizer not in LINEAR_OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {', '.join(LINEAR_OPTIMIZERS)}, got {optimizer!r}")
    if lr is None:
        lr = 1e-3 if optimizer == "adam" else 1.0
    if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not lr > 0:
        raise ValueError(f"lr must be a number > 0, got {lr!r}")
    if isinstance(weight_decay, bool) or not isinstance(weight_decay, (int, float)) or not weight_decay >= 0:
        raise ValueError(f"weight_decay must be a number >= 0, got {weight_decay!r}")
    if isinstance(tol, bool) or not isinstance(tol, (int, float)) or not tol >= 0:
        raise ValueError(f"tol must be a number >= 0, got {tol!r}")
    if batch_size is not None:
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive integer or None, got {batch_size!r}")
        if optimizer != "adam":
            raise ValueError(f"batch_size must be None with optimizer={optimizer!r} (full-batch); use optimizer='adam'")
    return float(lr)


def _standardise(tr: np.ndarray, te: np.ndarray, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Train and test features standardised with the train set's per-dimension mean and std
    (float64 statistics; a dimension with std < 1e-8 is only centred), as float32 tensors."""
    mu, sd = mean_std(tr)
    sd = np.where(sd < 1e-8, 1.0, sd)
    tr_t, te_t = (torch.from_numpy(rowwise_float32(a, lambda blk: (blk - mu) / sd)).to(device) for a in (tr, te))
    return tr_t, te_t


def _softmax_loss_grad(x, x_t, y, weight, bias, weight_decay):
    """Mean cross-entropy of softmax(x @ weight.T + bias) + weight_decay/2 * ||weight||^2, and
    its gradients (weight, bias). The two products with the features run in their dtype
    (float32), everything else in ``weight``'s (float64); ``x_t`` is ``x.T`` made contiguous
    (the faster layout for the logits' product on MKL)."""
    n = x.shape[0]
    z = (weight.to(x.dtype) @ x_t).T.to(weight.dtype) + bias
    lse = torch.logsumexp(z, dim=1)
    rows = torch.arange(n, device=x.device)
    loss = (lse - z[rows, y]).mean() + 0.5 * weight_decay * (weight * weight).sum()
    dz = torch.exp(z - lse[:, None])
    dz[rows, y] -= 1.0
    dz /= n
    g_weight = (dz.T.to(x.dtype) @ x).to(weight.dtype) + weight_decay * weight
    return loss, g_weight, dz.sum(dim=0)


def _precond_factor(x: torch.Tensor, mu: float, rows: int) -> torch.Tensor:
    """Lower Cholesky factor (float64) of S + mu*I, S the second moment of every
    ``n // rows``-th standardised train row (the data term of the loss's Hessian, up to the
    softmax weights)."""
    xs = x[:: max(1, x.shape[0] // rows)]
    s = (xs.T @ xs).double() / xs.shape[0]
    s.diagonal().add_(mu)
    return torch.linalg.cholesky(s)


def _lbfgs(params: list[torch.Tensor], lr: float, max_iter: int, max_eval: int | None = None) -> torch.optim.LBFGS:
    """The probe's L-BFGS: history 20, strong-Wolfe line search (max_eval None: 1.25 * max_iter)."""
    return torch.optim.LBFGS(
        params,
        lr=lr,
        max_iter=max_iter,
        max_eval=max_eval,
        history_size=20,
        tolerance_grad=1e-9,
        tolerance_change=1e-12,
        line_search_fn="strong_wolfe",
    )


def _fit_lbfgs_precond(x, y, c, epochs, lr, weight_decay, tol) -> LinearFit:
    """L-BFGS on v = weight @ L, L the Cholesky factor of :func:`_precond_factor`: the same
    objective and optimum as on ``weight``, with the features' correlations divided out of
    its curvature. Runs in blocks of 10 iterations and stops after ``epochs`` iterations, or
    once a block lowered the objective by no more than ``tol`` times its value."""
    x_t = x.T.contiguous()
    chol = _precond_factor(x, PRECOND_MU, PRECOND_ROWS).to(x.dtype)  # mu keeps L well-conditioned: float32 solves
    v = torch.zeros(c, x.shape[1], dtype=torch.float64, device=x.device, requires_grad=True)
    b = torch.zeros(c, dtype=torch.float64, device=x.device, requires_grad=True)
    cache: dict[str, Any] = {}

    def weight_of(v_: torch.Tensor) -> torch.Tensor:  # weight = v L^-1
        return torch.linalg.solve_triangular(chol.T, v_.T.to(x.dtype), upper=True).T.double()

    def closure() -> torch.Tensor:  # a block starts where the last one ended: reuse that evaluation
        with torch.no_grad():
            if not (cache and torch.equal(cache["v"], v) and torch.equal(cache["b"], b)):
                loss, g_w, g_b = _softmax_loss_grad(x, x_t, y, weight_of(v), b, weight_decay)
                g_v = torch.linalg.solve_triangular(chol, g_w.T.to(x.dtype), upper=False).T.double()  # g_w L^-T
                cache.update(v=v.detach().clone(), b=b.detach().clone(), out=(loss, g_v, g_b))
            loss, v.grad, b.grad = cache["out"][0], cache["out"][1].clone(), cache["out"][2].clone()
        return loss

    opt = _lbfgs([v, b], lr, 10, max_eval=10**6)  # a block ends on iterations, not on evaluations
    state = opt.state[v]
    last = None
    while state.get("n_iter", 0) < epochs:
        done = state.get("n_iter", 0)
        opt.param_groups[0]["max_iter"] = min(10, epochs - done)
        loss = float(opt.step(closure))  # the objective where this block starts
        if last is not None and last - loss <= tol * abs(loss):
            break
        if state["n_iter"] - done < opt.param_groups[0]["max_iter"]:  # L-BFGS's own tolerances
            break
        last = loss
    with torch.no_grad():
        return LinearFit(weight_of(v).float(), b.float(), int(state.get("n_iter", 0)))


def _fit_lbfgs(x, y, c, epochs, lr, weight_decay) -> LinearFit:
    """The first probe solver: ``epochs`` L-BFGS iterations (at most 1.25 * epochs
    evaluations) on the float32 objective by autograd, tolerances that float32 never meets."""
    layer = nn.Linear(x.shape[1], c).to(x.device)
    nn.init.zeros_(layer.weight)
    nn.init.zeros_(layer.bias)
    ce = nn.CrossEntropyLoss()
    opt = _lbfgs(list(layer.parameters()), lr, epochs)

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = ce(layer(x), y) + 0.5 * weight_decay * layer.weight.pow(2).sum()
        loss.backward()
        return loss

    opt.step(closure)
    return LinearFit(layer.weight.detach(), layer.bias.detach(), int(opt.state[layer.weight].get("n_iter", 0)))


def _fit_adam(x, y, c, epochs, lr, weight_decay, batch_size, seed) -> LinearFit:
    """Adam with a cosine schedule over ``epochs`` passes of mini-batches of ``batch_size``
    rows (full batch when None), shuffled by a generator seeded with ``seed``."""
    layer = nn.Linear(x.shape[1], c).to(x.device)
    nn.init.zeros_(layer.weight)
    nn.init.zeros_(layer.bias)
    ce = nn.CrossEntropyLoss()
    gen = torch.Generator().manual_seed(int(seed))
    opt = torch.optim.Adam(layer.parameters(), lr=lr)
    n = x.shape[0]
    bs = n if batch_size is None else min(batch_size, n)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=epochs * ((n + bs - 1) // bs))
    steps = 0
    for _ in range(epochs):
        perm = torch.randperm(n, generator=gen).to(x.device) if bs < n else None
        for j in range(0, n, bs):
            sel = slice(None) if perm is None else perm[j : j + bs]
            opt.zero_grad()
            (ce(layer(x[sel]), y[sel]) + 0.5 * weight_decay * layer.weight.pow(2).sum()).backward()
            opt.step()
            sched.step()
            steps += 1
    return LinearFit(layer.weight.detach(), layer.bias.detach(), steps)


@torch.no_grad()
def _linear_metrics(fit: LinearFit, xtr, ytr, xte, yte, c: int, weight_decay: float) -> dict[str, float]:
    """Test top-1/top-5, train top-1, the float32 objective on the train set, iterations."""
    logits_tr = nn.functional.linear(xtr, fit.weight, fit.bias)
    logits = nn.functional.linear(xte, fit.weight, fit.bias)
    loss = nn.functional.cross_entropy(logits_tr, ytr) + 0.5 * weight_decay * fit.weight.pow(2).sum()
    top5_idx = logits.topk(min(5, c), dim=1).indices
    return {
        "top1": (logits.argmax(1) == yte).double().mean().item(),  # a count's ratio in float64
        "top5": (top5_idx == yte[:, None]).any(dim=1).double().mean().item(),
        "train_top1": (logits_tr.argmax(1) == ytr).double().mean().item(),
        "train_loss": loss.item(),
        "iterations": fit.iterations,
    }


def linear_eval(
    train_f: Any,
    train_y: Any,
    test_f: Any,
    test_y: Any,
    epochs: int = 100,
    lr: float | None = None,
    weight_decay: float = 1e-3,
    batch_size: int | None = None,
    device: str | torch.device = "cpu",
    seed: int = 0,
    optimizer: str = "lbfgs-precond",
    num_classes: int | None = None,
    tol: float = 1e-5,
) -> dict[str, float]:
    """Linear probe: multinomial logistic regression on frozen, standardised features.

    Protocol: features are standardised with the train set's per-dimension mean and std
    (the same transform applied to test); a linear layer W h + b (zero-initialised) is
    trained to minimise cross-entropy + ``weight_decay``/2 * ||W||^2; we report test
    top-1/top-5, train top-1, the objective (``train_loss``) and ``iterations``. Optimizers:

    * ``'lbfgs-precond'`` (default): full-batch L-BFGS (``lr`` defaults to 1.0) on a
      preconditioned parametrisation of the same convex objective (:func:`_fit_lbfgs_precond`),
      at most ``epochs`` iterations, stopping once 10 iterations lower the objective by no
      more than ``tol`` times its value. ``batch_size`` must be None.
    * ``'lbfgs'``: the first solver, kept for comparison: exactly ``epochs`` plain L-BFGS
      iterations (float32, autograd); ``tol`` is not used.
    * ``'adam'``: Adam (``lr`` defaults to 1e-3) with a cosine schedule over ``epochs``
      passes of shuffled mini-batches of ``batch_size`` rows (full batch when None),
      shuffled by a generator seeded with ``seed``.

    Why preconditioned L-BFGS: the objective is badly conditioned (the standardised
    features' covariance spreads over five orders of magnitude), so plain L-BFGS stops
    well short of the minimum in the same number of iterations; the comparison of solvers
    is a benchmark record (``benchmarks/linear_probe.py``).

    How this differs from SimCLR's linear evaluation (Chen et al., 2020, Appendix B.6:
    90 epochs of SGD/LARS with Nesterov momentum on ImageNet, with random-crop and
    flip augmentation, i.e. the backbone runs every epoch): here the features are
    computed once, without augmentation, and the probe is a convex problem solved on
    them -- much cheaper and deterministic, typically a little below the augmented
    protocol's accuracy. Within a run the test set is not used (no early stopping, no
    per-run tuning). L-BFGS and weight_decay 1e-3 were chosen once, on 10k Fashion-MNIST
    16x16 images (random-init small_cnn 128-d features and raw pixels, 5k test images): 100
    plain L-BFGS iterations matched or beat Adam (mini-batch 256 for 20 or 100 epochs, or
    full-batch for 100) by 0-5 points top-1; weight_decay 1e-3 scored like 1e-4 and above 1e-2.
    """
    tr, ytr, te, yte, c = check_pair(train_f, train_y, test_f, test_y, num_classes)
    lr = _check_linear_args(epochs, optimizer, lr, weight_decay, batch_size, tol)
    return _linear_probe(
        tr,
        ytr,
        te,
        yte,
        c,
        optimizer=optimizer,
        epochs=epochs,
        lr=lr,
        weight_decay=weight_decay,
        batch_size=batch_size,
        seed=seed,
        tol=tol,
        device=torch.device(device),
    )[0]


def standardise(train_f: Any, test_f: Any, device: str | torch.device = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Train and test features standardised with the train rows' per-dimension mean and std
    (the linear probe's transform; it uses no labels), as float32 tensors on ``device``."""
    tr, te = check_features(train_f, "train_f"), check_features(test_f, "test_f")
    if tr.shape[1] != te.shape[1]:
        raise ValueError(f"test_f has {te.shape[1]} feature dims but train_f has {tr.shape[1]}")
    return _standardise(tr, te, torch.device(device))


def fit_linear(
    x: torch.Tensor, y: torch.Tensor, num_classes: int, weight_decay: float, epochs: int = 100, tol: float = 1e-5
) -> LinearFit:
    """The default probe's fit ('lbfgs-precond', :func:`linear_eval`) on rows already
    standardised (:func:`standardise`): ``y`` int64 labels on ``x``'s device."""
    _check_linear_args(epochs, "lbfgs-precond", None, weight_decay, None, tol)
    return _fit_lbfgs_precond(x, y, int(num_classes), epochs, 1.0, float(weight_decay), tol)


@torch.no_grad()
def linear_top1(fit: LinearFit, x: torch.Tensor, y: torch.Tensor) -> float:
    """Top-1 accuracy (a fraction) of a fitted probe on standardised rows ``x``."""
    return (nn.functional.linear(x, fit.weight, fit.bias).argmax(1) == y).double().mean().item()


def _linear_probe(tr, ytr, te, yte, c, *, optimizer, epochs, lr, weight_decay, batch_size, seed, tol, device):
    """:func:`linear_eval` on checked arguments; also returns the fit and the standardised
    train/test tensors, for a benchmark that compares solvers."""
    xtr, xte = _standardise(tr, te, device)
    ytr_t, yte_t = torch.from_numpy(ytr).to(device), torch.from_numpy(yte).to(device)
    if optimizer == "lbfgs-precond":
        fit = _fit_lbfgs_precond(xtr, ytr_t, c, epochs, lr, weight_decay, tol)
    elif optimizer == "lbfgs":
        fit = _fit_lbfgs(xtr, ytr_t, c, epochs, lr, weight_decay)
    else:
        fit = _fit_adam(xtr, ytr_t, c, epochs, lr, weight_decay, batch_size, seed)
    return _linear_metrics(fit, xtr, ytr_t, xte, yte_t, c, weight_decay), fit, (xtr, ytr_t, xte, yte_t)
