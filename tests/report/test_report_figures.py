"""The grid's figures as a paper shows them: one- or two-column sizes, fonts of at least 8 pt, every seed
drawn with the seeds' range (no 1-dof t interval), baseline labels that never collide (checked on the
text boxes matplotlib's renderer measures), and the accuracy-against-images-seen curves of the kNN
monitor.  The figures are built from a real SQLite store logged with designed values."""

from __future__ import annotations

import itertools
import shutil

import numpy as np
import pytest
from matplotlib.collections import PathCollection
from matplotlib.text import Text
from report_store import StoreBuilder

from smallbatch import report
from smallbatch.report.context import ReportContext
from smallbatch.report.figures import (
    MIN_FONT_PT,
    PAPER_RC,
    PAPER_WIDTHS,
    baseline_lines,
    paper_figure,
    plot_style,
    spread_labels,
)
from smallbatch.report.runs import load_runs, select_cells
from smallbatch.report.sections import grid_figures
from smallbatch.tracking import StoreReader

SEEDS = (0, 1)
BATCHES = (16, 64, 256)
#: kNN values around 81, so that both baselines (80.9, equal) lie inside the range drawn
KNN = {("infonce", 16): (81.6, 81.2), ("infonce", 64): (81.4, 81.3), ("infonce", 256): (80.6, 81.1)}
KNN.update({("dcl", b): (v0 - 0.2, v1 + 0.1) for (_, b), (v0, v1) in list(KNN.items())})


class Capture(ReportContext):
    """A report context that keeps what every saved figure drew (its size and text boxes) before saving it."""

    def save_figure(self, fig, stem, exact=False):
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
        texts = [t for t in fig.findobj(Text) if t.get_visible() and t.get_text()]
        self.seen[stem] = {
            "size": tuple(fig.get_size_inches()),
            "texts": [(t.get_text(), t.get_fontsize(), t.get_window_extent(renderer)) for t in texts],
            "figure": fig.bbox,
            "scatter_y": sorted(
                float(y)
                for ax in fig.axes
                for c in ax.collections
                if isinstance(c, PathCollection)
                for y in c.get_offsets()[:, 1]
            ),
        }
        return super().save_figure(fig, stem, exact)


@pytest.fixture(scope="module")
def store(store_uri, tmp_path_factory):
    b = StoreBuilder(store_uri)
    for (loss, bs), vals in KNN.items():
        for seed, knn in zip(SEEDS, vals):
            b.run(
                f"fashion_mnist/{loss}/bs{bs}-t0.1-s{seed}",
                params={
                    "dataset": "fashion_mnist",
                    "loss": loss,
                    "batch_size": bs,
                    "temperature": 0.1,
                    "seed": seed,
                    "epochs": 3,
                    "pretrain_images": 10_000,
                },
                final={"knn/top1": knn, "linear/top1": knn + 5.0},
                # the kNN monitor after each of 3 epochs, logged at the epoch's last optimiser step
                history={"monitor/knn_top1": [70.0 + 2 * e + (256 // bs) * 0.5 * e + seed for e in range(3)]},
            )
    for name in ("raw_pixels", "random_init"):  # equal kNN (they collided), both far below the linear range
        b.run(
            f"baselines/fashion_mnist/{name}-s0",
            kind="baseline",
            section="baseline",
            baseline=name,
            params={"dataset": "fashion_mnist", "baseline": name, "seed": 0},
            final={"knn/top1": 80.9, "linear/top1": 70.0 if name == "raw_pixels" else 70.1},
        )
    return store_uri, tmp_path_factory.mktemp("figures")


def _figures(store, metrics=("knn", "linear")) -> tuple[dict, dict]:
    uri, out = store
    reader = StoreReader(uri)
    runs, exp = load_runs(reader, None)
    for m in {"knn", "linear"} - set(metrics):
        runs = runs.drop(columns=[f"metrics.{m}/top1"])
    # a fresh folder per call: the report never writes over files it did not write (ReportContext.claim)
    folder = out / "-".join(metrics)
    shutil.rmtree(folder, ignore_errors=True)
    ctx = Capture(folder, uri, exp, reader, 1.0, report.load_papers(None), runs)
    ctx.seen = {}
    cells = select_cells(runs, "grid", (), [])
    agg = report.aggregate_cells(cells, ["dataset", "temperature", "loss", "label", "batch_size"], 1.0)
    captions = {
        f.__name__: f(cells, agg, "fashion_mnist", ctx)[1]
        for f in (grid_figures.accuracy_figure, grid_figures.learning_curve_figure)
    }
    return ctx.seen, captions


def _overlap(a, b) -> bool:
    return a.x0 < b.x1 and b.x0 < a.x1 and a.y0 < b.y1 and b.y0 < a.y1


def test_two_metrics_make_a_two_column_figure_whose_texts_never_collide(store):
    seen, captions = _figures(store)
    fig = seen["accuracy_vs_batch_fashion_mnist"]
    assert fig["size"][0] == pytest.approx(PAPER_WIDTHS[2])
    for text, size, _ in fig["texts"]:
        assert size >= MIN_FONT_PT, f"{text!r} is set in {size} pt"
    labels = [(t, box) for t, _, box in fig["texts"] if "pixels" in t or "init" in t]
    assert {t for t, _ in labels} == {"raw pixels 80.9", "random init 80.9", "↓ raw pixels 70.0", "↓ random init 70.1"}
    for (t1, b1), (t2, b2) in itertools.combinations([(t, box) for t, _, box in fig["texts"]], 2):
        assert not _overlap(b1, b2), f"{t1!r} and {t2!r} overlap"
    for t, box in labels:  # inside the canvas: nothing cut off
        assert fig["figure"].x0 <= box.x0 and box.x1 <= fig["figure"].x1 + 0.5, t
    # the title reads the data set's name; the top axis names the optimiser steps each batch size took
    texts = [t for t, _, _ in fig["texts"]]
    assert "Fashion-MNIST: top-1 against batch size (τ = 0.1)" in texts and "fashion_mnist" not in " ".join(texts)
    assert {"optimiser steps", "1,875", "471", "120"} <= set(texts)
    png = store[1] / "knn-linear" / "figures" / "accuracy_vs_batch_fashion_mnist.png"
    from matplotlib.image import imread

    assert imread(png).shape[1] == round(PAPER_WIDTHS[2] * 200)  # saved at its own size, not cropped
    cap = captions["accuracy_figure"]
    assert "2 seeds per cell" in cap and "range" in cap and "12.7" in cap and "15.6×" in cap


def test_every_seed_is_drawn_and_no_t_interval(store):
    seen, _ = _figures(store)
    drawn = seen["accuracy_vs_batch_fashion_mnist"]["scatter_y"]
    seeds = sorted([v for vals in KNN.values() for v in vals] + [v + 5.0 for vals in KNN.values() for v in vals])
    assert drawn == pytest.approx(seeds)


def test_one_metric_makes_a_one_column_figure(store):
    seen, _ = _figures(store, metrics=("knn",))
    fig = seen["accuracy_vs_batch_fashion_mnist"]
    assert fig["size"][0] == pytest.approx(PAPER_WIDTHS[1])
    boxes = [(t, box) for t, _, box in fig["texts"]]
    for (t1, b1), (t2, b2) in itertools.combinations(boxes, 2):
        assert not _overlap(b1, b2), f"{t1!r} and {t2!r} overlap"


def test_learning_curves_put_batch_sizes_on_images_seen(store):
    seen, captions = _figures(store)
    fig = seen["accuracy_vs_images_fashion_mnist"]
    assert fig["size"][0] == pytest.approx(PAPER_WIDTHS[2])
    assert {"InfoNCE", "DCL", "images seen (thousands)"} <= {t for t, _, _ in fig["texts"]}
    assert "images seen" in captions["learning_curve_figure"]


@pytest.mark.parametrize(
    "values",
    [
        {"raw_pixels": 80.9, "random_init": 80.9, "supervised": 80.95},  # equal and near-equal, inside
        {"raw_pixels": 70.0, "random_init": 70.1, "supervised": 95.0},  # both below and one above the range
        {"raw_pixels": 80.0, "random_init": 80.02, "supervised": 79.5},  # at the bottom edge, close together
    ],
)
def test_baseline_labels_do_not_overlap_and_stay_by_their_line(values):
    plt, _, rc = plot_style()
    with plt.rc_context({**rc, **PAPER_RC}):
        fig, axes = paper_figure(plt, 1, 1)
        ax = axes[0][0]
        ax.set_ylim(79.9, 82.0)
        texts = baseline_lines(ax, values)
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
        boxes = [t.get_window_extent(renderer) for t in texts]
        plt.close(fig)
    assert len(boxes) == 3
    for a, b in itertools.combinations(boxes, 2):
        assert not _overlap(a, b)
    # each within a few label heights of where it belongs
    box = ax.get_window_extent()
    for t, bb in zip(texts, boxes):
        name, value = t.get_text().lstrip("↑↓ ").rsplit(" ", 1)
        want = box.y0 + np.clip((float(value) - 79.9) / 2.1, 0, 1) * box.height
        assert abs((bb.y0 + bb.y1) / 2 - want) <= 2.5 * bb.height, t.get_text()


def test_spread_labels_stacks_colliding_labels_about_their_targets():
    # three labels of height 10 wanted at 50, 50, 52 with a gap of 1: a block of 32 centred on their mean
    got = spread_labels([50.0, 50.0, 52.0], [10.0, 10.0, 10.0], 0.0, 100.0, 1.0)
    assert got == pytest.approx([39.667, 50.667, 61.667], abs=1e-3)
    # far apart: untouched; against the top edge: pushed down inside it
    assert spread_labels([10.0, 50.0], [10.0, 10.0], 0.0, 100.0, 1.0) == pytest.approx([10.0, 50.0])
    assert spread_labels([99.0, 100.0], [10.0, 10.0], 0.0, 100.0, 1.0) == pytest.approx([84.0, 95.0])


def test_a_top1_panel_ends_at_100_percent_not_past_it():
    """Panels widened to the widest span (10 points here) keep their centres, except one whose window would
    run past 100 %: slid down to end there (99.0-100.5 centred at 99.75 would run to 104.75)."""
    from smallbatch.report.sections.grid_figures import _common_span

    assert _common_span([(99.0, 100.5), (80.0, 90.0)]) == [(90.0, 100.0), (80.0, 90.0)]
