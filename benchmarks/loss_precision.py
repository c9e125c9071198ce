"""float32-vs-float64 gradient error of InfoNCE vs FlatNCE (and DCL), side by side across K and tau.

FlatNCE's claim (Chen et al. 2021): when positives dominate (saturation), InfoNCE's
gradient is its FlatNCE-like direction times the vanishing factor
q_B = 1 - softmax_pos, computed as 1 - p with p ~ 1, so in float32 it loses its
relative precision (the positive's pull becomes exactly 0 once q_B < 2^-24),
while FlatNCE's gradient (= DCL's) carries no such factor.

For each setting the same float64 embeddings are cast to float32, the losses are
back-propagated in both precisions, and we print relative errors of the gradient
w.r.t. (z1, z2), ``||g - g_ref|| / ||g_ref||``:

    f32~f64   float32 against float64 of the same loss (the study's measure)
    f32~exact InfoNCE float32 against the exact InfoNCE gradient
    f64~exact InfoNCE float64 against the exact InfoNCE gradient

The exact InfoNCE gradient uses the identity grad L_i = q_B,i * grad l_i with
l_i = FlatNCE's logsumexp_j (s_j - s_p)/tau and q_B,i = sigmoid(l_i), evaluated in
float64 (no cancellation).  It matters when q_B < 2^-53: there float64 InfoNCE
loses the positive too, and "float32 vs float64" alone would look fine.

Usage: python benchmarks/loss_precision.py [--dim 128] [--seed 0] [--queue]
(--queue: N=8 queries against a MoCo queue of K keys instead of in-batch negatives).
"""

from __future__ import annotations

import argparse
import math

import torch

from smallbatch.losses import build_loss, in_batch_scores, queue_scores
from smallbatch.losses.diagnostics import diagnostics


def saturated_views(n: int, d: int, spread: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Two views z = base ± spread·noise: positives near cos 1, negatives near cos 0 (for large d)."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(n, d, generator=g, dtype=torch.float64)
    noise = torch.randn(n, d, generator=g, dtype=torch.float64)
    return base + spread * noise, base - spread * noise


def _scores(a, b, queue):
    return in_batch_scores(a, b) if queue is None else queue_scores(a, b, queue.to(a.dtype))


def gradient(name: str, tau: float, z1, z2, queue, dtype: torch.dtype) -> torch.Tensor:
    """d loss / d(z1, z2) of loss ``name`` computed in ``dtype`` ("exact_infonce": stable InfoNCE)."""
    a = z1.detach().to(dtype).clone().requires_grad_()
    b = z2.detach().to(dtype).clone().requires_grad_()
    pos, neg, mask = _scores(a, b, queue)
    if name == "exact_infonce":
        l = torch.logsumexp((neg - pos[:, None]) / tau, dim=1)
        (torch.sigmoid(l).detach() * l).mean().backward()
    else:
        build_loss(name).from_scores(pos, neg, mask, temperature=tau).loss.backward()
    return torch.cat([a.grad.flatten(), b.grad.flatten()]).double()


def rel(g: torch.Tensor, ref: torch.Tensor) -> float:
    return float((g - ref).norm() / ref.norm())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--queue", action="store_true", help="queue negatives (N=8 queries, K queued keys)")
    ap.add_argument("--ks", type=str, default="2,6,14,30,126,510")
    ap.add_argument("--taus", type=str, default="0.02,0.05,0.1,0.2,0.5,1.0")
    ap.add_argument("--spreads", type=str, default="0.05,0.3")
    args = ap.parse_args()
    torch.set_num_threads(1)
    ks = [int(k) for k in args.ks.split(",")]
    taus = [float(t) for t in args.taus.split(",")]
    spreads = [float(s) for s in args.spreads.split(",")]
    eps32 = 2.0**-24
    print(
        f"float32 unit roundoff u = 2^-24 = {eps32:.1e}, float64 2^-53 = {2.0**-53:.1e}; "
        "q_B = mean 1 - softmax_pos (float64); errors are relative, on d loss/d(z1, z2)"
    )
    hdr = (
        f"{'spread':>6} {'K':>5} {'tau':>5} {'pos_cos':>7} {'q_B':>8} | {'InfoNCE':>9} {'FlatNCE':>9} {'DCL':>9} "
        f"{'ratio':>8} | {'InfoNCE32':>9} {'InfoNCE64':>9}"
    )
    print(f"{'':>36} | {'---- f32~f64 of the same loss ----':^39} | {'-- ~exact --':^19}")
    print(hdr)
    print("-" * len(hdr))
    for spread in spreads:
        for k in ks:
            if args.queue:
                z1, z2 = saturated_views(8, args.dim, spread, args.seed)
                gq = torch.Generator().manual_seed(args.seed + 1)
                queue = torch.randn(k, args.dim, generator=gq, dtype=torch.float64)
            else:
                if k % 2 or k < 2:
                    continue
                z1, z2 = saturated_views(k // 2 + 1, args.dim, spread, args.seed)
                queue = None
            for tau in taus:
                dg = diagnostics(*_scores(z1, z2, queue)[:2], tau)
                g = {
                    (n, dt): gradient(n, tau, z1, z2, queue, dt)
                    for n in ("infonce", "flatnce", "dcl")
                    for dt in (torch.float32, torch.float64)
                }
                exact = gradient("exact_infonce", tau, z1, z2, queue, torch.float64)
                e_info = rel(g["infonce", torch.float32], g["infonce", torch.float64])
                e_flat = rel(g["flatnce", torch.float32], g["flatnce", torch.float64])
                e_dcl = rel(g["dcl", torch.float32], g["dcl", torch.float64])
                ratio = e_info / e_flat if e_flat > 0 else math.inf
                print(
                    f"{spread:>6.2f} {k:>5d} {tau:>5.2f} {dg['pos_cos']:>7.3f} {dg['qb_mean']:>8.1e} | "
                    f"{e_info:>9.2e} {e_flat:>9.2e} {e_dcl:>9.2e} {ratio:>8.1e} | "
                    f"{rel(g['infonce', torch.float32], exact):>9.2e} {rel(g['infonce', torch.float64], exact):>9.2e}"
                )
        print()


if __name__ == "__main__":
    main()
