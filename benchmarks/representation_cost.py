"""What the evaluation's representation measure costs beside the embedding it follows.

For the first cell of a config (default: the default study's, Fashion-MNIST at 16 px, small CNN,
F = 2048) with a random-init network: CPU seconds of
:func:`smallbatch.evaluation.representation.representation_metrics` (2,000 held-out images, two
views) and of embedding the cell's training and test images, measured in turn in one process on
one thread, and the uniformity of 2,000 x F unit rows by ``torch.pdist`` and by one matrix
product (the form the package uses), side by side.  Prints the load average beside them.

    python benchmarks/representation_cost.py [--config config.yaml] [--repeats 3]
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import time

import torch

from smallbatch.data import load as data
from smallbatch.evaluation import embed
from smallbatch.evaluation.representation import representation_metrics
from smallbatch.losses.diagnostics import alignment_uniformity
from smallbatch.pipeline.jobs import data_options
from smallbatch.study.cell import Cell
from smallbatch.study.cells import expand_cells
from smallbatch.study.config import load_config
from smallbatch.training import loop as train


def _cpu(fn) -> float:
    c0 = time.process_time()
    fn()
    return time.process_time() - c0


def _pdist_uniformity(x: torch.Tensor) -> float:
    d2 = torch.pdist(torch.nn.functional.normalize(x, dim=1), p=2).pow(2)
    return float(torch.logsumexp(-2.0 * d2, dim=0) - math.log(d2.numel()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="config.yaml")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    cell = Cell.of(next(iter(expand_cells(load_config(args.config)).values())))
    d = data.load_dataset(cell["dataset"], cell["data_root"], seed=0, **data_options(cell["dataset_options"]))
    torch.manual_seed(0)
    model = train.build_model(cell, d.train_x.shape[1], d.train_x.shape[-1])
    rows = {"representation": [], "embed train + test": [], "uniformity, pdist": [], "uniformity, product": []}
    x = torch.randn(2000, model.feat_dim, dtype=torch.float64, generator=torch.Generator().manual_seed(0)).abs()
    for _ in range(args.repeats):
        rows["representation"].append(
            _cpu(lambda: representation_metrics(model, d.test_x, d.mean, d.std, dict(cell["augment"])))
        )
        rows["embed train + test"].append(
            _cpu(lambda: [embed.embed(model.backbone, v, d.mean, d.std, batch_size=256) for v in (d.train_x, d.test_x)])
        )
        rows["uniformity, pdist"].append(_cpu(lambda: _pdist_uniformity(x)))
        rows["uniformity, product"].append(_cpu(lambda: alignment_uniformity(x, x)))
    print(f"cell {cell['id']}: F = {model.feat_dim}, {len(d.train_x)} + {len(d.test_x)} images; load {os.getloadavg()}")
    for name, values in rows.items():
        print(f"{name:>22}: median {statistics.median(values):.2f} CPU-s over {len(values)}")


if __name__ == "__main__":
    main()
