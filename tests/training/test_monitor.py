"""The kNN monitor (smallbatch.evaluation.monitor) on real training runs of the digits data set: a
curve every ``eval.monitor_every`` epochs, from training images only, and the very same
weights as a run without it (an execution setting, outside the cell's hash)."""

from __future__ import annotations

import pytest
import torch
from test_train import assert_same_weights, digits_cell, run, weights

from smallbatch.evaluation.monitor import KnnMonitor, knn_monitor
from smallbatch.study.cell import Cell

pytestmark = pytest.mark.usefixtures("one_thread")  # the same weights, bitwise


def test_the_monitor_logs_every_nth_epoch_and_trains_the_same_weights(tmp_path, digits):
    cell = digits_cell(epochs=4)
    watched = dict(cell, eval={**cell["eval"], "monitor_every": 2})
    assert watched["hash"] == cell["hash"]
    logs: list[tuple[int, dict]] = []
    run(cell, digits, tmp_path / "off")
    run(
        watched,
        digits,
        tmp_path / "on",
        log_fn=lambda m, s: logs.append((s, m)),
        at_epoch_end=knn_monitor(Cell.of(watched), digits, torch.device("cpu")),
    )
    assert_same_weights(weights(tmp_path / "off" / "checkpoint.pt"), weights(tmp_path / "on" / "checkpoint.pt"))
    spe = digits.pretrain_x.shape[0] // cell["batch_size"]
    points = [(s, m) for s, m in logs if "monitor/knn_top1" in m]
    assert [s for s, _ in points] == [2 * spe, 4 * spe] and [m["monitor/epoch"] for _, m in points] == [2.0, 4.0]
    assert all(0 <= m["monitor/knn_top1"] <= 100 for _, m in points)


def test_the_held_out_split_is_training_images_apart_from_the_bank(digits):
    mon = KnnMonitor(digits.train_x, digits.train_y, digits.mean, digits.std, every=1, k=5, t=0.1, seed=0, device="cpu")
    flat = digits.train_x.flatten(1)
    rows = {tuple(r.tolist()): i for i, r in enumerate(flat)}
    q = {rows[tuple(r.tolist())] for r in mon.xq.flatten(1)}
    b = {rows[tuple(r.tolist())] for r in mon.xb.flatten(1)}
    assert q and b and not q & b  # every query is a training image, none of them in the bank
    assert knn_monitor(Cell.of(digits_cell()), digits, "cpu") is None  # off by default


@pytest.mark.parametrize("every", [-1, 1.5, True])
def test_a_bad_period_is_refused_naming_the_key(digits, every):
    with pytest.raises(ValueError, match="monitor_every"):
        KnnMonitor(
            digits.train_x, digits.train_y, digits.mean, digits.std, every=every, k=5, t=0.1, seed=0, device="cpu"
        )
