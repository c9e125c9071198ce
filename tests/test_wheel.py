"""The package where users install it: a wheel built from the repository's files, installed
into a fresh virtual environment outside the checkout, plans the default study and runs one
digits cell (pretrain, evaluate, tracked in MLflow) from a folder outside the checkout;
``smallbatch.results`` reads that cell back and ``smallbatch report`` builds its report.

The fresh environment has no ``PYTHONPATH`` and no access to the checkout: it reaches the
test environment's dependencies (torch, MLflow, ...) through one ``.pth`` line naming their
site-packages, whose own ``.pth`` files -- the editable install of the checkout among them --
Python does not run for a folder a ``.pth`` line adds.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest
from cluster import HANG_S

ROOT = Path(__file__).resolve().parents[1]
#: the top-level packages under src/ that the wheel must hold, every file of them
PACKAGES = ("smallbatch", "snakemake_logger_plugin_smallbatch")

pytestmark = pytest.mark.slow


def _run(argv: list, cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(a) for a in argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=HANG_S)
    assert proc.returncode == 0, f"{' '.join(map(str, argv))}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    return proc


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> dict:
    """The wheel, a fresh venv holding it, and a working folder outside the checkout."""
    tmp = tmp_path_factory.mktemp("wheel")
    # built from a copy: setuptools writes build/ and *.egg-info beside the sources; the package's
    # links (resources/study -> the checkout's workflow files) stay links, as in a checkout
    tree = tmp / "tree"
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info")
    shutil.copytree(ROOT / "src", tree / "src", symlinks=True, ignore=ignore)
    linked = {os.readlink(p).split("/")[-1] for p in (ROOT / "src" / "smallbatch" / "resources" / "study").iterdir()}
    for name in ("pyproject.toml", "README.md", *linked):
        copy = shutil.copytree if (ROOT / name).is_dir() else shutil.copy2
        copy(ROOT / name, tree / name)
    dist = tmp / "dist"
    pip = [sys.executable, "-m", "pip", "-q", "--disable-pip-version-check"]
    _run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", dist, tree], cwd=tmp)
    (wheel,) = dist.glob("smallbatch-*.whl")

    venv = tmp / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", venv], cwd=tmp)
    py = venv / "bin" / "python"
    purelib = _run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], cwd=tmp).stdout.strip()
    ours = dict.fromkeys(sysconfig.get_paths()[k] for k in ("purelib", "platlib"))  # one folder, or two
    Path(purelib, "test-dependencies.pth").write_text("".join(f"{p}\n" for p in ours))
    _run([*pip, "--python", py, "install", "--no-deps", "--no-index", wheel], cwd=tmp)

    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    work = tmp / "work"
    work.mkdir()
    return {"wheel": wheel, "venv": venv, "py": py, "env": env, "work": work}


def test_the_wheel_holds_every_file_of_the_packages(installed):
    with zipfile.ZipFile(installed["wheel"]) as zf:
        held = set(zf.namelist())
    files = {
        p.relative_to(ROOT / "src").as_posix()
        for pkg in PACKAGES
        for p in (ROOT / "src" / pkg).rglob("*")
        if p.is_file() and "__pycache__" not in p.parts
    }
    assert {"smallbatch/resources/config.schema.yaml", "smallbatch/resources/paper_results.csv"} <= files
    assert files - held == set()


def test_the_installed_package_is_the_wheels_not_the_checkout(installed):
    code = (
        "import json, smallbatch, snakemake_logger_plugin_smallbatch as plugin\n"
        "from smallbatch.study.schema import schema_path\n"
        "print(json.dumps([smallbatch.__file__, plugin.__file__, str(schema_path())]))"
    )
    paths = json.loads(_run([installed["py"], "-c", code], cwd=installed["work"], env=installed["env"]).stdout)
    for p in paths:
        assert Path(p).resolve().is_relative_to(installed["venv"].resolve()), p
    version = _run(["smallbatch", "--version"], cwd=installed["work"], env=installed["env"]).stdout
    assert version.strip() == f"smallbatch {installed['wheel'].name.split('-')[1]}"


def test_the_installed_command_plans_a_study_and_runs_a_digits_cell(installed):
    work, env = installed["work"], installed["env"]
    shutil.copy2(ROOT / "config.yaml", work / "config.yaml")
    planned = _run(["smallbatch", "cells", "--config", "config.yaml"], cwd=work, env=env)
    here = _run([sys.executable, "-m", "smallbatch", "cells", "--config", "config.yaml"], cwd=work)
    assert planned.stdout == here.stdout and planned.stdout.count("\n") >= 10  # the checkout's cells
    assert planned.stderr.strip().splitlines()[-1].endswith("baselines")  # "N cells, M baselines"

    (work / "tiny.yaml").write_text(
        f"study: wheel\nresults_dir: {work / 'results'}\n"
        "datasets: {digits: {}}\n"
        "train: {width: 4, proj_hidden: 16, proj_dim: 8, lr: 0.003, epochs: 1, log_every: 5}\n"
        "eval: {knn_k: [5, 20], linear_iterations: 20}\n"
    )
    uri = f"sqlite:///{work / 'mlflow.db'}"
    cell = ["--config", "tiny.yaml", "--dataset", "digits", "--loss", "infonce", "--batch-size", "32"]
    cell += ["--temperature", "0.5"]
    _run(["smallbatch", "init-store", "--tracking-uri", uri, "--experiment", "wheel"], cwd=work, env=env)
    trained = _run(["smallbatch", "pretrain", "--tracking-uri", uri, "--no-progress", *cell], cwd=work, env=env)
    assert json.loads(trained.stdout.strip().splitlines()[-1])["status"] == "finished"
    evaluated = _run(["smallbatch", "evaluate", "--tracking-uri", uri, *cell], cwd=work, env=env)
    knn = json.loads(evaluated.stdout.strip().splitlines()[-1])["knn"]
    assert knn["status"] == "finished"

    code = (
        "import json, sys, smallbatch\n"
        "df = smallbatch.results(sys.argv[1])\n"
        "print(json.dumps(df[['cell_id', 'status', 'metrics.knn/top1']].to_dict('records')))"
    )
    rows = json.loads(_run([installed["py"], "-c", code, uri], cwd=work, env=env).stdout)
    assert rows == [
        {"cell_id": "digits/infonce/bs32-t0.5-s0", "status": "finished", "metrics.knn/top1": knn["knn/top1"]}
    ]
    # the report reads the papers' numbers from the package's data (resources/paper_results.csv)
    _run(["smallbatch", "report", "--tracking-uri", uri, "--out", "report"], cwd=work, env=env)
    assert "digits/infonce/bs32-t0.5-s0" in (work / "report" / "tables" / "cost_runs.csv").read_text()
    assert (work / "report" / "tables" / "papers_reported.csv").stat().st_size > 0


def test_the_installed_package_writes_a_study_folder_that_snakemake_plans(installed):
    work, env = installed["work"], installed["env"]
    _run(["smallbatch", "init-study", "study"], cwd=work, env=env)
    assert (work / "study" / "Snakefile").read_bytes() == (ROOT / "Snakefile").read_bytes()
    cells = _run(["smallbatch", "cells", "--config", "config.yaml"], cwd=work / "study", env=env)
    n_cells = int(cells.stderr.strip().splitlines()[-1].split()[0])  # "N cells, M baselines"
    plan = _run([installed["py"], "-m", "snakemake", "-n"], cwd=work / "study", env=env)
    jobs = dict(line.split() for line in plan.stdout.splitlines() if re.fullmatch(r"\w+ +\d+", line.strip()))
    assert int(jobs["pretrain"]) == int(jobs["evaluate"]) == n_cells > 10
    again = subprocess.run(["smallbatch", "init-study", "study"], cwd=work, env=env, capture_output=True, text=True)
    assert again.returncode == 2 and "exists and is not empty" in again.stderr  # never over a study


#: a loss plugin as a researcher writes it: a package whose entry point names its spec (no torch),
#: the loss class beside it (an additive margin on the positive's cosine, AM-Softmax style)
PLUGIN = {
    "pyproject.toml": """\
[build-system]
requires = ["setuptools>=77"]
build-backend = "setuptools.build_meta"

[project]
name = "margin-nce"
version = "0.1"
dependencies = ["smallbatch"]

[project.entry-points."smallbatch.losses"]
margin_nce = "margin_nce.spec:SPEC"

[project.entry-points."smallbatch.datasets"]
digits_mirror = "margin_nce.mirror:DATASET"

[project.entry-points."smallbatch.probes"]
centroid = "margin_nce.centroid:SPEC"
""",
    "margin_nce/__init__.py": "",
    "margin_nce/spec.py": """\
from smallbatch.losses.registry import LossSpec

MARGIN = {"type": "number", "minimum": 0, "maximum": 1, "default": 0.2, "description": "Margin-NCE: the margin"}
SPEC = LossSpec(
    name="margin_nce",
    display="Margin-NCE",
    paper="InfoNCE with an additive margin on the positive",
    impl="margin_nce.loss:MarginNCE",
    params={"margin": MARGIN},
)
""",
    "margin_nce/loss.py": """\
from smallbatch.losses import ContrastiveLoss, infonce_rows


class MarginNCE(ContrastiveLoss, spec="margin_nce"):
    def _rows(self, pos, neg, neg_mask, tau, batch_pos):
        rows = infonce_rows(pos - self.margin, neg, neg_mask, tau)
        return rows, rows
""",
    "margin_nce/mirror.py": """\
import hashlib

import numpy as np
from smallbatch.data.registry import DatasetPlugin, DatasetSpec

SIZES = {"train": 1437, "test": 360}


def images():
    from sklearn.datasets import load_digits

    bunch = load_digits()
    return np.ascontiguousarray((bunch.images[:, :, ::-1] * 255 / 16).round().astype(np.uint8)), bunch.target


def read(spec, root, download, image_size):
    x, y = images()
    return {"train_x": x[:1437], "train_y": y[:1437], "test_x": x[1437:], "test_y": y[1437:], "channels_last": False,
            "num_classes": 10, "classes": [str(i) for i in range(10)], "source": "digits, mirrored"}


def digest(root):
    return "sha256:" + hashlib.sha256(images()[0].tobytes()).hexdigest()[:16]


SPEC = DatasetSpec(name="digits_mirror", display="Mirrored digits", reader="digits_mirror", sizes=SIZES, classes=10)
DATASET = DatasetPlugin(spec=SPEC, read=read, digest=digest)
""",
    "margin_nce/centroid.py": """\
import numpy as np
from smallbatch.study.probe_registry import ProbeSpec


def run(features, settings):
    xtr, ytr, xte, yte = (np.asarray(f, dtype=np.float64) for f in features)
    means = np.stack([xtr[ytr == c].mean(axis=0) for c in range(int(ytr.max()) + 1)])
    guess = np.argmin(((xte[:, None, :] - means[None]) ** 2).sum(-1), axis=1)
    return {"top1": float(np.mean(guess == yte)), "shrink": float(settings["centroid_shrink"])}


SHRINK = {"type": "number", "minimum": 0, "default": 0.0, "description": "centroid: a setting of its own"}
SPEC = ProbeSpec(name="centroid", title="nearest class mean", impl="margin_nce.centroid:run", metric="top1",
                 label="centroid top-1", settings=("centroid_shrink",), params={"centroid_shrink": SHRINK})
""",
}
#: a study reading the plugin's loss, its parameters and cells, printing whether torch was loaded
READ_PLUGIN_STUDY = """
import json, sys
from smallbatch.study.cells import expand_cells
from smallbatch.study.config import load_config
print(json.dumps([sorted(expand_cells(load_config(sys.argv[1]))), "torch" in sys.modules]))
"""


def test_a_loss_a_data_set_and_a_probe_plugin_installed_beside_the_package_run_a_cell(installed, tmp_path):
    work, env, py = installed["work"] / "plugin", installed["env"], installed["py"]
    work.mkdir()
    for name, text in PLUGIN.items():
        (tmp_path / "plugin" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "plugin" / name).write_text(text)
    pip = [sys.executable, "-m", "pip", "-q", "--disable-pip-version-check", "--python", py]
    _run([*pip, "install", "--no-deps", "--no-build-isolation", "--no-index", tmp_path / "plugin"], cwd=work)
    checked = _run(["smallbatch", "check-loss", "margin_nce"], cwd=work, env=env)
    assert checked.stdout.startswith("margin_nce: keeps the contract (build, shape, finite, gradient, temperature")

    (work / "tiny.yaml").write_text(
        f"study: plugin\nresults_dir: {work / 'results'}\nbaselines: false\n"
        "datasets: {digits_mirror: {}}\n"
        "grid: {losses: [{name: margin_nce, margin: [0.3]}], batch_sizes: [32], temperatures: [0.5], seeds: [0]}\n"
        "train: {width: 4, proj_hidden: 16, proj_dim: 8, lr: 0.003, epochs: 1, log_every: 5}\n"
        "eval: {knn_k: [5, 20], linear_iterations: 20, probes: [knn, linear, centroid], centroid_shrink: 0.5}\n"
    )
    cell_id = "digits_mirror/margin_nce-margin0.3/bs32-t0.5-s0"
    assert json.loads(_run([py, "-c", READ_PLUGIN_STUDY, "tiny.yaml"], cwd=work, env=env).stdout) == [[cell_id], False]
    reference = _run(["smallbatch", "config-reference"], cwd=work, env=env).stdout
    assert "Margin-NCE: the margin" in reference  # CONFIGURATION.md as this install generates it
    assert "digits_mirror" in _run(["smallbatch", "prepare-data", "--help"], cwd=work, env=env).stdout

    # the study through the workflow, from a folder init-study wrote: its cell, the report, the store
    _run(["smallbatch", "init-study", "study"], cwd=work, env=env)
    (work / "study" / "tiny.yaml").write_text((work / "tiny.yaml").read_text())
    _run([py, "-m", "snakemake", "--cores", "1", "--configfile", "tiny.yaml"], cwd=work / "study", env=env)
    code = (
        "import json, sys, smallbatch\n"
        "df = smallbatch.results(sys.argv[1])\n"
        "df = df[df['cell_id'] == sys.argv[2]]\n"
        "cols = ['status', 'params.loss', 'params.loss.margin', 'params.data_digest', 'metrics.centroid/shrink']\n"
        "print(json.dumps(df[cols].to_dict('records')))"
    )
    uri = f"sqlite:///{work / 'results' / 'mlflow.db'}"
    rows = json.loads(_run([py, "-c", code, uri, cell_id], cwd=work, env=env).stdout)
    digest = _run([py, "-c", "from margin_nce import mirror; print(mirror.digest(None))"], cwd=work, env=env).stdout
    assert rows == [
        {
            "status": "finished",
            "params.loss": "margin_nce",
            "params.loss.margin": "0.3",
            "params.data_digest": digest.strip(),
            "metrics.centroid/shrink": 0.5,
        }
    ]
    index = (work / "results" / "report" / "index.md").read_text()
    assert "Margin-NCE" in index and "Mirrored digits" in index  # the plugins' display names
