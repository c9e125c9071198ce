"""Tests of the pretraining loop (``smallbatch.training.loop``) on the real digits data set.

Every run here is a real (tiny) training run on CPU: small_cnn of width 4, a
16-8 projection head, the digits images that ship with scikit-learn.  Tracking
is off.  Runs are seeded, and the equivalence tests compare state dicts
*bitwise*: a resumed run must end with exactly the weights of an uninterrupted
one (same RNG streams, same optimiser state, same epoch permutation).

The interruption tests kill real ``smallbatch pretrain`` processes (SIGKILL,
SIGTERM) while they train; all of them are started at once by one fixture so
their start-up (importing torch) overlaps.
"""

from __future__ import annotations

import json
import math
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import cluster
import pytest
import torch
from hooks import crash_after

from smallbatch.data import load as data
from smallbatch.errors import CheckpointError
from smallbatch.pipeline import jobs as steps
from smallbatch.study.cell import Cell, read_cell
from smallbatch.study.cells import make_cell
from smallbatch.study.config import load_config
from smallbatch.training import loop as train

SMALLBATCH = Path(sys.executable).with_name("smallbatch")

# tiny model, fast enough for many runs on a shared 2-core CPU
TINY = {"width": 4, "proj_hidden": 16, "proj_dim": 8, "lr": 3e-3, "log_every": 10}


def digits_cell(
    loss: str = "infonce",
    batch_size: int = 32,
    temperature: float = 0.5,
    seed: int = 0,
    loss_params: dict | None = None,
    **train_opts,
) -> dict:
    """A resolved digits cell, built the way the study builds cells (config -> make_cell)."""
    cfg = load_config(None, {"datasets": {"digits": {}}, "train": {**TINY, **train_opts}})
    return make_cell(
        cfg,
        dataset="digits",
        loss=loss,
        loss_params=loss_params or {},
        batch_size=batch_size,
        temperature=temperature,
        seed=seed,
    )


def run(cell: dict, d, out: Path, **kw) -> train.TrainResult:
    return train.pretrain(Cell.of(cell), d.pretrain_x, d.mean, d.std, out, device="cpu", progress=False, **kw)


def weights(path: Path) -> dict[str, torch.Tensor]:
    return train.load_checkpoint(path)["model"]


def assert_same_weights(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype, k
        assert torch.equal(a[k], b[k]), f"{k} differs (max abs diff {(a[k].double() - b[k].double()).abs().max()})"


def steps_per_epoch(cell: dict, d) -> int:
    return d.pretrain_x.shape[0] // cell["batch_size"]


pytestmark = pytest.mark.usefixtures("one_thread")

# the cells the equivalence tests share (4 and 3 epochs: long enough to kill mid-run)
MAIN = dict(epochs=4)
QUEUE = dict(epochs=3, queue_size=64, moco_momentum=0.9)


@pytest.fixture(scope="module")
def main_cell():
    return digits_cell(**MAIN)


@pytest.fixture(scope="module")
def queue_cell():
    return digits_cell(batch_size=16, **QUEUE)


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory, digits, main_cell):
    """Uninterrupted run of the main cell: (result, its folder, its logged metrics)."""
    out = tmp_path_factory.mktemp("ref_main")
    logs: list[tuple[int, dict]] = []
    res = run(main_cell, digits, out, log_fn=lambda m, s: logs.append((s, m)))
    return res, out, logs


@pytest.fixture(scope="module")
def reference(reference_run):
    """(result, weights) of the uninterrupted main cell."""
    res, out, _ = reference_run
    return res, weights(out / "checkpoint.pt")


@pytest.fixture(scope="module")
def queue_reference(tmp_path_factory, digits, queue_cell):
    out = tmp_path_factory.mktemp("ref_queue")
    logs: list[tuple[int, dict]] = []
    res = run(queue_cell, digits, out, log_fn=lambda m, s: logs.append((s, m)))
    return res, weights(out / "checkpoint.pt"), logs


# --------------------------------------------------------------------------- a cell trains
def test_digits_cell_trains_and_writes_checkpoint(digits, main_cell, reference_run):
    res, out, logs = reference_run
    spe = steps_per_epoch(main_cell, digits)
    every = main_cell["train"]["log_every"]
    assert (
        res.status == "finished" and res.steps == MAIN["epochs"] * spe and res.epochs == pytest.approx(MAIN["epochs"])
    )
    ck = train.load_checkpoint(out / "checkpoint.pt")
    assert ck["status"] == "finished" and ck["steps"] == res.steps and ck["cell"]["hash"] == main_cell["hash"]
    assert ck["final_loss"] == res.final_loss == logs[-1][1]["train/loss"]
    # the checkpoint rebuilds the model it was trained as
    model = train.build_model(read_cell(ck["cell"]), ck["channels"], ck["image_size"])
    model.load_state_dict(ck["model"])
    # a log every `log_every` steps and at the last step, every value finite
    expected = sorted(set(range(every, res.steps + 1, every)) | {res.steps})
    assert [s for s, _ in logs] == expected
    losses = [m["train/loss"] for _, m in logs]
    assert all(math.isfinite(v) for v in losses)
    first, last = statistics.mean(losses[:5]), statistics.mean(losses[-5:])
    assert last < first - 0.1, f"loss did not decrease: first window {first:.3f}, last window {last:.3f}"
    # the in-batch K of the papers is 2N-2, and the diagnostics agree with it
    m = logs[-1][1]
    assert m["diag/k"] == main_cell["negatives"] == 2 * 32 - 2
    assert m["diag/mi_ceiling"] == pytest.approx(math.log(2 * 32 - 1), rel=1e-6)
    for key in (
        "diag/ess",
        "diag/alignment",
        "diag/uniformity",
        "diag/qb_mean",
        "diag/mi_estimate",
        "train/images_per_s",
        "train/lr",
        "epoch",
    ):
        assert math.isfinite(m[key]), key
    assert m["epoch"] == pytest.approx(MAIN["epochs"])


def test_logged_lr_follows_scaling_and_schedule(tmp_path, digits):
    cell = digits_cell(epochs=1, lr=0.1, lr_scaling="linear", warmup_epochs=0.25, log_every=1, optimizer="sgd")
    logs: list[tuple[int, dict]] = []
    res = run(cell, digits, tmp_path, log_fn=lambda m, s: logs.append((s, m)))
    spe = steps_per_epoch(cell, digits)
    peak = 0.1 * 32 / 256
    warm = round(0.25 * spe)
    for s, m in logs:  # metrics at step s belong to the s-th update, whose index is s-1
        assert m["train/lr"] == pytest.approx(train.lr_at(s - 1, res.steps, warm, peak), rel=1e-12)
    assert max(m["train/lr"] for _, m in logs) == pytest.approx(peak)


# --------------------------------------------------------------------------- resume equivalence
def test_resume_after_crash_mid_epoch_is_bitwise_identical(tmp_path, digits, main_cell, reference, capfd):
    ref_res, ref_w = reference
    spe = steps_per_epoch(main_cell, digits)
    with pytest.raises(KeyboardInterrupt):
        run(main_cell, digits, tmp_path, after_step=crash_after(spe + 7))  # crash 7 steps into epoch 2
    assert not (tmp_path / "checkpoint.pt").exists()
    st = train.load_checkpoint(tmp_path / "state.pt")
    assert st["step"] == spe  # the last epoch-end save
    capfd.readouterr()
    res = run(main_cell, digits, tmp_path)
    assert f"from step {spe}/" in capfd.readouterr().err
    assert res.status == "finished" and res.steps == ref_res.steps
    assert res.final_loss == ref_res.final_loss
    assert_same_weights(weights(tmp_path / "checkpoint.pt"), ref_w)


def _start(cell: dict, out: Path, cache: Path, pause_at: int) -> subprocess.Popen:
    out.mkdir(parents=True, exist_ok=True)
    cell_file = out / "cell.json"
    cell_file.write_text(json.dumps(cell))
    cmd = [
        sys.executable,
        "-c",
        cluster.PAUSED_PRETRAIN,
        str(out / "paused"),
        str(pause_at),
        "pretrain",
        "--cell",
        str(cell_file),
        "--out",
        str(out),
        "--data-cache",
        str(cache),
        "--tracking-uri",
        "none",
        "--no-progress",
    ]
    with open(out / "stdout.txt", "w") as so, open(out / "stderr.txt", "w") as se:  # files: no pipe to fill up
        return subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=so, stderr=se)


@pytest.fixture(scope="module")
def interrupted(tmp_path_factory, digits, main_cell, queue_cell):
    """Three real `smallbatch pretrain` processes, started together (their imports overlap),
    each paused 3 steps into its second epoch (after its first epoch-end state save) and
    signalled there: SIGKILL (main cell), SIGKILL (queue cell), SIGTERM (main cell).
    Returns per name: dict(rc, err, paused_at, state_before, dir)."""
    root = tmp_path_factory.mktemp("interrupted")
    cache = root / "digits_cache.pt"
    data.save_cache(digits, cache)
    plan = {
        "kill": (main_cell, signal.SIGKILL),
        "kill_queue": (queue_cell, signal.SIGKILL),
        "term": (main_cell, signal.SIGTERM),
    }
    pause = {name: steps_per_epoch(cell, digits) + 3 for name, (cell, _) in plan.items()}
    procs = {name: _start(cell, root / name, cache, pause[name]) for name, (cell, _) in plan.items()}
    out = {name: {"dir": root / name, "paused_at": pause[name], "state_before": None, "rc": None} for name in plan}
    try:
        for name, (_, sig) in plan.items():
            p, r = procs[name], out[name]
            deadline = time.monotonic() + 300  # a hang guard only: the process waits for us once paused
            while not (r["dir"] / "paused").exists() and p.poll() is None and time.monotonic() < deadline:
                time.sleep(0.05)
            if p.poll() is not None or not (r["dir"] / "paused").exists():
                continue  # ended (or hung) before its pause: the tests report it with its stderr
            r["state_before"] = train.load_checkpoint(r["dir"] / "state.pt")["step"]
            p.send_signal(sig)
            if sig != signal.SIGKILL:
                p.stdin.write(b"go")  # the SIGTERM is pending before the process reads this
                p.stdin.flush()
    finally:
        for name, p in procs.items():
            try:
                p.stdin.close()
            except OSError:  # SIGKILLed: the pipe has no reader
                pass
            try:
                p.wait(timeout=300)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
            out[name]["rc"] = p.returncode
            out[name]["err"] = (out[name]["dir"] / "stderr.txt").read_text()
    return out


@pytest.mark.slow  # several of the package's processes (pyproject: markers)
@pytest.mark.parametrize("name", ["kill", "kill_queue"])
def test_resume_after_sigkill_is_bitwise_identical(name, interrupted, digits, request, capfd):
    r = interrupted[name]
    cell = request.getfixturevalue("main_cell" if name == "kill" else "queue_cell")
    ref_res, ref_w = request.getfixturevalue("reference" if name == "kill" else "queue_reference")[:2]
    assert r["state_before"] is not None, f"process ended before its pause: {r['err'][-800:]}"
    assert r["rc"] == -signal.SIGKILL, r["err"][-800:]
    assert not (r["dir"] / "checkpoint.pt").exists(), "the process finished before it was killed"
    spe = steps_per_epoch(cell, digits)
    st = train.load_checkpoint(r["dir"] / "state.pt")
    assert st["step"] == r["state_before"] == spe < r["paused_at"] < ref_res.steps  # killed mid-epoch 2
    if name == "kill_queue":
        assert st["queue"] is not None and st["key_model"] is not None
    capfd.readouterr()
    res = run(cell, digits, r["dir"])
    assert f"from step {st['step']}/" in capfd.readouterr().err
    assert res.steps == ref_res.steps and res.final_loss == ref_res.final_loss
    assert_same_weights(weights(r["dir"] / "checkpoint.pt"), ref_w)


def test_sigterm_saves_state_at_current_step_and_exits_143(interrupted, digits, main_cell, reference):
    r = interrupted["term"]
    ref_res, ref_w = reference
    assert r["state_before"] is not None, f"process ended before its pause: {r['err'][-800:]}"
    assert r["rc"] == 143, r["err"][-800:]
    assert not (r["dir"] / "checkpoint.pt").exists()
    st = train.load_checkpoint(r["dir"] / "state.pt")
    # saved at once, at the step the signal arrived in (not at the next epoch end, not later)
    assert r["state_before"] == steps_per_epoch(main_cell, digits) < st["step"] == r["paused_at"] < ref_res.steps
    last = r["err"].strip().splitlines()[-1]
    assert last.startswith("smallbatch: preempted:") and f"at step {st['step']} " in last
    res = run(main_cell, digits, r["dir"])
    assert res.steps == ref_res.steps and res.final_loss == ref_res.final_loss
    assert_same_weights(weights(r["dir"] / "checkpoint.pt"), ref_w)


# --------------------------------------------------------------------------- divergence
def past_the_plan(cell: dict, **train: object) -> dict:
    """``cell`` with ``train`` settings no plan accepts (a rate that overflows on the first update):
    the training's own handling of what gets past it."""
    return {**cell, "train": {**cell["train"], **train}}


def test_huge_lr_diverges_and_the_checkpoint_records_it(tmp_path, digits):
    """SGD at lr 1e30 overflows the weights on the first update: a real non-finite loss."""
    cell = past_the_plan(digits_cell(epochs=1, optimizer="sgd", warmup_epochs=0), lr=1e30)
    logs: list[tuple[int, dict]] = []
    res = run(cell, digits, tmp_path, log_fn=lambda m, s: logs.append((s, m)))
    assert res.status == "diverged" and math.isnan(res.final_loss)
    assert res.steps < steps_per_epoch(cell, digits)
    ck = train.load_checkpoint(tmp_path / "checkpoint.pt")
    assert ck["status"] == "diverged"
    assert logs[-1][1].get("train/diverged") == 1.0


def _diverged_checkpoint(tmp_path, digits) -> dict:
    cell = past_the_plan(digits_cell(epochs=1, optimizer="sgd", warmup_epochs=0), lr=1e30)
    assert run(cell, digits, tmp_path).status == "diverged"
    return cell


def test_embed_and_probes_of_a_diverged_cell_write_diverged_outputs(tmp_path, digits):
    cell = _diverged_checkpoint(tmp_path, digits)
    res = steps.run_embed(Cell.of(cell), tmp_path / "checkpoint.pt", tmp_path / "features.npz")
    assert res["status"] == "diverged"
    for kind in ("knn", "linear"):
        out = steps.run_probe(
            kind, Cell.of(cell), tmp_path / "features.npz", tmp_path / f"{kind}.json", tracking_uri=None, experiment="x"
        )
        assert out["status"] == "diverged"
        assert json.loads((tmp_path / f"{kind}.json").read_text())["status"] == "diverged"


def test_nan_loss_mid_run_ends_cell_as_diverged(tmp_path, digits, monkeypatch):
    """Simulates the numerical event itself: the loss returns NaN at its k-th call
    (after an epoch-end state save), everything else is the real loop.  The step reads
    the loss on the host only every `log_every` steps, so the cell ends as diverged at
    the first check at or after the NaN — and no state is saved after it."""
    real_build = train.build_loss
    k = 50

    def build_nan_at_k(name, **params):
        loss = real_build(name, **params)
        calls = {"n": 0}
        orig = loss.from_scores

        def from_scores(*a, **kw):
            out = orig(*a, **kw)
            calls["n"] += 1
            if calls["n"] == k:
                out.loss = out.loss * float("nan")
            return out

        loss.from_scores = from_scores
        return loss

    monkeypatch.setattr(train, "build_loss", build_nan_at_k)
    cell = digits_cell(epochs=3)
    spe, every = steps_per_epoch(cell, digits), cell["train"]["log_every"]
    assert spe < k < 2 * spe
    res = run(cell, digits, tmp_path)
    assert res.status == "diverged" and k <= res.steps < k + every and math.isnan(res.final_loss)
    assert train.load_checkpoint(tmp_path / "checkpoint.pt")["status"] == "diverged"
    assert train.load_checkpoint(tmp_path / "state.pt")["step"] == spe  # the save before the NaN, none after


# --------------------------------------------------------------------------- state files
def test_corrupt_state_raises_checkpoint_error_and_restart_starts_afresh(tmp_path, digits):
    cell = digits_cell(epochs=1.5)
    ref = tmp_path / "ref"
    ref_res = run(cell, digits, ref)
    out = tmp_path / "cell"
    out.mkdir()
    (out / "state.pt").write_bytes(b"PK\x03\x04 this is not a zip archive" * 3)
    with pytest.raises(CheckpointError) as ei:
        run(cell, digits, out)
    assert str(out / "state.pt") in str(ei.value) and "\n" not in str(ei.value)
    res = run(cell, digits, out, restart=True)
    assert res.steps == ref_res.steps and res.final_loss == ref_res.final_loss
    assert_same_weights(weights(out / "checkpoint.pt"), weights(ref / "checkpoint.pt"))


def test_truncated_state_raises_checkpoint_error(tmp_path, digits):
    cell = digits_cell(epochs=1.5)
    with pytest.raises(KeyboardInterrupt):
        run(cell, digits, tmp_path, after_step=crash_after(50))
    state = tmp_path / "state.pt"
    blob = state.read_bytes()
    state.write_bytes(blob[: len(blob) // 2])
    with pytest.raises(CheckpointError, match="state.pt"):
        run(cell, digits, tmp_path)


def test_state_of_another_config_is_ignored(tmp_path, digits, capfd):
    other = digits_cell(epochs=1.5, lr=1e-2)  # same cell id, different science -> different hash
    cell = digits_cell(epochs=1.5)
    assert other["id"] == cell["id"] and other["hash"] != cell["hash"]
    with pytest.raises(KeyboardInterrupt):
        run(other, digits, tmp_path / "cell", after_step=crash_after(50))
    ref_res = run(cell, digits, tmp_path / "ref")
    capfd.readouterr()
    res = run(cell, digits, tmp_path / "cell")
    err = capfd.readouterr().err
    assert "resuming" not in err and "starting afresh" in err
    assert res.final_loss == ref_res.final_loss
    assert_same_weights(weights(tmp_path / "cell" / "checkpoint.pt"), weights(tmp_path / "ref" / "checkpoint.pt"))


# --------------------------------------------------------------------------- precision
def test_fp64_trains_in_float64(tmp_path, digits):
    cell = digits_cell(epochs=0.5, precision="fp64")
    res = run(cell, digits, tmp_path)
    assert res.status == "finished" and math.isfinite(res.final_loss)
    w = weights(tmp_path / "checkpoint.pt")
    floats = [v for v in w.values() if v.is_floating_point()]
    assert floats and all(v.dtype == torch.float64 for v in floats)
    # and it is not the fp32 run cast up: the fp32 run ends elsewhere
    r32 = run(digits_cell(epochs=0.5), digits, tmp_path / "fp32")
    assert r32.final_loss != res.final_loss


def test_fp64_checkpoint_can_be_embedded(tmp_path, digits):
    cell = digits_cell(epochs=0.25, precision="fp64")
    run(cell, digits, tmp_path)
    res = steps.run_embed(Cell.of(cell), tmp_path / "checkpoint.pt", tmp_path / "features.npz")
    assert res["status"] == "finished" and res["train"] == (digits.train_x.shape[0], 16)


def test_bf16_on_cpu_trains_finite_and_differs_from_fp32(tmp_path, digits):
    fp32 = digits_cell(epochs=0.5)
    bf16 = digits_cell(epochs=0.5, precision="bf16")
    r32 = run(fp32, digits, tmp_path / "fp32")
    r16 = run(bf16, digits, tmp_path / "bf16")
    assert r16.status == "finished" and math.isfinite(r16.final_loss)
    w32, w16 = weights(tmp_path / "fp32" / "checkpoint.pt"), weights(tmp_path / "bf16" / "checkpoint.pt")
    assert all(v.dtype == torch.float32 for v in w16.values() if v.is_floating_point())  # autocast keeps fp32 masters
    assert all(torch.isfinite(v).all() for v in w16.values() if v.is_floating_point())
    assert any(not torch.equal(w32[k], w16[k]) for k in w32), "bf16 autocast changed nothing"
    assert r16.final_loss != r32.final_loss


def test_fp16_on_cpu_is_refused(tmp_path, digits):
    with pytest.raises(ValueError, match="fp16"):
        run(digits_cell(epochs=1, precision="fp16"), digits, tmp_path)
    assert not (tmp_path / "checkpoint.pt").exists()


# --------------------------------------------------------------------------- lr rules
@pytest.mark.parametrize(
    "rule,bs,expected",
    [
        ("linear", 256, 0.3),
        ("linear", 512, 0.6),
        ("linear", 16, 0.3 / 16),
        ("sqrt", 256, 0.3),
        ("sqrt", 1024, 0.6),
        ("sqrt", 64, 0.15),
        ("none", 16, 0.3),
        ("none", 4096, 0.3),
    ],
)
def test_scaled_lr(rule, bs, expected):
    assert train.scaled_lr(0.3, bs, rule) == pytest.approx(expected, rel=1e-12)


def test_scaled_lr_rejects_unknown_rule():
    with pytest.raises(ValueError, match="lr_scaling.*linear"):
        train.scaled_lr(0.3, 256, "quadratic")


def test_lr_warmup_then_cosine():
    total, warm, peak = 110, 10, 2.0
    # linear warm-up: (step+1)/warmup of the peak
    assert [train.lr_at(s, total, warm, peak) for s in range(3)] == pytest.approx([0.2, 0.4, 0.6])
    assert train.lr_at(9, total, warm, peak) == pytest.approx(peak)
    # cosine over the remaining 100 steps: peak at its start, half way at 50, zero at the end
    assert train.lr_at(10, total, warm, peak) == pytest.approx(peak)
    assert train.lr_at(60, total, warm, peak) == pytest.approx(1.0)
    assert train.lr_at(35, total, warm, peak) == pytest.approx(peak * 0.5 * (1 + math.cos(math.pi * 0.25)))
    assert train.lr_at(110, total, warm, peak) == pytest.approx(0.0, abs=1e-15)
    assert train.lr_at(500, total, warm, peak) == pytest.approx(0.0, abs=1e-15)  # clamped past the end
    lrs = [train.lr_at(s, total, warm, peak) for s in range(warm, total)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:]))
    # no warm-up
    assert train.lr_at(0, 100, 0, 1.0) == pytest.approx(1.0)


def test_cpu_adam_is_fused_and_steps_like_the_reference_adam():
    """The CPU Adam is torch's fused kernel (one pass over all parameters): after 50 steps with
    weight decay and a changing rate its parameters equal the single-tensor Adam's to float
    rounding, and a float64 run of it equals the reference to 1e-12."""
    from smallbatch.training.optim import make_optimizer, set_lr

    for dtype, tol in ((torch.float32, 1e-5), (torch.float64, 1e-12)):
        torch.manual_seed(0)
        a = [torch.nn.Parameter(torch.randn(7, 5, dtype=dtype)), torch.nn.Parameter(torch.randn(5, dtype=dtype))]
        b = [torch.nn.Parameter(p.detach().clone()) for p in a]
        fused = make_optimizer(a, "adam", 0.01, 0.9, 1e-4)
        ref = torch.optim.Adam(b, lr=0.01, weight_decay=1e-4, foreach=False)
        assert fused.param_groups[0]["fused"] is True
        for step in range(50):
            grads = [torch.randn_like(p) for p in a]
            for p, q, g in zip(a, b, grads):
                p.grad, q.grad = g.clone(), g.clone()
            lr = float(torch.tensor(0.01 * (1 + step) / 50, dtype=torch.float32))  # its rate is a float32 tensor
            set_lr(fused, lr)
            ref.param_groups[0]["lr"] = lr
            fused.step()
            ref.step()
        for p, q in zip(a, b):
            torch.testing.assert_close(p, q, rtol=tol, atol=tol)


def test_lars_step_matches_hand_computation():
    w = torch.nn.Parameter(torch.tensor([[3.0, 4.0]], dtype=torch.float64))  # 2-D: adapted and decayed
    b = torch.nn.Parameter(torch.tensor([1.0, -2.0], dtype=torch.float64))  # 1-D: plain SGD + momentum
    opt = train.LARS([w, b], lr=0.5, momentum=0.9, weight_decay=0.1, eta=0.01)

    w.grad = torch.tensor([[0.6, 0.8]], dtype=torch.float64)
    b.grad = torch.tensor([0.5, 0.5], dtype=torch.float64)
    opt.step()
    # g = grad + wd*w = (0.9, 1.2), |g| = 1.5, |w| = 5, trust = 0.01*5/1.5 = 1/30
    # buf = trust*g = (0.03, 0.04); w <- w - 0.5*buf
    assert w.detach().flatten().tolist() == pytest.approx([2.985, 3.98], abs=1e-12)
    assert b.detach().tolist() == pytest.approx([0.75, -2.25], abs=1e-12)

    w.grad = torch.tensor([[0.0, 1.0]], dtype=torch.float64)
    b.grad = torch.tensor([-1.0, 0.0], dtype=torch.float64)
    opt.step()
    # g = (0, 1) + 0.1*(2.985, 3.98) = (0.2985, 1.398); trust = 0.01*|w|/|g|
    gw = [0.2985, 1.398]
    trust = 0.01 * math.hypot(2.985, 3.98) / math.hypot(*gw)
    buf = [0.9 * 0.03 + trust * gw[0], 0.9 * 0.04 + trust * gw[1]]
    assert w.detach().flatten().tolist() == pytest.approx([2.985 - 0.5 * buf[0], 3.98 - 0.5 * buf[1]], abs=1e-12)
    # bias: buf = 0.9*(0.5, 0.5) + (-1, 0) = (-0.55, 0.45)
    assert b.detach().tolist() == pytest.approx([0.75 + 0.275, -2.25 - 0.225], abs=1e-12)


# --------------------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    "kw,n_images,arg",
    [
        (dict(batch_size=1), None, "batch_size"),
        (dict(batch_size=32), 20, "batch size 32 is larger than the 20 pretraining images"),
    ],
)
def test_bad_cells_raise_value_error_naming_the_argument(tmp_path, digits, kw, n_images, arg):
    cell = digits_cell(epochs=1, **kw)
    x = digits.pretrain_x if n_images is None else digits.pretrain_x[:n_images]
    with pytest.raises(ValueError) as ei:
        train.pretrain(Cell.of(cell), x, digits.mean, digits.std, tmp_path, device="cpu", progress=False)
    msg = str(ei.value)
    assert arg in msg and "\n" not in msg
    assert not (tmp_path / "checkpoint.pt").exists()


def test_non_positive_epochs_raise(tmp_path, digits):
    cell = digits_cell(epochs=1)
    cell["train"]["epochs"] = 0
    with pytest.raises(ValueError, match="epochs"):
        run(cell, digits, tmp_path)


# --------------------------------------------------------------------------- MoCo queue
def test_momentum_encoder_is_the_ema_of_the_query_encoder_and_its_keys_are_queued():
    """MoCo's update after a step: key = m * key + (1 - m) * query for every parameter, the
    query encoder's buffers copied, this step's keys (normalised) queued with their images."""
    from smallbatch.training.negatives import QueueNegatives

    torch.manual_seed(0)
    query = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    key = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    query(torch.randn(8, 4))  # running statistics of its own
    before = [p.detach().clone() for p in key.parameters()]
    src = QueueNegatives(key, size=16, dim=3, momentum=0.9, device=torch.device("cpu"), dtype=torch.float64)
    z2 = torch.randn(5, 3, dtype=torch.float64)
    src.after_step(query, z2, torch.arange(5))
    for k0, k1, q in zip(before, key.parameters(), query.parameters()):  # measured: equal (the same float32
        torch.testing.assert_close(k1, 0.9 * k0 + 0.1 * q.detach(), rtol=0, atol=1e-7)  # ops); one ulp allowed
    for bk, bq in zip(key.buffers(), query.buffers()):
        assert torch.equal(bk, bq)
    keys, idx = src.queue.negatives()
    assert torch.equal(idx.sort().values, torch.arange(5))
    torch.testing.assert_close(
        keys[idx.argsort()], torch.nn.functional.normalize(z2, dim=1), rtol=0, atol=1e-15
    )  # measured 1.1e-16


def test_queue_cell_trains_with_k_equal_to_queue_size(digits, queue_cell, queue_reference):
    res, _, logs = queue_reference
    q, bs = queue_cell["train"]["queue_size"], queue_cell["batch_size"]
    spe = steps_per_epoch(queue_cell, digits)
    assert queue_cell["negatives"] == q
    assert res.status == "finished" and math.isfinite(res.final_loss)
    ks = {s: m["diag/k"] for s, m in logs if "diag/k" in m}
    full = [s for s in ks if q // bs < s <= spe]  # queue full, still in epoch 1: no key of the anchor's own image
    assert full, "no diagnostics logged while the queue was full in epoch 1"
    assert all(ks[s] == q for s in full)
    # later epochs may mask an anchor's own old key: K never exceeds the queue and drops by < 1 per anchor
    assert all(q - 1 <= k <= q for s, k in ks.items() if s > q // bs)


# --------------------------------------------------------------------------- ESS-scheduled temperature
def test_ess_schedule_steers_tau_to_the_target_and_resumes_bitwise(tmp_path, digits, capfd):
    cell = digits_cell(epochs=1.5, log_every=5, ess_schedule={"start": 0.9, "end": 0.3, "rate": 1.0})
    logs: list[tuple[int, dict]] = []
    ref = run(cell, digits, tmp_path / "ref", log_fn=lambda m, s: logs.append((s, m)))
    lo, hi = cell["train"]["ess_schedule"]["tau_min"], cell["train"]["ess_schedule"]["tau_max"]
    targets = [m["diag/ess_target"] for _, m in logs]
    assert targets[0] > targets[-1] and all(a >= b for a, b in zip(targets, targets[1:]))
    steered = 0
    for _, m in logs:
        if lo * 1.001 < m["train/tau"] < hi * 0.999:  # not clamped: the step's ESS is the target
            assert m["diag/ess"] == pytest.approx(m["diag/ess_target"], rel=2e-3)
            steered += 1
    assert steered >= len(logs) // 2
    assert logs[-1][1]["train/tau"] < logs[0][1]["train/tau"]  # lower ESS target -> lower tau
    # tau is part of the resumable state
    spe = steps_per_epoch(cell, digits)
    with pytest.raises(KeyboardInterrupt):
        run(cell, digits, tmp_path / "cell", after_step=crash_after(spe + 5))
    capfd.readouterr()
    res = run(cell, digits, tmp_path / "cell")
    assert f"from step {spe}/" in capfd.readouterr().err
    assert res.final_loss == ref.final_loss
    assert_same_weights(weights(tmp_path / "cell" / "checkpoint.pt"), weights(tmp_path / "ref" / "checkpoint.pt"))


# --------------------------------------------------------------------------- what only a GPU (or autocast) would show
def test_bf16_autocast_does_not_reach_the_scores_or_the_loss(tmp_path, digits):
    """Under autocast `z @ z.T` would run in bf16 even after `.float()` (~2^-8 error in
    the similarities); the step computes scores and loss in fp32 outside autocast, so the
    loss equals the fp32 loss of the same embeddings."""
    from smallbatch.losses import in_batch_scores

    cell = digits_cell(epochs=1, precision="bf16")
    t = train.build_training(Cell.of(cell), digits.pretrain_x, digits.mean, digits.std, torch.device("cpu"), tmp_path)
    idx = torch.arange(32)
    u = t.step_fn.aug.draw(64, torch.Generator().manual_seed(0))
    out = t.step_fn.forward(t.images[idx], u, idx)
    assert out.z1.dtype == torch.float32 and out.scores.neg.dtype == torch.float32
    pos, neg, mask = in_batch_scores(out.z1, out.z2)
    ref = t.step_fn.loss_fn.from_scores(pos, neg, mask, temperature=cell["temperature"])
    assert torch.equal(out.scores.neg, neg) and torch.equal(out.loss.detach(), ref.loss)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # what the old step did: the guard is real
        assert in_batch_scores(out.z1, out.z2)[1].dtype == torch.bfloat16


def test_a_state_saved_on_cuda_resumes_on_a_cpu_only_machine(tmp_path, digits, main_cell, reference):
    """A state written on a GPU has its tensors tagged `cuda:0` (torch.load without a map
    location fails on a CPU-only machine).  Forged here by saving with CUDA location tags:
    the resume loads it on the CPU and, the random streams being counter-seeded, ends with
    the uninterrupted CPU run's weights."""
    import torch.serialization as ser

    ref_res, ref_w = reference
    spe = steps_per_epoch(main_cell, digits)
    with pytest.raises(KeyboardInterrupt):
        run(main_cell, digits, tmp_path, after_step=crash_after(spe + 3))
    st = train.load_checkpoint(tmp_path / "state.pt")
    st["saved_on"] = "cuda"
    real_tag = ser.location_tag
    ser.location_tag = lambda storage: "cuda:0"
    try:
        torch.save(st, tmp_path / "state.pt")
    finally:
        ser.location_tag = real_tag
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="CUDA"):
            torch.load(tmp_path / "state.pt", weights_only=False)
    res = run(main_cell, digits, tmp_path)
    assert res.steps == ref_res.steps and res.final_loss == ref_res.final_loss
    assert_same_weights(weights(tmp_path / "checkpoint.pt"), ref_w)


def test_fp16_skipped_steps_are_counted(tmp_path):
    """The GradScaler skips an update whose gradients overflow; the step counts it."""
    from smallbatch.training.step import TrainStep

    w = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([w], lr=0.1)
    step = TrainStep(torch.nn.Linear(1, 1), None, None, None, None, opt, "fp16", torch.device("cpu"))
    step.update((w * float("inf")).sum())
    assert step.skipped_steps == 1 and torch.equal(w.detach(), torch.ones(3))
    step.update((w * 2.0).sum())
    assert step.skipped_steps == 1 and not torch.equal(w.detach(), torch.ones(3))
    assert step.state_dict()["skipped_steps"] == 1


def test_tf32_and_determinism_are_explicit_settings(tmp_path, digits, monkeypatch):
    import os

    from smallbatch.study.cells import flat_params
    from smallbatch.training.step import configure_backends

    cell = digits_cell(epochs=1, tf32=True)
    configure_backends(Cell.of(cell).train, torch.device("cpu"))
    assert torch.backends.cuda.matmul.allow_tf32 and torch.get_float32_matmul_precision() == "high"
    configure_backends(Cell.of(digits_cell(epochs=1)).train, torch.device("cpu"))
    assert not torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.allow_tf32
    assert torch.get_float32_matmul_precision() == "highest"
    p = flat_params(cell)
    assert p["train.tf32"] == "True" and p["train.deterministic"] == "False" and p["train.compile"] == "False"
    assert cell["hash"] != digits_cell(epochs=1)["hash"]  # tf32 changes the numbers: another config
    assert digits_cell(epochs=1, compile=True)["hash"] == digits_cell(epochs=1)["hash"]  # compile does not
    # deterministic: the GPU's switches (set as flags; no CUDA call is made, so this runs on a CPU too)
    det = digits_cell(epochs=1, deterministic=True)
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    try:
        configure_backends(Cell.of(digits_cell(epochs=1)).train, torch.device("cuda"))
        assert not torch.backends.cudnn.deterministic and torch.backends.cudnn.benchmark  # autotuned when not asked
        assert not torch.are_deterministic_algorithms_enabled() and "CUBLAS_WORKSPACE_CONFIG" not in os.environ
        configure_backends(Cell.of(det).train, torch.device("cuda"))
        assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
        assert torch.are_deterministic_algorithms_enabled() and torch.is_deterministic_algorithms_warn_only_enabled()
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    finally:
        torch.use_deterministic_algorithms(False)
        configure_backends(Cell.of(digits_cell(epochs=1)).train, torch.device("cpu"))
    assert not torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark  # the CPU: neither
    assert flat_params(det)["train.deterministic"] == "True"
    assert det["hash"] == digits_cell(epochs=1)["hash"]  # how it runs, not what it computes


def test_the_gradient_scale_mechanism_is_logged(digits, reference_run):
    """Every logging step carries DCL's mechanism measured on the step's embeddings: the
    norms of the cell's, InfoNCE's and DCL's gradients w.r.t. the embeddings, their ratio
    (at most 1: InfoNCE's is DCL's times factors q_i <= 1) and the update size per lr."""
    _, _, logs = reference_run
    for _, m in logs:
        ratio = m["diag/grad_ratio_infonce_dcl"]
        assert 0 < ratio <= 1 and m["diag/grad_norm"] == pytest.approx(m["diag/grad_norm_infonce"])
        assert m["diag/update_per_lr"] > 0
        # the norm ratio is a gradient-weighted mean of the q_B,i: measured within 0.9 % of their plain
        # mean at every logging step of this run (q_B ~ 0.98), held to 5 %
        assert m["diag/grad_ratio_infonce_dcl"] == pytest.approx(m["diag/qb_mean"], rel=0.05)
