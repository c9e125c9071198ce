"""Gradient noise scale and negatives' bias of InfoNCE beside a supervised cross-entropy,
on the default study's data and network, at initialisation and after a short training.

Data and network: Fashion-MNIST at 16 px, 10,000 training images (Debian's
dataset-fashion-mnist), ``small_cnn`` width 32 with the 4x4 pooled map, as ``config.yaml``
sets them; InfoNCE at tau = 0.1 with its projection head; the control is the same backbone
with a linear classifier trained by cross-entropy (one augmented view per image), as the
supervised baseline is.  Both train ``--steps`` steps at B = 256 with the default study's
optimiser and schedule (InfoNCE through the package's own loop, ``training.loop.run_loop``).

Measured at step 0 and after training, with BatchNorm in eval mode (its statistics
recalibrated over ``--calib`` batches of 256 at each point), so that no image's gradient
depends on another's, as the estimators require:

* the simple noise scale ``B_simple = tr(Sigma) / |G|^2`` (McCandlish et al. 2018, App. A:
  ``training.noise_scale``) from ``--draws`` (cross-entropy: ``--ce-draws``) squared gradient
  norms (all parameters) at B = 32 and at B = 256, the images drawn with replacement, each
  with fresh augmentations.
  InfoNCE's negatives are held fixed: every anchor is scored against the same pool of 255
  images' 510 views (drawn once per point, embedded without gradient, kept out of the
  anchors' draws), ``training.noise_scale.fixed_pool_loss``; so K = 510 at both batch sizes
  and what varies between draws is the anchors (and their views) alone.  Interval: bootstrap
  over the draws (95 %).
* the negatives' bias ``||E g_K - g_510|| / ||g_510||`` of InfoNCE's parameter gradient at one
  fixed batch of 256 images and views, K = 2G - 2 by grouping the negatives in groups of G
  (``training.negatives_bias``), each from ``--bias-draws`` random groupings, with its Monte
  Carlo floor; and of the cross-entropy (zero by construction: the estimator's check).

    python benchmarks/noise_scale.py [--steps 200] [--draws 256] [--ce-draws 1024] [--bias-draws 32]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

DATA_ROOT = "/usr/share/datasets/fashion-mnist"
REPO = Path(__file__).resolve().parents[1]
TAU, B_SMALL, B_BIG, POOL_IMAGES = 0.1, 32, 256, 255
GROUPS = (2, 4, 8, 16, 32, 64, 128, 256)  # K = 2G - 2: 2, 6, ..., 510


def _log(msg: str, t0: list[float]) -> None:
    print(f"[{time.perf_counter() - t0[0]:6.0f} s wall, {time.process_time():6.0f} s CPU] {msg}", flush=True)


def _infonce_training(steps: int, d, out: Path):
    """The default study's InfoNCE cell at B = 256, tau = 0.1, seed 0, trained ``steps`` steps."""
    from smallbatch.study.cell import Cell
    from smallbatch.study.cells import make_cell
    from smallbatch.study.config import load_config
    from smallbatch.training import loop

    over = {"datasets": {"fashion_mnist": {"root": DATA_ROOT}}, "train": {"steps": steps, "log_every": 10**6}}
    cfg = load_config(str(REPO / "config.yaml"), over)
    cell = make_cell(
        cfg, dataset="fashion_mnist", loss="infonce", loss_params={}, batch_size=B_BIG, temperature=TAU, seed=0
    )
    return loop.build_training(Cell.of(cell), d.pretrain_x, d.mean, d.std, torch.device("cpu"), out)


def _supervised(t):
    """The control: the cell's backbone (fresh, same seed) and a linear classifier, with the
    cell's optimiser and schedule."""
    from smallbatch.training.models import build_backbone
    from smallbatch.training.optim import make_optimizer

    tr = t.cell.train
    torch.manual_seed(t.cell.seed)
    backbone, feat = build_backbone(tr.backbone, t.images.shape[1], t.images.shape[-1], tr.width, tr.pool_grid)
    net = torch.nn.Sequential(backbone, torch.nn.Linear(feat, 10))
    opt = make_optimizer(
        net.parameters(), tr.optimizer, t.peak_lr, tr.momentum, tr.weight_decay, beta2=float(tr.adam_beta2)
    )
    return net, opt


def _train_supervised(t, net, opt, labels: torch.Tensor) -> None:
    """Cross-entropy on one view per image, the InfoNCE run's steps, images order and schedule."""
    from smallbatch.training.optim import lr_at, set_lr

    aug, bs = t.step_fn.aug, t.cell.batch_size
    net.train()
    for step in range(t.total):
        pos = step % t.steps_per_epoch
        if pos == 0:
            perm = torch.randperm(
                t.images.shape[0], generator=t.rng.generator("permutation", step // t.steps_per_epoch)
            )
        idx = perm[pos * bs : (pos + 1) * bs]
        views = aug.apply(t.images[idx], aug.draw(bs, t.rng.generator("augment", step)))
        set_lr(opt, lr_at(step, t.total, t.warmup, t.peak_lr, t.schedule))
        loss = F.cross_entropy(net(views), labels[idx])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()


def _views(aug, x: torch.Tensor, n_views: int, gen: torch.Generator) -> list[torch.Tensor]:
    """``n_views`` augmented views of the images ``x`` (each from fresh uniforms)."""
    v = aug.apply(torch.cat([x] * n_views), aug.draw(n_views * x.shape[0], gen))
    return list(v.split(x.shape[0]))


@torch.no_grad()
def _calibrate(net, aug, images: torch.Tensor, batches: int, gen: torch.Generator) -> None:
    """BatchNorm's running statistics re-estimated (a plain average) over ``batches`` batches of
    256 augmented images, then eval mode: each image's output depends on itself alone."""
    bns = [m for m in net.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
    momenta = [m.momentum for m in bns]
    for m in bns:
        m.reset_running_stats()
        m.momentum = None
    net.train()
    for _ in range(batches):
        net(_views(aug, images[torch.randint(images.shape[0], (B_BIG,), generator=gen)], 1, gen)[0])
    for m, momentum in zip(bns, momenta):
        m.momentum = momentum
    net.eval()


def _noise(loss_of, params, population: torch.Tensor, draws: int, gen: torch.Generator, t0) -> dict:
    """B_simple from ``draws`` squared gradient norms at B_SMALL and at B_BIG; ``loss_of(idx)``
    is the loss of the images ``idx`` (drawn with replacement from ``population``)."""
    from smallbatch.training.noise_scale import noise_scale, noise_scale_interval, squared_grad_norm

    sq = {}
    for b in (B_SMALL, B_BIG):
        sq[b] = [
            squared_grad_norm(loss_of(population[torch.randint(population.shape[0], (b,), generator=gen)]), params)
            for _ in range(draws)
        ]
        _log(f"  {draws} draws at B={b}", t0)
    est = noise_scale(sq[B_SMALL], sq[B_BIG], B_SMALL, B_BIG)
    return {"est": est, "ci": noise_scale_interval(sq[B_SMALL], sq[B_BIG], B_SMALL, B_BIG, seed=1)}


def _measure(model, net, t, d, args, point: int, t0) -> dict:
    """Noise scales and biases of both networks at one point (``point`` seeds its draws)."""
    from smallbatch.training.negatives_bias import cross_entropy_gradient, grouped_gradient, negatives_bias
    from smallbatch.training.noise_scale import fixed_pool_loss

    gen = torch.Generator().manual_seed(1000 + point)
    aug, images, labels, loss_fn = t.step_fn.aug, t.images, d.train_y, t.step_fn.loss_fn
    perm = torch.randperm(images.shape[0], generator=gen)
    pool_idx, population = perm[:POOL_IMAGES], perm[POOL_IMAGES:]
    for m in (model, net):
        _calibrate(m, aug, images, args.calib, gen)
    with torch.no_grad():
        pool = torch.cat([model(v) for v in _views(aug, images[pool_idx], 2, gen)])
    mp, np_ = [p for p in model.parameters()], [p for p in net.parameters()]

    def infonce_of(idx):
        return fixed_pool_loss(loss_fn, *(model(v) for v in _views(aug, images[idx], 2, gen)), pool, TAU)

    def ce_of(idx):
        return F.cross_entropy(net(_views(aug, images[idx], 1, gen)[0]), labels[idx])

    res = {"infonce": _noise(infonce_of, mp, population, args.draws, gen, t0)}
    res["ce"] = _noise(ce_of, np_, population, args.ce_draws, gen, t0)
    batch = population[:B_BIG]
    v1, v2 = _views(aug, images[batch], 2, gen)
    grad_at = grouped_gradient(loss_fn, model(v1), model(v2), mp, TAU)
    res["bias"] = negatives_bias(grad_at, B_BIG, GROUPS, draws=args.bias_draws, seed=point)
    _log(f"  InfoNCE bias, {args.bias_draws} groupings per K", t0)
    ce_at = cross_entropy_gradient(net(v1), labels[batch], np_)
    res["ce_bias"] = max(b.bias for b in negatives_bias(ce_at, B_BIG, GROUPS, draws=2, seed=point))
    return res


def _print(results: dict[str, dict]) -> None:
    print("\n| point | loss | B_simple | 95 % interval | G² | tr(Σ) |\n|---|---|---|---|---|---|")
    for point, res in results.items():
        for name, label in (("infonce", "InfoNCE (K = 510, fixed pool)"), ("ce", "cross-entropy")):
            e, (lo, hi) = res[name]["est"], res[name]["ci"]
            ci = f"{lo:.4g} – {hi:.4g}" if hi < float("inf") else f"above {lo:.4g} (no upper end)"
            print(f"| {point} | {label} | {e.b_simple:.4g} | {ci} | {e.g2:.4g} | {e.trace:.4g} |")
    print("\n| point | " + " | ".join(f"K={2 * g - 2}" for g in GROUPS) + " |")
    print("|---|" + "---|" * len(GROUPS))
    for point, res in results.items():
        print(f"| {point} bias | " + " | ".join(f"{b.bias:.3f}" for b in res["bias"]) + " |")
        print(f"| {point} floor | " + " | ".join(f"{b.floor:.3f}" for b in res["bias"]) + " |")
        print(f"| {point} debiased | " + " | ".join(f"{b.debiased:.3f}" for b in res["bias"]) + " |")
    for point, res in results.items():
        print(f"cross-entropy bias at {point}, largest over K: {res['ce_bias']:.2e}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=200, help="training steps at B=256 (both networks)")
    ap.add_argument("--draws", type=int, default=256, help="InfoNCE's squared gradient norms per batch size")
    ap.add_argument("--ce-draws", type=int, default=1024, help="the cross-entropy's (cheaper: one view per image)")
    ap.add_argument("--bias-draws", type=int, default=32, help="random groupings per K")
    ap.add_argument("--calib", type=int, default=10, help="batches of 256 for BatchNorm's statistics")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    from smallbatch.data import load as data
    from smallbatch.training import loop

    t0, load0 = [time.perf_counter()], os.getloadavg()
    d = data.load_dataset("fashion_mnist", DATA_ROOT, seed=0, image_size=16, train_subset=10000)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        t = _infonce_training(args.steps, d, Path(tmp))
        net, opt = _supervised(t)
        _log("step 0", t0)
        results["step 0"] = _measure(t.step_fn.model, net, t, d, args, 0, t0)
        t.step_fn.model.train()
        status = loop.run_loop(t, loop.Hooks(progress=False), time.perf_counter())
        _train_supervised(t, net, opt, d.train_y)
        _log(f"trained {t.total} steps (InfoNCE {status}, loss {float(t.last_value):.3f})", t0)
        results[f"step {t.total}"] = _measure(t.step_fn.model, net, t, d, args, 1, t0)
    load1 = os.getloadavg()
    print(f"torch {torch.__version__}, {args.threads} thread(s), {os.cpu_count()} CPUs; {vars(args)}")
    print(f"load average before: {' '.join(f'{x:.2f}' for x in load0)}; after: {' '.join(f'{x:.2f}' for x in load1)}")
    print(f"wall {time.perf_counter() - t0[0]:.0f} s, CPU {time.process_time():.0f} s")
    _print(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
