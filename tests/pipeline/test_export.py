"""``smallbatch export``: a trained cell's backbone as a plain state dict that loads (with
weights_only=True) into a fresh backbone -- the project's, and torchvision's where one fits,
by the very lines the command prints -- and gives the same features."""

from __future__ import annotations

import contextlib
import io
import os
import stat
from pathlib import Path

import pytest
import torch

from smallbatch.pipeline import cli
from smallbatch.pipeline.export import export_backbone, how_to_load
from smallbatch.study.cell import Cell, read_cell
from smallbatch.training.checkpoint import load_checkpoint, save_checkpoint
from smallbatch.training.models import ContrastiveModel, build_backbone

CELL_ID = "digits/infonce/bs32-t0.5-s0"
CELL = ["--dataset", "digits", "--loss", "infonce", "--batch-size", "32", "--temperature", "0.5"]


def run(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = cli.main(argv)
    return rc, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny digits cell pretrained (one epoch) and exported, under umask 022."""
    tmp = tmp_path_factory.mktemp("export")
    cfg = tmp / "study.yaml"
    cfg.write_text(
        f"study: export-test\nresults_dir: {tmp / 'results'}\ndatasets: {{digits: {{}}}}\n"
        "train: {width: 4, proj_hidden: 16, proj_dim: 8, lr: 0.003, epochs: 1, log_every: 5}\n"
    )
    threads, mask = torch.get_num_threads(), os.umask(0o022)
    try:
        rc, _, err = run(["pretrain", "--tracking-uri", "none", "--no-progress", "--config", str(cfg), *CELL])
        assert rc == 0, err
        rc, printed, err = run(["export", "--config", str(cfg), "--cell-id", CELL_ID, "--out", str(tmp / "bb.pt")])
        assert rc == 0, err
    finally:
        os.umask(mask)
        torch.set_num_threads(threads)
    return {
        "tmp": tmp,
        "cfg": cfg,
        "out": tmp / "bb.pt",
        "printed": printed,
        "run_dir": tmp / "results" / "runs" / CELL_ID,
    }


def loading_lines(printed: str) -> str:
    """The Python lines the command prints under 'to load it:'."""
    tail = printed.split("to load it:\n", 1)[1]
    return "".join(line[4:] + "\n" for line in tail.splitlines())


def reference_backbone(checkpoint: Path) -> torch.nn.Module:
    """The backbone as the project's embed step builds it from the checkpoint."""
    from smallbatch.training.loop import build_model

    ck = load_checkpoint(checkpoint, kind="checkpoint")
    model = build_model(read_cell(ck["cell"]), ck["channels"], ck["image_size"])
    model.load_state_dict(ck["model"])
    return model.backbone.eval()


def test_export_is_a_plain_state_dict_of_the_backbone(trained):
    state = torch.load(trained["out"], weights_only=True)
    assert isinstance(state, dict) and state
    assert all(isinstance(v, torch.Tensor) for v in state.values())
    assert not any(k.startswith(("backbone.", "head.")) for k in state)
    ck = load_checkpoint(trained["run_dir"] / "checkpoint.pt", kind="checkpoint")
    assert set(state) == {k[len("backbone.") :] for k in ck["model"] if k.startswith("backbone.")}


def test_the_printed_lines_load_it_into_a_fresh_backbone_with_the_same_features(trained):
    assert f"backbone of cell {CELL_ID} (small_cnn" in trained["printed"]
    scope: dict = {}
    exec(loading_lines(trained["printed"]), scope)  # noqa: S102 - the lines a user would paste
    net, ref = scope["net"], reference_backbone(trained["run_dir"] / "checkpoint.pt")
    assert "tv" not in scope  # small_cnn: no torchvision model
    x = torch.randn(16, 1, 8, 8, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(net(x), ref(x))
        fresh, _ = build_backbone("small_cnn", 1, 8, width=4)
        assert not torch.equal(fresh.eval()(x), ref(x))  # the test can fail: random weights differ


def test_export_by_run_folder_writes_the_same_weights(trained):
    out = trained["tmp"] / "by-folder.pt"
    rc, printed, err = run(["export", "--run-dir", str(trained["run_dir"]), "--out", str(out)])
    assert rc == 0, err
    a, b = torch.load(trained["out"], weights_only=True), torch.load(out, weights_only=True)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    rc, _, err = run(["export", "--run-dir", str(trained["run_dir"])])  # default: <folder>/backbone.pt
    assert rc == 0, err
    assert (trained["run_dir"] / "backbone.pt").is_file()


def test_result_files_of_a_cell_are_group_readable_under_umask_022(trained):
    files = [p for p in trained["run_dir"].rglob("*") if p.is_file()] + [trained["out"]]
    assert {"checkpoint.pt", "cell.json", "bb.pt"} <= {p.name for p in files}
    modes = {p.name: oct(stat.S_IMODE(p.stat().st_mode)) for p in files}
    assert set(modes.values()) == {"0o644"}, modes


@pytest.mark.parametrize("name,channels,grid", [("resnet18_cifar", 3, 1), ("resnet50", 1, 2)])
def test_a_resnet_loads_into_torchvisions_model(tmp_path, trained, name, channels, grid):
    ck = load_checkpoint(trained["run_dir"] / "checkpoint.pt", kind="checkpoint")
    cell = {**ck["cell"], "train": {**ck["cell"]["train"], "backbone": name, "pool_grid": grid}}
    torch.manual_seed(0)
    backbone, dim = build_backbone(name, channels, 32, pool_grid=grid)
    model = ContrastiveModel(backbone, dim, 16, 8)
    with torch.no_grad():  # BatchNorm statistics off their defaults, so loading them is tested too
        for m in model.modules():
            if isinstance(m, torch.nn.BatchNorm2d):
                m.running_mean.uniform_(-0.1, 0.1)
                m.running_var.uniform_(0.5, 1.5)
    save_checkpoint(
        tmp_path / "checkpoint.pt",
        Cell.of(cell),
        model=model.state_dict(),
        status="finished",
        channels=channels,
        image_size=32,
        mean=[0.5] * channels,
        std=[0.25] * channels,
    )
    info = export_backbone(tmp_path / "checkpoint.pt", tmp_path / "bb.pt")
    assert info["feat_dim"] == dim
    scope: dict = {}
    exec(how_to_load(info), scope)  # noqa: S102
    x = torch.randn(2, channels, 32, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model.backbone.eval()(x)
        assert torch.equal(scope["net"](x), ref)
        assert torch.equal(scope["tv"](x), ref)


def error_line(argv: list[str]) -> str:
    rc, out, err = run(argv)
    assert rc == 2, err
    (line,) = err.strip().splitlines()
    assert line.startswith("smallbatch: error: ")
    return line


def test_refusals_are_one_line(tmp_path, trained):
    cfg, run_dir = str(trained["cfg"]), str(trained["run_dir"])
    assert "--cell-id has no effect with --run-dir" in error_line(
        ["export", "--run-dir", run_dir, "--cell-id", CELL_ID, "--out", str(tmp_path / "x.pt")]
    )
    other = "digits/infonce/bs16-t0.5-s0"
    line = error_line(
        [
            "export",
            "--config",
            cfg,
            "--dataset",
            "digits",
            "--loss",
            "infonce",
            "--batch-size",
            "16",
            "--temperature",
            "0.5",
            "--checkpoint",
            str(trained["run_dir"] / "checkpoint.pt"),
            "--out",
            str(tmp_path / "x.pt"),
        ]
    )
    assert CELL_ID in line and other in line
    ck = load_checkpoint(trained["run_dir"] / "checkpoint.pt", kind="checkpoint")
    save_checkpoint(
        tmp_path / "diverged.pt",
        Cell.of(ck["cell"]),
        model=ck["model"],
        status="diverged",
        channels=ck["channels"],
        image_size=ck["image_size"],
    )
    assert "diverged" in error_line(
        [
            "export",
            "--run-dir",
            str(tmp_path),
            "--checkpoint",
            str(tmp_path / "diverged.pt"),
            "--out",
            str(tmp_path / "x.pt"),
        ]
    )
    assert "does not exist" in error_line(
        ["export", "--run-dir", str(tmp_path / "none"), "--out", str(tmp_path / "x.pt")]
    )
    assert not (tmp_path / "x.pt").exists()


def test_a_backbone_with_nan_weights_is_refused(tmp_path, trained):
    """A checkpoint whose backbone holds a NaN (a 'finished' cell whose weights broke) exports
    nothing: one line naming the checkpoint and the first tensor."""
    ck = load_checkpoint(trained["run_dir"] / "checkpoint.pt", kind="checkpoint")
    model = {k: v.clone() for k, v in ck["model"].items()}
    name = next(k for k, v in model.items() if k.startswith("backbone.") and v.is_floating_point())
    model[name].view(-1)[0] = float("nan")
    save_checkpoint(
        tmp_path / "checkpoint.pt",
        Cell.of(ck["cell"]),
        model=model,
        status="finished",
        channels=ck["channels"],
        image_size=ck["image_size"],
    )
    line = error_line(["export", "--run-dir", str(tmp_path), "--out", str(tmp_path / "x.pt")])
    assert f"checkpoint {tmp_path / 'checkpoint.pt'} of cell {CELL_ID}: 1 of the backbone's" in line, line
    assert f"(first: {name[len('backbone.') :]}); refused" in line, line
    assert not (tmp_path / "x.pt").exists()


def test_the_default_export_never_replaces_an_existing_file(tmp_path, trained):
    """`smallbatch export` without --out writes <cell folder>/backbone.pt, once: a second export
    (or a file of the user's there) is refused, the file kept."""
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / "checkpoint.pt").write_bytes((trained["run_dir"] / "checkpoint.pt").read_bytes())
    (folder / "backbone.pt").write_text("mine\n")
    line = error_line(["export", "--run-dir", str(folder)])
    assert (
        line
        == f"smallbatch: error: {folder / 'backbone.pt'}: exists; refused (never overwritten): remove it or choose another path"
    )
    assert (folder / "backbone.pt").read_text() == "mine\n"
