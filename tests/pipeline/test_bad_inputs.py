"""Bad inputs a user meets, in one table: each must stop with ONE line naming the problem.

Every row is (case, how to trigger it, a regex of the whole line expected).  The command line runs
in-process (``smallbatch.pipeline.cli.main``, fast): exit status 2, exactly one stderr line
``smallbatch: error: <expected>``, no traceback anywhere.  The rows marked ``snakemake``
run ``python -m snakemake -n`` in a real process (seconds each, marked slow): it must fail
before any job, and apart from Snakemake's own frame (the profile line, ``WorkflowError in
file ...``, ``  File ...``) print exactly the line ``config error: <expected>``.

``{tmp}`` in a row's arguments and files is the test's temporary folder, which is also
the working directory.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from cluster import as_foreground

from smallbatch.pipeline import cli

ROOT = Path(__file__).resolve().parents[2]
SMOKE = str(ROOT / "workflow" / "configs" / "smoke.yaml")
BIN = Path(sys.executable).parent


def study(grid: str = "batch_sizes: [16], temperatures: [0.1]", extra: str = "", dataset: str = "digits: {}") -> str:
    """A small study config: one data set, InfoNCE, seed 0, the given grid keys and extra lines."""
    return f"datasets: {{{dataset}}}\ngrid: {{losses: [infonce], seeds: [0], {grid}}}\n{extra}"


STUDY = study()  # one digits cell
#: a 0.5-kB YAML alias bomb as the value of a known key: nine anchors, each ten aliases of the one
#: before, expand to 10^8 values (refused before anything walks them)
ALIAS_BOMB = (
    "study: {a0: &a0 [x, x, x, x, x, x, x, x, x, x], "
    + ", ".join(f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, 9))
    + "}\n"
)
CELLS = ("cells", "--config", "{tmp}/c.yaml")
PRETRAIN = ("pretrain", "--tracking-uri", "none", "--out", "{tmp}/out", "--dataset", "digits", "--loss")
TRACKING_HINT = (
    r"MLflow has no tracking store for the scheme 'foo'; use sqlite:///PATH, http\(s\)://HOST:PORT, "
    r"postgresql://, mysql://, mssql:// or databricks"
)


@dataclass(frozen=True)
class Case:
    name: str
    argv: tuple[str, ...]  # smallbatch's arguments, or snakemake's
    expect: str  # regex of the whole error line
    files: dict[str, str] = field(default_factory=dict)  # written under {tmp} first
    setup: Callable | None = None  # (tmp_path, monkeypatch) -> None, before the command
    snakemake: bool = False  # run `python -m snakemake` in a process
    env: dict[str, str] = field(default_factory=dict)  # snakemake rows: extra environment


# --------------------------------------------------------------------------- setups
def no_network(tmp: Path, mp: pytest.MonkeyPatch) -> None:
    """Name resolution fails as on a machine without network (whatever this one has)."""

    def fail(*args, **kwargs):
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    mp.setattr(socket, "getaddrinfo", fail)


def tracking_env(tmp: Path, mp: pytest.MonkeyPatch) -> None:
    mp.setenv("MLFLOW_TRACKING_URI", "foo://bar")


def no_http_retries(tmp: Path, mp: pytest.MonkeyPatch) -> None:
    mp.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")


#: how long the impostor server below serves at most: far longer than a row takes
IMPOSTOR_S = 120.0


def mlflow_impostor(tmp: Path, mp: pytest.MonkeyPatch) -> None:
    """$MLFLOW_TRACKING_URI: an HTTP server on 127.0.0.1 answering ``200 {}`` to every request,
    no MLflow; it stops itself once :data:`IMPOSTOR_S` have passed."""
    import http.server
    import threading
    import time

    class Handler(http.server.BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def _any(self):
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"{}")

        do_GET = do_POST = do_PATCH = do_DELETE = _any

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    httpd.daemon_threads, httpd.timeout, end = True, 0.2, time.monotonic() + IMPOSTOR_S

    def serve() -> None:
        with httpd:
            while time.monotonic() < end:
                httpd.handle_request()

    threading.Thread(target=serve, daemon=True).start()
    mp.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{httpd.server_address[1]}")


def existing_store(tmp: Path, mp: pytest.MonkeyPatch) -> None:
    """A real SQLite store with the schema and one experiment, opened read-only by the row."""
    assert cli.main(["init-store", "--tracking-uri", f"sqlite:///{tmp}/mlflow.db", "--experiment", "study"]) == 0


def store_of_format_1(tmp: Path, mp: pytest.MonkeyPatch) -> None:
    """A real SQLite store whose experiment says it was written in format 1."""
    from mlflow import MlflowClient

    existing_store(tmp, mp)
    client = MlflowClient(f"sqlite:///{tmp}/mlflow.db")
    client.set_experiment_tag(client.get_experiment_by_name("study").experiment_id, "smallbatch.format", "1")


def cell_file_without(key: str | None) -> Callable:
    """A real cell file of the one-cell study, without ``key``."""

    def write(tmp: Path, mp: pytest.MonkeyPatch) -> None:
        from smallbatch.study.cells import expand_cells
        from smallbatch.study.config import load_config

        (tmp / "c.yaml").write_text(STUDY)
        cell = next(iter(expand_cells(load_config(tmp / "c.yaml")).values()))
        cell.pop(key, None)
        (tmp / "cell.json").write_text(json.dumps(cell))

    return write


def image_folder(tmp: Path, mp: pytest.MonkeyPatch) -> None:
    """An ImageNet-style tree of 2 classes x 3 tiny images in train/ and val/."""
    from PIL import Image

    for split in ("train", "val"):
        for c in ("cat", "dog"):
            (tmp / "folder" / split / c).mkdir(parents=True)
            for i in range(3):
                Image.new("RGB", (8, 8), (40 * i, 0, 0)).save(tmp / "folder" / split / c / f"{i}.png")


def a_file(tmp: Path, mp: pytest.MonkeyPatch) -> None:
    (tmp / "afile").write_text("not a folder\n")


def a_fifo(name: str) -> Callable:
    return lambda tmp, mp: os.mkfifo(tmp / name)


def a_folder(name: str) -> Callable:
    return lambda tmp, mp: (tmp / name).mkdir(parents=True)


def cell_file_with_id_twice(tmp: Path, mp: pytest.MonkeyPatch) -> None:
    """A real cell file of the one-cell study whose text names a second ``id`` (JSON readers keep the last)."""
    from smallbatch.study.cells import expand_cells
    from smallbatch.study.config import load_config

    (tmp / "c.yaml").write_text(STUDY)
    text = json.dumps(next(iter(expand_cells(load_config(tmp / "c.yaml")).values())))
    (tmp / "cell.json").write_text('{"id": "digits/infonce/bs16-t0.1-s1", ' + text[1:])


def one_loss(loss: str, params: str = "", temperature: str = "0.1") -> str:
    """A one-cell digits study of ``loss`` with ``loss_params`` of it (flow YAML, may be empty)."""
    extra = f"loss_params: {{{loss}: {{{params}}}}}\n" if params else ""
    return f"datasets: {{digits: {{}}}}\ngrid: {{losses: [{loss}], batch_sizes: [16], temperatures: [{temperature}], seeds: [0]}}\n{extra}"


#: digits' 1,437 pretraining images make 89 steps an epoch at batch 16
CELL = r"cell 'digits/infonce/bs16-t0\.1-s0': "
SNAPSHOTS = "lr_schedule: constant, snapshot_epochs: "
THOUSAND = "[" + ", ".join(f"{i / 100:g}" for i in range(1, 1001)) + "]"  # 0.01 .. 10 epochs


def deleted_working_folder(tmp: Path, mp: pytest.MonkeyPatch) -> None:
    (tmp / "gone").mkdir()
    mp.chdir(tmp / "gone")
    os.rmdir(tmp / "gone")


def unwritable_folders(tmp: Path, mp: pytest.MonkeyPatch) -> None:
    """Every new file is refused as in a read-only folder (whoever runs the tests, root included)."""
    import tempfile

    def refuse(prefix: str = "", suffix: str = "", dir: str | None = None, **kw):
        raise PermissionError(13, "Permission denied", os.path.join(str(dir), f"{prefix}x1y2z3{suffix}"))

    mp.setattr(tempfile, "mkstemp", refuse)


def deeply_nested(name: str, opening: str, closing: str, before: str = "") -> Callable:
    return lambda tmp, mp: (tmp / name).write_text(before + opening * 100_000 + closing * 100_000 + "\n")


#: a PID above Linux's largest (2^22): never a running process
DEAD_PID = str(2**22 + 1)
TINY_CELL = ("infonce", "--batch-size", "16", "--temperature", "0.5")


# --------------------------------------------------------------------------- the table
CASES = [
    # --- temperatures: .nan / .inf pass every JSON-schema bound, so they are caught as not finite
    Case(
        "temperature nan in the grid",
        CELLS,
        r"config key 'grid\.temperatures\[0\]' = nan is not a finite number",
        {"c.yaml": study("batch_sizes: [16], temperatures: [.nan]")},
    ),
    Case(
        "temperature inf in the grid",
        CELLS,
        r"config key 'grid\.temperatures\[0\]' = inf is not a finite number",
        {"c.yaml": study("batch_sizes: [16], temperatures: [.inf]")},
    ),
    Case(
        "temperature nan in a side experiment",
        CELLS,
        r"config key 'experiments\.tsweep\.temperatures\[1\]' = nan is not a finite number",
        {"c.yaml": STUDY + "experiments: {tsweep: {enabled: true, temperatures: [0.1, .nan]}}\n"},
    ),
    Case(
        "temperature inf in a loss entry",
        CELLS,
        r"config key 'grid\.losses\[0\]\.temperatures\[0\]' = inf is not a finite number",
        {"c.yaml": "datasets: {digits: {}}\ngrid: {losses: [{name: dclw, temperatures: [.inf]}]}\n"},
    ),
    Case(
        "--temperature inf",
        (*PRETRAIN, "infonce", "--batch-size", "16", "--temperature", "inf"),
        r"--temperature τ = inf is outside \[0\.001, 100\], where the losses stop being meaningful .*",
    ),
    Case(
        "--temperature nan",
        (*PRETRAIN, "infonce", "--batch-size", "16", "--temperature", "nan"),
        r"--temperature τ = nan is outside \[0\.001, 100\], where the losses stop being meaningful .*",
    ),
    Case(
        "loss parameter nan in loss_params",
        CELLS,
        r"config key 'loss_params\.dclw\.sigma' = nan is not a finite number",
        {"c.yaml": STUDY + "loss_params: {dclw: {sigma: .nan}}\n"},
    ),
    Case(
        "loss parameter inf its schema refuses",
        CELLS,
        r"config key 'loss_params\.eqco\.alpha' = inf is not a finite number",
        {
            "c.yaml": "datasets: {digits: {}}\ngrid: {losses: [eqco], batch_sizes: [16], temperatures: [0.1], seeds: [0]}\n"
            "loss_params: {eqco: {alpha: .inf}}\n"
        },
    ),
    # --- every check a job makes of a cell's settings runs when the study is planned
    Case(
        "a snapshot past a fixed steps budget",
        CELLS,
        CELL + r"train\.snapshot_epochs 1 is step 89, past the cell's 12 steps; use budgets within it",
        {"c.yaml": STUDY + "train: {steps: 12, " + SNAPSHOTS + "[1]}\n"},
    ),
    Case(
        "two snapshots on one step",
        CELLS,
        CELL + r"train\.snapshot_epochs 0\.5 and 0\.501 are both step 45 \(89 steps per epoch\); give each budget a "
        r"step of its own",
        {"c.yaml": STUDY + "train: {epochs: 2, " + SNAPSHOTS + "[0.5, 0.501]}\n"},
    ),
    Case(
        "1,000 snapshots on a 12-step cell",
        CELLS,
        # 0.04 x 89 = 3.56 and 0.05 x 89 = 4.45 both round to step 4
        CELL + r"train\.snapshot_epochs 0\.04 and 0\.05 are both step 4 \(89 steps per epoch\); .*",
        {"c.yaml": STUDY + "train: {steps: 12, " + SNAPSHOTS + THOUSAND + "}\n"},
    ),
    Case(
        "a snapshot of the untrained weights",
        CELLS,
        CELL + r"train\.snapshot_epochs 1e-06 is less than half of one of the cell's 89 steps per epoch \(it would "
        r"save the untrained weights\); use at least 0\.00562",
        {"c.yaml": STUDY + "train: {" + SNAPSHOTS + "[1.0e-6]}\n"},
    ),
    Case(
        "kcl t 1e308",
        CELLS,
        r"config key 'loss_params\.kcl\.t' = 1e\+308 is out of range; it must be <= 20",
        {"c.yaml": one_loss("kcl", "t: 1.0e+308")},
    ),
    Case(
        "siglip bias_init 1e30",
        CELLS,
        r"config key 'loss_params\.siglip\.bias_init' = 1e\+30 is out of range; it must be <= 100(\.0)?",
        {"c.yaml": one_loss("siglip", "bias_init: 1.0e+30")},
    ),
    Case(
        "vicreg with every weight 0",
        CELLS,
        r"cell 'digits/vicreg[^']*/bs16-t0\.1-s0': VICReg's lam, mu, nu are all 0 \(the loss is 0 and nothing trains\); "
        r"give one of them a weight",
        {"c.yaml": one_loss("vicreg", "lam: 0, mu: 0, nu: 0")},
    ),
    Case(
        "byol ema 1",
        CELLS,
        r"config key 'loss_params\.byol\.ema' = 1 is out of range; it must be < 1",
        {"c.yaml": one_loss("byol", "ema: 1")},
    ),
    Case(
        "train.moco_momentum 1.0",
        CELLS,
        r"config key 'train\.moco_momentum' = 1\.0 is out of range; it must be < 1",
        {"c.yaml": STUDY + "train: {queue_size: 64, moco_momentum: 1.0}\n"},
    ),
    Case(
        "byol ema a hair below 1, 1 at batch 16 under ema_scaling samples",
        CELLS,
        r"cell 'digits/byol[^']*/bs16-t0\.1-s0': byol's ema at batch 16 is 1 under train\.ema_scaling samples "
        r"\(its value at batch 256 to the power 16/256, rounded\); choose a value farther below 1 or "
        r"train\.ema_scaling: none",
        {"c.yaml": one_loss("byol", "ema: 0.9999999999999999") + "train: {ema_scaling: samples}\n"},
    ),
    Case(
        "train.moco_momentum a hair below 1, 1 at batch 16 under ema_scaling samples",
        CELLS,
        r"cell 'digits/infonce/bs16-t0\.1-s0': train\.moco_momentum at batch 16 is 1 under train\.ema_scaling "
        r"samples \(its value at batch 256 to the power 16/256, rounded\); choose a value farther below 1 or "
        r"train\.ema_scaling: none",
        {"c.yaml": STUDY + "train: {queue_size: 64, moco_momentum: 0.9999999999999999, ema_scaling: samples}\n"},
    ),
    Case(
        "isogclr at a tau below its tau_min",
        CELLS,
        r"cell 'digits/isogclr/bs16-t0\.01-s0': iSogCLR starts its learnt τ at the cell's temperature 0\.01, below its "
        r"tau_min = 0\.05, which it never goes under; choose a temperature >= 0\.05 or a lower tau_min",
        {"c.yaml": one_loss("isogclr", temperature="0.01")},
    ),
    Case(
        "lrsweep without rates",
        CELLS,
        r"config key 'experiments\.lrsweep' has 1 of the 2 different learning rates it needs \(0\.001\): give it "
        r"axes: \{lr: \[\.\.\.\]\}",
        {"c.yaml": STUDY + "experiments: {lrsweep: {enabled: true, batch_sizes: [16, 32]}}\n"},
    ),
    Case(
        "lrsweep of one batch size",
        CELLS,
        r"config key 'experiments\.lrsweep' has 1 of the 2 different batch sizes it needs \(16\): give it "
        r"batch_sizes: \[\.\.\.\] \(the exponent is fitted across them\)",
        {"c.yaml": STUDY + "experiments: {lrsweep: {enabled: true, axes: {lr: [0.001, 0.002]}}}\n"},
    ),
    Case(
        "ksweep without a queue axis",
        CELLS,
        r"config key 'experiments\.ksweep' has 1 of the 2 different queue sizes K it needs \(0\): give it axes: "
        r"\{queue_size: \[\.\.\.\]\}",
        {"c.yaml": STUDY + "experiments: {ksweep: {enabled: true}}\n"},
    ),
    Case(
        "instrument with none of its arms",
        CELLS,
        r"config key 'experiments\.instrument' has 0 of the 2 different batch sizes of plain InfoNCE arms it needs "
        r"\(none\): .*",
        {"c.yaml": STUDY + "experiments: {instrument: {enabled: true, losses: [dcl], batch_sizes: [16, 32]}}\n"},
    ),
    Case(
        "tsweep of one tau",
        CELLS,
        r"config key 'experiments\.tsweep' has 1 of the 2 different temperatures it needs \(0\.1\): give it "
        r"temperatures: \[\.\.\.\]",
        {"c.yaml": STUDY + "experiments: {tsweep: {enabled: true}}\n"},
    ),
    Case(
        "the grid off and no experiment",
        CELLS,
        r"the study plans 0 cells: config key 'grid\.enabled' is false and no side experiment is enabled; enable "
        r"the grid or a side experiment",
        {"c.yaml": "datasets: {digits: {}}\ngrid: {enabled: false}\n"},
    ),
    *(
        Case(
            f"study holding {what}",
            CELLS,
            rf"config key 'study' = 'a\\x{code}b' holds a control character; rename it",
            {"c.yaml": STUDY + f'study: "a\\{escape}b"\n'},
        )
        for what, escape, code in (("NUL", "0", "00"), ("ESC", "e", "1b"))
    ),
    Case(
        "--experiment holding ESC",
        ("init-store", "--tracking-uri", "sqlite:///{tmp}/m.db", "--experiment", "a\x1bb"),
        r"--experiment = 'a\\x1bb' holds a control character; rename it",
    ),
    Case(
        "--tracking-uri with a leading space",
        ("init-store", "--tracking-uri", " sqlite:///{tmp}/m.db", "--experiment", "x"),
        r"--tracking-uri = ' sqlite:///.*/m\.db' starts or ends with a space, which would be read as part of the "
        r"URI; remove it",
    ),
    Case(
        "data.root ''",
        CELLS,
        r"config key 'data\.root' is empty \(it would name the current folder\); name a file or folder",
        {"c.yaml": STUDY + "data: {root: ''}\n"},
    ),
    Case(
        "tracking_uri with a leading space",
        CELLS,
        r"config key 'tracking_uri' = ' sqlite:///x\.db' starts or ends with a space, which would be read as part "
        r"of the URI; remove it",
        {"c.yaml": STUDY + "tracking_uri: ' sqlite:///x.db'\n"},
    ),
    *(
        Case(
            f"{key} {value}",
            CELLS,
            rf"config key '{re.escape(key)}' = {re.escape(shown)} is out of range; it must be {re.escape(bound)}",
            {"c.yaml": study(dataset=dataset) + text},
        )
        for key, value, shown, bound, text, dataset in (
            ("train.width", "1e6", "1000000", "<= 1024", "train: {width: 1000000}\n", "digits: {}"),
            ("train.proj_dim", "1e9", "1000000000", "<= 65536", "train: {proj_dim: 1000000000}\n", "digits: {}"),
            (
                "loss_params.simsiam.pred_hidden",
                "1e9",
                "1000000000",
                "<= 65536",
                "loss_params: {simsiam: {pred_hidden: 1000000000}}\n",
                "digits: {}",
            ),
            ("datasets.digits.image_size", "100000", "100000", "<= 1024", "", "digits: {image_size: 100000}"),
            ("eval.fewshot_draws", "1e9", "1000000000", "<= 1000", "eval: {fewshot_draws: 1000000000}\n", "digits: {}"),
            ("train.lr", "1e300", "1e+300", "<= 1000000.0", "train: {lr: 1.0e+300}\n", "digits: {}"),
            ("eval.knn_t", "1e-300", "1e-300", ">= 0.001", "eval: {knn_t: 1.0e-300}\n", "digits: {}"),
        )
    ),
    Case(
        "a cell file with its id twice",
        ("pretrain", "--tracking-uri", "none", "--cell", "{tmp}/cell.json"),
        r"cell file .*/cell\.json has the key 'id' twice in one object; a reader would keep only one: remove the other",
        setup=cell_file_with_id_twice,
    ),
    # --- errors that name the right thing
    *(
        Case(
            f"a {kind} as --config",
            CELLS,
            rf"config file .*/c\.yaml is a {kind}, not a file; name a YAML file",
            setup=make("c.yaml"),
        )
        for kind, make in (("folder", a_folder), ("FIFO", a_fifo))
    ),
    Case(
        "a loss parameter of the wrong type",
        CELLS,
        r"config key 'grid\.losses\[0\]\.sigma' = 'abc' has the wrong type; expected number or array",
        {"c.yaml": "datasets: {digits: {}}\ngrid: {losses: [{name: dclw, sigma: abc}], seeds: [0]}\n"},
    ),
    Case(
        "a config nested 100,000 deep",
        CELLS,
        r"config file .*/c\.yaml nests its values too deep to be read; no config key nests so deep",
        setup=deeply_nested("c.yaml", "[", "]", "study: "),
    ),
    Case(
        "a cell file nested 100,000 deep",
        ("pretrain", "--tracking-uri", "none", "--cell", "{tmp}/cell.json"),
        r"cell file .*/cell\.json nests its values too deep to be read; no key of a cell nests so deep",
        setup=deeply_nested("cell.json", "[", "]"),
    ),
    Case(
        "a deleted working folder",
        CELLS,
        r"the working folder was deleted \(or moved\) under this shell; cd into a folder that exists and run it again",
        {"c.yaml": STUDY},
        setup=deleted_working_folder,
    ),
    Case(
        "a read-only output folder",
        ("prepare-data", "--dataset", "digits", "--out", "{tmp}/ro/c.pt"),
        r".*/ro/c\.pt: Permission denied \(cannot write into .*/ro\)",
        setup=unwritable_folders,
    ),
    Case(
        "pretrain --out onto a file",
        (*PRETRAIN, *TINY_CELL),
        r"--out .*/out is a regular file, not a folder; it names the folder this command writes into: choose another path",
        {"out": "my notes\n"},
    ),
    Case(
        "a folder where state.pt should be",
        (*PRETRAIN, *TINY_CELL, "--steps", "1"),
        r".*state .*/out/state\.pt is a folder, not a file; remove it \(the cell then starts afresh\)",
        setup=a_folder("out/state.pt"),
    ),
    Case(
        "a folder where the data cache should be",
        (*PRETRAIN, *TINY_CELL, "--data-cache", "{tmp}/cache.pt"),
        r"data cache .*/cache\.pt is a folder, not a file; remove it and prepare the data again",
        setup=a_folder("cache.pt"),
    ),
    Case(
        "a folder where checkpoint.pt should be",
        ("embed", "--checkpoint", "{tmp}/ck.pt", "--dataset", "digits", "--loss", *TINY_CELL, "--out", "{tmp}/f.npz"),
        r".*checkpoint .*/ck\.pt is a folder, not a file",
        setup=a_folder("ck.pt"),
    ),
    Case(
        "export --out newdir/",
        (
            "export",
            "--checkpoint",
            "{tmp}/ck.pt",
            "--dataset",
            "digits",
            "--loss",
            *TINY_CELL,
            "--out",
            "{tmp}/newdir/",
        ),
        r"--out .*/newdir/ ends with '/', a folder, and this command writes one file: name the file \(e\.g\. "
        r".*/newdir/<name>\)",
        {"ck.pt": "a checkpoint\n"},
    ),
    Case(
        "warm-server --socket onto an existing file",
        ("warm-server", "--socket", "{tmp}/sock"),
        r"--socket .*/sock exists \(a regular file\); the server makes its own socket there: remove it or choose "
        r"another path",
        {"sock": ""},
    ),
    Case(
        "warm-server --watch-pid of an ended process",
        ("warm-server", "--socket", "{tmp}/sock", "--watch-pid", DEAD_PID),
        rf"--watch-pid {DEAD_PID}: no such process \(it has ended\); give the PID of the running process to watch",
    ),
    Case(
        "warm-server --idle-timeout -1",
        ("warm-server", "--socket", "{tmp}/sock", "--idle-timeout", "-1"),
        r"--idle-timeout must be a positive number of seconds, not -1",
    ),
    # --- sizes: batch sizes and subsets against data.split_sizes, before any job
    Case(
        "batch size larger than the data set",
        CELLS,
        r"cell 'digits/infonce/bs2048-t0\.1-s0': batch size 2048 is larger than the 1,437 pretraining images of digits",
        {"c.yaml": study("batch_sizes: [16, 2048], temperatures: [0.1]")},
    ),
    Case(
        "batch size larger than train_subset",
        CELLS,
        r"cell 'digits/infonce/bs128-t0\.1-s0': batch size 128 is larger than the 100 pretraining images of digits "
        r"\(datasets\.digits\.train_subset\)",
        {"c.yaml": study("batch_sizes: [128], temperatures: [0.1]", dataset="digits: {train_subset: 100}")},
    ),
    Case(
        "batch size larger than the data set in a side experiment",
        CELLS,
        r"cell 'precision/digits/infonce/bs4096-t0\.1-s0-fp64': batch size 4096 is larger than the 1,437 "
        r"pretraining images of digits",
        {
            "c.yaml": STUDY
            + "experiments: {precision: {enabled: true, batch_sizes: [4096], axes: {precision: [fp64]}}}\n"
        },
    ),
    Case(
        "--batch-size larger than the data set",
        (*PRETRAIN, "infonce", "--batch-size", "4096", "--temperature", "0.5"),
        r"cell 'digits/infonce/bs4096-t0\.5-s0': batch size 4096 is larger than the 1,437 pretraining images of digits",
    ),
    Case(
        "train_subset larger than the data set",
        CELLS,
        r"config key 'datasets\.digits\.train_subset' = 5000 is larger than the 1,437 train images of digits",
        {"c.yaml": "datasets: {digits: {train_subset: 5000}}\n"},
    ),
    Case(
        "test_subset larger than the test split",
        CELLS,
        r"config key 'datasets\.digits\.test_subset' = 1000 is larger than the 360 test images of digits",
        {"c.yaml": "datasets: {digits: {test_subset: 1000}}\n"},
    ),
    Case(
        "train_subset larger than Fashion-MNIST",
        CELLS,
        r"config key 'datasets\.fashion_mnist\.train_subset' = 70000 is larger than the 60,000 train images of fashion_mnist",
        {"c.yaml": "datasets: {fashion_mnist: {train_subset: 70000}}\n"},
    ),
    Case(
        "train_subset larger than STL-10's unlabeled split",
        CELLS,
        r"config key 'datasets\.stl10\.train_subset' = 200000 is larger than the 100,000 unlabeled images of stl10",
        {"c.yaml": "datasets: {stl10: {train_subset: 200000}}\n"},
    ),
    Case(
        "train_subset larger than an image folder (known once read: prepare-data)",
        (
            "prepare-data",
            "--dataset",
            "imagefolder",
            "--data-root",
            "{tmp}/folder",
            "--train-subset",
            "20",
            "--out",
            "{tmp}/c.pt",
        ),
        r"train_subset = 20 is larger than the 6 train images of imagefolder \(.*/folder\)",
        setup=image_folder,
    ),
    # --- warm-up against the epochs (not compared when train.steps is set: CONFIGURATION.md, train.warmup_epochs)
    Case(
        "warmup_epochs longer than epochs",
        CELLS,
        r"cell 'digits/infonce/bs16-t0\.1-s0': train\.warmup_epochs = 5 is longer than train\.epochs = 1 "
        r"\(the learning rate would never finish warming up\)",
        {"c.yaml": STUDY + "train: {epochs: 1, warmup_epochs: 5}\n"},
    ),
    Case(
        "warmup_epochs longer than an epochs axis value",
        CELLS,
        r"cell 'digits/infonce/bs16-t0\.1-s0-ep0\.05': train\.warmup_epochs = 0\.1 is longer than train\.epochs = 0\.05 "
        r"\(the learning rate would never finish warming up\)",
        {"c.yaml": study("batch_sizes: [16], temperatures: [0.1], axes: {epochs: [1, 0.05]}")},
    ),
    # --- results_dir
    Case(
        "results_dir is a file",
        ("cells", "--write", "--config", "{tmp}/c.yaml"),
        r"config key 'results_dir' = '.*/afile' is a file, not a folder",
        {"c.yaml": STUDY + "results_dir: {tmp}/afile\n"},
        setup=a_file,
    ),
    Case(
        "results_dir below a file",
        ("cells", "--write", "--config", "{tmp}/c.yaml"),
        r"config key 'results_dir' = '.*/afile/results' is not writable: .*/afile is a file, not a folder",
        {"c.yaml": STUDY + "results_dir: {tmp}/afile/results\n"},
        setup=a_file,
    ),
    Case(
        "results_dir unwritable",
        ("cells", "--write", "--config", "{tmp}/c.yaml"),  # sysfs: even root cannot mkdir
        r"config key 'results_dir' = '/sys/smallbatch-results' is not writable: "
        r"(Operation not permitted|Permission denied|Read-only file system)",
        {"c.yaml": STUDY + "results_dir: /sys/smallbatch-results\n"},
    ),
    Case(
        "a YAML alias bomb as the value of a known key",
        CELLS,
        r"config file .*/c\.yaml: its aliases \(\*name\) expand to more than 100000 values \(an alias bomb, or an "
        r"alias inside its own anchor\); write the values out, or alias fewer times",
        {"c.yaml": ALIAS_BOMB},
    ),
    # --- tracking URIs and stores
    Case(
        "tracking_uri with an unknown scheme",
        CELLS,
        r"config key 'tracking_uri' = 'foo://bar': " + TRACKING_HINT,
        {"c.yaml": STUDY + "tracking_uri: foo://bar\n"},
    ),
    Case(
        "--tracking-uri with an unknown scheme",
        ("init-store", "--tracking-uri", "foo://bar"),
        r"MLflow tracking store foo://bar: " + TRACKING_HINT,
    ),
    Case(
        "$MLFLOW_TRACKING_URI with an unknown scheme",
        ("init-store",),
        r"\$MLFLOW_TRACKING_URI = 'foo://bar': " + TRACKING_HINT,
        setup=tracking_env,
    ),
    Case(
        "SQLite URI with two slashes",
        ("init-store", "--tracking-uri", "sqlite://results/mlflow.db"),
        r"MLflow tracking store sqlite://results/mlflow\.db: a SQLite URI has three slashes before a relative path, "
        r"four before an absolute one \(sqlite:///results/mlflow\.db\)",
    ),
    Case(
        "read-only tracking store",
        ("init-store", "--tracking-uri", "sqlite:///file:{tmp}/mlflow.db?mode=ro&uri=true", "--experiment", "other"),
        r"MLflow tracking store sqlite:///file:.*/mlflow\.db\?mode=ro&uri=true failed while opening experiment 'other': "
        r"attempt to write a readonly database",
        setup=existing_store,
    ),
    Case(
        "tracking server not there",
        ("init-store", "--tracking-uri", "http://127.0.0.1:1", "--experiment", "x"),
        r"MLflow tracking store http://127\.0\.0\.1:1 failed while opening experiment 'x': nothing is listening there "
        r"\(connection refused, 1 try\)",
        setup=no_http_retries,
    ),
    Case(
        "a server answering 200 {} to every request as the tracking store",
        ("init-store", "--experiment", "relx", "--touch", "{tmp}/mlflow.ready"),
        r"MLflow tracking store http://127\.0\.0\.1:\d+ answered experiment 'relx' with id '' and name '': not an "
        r"MLflow tracking server; check --tracking-uri / tracking_uri",
        setup=mlflow_impostor,
    ),
    Case(
        "tracking store on a full disk",
        ("init-store", "--tracking-uri", "sqlite:////dev/full"),
        r"MLflow tracking store sqlite:////dev/full failed while opening the store: database or disk is full",
    ),
    # --- downloads without network
    Case(
        "CIFAR-10 download without network",
        ("prepare-data", "--dataset", "cifar10", "--data-root", "{tmp}/data", "--download", "--out", "{tmp}/c.pt"),
        r"cifar10: could not download CIFAR-10 from https://www\.cs\.toronto\.edu/~kriz/cifar-10-python\.tar\.gz: "
        r"no network \(Name or service not known\); put the files under .*/data/cifar-10-batches-py/ "
        r"\(data_batch_1\.\.5, test_batch, batches\.meta\)",
        setup=no_network,
    ),
    Case(
        "Fashion-MNIST download without network (no Debian package)",
        (
            "prepare-data",
            "--dataset",
            "fashion_mnist",
            "--data-root",
            "{tmp}/data",
            "--download",
            "--out",
            "{tmp}/c.pt",
        ),
        r"fashion_mnist: could not download Fashion-MNIST from http://fashion-mnist\.s3-website\.eu-central-1\.amazonaws\.com/: "
        r"no network \(Name or service not known\); put the files under .*/data/FashionMNIST/raw/",
        setup=lambda tmp, mp: (
            no_network(tmp, mp),
            mp.setattr("smallbatch.data.readers.DEBIAN_FASHION_MNIST", tmp / "none"),
        ),
    ),
    Case(
        "STL-10 download without network",
        ("prepare-data", "--dataset", "stl10", "--data-root", "{tmp}/data", "--download", "--out", "{tmp}/c.pt"),
        r"stl10: could not download STL-10 from http://ai\.stanford\.edu/~acoates/stl10/stl10_binary\.tar\.gz: "
        r"no network \(Name or service not known\); put the files under .*/data/stl10_binary/ \(.*\)",
        setup=no_network,
    ),
    # --- files of another smallbatch: refused, never read half-right
    Case(
        "--cell file of another format",
        ("pretrain", "--tracking-uri", "none", "--cell", "{tmp}/cell.json"),
        r"cell file .*/cell\.json was written by another smallbatch \(format none; this one reads and writes "
        r"format 2\): write it again with `smallbatch cells --write`",
        setup=cell_file_without("format"),
    ),
    Case(
        "store of another format",
        ("init-store", "--tracking-uri", "sqlite:///{tmp}/mlflow.db", "--experiment", "study"),
        r"experiment 'study' of the store sqlite:///.*/mlflow\.db was written by another smallbatch \(format 1; "
        r"this one reads and writes format 2\): run the study into a new store \(another results_dir or "
        r"tracking_uri\), or read this one with the smallbatch that wrote it",
        setup=store_of_format_1,
    ),
    # --- cell files
    Case(
        "--cell file holding {}",
        ("pretrain", "--tracking-uri", "none", "--cell", "{tmp}/cell.json"),
        r"cell file .*/cell\.json lacks the key 'id' of a cell \(and \d+ more\); write it with `smallbatch cells --write`",
        {"cell.json": "{}\n"},
    ),
    Case(
        "--cell file without its temperature",
        ("pretrain", "--tracking-uri", "none", "--cell", "{tmp}/cell.json"),
        r"cell file .*/cell\.json lacks the key 'temperature' of a cell; write it with `smallbatch cells --write`",
        setup=cell_file_without("temperature"),
    ),
    Case(
        "--cell file of a study cell given to baseline",
        ("baseline", "--tracking-uri", "none", "--cell", "{tmp}/cell.json"),
        r"cell file .*/cell\.json lacks the key 'baseline' of a baseline cell; write it with `smallbatch cells --write`",
        setup=cell_file_without(None),
    ),
    Case(
        "--cell file holding a list",
        ("pretrain", "--tracking-uri", "none", "--cell", "{tmp}/cell.json"),
        r"cell file .*/cell\.json must hold a JSON object \(one cell\), not a list",
        {"cell.json": "[1, 2]\n"},
    ),
    # --- --loss-param values, checked against the loss's schema
    Case(
        "--loss-param sigma=abc",
        (*PRETRAIN, "dclw", "--batch-size", "16", "--temperature", "0.1", "--loss-param", "sigma=abc"),
        r"--loss-param sigma = 'abc' has the wrong type; expected number",
    ),
    Case(
        "--loss-param sigma=-1",
        (*PRETRAIN, "dclw", "--batch-size", "16", "--temperature", "0.1", "--loss-param", "sigma=-1"),
        r"--loss-param sigma = -1 is out of range; it must be > 0",
    ),
    Case(
        "--loss-param sigma=nan",
        (*PRETRAIN, "dclw", "--batch-size", "16", "--temperature", "0.1", "--loss-param", "sigma=nan"),
        r"--loss-param sigma = nan is not a finite number",
    ),
    # --- config files
    Case(
        "YAML syntax error",
        CELLS,
        r"config file .*/c\.yaml is not valid YAML at line 3, column 6: mapping values are not allowed here",
        {"c.yaml": "train:\n  epochs: 3\n   lr: 0.1\n"},
    ),
    Case(
        "YAML indented with a tab",
        CELLS,
        r"config file .*/c\.yaml is not valid YAML at line 2, column 1: found character '\\t' that cannot start any token",
        {"c.yaml": "train:\n\tepochs: 3\n"},
    ),
    Case(
        "empty config file",
        CELLS,
        r"config file .*/c\.yaml is empty \(no settings, only blanks or comments\); write \{\} for a study of every default",
        {"c.yaml": ""},
    ),
    Case(
        "config file of comments only",
        CELLS,
        r"config file .*/c\.yaml is empty \(no settings, only blanks or comments\);.*",
        {"c.yaml": "# study: mine\n\n"},
    ),
    # --- values that passed validation, then broke or changed meaning
    Case(
        "train.neg_group 8.0 (a whole float)",
        CELLS,
        r"config key 'train\.neg_group' = 8\.0 has the wrong type; expected \['integer', 'null'\]",
        {"c.yaml": STUDY + "train: {neg_group: 8.0}\n"},
    ),
    Case(
        "epochs 1:30 (YAML 1.1 base 60)",
        CELLS,
        r"config file .*/c\.yaml: key 'train\.epochs' = 1:30 \(line 3\) reads as 90 in YAML 1\.1 and as the text "
        r"'1:30' in YAML 1\.2; write it so both read the same \(a plain decimal number, true or false, or the text in quotes\)",
        {"c.yaml": STUDY + "train: {epochs: 1:30}\n"},
    ),
    Case(
        "seeds [010] (YAML 1.1 octal)",
        CELLS,
        r"config file .*/c\.yaml: key 'grid\.seeds\[0\]' = 010 \(line 2\) reads as 8 in YAML 1\.1 and as 10 in YAML 1\.2; .*",
        {"c.yaml": "datasets: {digits: {}}\ngrid: {losses: [infonce], seeds: [010]}\n"},
    ),
    Case(
        "lr 1e-3 (text in YAML 1.1)",
        CELLS,
        r"config file .*/c\.yaml: key 'train\.lr' = 1e-3 \(line 3\) reads as the text '1e-3' in YAML 1\.1 and as "
        r"0\.001 in YAML 1\.2; .*",
        {"c.yaml": STUDY + "train: {lr: 1e-3}\n"},
    ),
    Case(
        "two << merge keys in one mapping",
        CELLS,
        r"config file .*/c\.yaml: mapping train \(line 5\) has 2 '<<' merge keys \(lines 5, 6\); YAML keeps only one "
        r"of them: write one '<<: \[\*a, \*b\]'",
        {"c.yaml": STUDY + "a: &a {epochs: 2}\ntrain:\n  <<: *a\n  <<: {lr: 0.1}\n"},
    ),
    Case(
        "a key ~ (null)",
        CELLS,
        r"config file .*/c\.yaml: the key ~ \(line 3\) is not a name \(YAML reads it as None\); a config key is text: "
        r"quote it, or remove it",
        {"c.yaml": STUDY + "~: 1\n"},
    ),
    Case(
        "train.steps 10^15",
        CELLS,
        r"config key 'train\.steps' = 1000000000000000 is out of range; it must be <= 1000000000",
        {"c.yaml": STUDY + "train: {steps: 1000000000000000}\n"},
    ),
    Case(
        "threads 10^9",
        CELLS,
        r"config key 'threads' = 1000000000 is out of range; it must be <= 1024",
        {"c.yaml": STUDY + "threads: 1000000000\n"},
    ),
    Case(
        "a seed of 2^64",
        CELLS,
        r"config key 'grid\.seeds\[0\]' = 18446744073709551616 is out of range; it must be <= 4294967295",
        {"c.yaml": "datasets: {digits: {}}\ngrid: {losses: [infonce], seeds: [18446744073709551616]}\n"},
    ),
    Case(
        "a seed given twice",
        CELLS,
        r"config key 'grid\.seeds' = \[0, 0\] holds a value twice; give each once",
        {"c.yaml": "datasets: {digits: {}}\ngrid: {losses: [infonce], seeds: [0, 0]}\n"},
    ),
    Case(
        "an integer without its own bound above int32",
        CELLS,
        r"config key 'train\.grad_error_every' = 4294967296 is out of range; it must be <= 2147483647",
        {"c.yaml": STUDY + "train: {grad_error_every: 4294967296}\n"},
    ),
    Case(
        "experiments.mi with one seed",
        CELLS,
        r"config key 'experiments\.mi\.seeds' = \[0\] has 1; it needs at least 3",
        {"c.yaml": STUDY + "experiments: {mi: {enabled: true, seeds: [0]}}\n"},
    ),
    Case(
        "eval.fewshot_fractions [0.0001]: fewer than one label of a class",
        CELLS,
        r"cell 'digits/infonce/bs16-t0\.1-s0': eval\.fewshot_fractions = 0\.0001 gives a class of 144 training images "
        r"no labelled image \(round\(0\.0001 x 144\) = 0\); use a fraction of at least 0\.007",
        {"c.yaml": STUDY + "eval: {fewshot_fractions: [0.0001]}\n"},
    ),
    Case(
        "eval.fewshot_fractions [1.0]: more labels than lie outside the validation split",
        CELLS,
        r"cell 'digits/infonce/bs16-t0\.1-s0': eval\.fewshot_fractions = 1 is more than the 0\.9 of each class's "
        r"training images outside the validation split \(eval\.linear_val_fraction = 0\.1\); use at most that "
        r"\(all labels: the linear probe, linear/top1\)",
        {"c.yaml": STUDY + "eval: {fewshot_fractions: [1.0]}\n"},
    ),
    Case(
        "--out ~/x (a literal tilde)",
        ("prepare-data", "--dataset", "digits", "--out", "~/x.pt"),
        r"--out = '~/x\.pt' starts with '~', which nothing expands here; write the full path \('.*/x\.pt'\?\)",
    ),
    # --- the same checks on Snakemake's path, before any job
    Case(
        "YAML syntax error in config.yaml (snakemake)",
        ("--snakefile", str(ROOT / "Snakefile"), "-n"),
        r"config file config\.yaml is not valid YAML at line 3, column 6: mapping values are not allowed here",
        {"config.yaml": "train:\n  epochs: 3\n   lr: 0.1\n"},
        snakemake=True,
    ),
    Case(
        "empty config.yaml (snakemake)",
        ("--snakefile", str(ROOT / "Snakefile"), "-n"),
        r"config file config\.yaml is empty \(no settings, only blanks or comments\); write \{\} for a study of every default",
        {"config.yaml": "\n"},
        snakemake=True,
    ),
    Case(
        "results_dir is a file (snakemake)",
        ("--snakefile", str(ROOT / "Snakefile"), "-n", "--configfile", SMOKE, "--config", "results_dir={tmp}/afile"),
        r"config key 'results_dir' = '.*/afile' is a file, not a folder",
        setup=a_file,
        snakemake=True,
    ),
    Case(
        "batch size larger than the data set (snakemake)",
        ("--snakefile", str(ROOT / "Snakefile"), "-n", "--configfile", "{tmp}/c.yaml"),
        r"cell 'digits/infonce/bs2048-t0\.1-s0': batch size 2048 is larger than the 1,437 pretraining images of digits",
        {"c.yaml": study("batch_sizes: [2048], temperatures: [0.1]", "results_dir: {tmp}/results\n")},
        snakemake=True,
    ),
    Case(
        "$MLFLOW_TRACKING_URI with an unknown scheme (snakemake)",
        ("--snakefile", str(ROOT / "Snakefile"), "-n", "--configfile", SMOKE, "--config", "results_dir={tmp}/results"),
        r"\$MLFLOW_TRACKING_URI = 'foo://bar': " + TRACKING_HINT,
        snakemake=True,
        env={"MLFLOW_TRACKING_URI": "foo://bar"},
    ),
]


def _fill(text: str, tmp: Path) -> str:
    return text.replace("{tmp}", str(tmp))


def _run_cli(case: Case, tmp: Path, capsys) -> None:
    rc = cli.main([_fill(a, tmp) for a in case.argv])
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err, err
    assert rc == 2, f"exit status {rc}; stderr: {err}"
    lines = err.strip().splitlines()
    assert len(lines) == 1, f"not one line:\n{err}"
    assert re.fullmatch(r"smallbatch: error: " + case.expect, lines[0]), lines[0]


def _run_snakemake(case: Case, tmp: Path) -> None:
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
    env.pop("MLFLOW_TRACKING_URI", None)
    env.update(case.env)
    proc = subprocess.run(
        [sys.executable, "-m", "snakemake", *(_fill(a, tmp) for a in case.argv)],
        cwd=tmp,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, output
    assert "Traceback" not in output, output
    assert not re.search(r"^(local)?rule \w+:", output, re.M), f"a job was planned:\n{output}"
    frame = ("Using workflow specific profile", "WorkflowError in file ", "  File ")
    body = [line for line in output.splitlines() if line.strip() and not line.startswith(frame)]
    assert len(body) == 1, f"not one line:\n{output}"
    assert re.fullmatch(r"config error: " + case.expect, body[0]), body[0]


@pytest.mark.parametrize(
    "case", [pytest.param(c, id=c.name, marks=[pytest.mark.slow] if c.snakemake else []) for c in CASES]
)
def test_bad_input_stops_with_one_line_naming_the_problem(case: Case, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # relative paths (and MLflow's folders for SQLite URIs) land here
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    for name, text in case.files.items():
        (tmp_path / name).write_text(_fill(text, tmp_path))
    if case.setup is not None:
        case.setup(tmp_path, monkeypatch)
    capsys.readouterr()  # what a setup printed is not the row's output
    if case.snakemake:
        _run_snakemake(case, tmp_path)
    else:
        _run_cli(case, tmp_path, capsys)


@pytest.mark.slow
def test_bare_snakemake_uses_the_default_workflow_profile(tmp_path):
    """`snakemake -n` from the project root, no --workflow-profile: Snakemake finds
    profiles/default (a link to workflow/profiles/default) next to the Snakefile."""
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
    env.pop("MLFLOW_TRACKING_URI", None)
    proc = subprocess.run(
        [sys.executable, "-m", "snakemake", "-n", "--configfile", SMOKE, "--config", f"results_dir={tmp_path}"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output
    assert "Using workflow specific profile profiles/default for setting default command line arguments." in output
    assert (ROOT / "profiles" / "default").resolve() == (ROOT / "workflow" / "profiles" / "default").resolve()
    assert re.search(r"^pretrain\s+4$", output, re.M), output  # the smoke study's 4 cells are planned


def test_ctrl_c_ends_a_command_with_one_line_and_exit_130():
    """SIGINT to `smallbatch init-store` once it waits on a server that never answers: exit 130
    and the one line "smallbatch: interrupted", no traceback."""
    import http.server
    import signal
    import threading

    asked, stop = threading.Event(), threading.Event()

    class Silent(http.server.BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def _any(self):
            asked.set()
            stop.wait(IMPOSTOR_S)

        do_GET = do_POST = _any

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Silent)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    uri = f"http://127.0.0.1:{httpd.server_address[1]}"
    argv = as_foreground([BIN / "smallbatch", "init-store", "--tracking-uri", uri, "--experiment", "x"])
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        assert asked.wait(IMPOSTOR_S), "the command never asked the server"
        proc.send_signal(signal.SIGINT)
        err = proc.communicate(timeout=IMPOSTOR_S)[1]
    finally:
        proc.kill()
        stop.set()
        httpd.shutdown()
        httpd.server_close()
    assert proc.returncode == 130 and err.strip() == "smallbatch: interrupted", (proc.returncode, err[-2000:])
