"""Trust boundaries, as tables: each row is an input and the one line it must
stop with, or the recovery it must end in.

* no value from a config, a cell or a flag reaches a shell: every placeholder of every rule
  is quoted, and a study whose names hold quotes, ``;``, ``$( )``, spaces and non-ASCII
  runs no payload and writes nothing outside its results folder;
* no file read runs code: a crafted pickle as state.pt or checkpoint.pt is refused in one
  line and its payload (it would write a file) never runs;
* every path stays inside the results folder: a cell id outside the id grammar is refused,
  the cell lock and the report's outputs refuse symbolic links, and ``report --out``
  deletes only files it wrote itself (its manifest);
* inputs that used to pass silently (a key twice, another loss's parameter, flags a
  ``--cell-id`` or ``--cell-json`` run ignores, an unusable results_dir, an MI section that
  is not a mapping, a hand-edited cell file) stop with one line.

Commands run in-process (``smallbatch.pipeline.cli.main``) unless a row needs a real process.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from cluster import HANG_S

from smallbatch import io
from smallbatch.data import load as data
from smallbatch.pipeline import cli
from smallbatch.study.cells import cell_hash, make_cell
from smallbatch.study.config import load_config

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
TINY = {"width": 4, "proj_hidden": 16, "proj_dim": 8, "log_every": 5, "steps": 3}


def tiny_cell(**train) -> dict:
    cfg = load_config(None, {"datasets": {"digits": {}}, "train": {**TINY, **train}, "device": "cpu"})
    return make_cell(cfg, dataset="digits", loss="infonce", loss_params={}, batch_size=16, temperature=0.5, seed=0)


def with_id(cell: dict, cid: str) -> dict:
    return {**cell, "id": cid}  # the hash (which covers the id) not recomputed: the grammar refuses it first


def rehashed(cell: dict) -> dict:
    """``cell`` with the hash of its (edited) settings: only the cell checks can refuse it."""
    return {**cell, "hash": cell_hash(cell)}


def edited(section: str | None = None, drop: str | None = None, **values) -> dict:
    """A tiny cell edited by hand (a top-level key, or one of ``section``), its hash recomputed."""
    cell = tiny_cell()
    if section is None:
        return rehashed({**cell, **values})
    part = {k: v for k, v in {**cell[section], **values}.items() if k != drop}
    return rehashed({**cell, section: part})


def one_line(capsys, argv: list[str]) -> str:
    """Run the CLI in-process; it must exit 2 with exactly one stderr line, no traceback."""
    rc = cli.main(argv)
    err = capsys.readouterr().err
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    assert rc == 2 and len(lines) == 1 and "Traceback" not in err, (rc, err[-2000:])
    assert lines[0].startswith("smallbatch: error: "), lines
    return lines[0][len("smallbatch: error: ") :]


class Payload:
    """Unpickling this runs ``touch <marker>`` -- if anything lets it."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


# --------------------------------------------------------------------------- the rules' quoting
#: a rule's `shell:` strings (comment lines between them and `shell:` skipped)
SHELL_BLOCK = r"^\s+shell:\n(?:\s+#.*\n)*((?:\s+\".*\"\n?)+)"


def shell_placeholders(text: str) -> list[str]:
    """The ``{...}`` placeholders of every ``shell:`` string of a rule file."""
    found = []
    for block in re.findall(SHELL_BLOCK, text, flags=re.M):
        joined = "".join(re.findall(r"\"(.*)\"", block))
        found += re.findall(r"(?<!\{)\{([^{}]+)\}(?!\})", joined)
    return found


def test_every_placeholder_of_every_rule_is_shell_quoted():
    """The convention of workflow/rules/common.smk: every placeholder carries :q (the
    launcher, made from no config value, is the one exception)."""
    files = sorted((ROOT / "workflow" / "rules").glob("*.smk"))
    seen = 0
    for smk in files:
        for ph in shell_placeholders(smk.read_text()):
            seen += 1
            assert ph.endswith(":q") or ph == "params.launch", f"{smk.name}: {{{ph}}} is not quoted"
    assert seen >= 30  # the parser found the rules' commands


def test_every_option_of_every_rule_takes_its_value_joined():
    """`--opt={x:q}`, never `--opt {x:q}`: a value that starts with a dash (a study named
    --help, a results_dir -rf, a data root --download) stays that option's value."""
    files = sorted((ROOT / "workflow" / "rules").glob("*.smk"))
    joined = 0
    for smk in files:
        for block in re.findall(SHELL_BLOCK, smk.read_text(), flags=re.M):
            line = "".join(re.findall(r"\"(.*)\"", block))
            assert not re.search(r"--[a-z][a-z-]* \{", line), f"{smk.name}: {line}"
            joined += len(re.findall(r"--[a-z][a-z-]*=\{", line))
    assert joined >= 25
    from smallbatch.pipeline.plan import flag  # the rules' optional options: the value joined too

    assert flag("--image-size", "-rf") == ["--image-size=-rf"] and flag("--download") == ["--download"]
    assert flag("--train-subset", None) == [] and flag("--features", "") == [] and flag("--x", False) == []


def test_every_rule_removes_what_lies_at_its_log_path_before_writing_it():
    """`> {log:q}` would write through a link, a FIFO or a hard link planted there: every rule
    that redirects into its log first removes what is at that path (the link, not its target)."""
    seen = 0
    for smk in sorted((ROOT / "workflow" / "rules").glob("*.smk")):
        for block in re.findall(SHELL_BLOCK, smk.read_text(), flags=re.M):
            line = "".join(re.findall(r"\"(.*)\"", block))
            if "> {log:q}" in line:
                seen += 1
                assert line.startswith("rm -f -- {log:q} && "), f"{smk.name}: {line}"
    assert seen >= 7


# --------------------------------------------------------------------------- one-line refusals
@dataclass(frozen=True)
class Row:
    name: str
    argv: tuple[str, ...]  # {tmp} is the test's folder, {cell} a tiny cell's JSON, {cache} the data cache
    expect: str  # regex of the line after "smallbatch: error: "
    files: dict[str, str | bytes] = field(default_factory=dict)
    cell: dict | None = None  # the cell {cell} stands for (default: tiny_cell())
    setup: Callable[[Path], None] | None = None  # makes what files cannot (a FIFO, a link), in {tmp}


def fifo(name: str) -> Callable[[Path], None]:
    return lambda tmp: (tmp / name).parent.mkdir(parents=True, exist_ok=True) or os.mkfifo(tmp / name)


def folder(name: str) -> Callable[[Path], None]:
    return lambda tmp: (tmp / name).mkdir(parents=True)


def symlink(name: str, target: str = "thesis.tex") -> Callable[[Path], None]:
    def make(tmp: Path) -> None:
        (tmp / target).write_text("my thesis\n")
        (tmp / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp / name).symlink_to(tmp / target)

    return make


def hardlink(name: str, target: str = "thesis.tex") -> Callable[[Path], None]:
    def make(tmp: Path) -> None:
        (tmp / target).write_text("my thesis\n")
        (tmp / name).parent.mkdir(parents=True, exist_ok=True)
        os.link(tmp / target, tmp / name)

    return make


def socket_file(name: str) -> Callable[[Path], None]:
    def make(tmp: Path) -> None:
        import socket

        (tmp / name).parent.mkdir(parents=True, exist_ok=True)
        sock = socket.socket(socket.AF_UNIX)
        sock.bind(str(tmp / name))
        SOCKETS.append(sock)

    return make


SOCKETS: list = []


STUDY_YAML = "datasets: {digits: {}}\ngrid: {losses: [infonce], batch_sizes: [16], temperatures: [0.5], seeds: [0]}\n"
CELL_ID = "digits/infonce/bs16-t0.5-s0"
BY_ID = ("pretrain", "--tracking-uri", "none", "--config", "{tmp}/c.yaml", "--cell-id", CELL_ID)
BY_JSON = (
    "pretrain",
    "--tracking-uri",
    "none",
    "--out",
    "{tmp}/out",
    "--data-cache",
    "{cache}",
    "--cell-json",
    "{cell}",
)
#: the writer's refusal of a target that is not a regular file (smallbatch.io.refusal)
REFUSED = r"refused \(smallbatch writes only regular files of one name, never through a link\)"
BASELINE_JSON = json.dumps(
    {
        **{k: v for k, v in tiny_cell().items() if k not in ("loss", "loss_params", "temperature", "negatives")},
        "id": "baselines/digits/raw_pixels",
        "experiment": "baseline",
        "baseline": "raw_pixels",
    }
)
#: an MI section of one short setting (the benchmark itself is never reached by a refused command)
TINY_MI = json.dumps(
    {"mi_values": [2], "ks": [4], "estimators": ["infonce"], "critics": ["oracle"], "steps": 2, "eval_batches": 1}
)
NOT_AN_ID = r"is not a cell id \(segments of letters, digits and _ \. = \+ - joined by single '/', none empty or starting with a dot\); use an id `smallbatch cells` lists"

ROWS = [
    # --- a cell id is never a path outside results_dir
    *(
        Row(
            f"--cell-json id {cid!r}",
            BY_JSON,
            rf"--cell-json: id {re.escape(repr(cid))} {NOT_AN_ID}",
            cell=with_id(tiny_cell(), cid),
        )
        for cid in (
            "../../../../escape_cell",
            "/tmp/abs_cell",
            "digits//infonce",
            "digits/./x",
            "digits/../x",
            ".hidden/x",
            "digits/x/",
            "dig its/x",
            "digits/x\n",
        )
    ),
    Row(
        "--cell file whose id climbs out",
        ("pretrain", "--tracking-uri", "none", "--cell", "{tmp}/cell.json"),
        rf"cell file .*/cell\.json: id '\.\./escape' {NOT_AN_ID}",
        {"cell.json": json.dumps(with_id(tiny_cell(), "../escape"))},
    ),
    # --- a cell file is checked against its own hash
    Row(
        "--cell-json edited by hand (epochs)",
        BY_JSON,
        r"--cell-json: cell digits/infonce/bs16-t0\.5-s0 says hash '\w+' but its settings hash to '\w+' "
        r"\(edited by hand\?\); write it again with `smallbatch cells --write`, or change the config instead",
        cell={**tiny_cell(), "train": {**tiny_cell()["train"], "epochs": 7}},
    ),
    # --- flags a run that names its cell would ignore
    *(
        Row(
            f"{' '.join(extra)} with --cell-id",
            (*BY_ID, *extra),
            rf"{re.escape(extra[0])} has no effect with --cell-id \(the cell's settings come from the config\); leave it out, "
            r"or set it in the config, or name a stand-alone cell without --cell-id",
            {"c.yaml": STUDY_YAML},
        )
        for extra in (
            ("--image-size", "8"),
            ("--train-subset", "100"),
            ("--seed", "3"),
            ("--loss-param", "sigma=1"),
            ("--dataset", "digits"),
            ("--batch-size", "32"),
        )
    ),
    Row(
        "--threads 0 with --cell-id",
        (*BY_ID, "--threads", "0"),
        r"--threads = 0 is out of range; it must be >= 1",
        {"c.yaml": STUDY_YAML},
    ),
    Row(
        "--epochs with --cell-json",
        (*BY_JSON, "--epochs", "3"),
        r"--epochs has no effect with --cell-json \(the cell's settings come from the cell\); leave it out, .*",
    ),
    # --- config values that used to pass
    Row(
        "a key given twice",
        ("cells", "--config", "{tmp}/c.yaml"),
        r"config file .*/c\.yaml has the key 'train' twice in one mapping \(line 3 and line 4\); "
        r"YAML would keep only the second: merge them",
        {"c.yaml": STUDY_YAML + "train: {epochs: 1}\ntrain: {epochs: 2}\n"},
    ),
    Row(
        "another loss's parameter on a loss entry",
        ("cells", "--config", "{tmp}/c.yaml"),
        r"config key 'grid\.losses\[0\]\.alpha' is not a parameter of dclw; its parameters: sigma",
        {"c.yaml": "datasets: {digits: {}}\ngrid: {losses: [{name: dclw, alpha: 3}]}\n"},
    ),
    Row(
        "results_dir ~/x",
        ("cells", "--config", "{tmp}/c.yaml"),
        r"config key 'results_dir' = '~/x' starts with '~', which nothing expands here; write the full path .*",
        {"c.yaml": STUDY_YAML + "results_dir: ~/x\n"},
    ),
    Row(
        "results_dir empty",
        ("cells", "--config", "{tmp}/c.yaml"),
        r"config key 'results_dir' is empty \(it would name the current folder\); name a file or folder",
        {"c.yaml": STUDY_YAML + "results_dir: ''\n"},
    ),
    Row(
        "results_dir with braces",
        ("cells", "--config", "{tmp}/c.yaml"),
        r"config key 'results_dir' = 'r\{x\}' holds '\{', '\}', which a results path may not hold .*",
        {"c.yaml": STUDY_YAML + "results_dir: 'r{x}'\n"},
    ),
    # --- extreme but legal values
    *(
        Row(
            f"temperature {tau}",
            ("cells", "--config", "{tmp}/c.yaml"),
            rf"cell 'digits/infonce/bs16-t{re.escape(f'{float(tau):g}')}-s0': temperature τ = {re.escape(f'{float(tau):g}')} is outside \[0\.001, 100\], where the losses "
            r"stop being meaningful \(s/τ overflows, or every logit is ~0\); choose a τ in that range",
            {
                "c.yaml": f"datasets: {{digits: {{}}}}\ngrid: {{losses: [infonce], batch_sizes: [16], temperatures: [{tau}]}}\n"
            },
        )
        for tau in ("1.0e-9", "1.0e+9")
    ),
    Row(
        "--cell-json whose k is above the train set",
        BY_JSON,
        r"--cell-json: cell digits/infonce/bs16-t0\.5-s0: eval\.knn_k = 5000 is more than the 1,437 train images of "
        r"digits the kNN probe votes over; use k <= 1437",
        cell=(lambda c: {**c, "hash": cell_hash(c)})({**tiny_cell(), "eval": {**tiny_cell()["eval"], "knn_k": [5000]}}),
    ),
    Row(
        "knn_k above the train set",
        ("cells", "--config", "{tmp}/c.yaml"),
        r"cell 'digits/infonce/bs16-t0\.5-s0': eval\.knn_k = 100000 is more than the 400 train images of digits the "
        r"kNN probe votes over; use k <= 400",
        {"c.yaml": STUDY_YAML.replace("digits: {}", "digits: {train_subset: 400}") + "eval: {knn_k: [5, 100000]}\n"},
    ),
    Row(
        "mi --section-json '[]'",
        ("mi", "--section-json", "[]", "--tracking-uri", "none", "--out", "{tmp}/mi.json"),
        r"--section-json must hold a JSON object \(the experiments\.mi section\), not a list",
    ),
    Row(
        "mi --section file holding a number",
        ("mi", "--section", "{tmp}/s.json", "--tracking-uri", "none", "--out", "{tmp}/mi.json"),
        r"section file .*/s\.json must hold a JSON object \(the experiments\.mi section\), not a int",
        {"s.json": "3\n"},
    ),
    Row(
        "an unknown tracking scheme",
        ("init-store", "--tracking-uri", "foo://bar", "--experiment", "x"),
        r"MLflow tracking store foo://bar: MLflow has no tracking store for the scheme 'foo'; use sqlite:///PATH, "
        r"http\(s\)://HOST:PORT, postgresql://, mysql://, mssql:// or databricks",
    ),
    # --- a cell's id is inside its hash: a file edited to name another cell fails the hash check
    Row(
        "--cell-json whose id was edited to another real cell's",
        BY_JSON,
        r"--cell-json: cell digits/infonce/bs16-t0\.5-s1 says hash '\w+' but its settings hash to '\w+' "
        r"\(edited by hand\?\); write it again with `smallbatch cells --write`, or change the config instead",
        cell=with_id(tiny_cell(), "digits/infonce/bs16-t0.5-s1"),
    ),
    # --- a hand-edited cell is checked whole (schema, derived values, cell checks) before it is typed
    Row(
        "--cell-json without train.width",
        BY_JSON,
        r"--cell-json lacks the key 'train\.width' of a cell; write it with `smallbatch cells --write`",
        cell=edited("train", drop="width"),
    ),
    Row(
        "--cell-json with negatives 999",
        BY_JSON,
        r"--cell-json: key 'negatives' = 999 is not the K of its settings \(30: batch size, train\.neg_group, "
        r"train\.queue_size, train\.extra_negatives\); write it with `smallbatch cells --write`",
        cell=edited(negatives=999),
    ),
    Row(
        "--cell-json with eval.knn_k [0]",
        BY_JSON,
        r"--cell-json: key 'eval\.knn_k\[0\]' = 0 is out of range; it must be >= 1",
        cell=edited("eval", knn_k=[0]),
    ),
    Row(
        "--cell-json with seed -1",
        BY_JSON,
        r"--cell-json: key 'seed' = -1 is out of range; it must be >= 0",
        cell=edited(seed=-1),
    ),
    Row(
        "--cell-json with tracking.log_checkpoint 'no'",
        BY_JSON,
        r"--cell-json: key 'tracking\.log_checkpoint' = 'no' has the wrong type; expected boolean",
        cell=edited("tracking", log_checkpoint="no"),
    ),
    Row(
        "--cell-json with train.neg_group 8.0",
        BY_JSON,
        r"--cell-json: key 'train\.neg_group' = 8\.0 has the wrong type; expected \['integer', 'null'\]",
        cell=edited("train", neg_group=8.0),
    ),
    Row(
        "--cell-json with data_root ''",
        BY_JSON,
        r"--cell-json: key 'data_root' is empty \(it would name the current folder\); name a file or folder",
        cell=edited(data_root=""),
    ),
    Row(
        "--threads 2000 with --cell-json",
        (*BY_JSON, "--threads", "2000"),
        r"--threads = 2000 is out of range; it must be <= 1024",
    ),
    # --- a path the user names is never clobbered: no output through a device, FIFO, socket, folder or link
    *(
        Row(
            f"{argv[0]} {flag} onto a {kind}",
            (*argv, flag, "{tmp}/target"),
            rf".*/target is a {kind}, not a regular file; {REFUSED}: choose another path",
            setup=make("target"),
        )
        for argv, flag in (
            (("prepare-data", "--dataset", "digits"), "--out"),
            (("embed", "--checkpoint", "{tmp}/ck.pt", "--data-cache", "{cache}", "--cell-json", "{cell}"), "--out"),
            (("knn", "--tracking-uri", "none", "--features", "{tmp}/f.npz", "--cell-json", "{cell}"), "--out"),
            (("linear", "--tracking-uri", "none", "--features", "{tmp}/f.npz", "--cell-json", "{cell}"), "--out"),
            (("baseline", "--tracking-uri", "none", "--data-cache", "{cache}", "--cell-json", BASELINE_JSON), "--out"),
            (("mi", "--section-json", TINY_MI, "--tracking-uri", "none"), "--out"),
            (("export", "--checkpoint", "{tmp}/ck.pt", "--cell-json", "{cell}"), "--out"),
            (("init-store", "--tracking-uri", "sqlite:///{tmp}/m.db", "--experiment", "x"), "--touch"),
            (
                ("evaluate", "--tracking-uri", "none", "--checkpoint", "{tmp}/ck.pt", "--cell-json", "{cell}"),
                "--features",
            ),
        )
        for kind, make in (("FIFO", fifo), ("folder", folder), ("socket", socket_file))
        if not (kind == "socket" and argv[0] not in ("prepare-data", "export"))
    ),
    Row(
        "knn --out onto a symbolic link",
        ("knn", "--tracking-uri", "none", "--features", "{tmp}/f.npz", "--cell-json", "{cell}", "--out", "{tmp}/link"),
        rf".*/link is a symbolic link, not a regular file; {REFUSED}: choose another path",
        setup=symlink("link"),
    ),
    Row(
        "export --out onto an existing file",
        ("export", "--checkpoint", "{tmp}/ck.pt", "--cell-json", "{cell}", "--out", "{tmp}/mine.pt"),
        r".*/mine\.pt: exists; refused \(never overwritten\): remove it or choose another path",
        {"mine.pt": "my weights\n", "ck.pt": "a checkpoint\n"},
    ),
    Row(
        "export --out onto the cell's own checkpoint",
        ("export", "--checkpoint", "{tmp}/ck.pt", "--cell-json", "{cell}", "--out", "{tmp}/ck.pt"),
        r".*/ck\.pt: exists; refused \(never overwritten\): remove it or choose another path",
        {"ck.pt": "the cell's checkpoint\n"},
    ),
    Row(
        "embed --out onto the checkpoint it reads",
        (
            "embed",
            "--checkpoint",
            "{tmp}/ck.pt",
            "--data-cache",
            "{cache}",
            "--cell-json",
            "{cell}",
            "--out",
            "{tmp}/ck.pt",
        ),
        r"--out .*/ck\.pt is the checkpoint this command reads; refused \(it would be replaced\): choose another path",
        {"ck.pt": "the cell's checkpoint\n"},
    ),
    Row(
        "report --out ''",
        ("report", "--tracking-uri", "sqlite:///{tmp}/none.db", "--out", ""),
        r"--out is empty \(it would name the current folder\); name a file or folder",
    ),
    Row(
        "report --out '~' (a literal tilde)",
        ("report", "--tracking-uri", "sqlite:///{tmp}/none.db", "--out", "~"),
        r"--out = '~' starts with '~', which nothing expands here; write the full path \('.*'\?\)",
    ),
    Row(
        "report --out onto a folder with the user's own index.md",
        ("report", "--tracking-uri", "sqlite:///{tmp}/none.db", "--out", "{tmp}/paper"),
        r"report output .*/paper/index\.md exists and was not written by the report \(not in "
        r".*/paper/\.smallbatch-report-files\); refused: move it, or choose another --out",
        {"paper/index.md": "# my paper\n"},
    ),
    Row(
        "report with a manifest that is not UTF-8",
        ("report", "--tracking-uri", "sqlite:///{tmp}/none.db", "--out", "{tmp}/paper"),
        r"report manifest .*/paper/\.smallbatch-report-files is not UTF-8 text; nothing was rewritten: remove it "
        r"\(the report then treats every file already in the folder as not its own\) or choose another --out",
        {"paper/index.md": "# built before\n", "paper/.smallbatch-report-files": b"index.md\n\xff\xfe\n"},
    ),
    Row(
        "a FIFO as a cell's .lock",
        BY_JSON,
        rf"the lock of cell digits/infonce/bs16-t0\.5-s0, .*/out/\.lock, is a FIFO, not a regular file; {REFUSED}: "
        r"remove it",
        setup=fifo("out/.lock"),
    ),
    Row(
        "a hard link as a cell's .lock",
        BY_JSON,
        rf"the lock of cell digits/infonce/bs16-t0\.5-s0, .*/out/\.lock, is a file with 2 names \(a hard link\); "
        rf"{REFUSED}: remove it",
        setup=hardlink("out/.lock"),
    ),
]


@pytest.mark.parametrize("row", ROWS, ids=[r.name for r in ROWS])
def test_bad_input_stops_with_one_line_and_writes_nothing(row, tmp_path, cache, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # a '~' a library expanded would land here
    for name, text in row.files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(text if isinstance(text, bytes) else text.encode())
    if row.setup is not None:
        row.setup(tmp_path)
    before = {p: p.read_bytes() if p.is_file() and not p.is_symlink() else None for p in tmp_path.rglob("*")}
    cell = json.dumps(row.cell or tiny_cell())
    argv = [a.replace("{tmp}", str(tmp_path)).replace("{cache}", str(cache)).replace("{cell}", cell) for a in row.argv]
    try:
        line = one_line(capsys, argv)
    finally:
        while SOCKETS:
            SOCKETS.pop().close()
    assert re.fullmatch(row.expect, line), line
    after = {p: p.read_bytes() if p.is_file() and not p.is_symlink() else None for p in tmp_path.rglob("*")}
    assert set(after) == set(before), "a refused command wrote a file"
    assert after == before, "a refused command changed a file"
    assert not (tmp_path.parent / "escape_cell").exists()


# --------------------------------------------------------------------------- files that would run code
def write_payload(path: Path, marker: Path, kind: str, cell: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(
        {
            "kind": kind,
            "cell_id": cell["id"],
            "cell_hash": cell["hash"],
            "version": 2,
            "step": 1,
            "model": Payload(marker),
        },
        path,
    )


PICKLES = [
    (
        "state.pt read by pretrain",
        "out/state.pt",
        "state",
        BY_JSON,
        r"checkpoint .*/out/state\.pt holds objects other than tensors and plain values \(.*\); refused, as loading it "
        r"could run code; rerun with --restart to start the cell afresh \(it overwrites state\.pt\), or delete the file",
    ),
    (
        "checkpoint.pt read by evaluate",
        "out/checkpoint.pt",
        "checkpoint",
        (
            "evaluate",
            "--tracking-uri",
            "none",
            "--device",
            "cpu",
            "--checkpoint",
            "{tmp}/out/checkpoint.pt",
            "--out-dir",
            "{tmp}/out",
            "--data-cache",
            "{cache}",
            "--cell-json",
            "{cell}",
        ),
        r"checkpoint .*/out/checkpoint\.pt holds objects other than tensors and plain values \(.*\); refused, as "
        r"loading it could run code",
    ),
    (
        "checkpoint.pt read by embed",
        "out/checkpoint.pt",
        "checkpoint",
        (
            "embed",
            "--checkpoint",
            "{tmp}/out/checkpoint.pt",
            "--out",
            "{tmp}/out/f.npz",
            "--data-cache",
            "{cache}",
            "--cell-json",
            "{cell}",
        ),
        r"checkpoint .*/out/checkpoint\.pt holds objects other than tensors and plain values \(.*\); refused, as "
        r"loading it could run code",
    ),
]


@pytest.mark.parametrize("name,rel,kind,argv,expect", PICKLES, ids=[p[0] for p in PICKLES])
def test_a_crafted_pickle_is_refused_and_its_payload_never_runs(name, rel, kind, argv, expect, tmp_path, cache, capsys):
    cell = tiny_cell()
    marker = tmp_path / "PWNED"
    write_payload(tmp_path / rel, marker, kind, cell)
    argv = [
        a.replace("{tmp}", str(tmp_path)).replace("{cache}", str(cache)).replace("{cell}", json.dumps(cell))
        for a in argv
    ]
    line = one_line(capsys, argv)
    assert re.fullmatch(expect, line), line
    assert not marker.exists(), "the pickle's payload ran"


def test_a_truncated_state_names_restart_and_restart_recovers(tmp_path, cache, capsys):
    cell = tiny_cell()
    argv = [
        a.replace("{tmp}", str(tmp_path)).replace("{cache}", str(cache)).replace("{cell}", json.dumps(cell))
        for a in BY_JSON
    ]
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "state.pt").write_bytes(b"PK\x03\x04 cut short")
    line = one_line(capsys, argv)
    assert "corrupt or truncated" in line and "rerun with --restart" in line, line
    assert cli.main([*argv, "--restart", "--no-progress"]) == 0
    assert (tmp_path / "out" / "checkpoint.pt").is_file()


# --------------------------------------------------------------------------- links
def test_a_lock_that_is_a_symlink_is_refused_and_its_target_untouched(tmp_path, cache, capsys):
    victim = tmp_path / "thesis.tex"
    victim.write_text("my thesis\n")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / ".lock").symlink_to(victim)
    argv = [
        a.replace("{tmp}", str(tmp_path)).replace("{cache}", str(cache)).replace("{cell}", json.dumps(tiny_cell()))
        for a in BY_JSON
    ]
    line = one_line(capsys, argv)
    assert re.fullmatch(
        rf"the lock of cell .*, .*/out/\.lock, is a symbolic link, not a regular file; {REFUSED}: remove it",
        line,
    ), line
    assert victim.read_text() == "my thesis\n"


#: a folder of the results folder replaced by a link to a folder elsewhere: (the linked folder,
#: refused?); the results folder itself may be a link (to a big disk)
LINKED = [
    ("runs", True),
    ("runs/digits", True),
    ("runs/digits/infonce", True),
    (f"runs/{CELL_ID}", True),
    ("", False),
]


@pytest.mark.parametrize("level,refused", LINKED, ids=[lvl or "results itself" for lvl, _ in LINKED])
def test_pretrain_never_writes_through_a_link_inside_the_results_folder(level, refused, tmp_path, cache, capsys):
    """A link at each level under runs/: refused in one line naming the link, nothing written at its
    target; the results folder as a link: the cell is trained there."""
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    results = tmp_path / "results"
    link = results / level if level else results
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(outside, target_is_directory=True)
    tiny = json.dumps({k: v for k, v in TINY.items() if k != "log_every"})
    (tmp_path / "c.yaml").write_text(STUDY_YAML + f"train: {tiny}\ndevice: cpu\nresults_dir: {results}\n")
    argv = [a.replace("{tmp}", str(tmp_path)) for a in BY_ID] + ["--data-cache", str(cache), "--no-progress"]
    if not refused:
        assert cli.main(argv) == 0
        assert (outside / "runs" / CELL_ID / "checkpoint.pt").is_file()
        return
    line = one_line(capsys, argv)
    assert re.fullmatch(
        rf".* lies through the link {re.escape(str(link))} -> {re.escape(str(outside))}, outside the results "
        rf"folder {re.escape(str(results))}; refused \(smallbatch writes nothing outside its results folder\): "
        "remove the link",
        line,
    ), line
    assert list(outside.iterdir()) == [], "written through the link"


#: each way the package writes, into a folder of a results folder (the argument)
WRITERS: dict[str, Callable[[Path], object]] = {
    "a JSON file": lambda folder: io.write_json(folder / "result.json", {}),
    "a cell's lock": lambda folder: io.CellLock(folder / "cell").acquire(),
    "a log": lambda folder: io.open_log(folder / "logs" / "job.log"),
    "a folder": lambda folder: io.make_folder(folder / "figures"),
    "an open file": lambda folder: os.close(io.open_regular(folder / "run.lock")),
}


@pytest.mark.parametrize("writer", WRITERS)
def test_no_writer_writes_through_a_linked_folder_of_a_results_folder(writer, tmp_path):
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    results = tmp_path / "results"
    results.mkdir()
    (results / "runs").symlink_to(outside, target_is_directory=True)
    io.add_results_folder(results)
    with pytest.raises(io.UnsafeTarget, match=rf"lies through the link {re.escape(str(results / 'runs'))} -> "):
        WRITERS[writer](results / "runs" / "digits")
    assert list(outside.iterdir()) == []


def test_report_outputs_refuse_links_and_delete_only_files_the_report_wrote(tmp_path):
    from smallbatch.report import MANIFEST, _check_out_dir, _remove_stale, read_manifest

    out = tmp_path / "paper"
    (out / "tables").mkdir(parents=True)
    user = out / "tables" / "thesis_table.tex"
    user.write_text("mine\n")
    ours = [out / "tables" / "grid.csv", out / "tables" / "old.csv", out / "index.md"]
    for p in ours:
        p.write_text("x\n")
    _remove_stale(out, ours, read_manifest(out))  # first build: records its files, deletes nothing
    assert user.exists() and all(p.exists() for p in ours)
    _remove_stale(out, [ours[0], ours[2]], read_manifest(out))  # a later build no longer writes old.csv
    assert not ours[1].exists(), "a stale file the report wrote was left"
    assert user.read_text() == "mine\n", "the report deleted a user's file"
    assert (out / MANIFEST).read_text().splitlines() == ["index.md", "tables/grid.csv"]
    # a manifest naming a path outside the output folders deletes nothing there
    (out / MANIFEST).write_text("../outside.txt\ntables/thesis_table.tex\n")
    (tmp_path / "outside.txt").write_text("keep\n")
    _remove_stale(out, [ours[0]], read_manifest(out))
    assert (tmp_path / "outside.txt").exists()
    # links: the folder, its tables/ and a file the report would write through
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    for link, target in ((out / "figures", elsewhere), (out / "tables" / "grid.md", user)):
        link.symlink_to(target)
        with pytest.raises(ValueError, match=r"report output .* is a symbolic link; refused"):
            _check_out_dir(out)
        link.unlink()
    linked = tmp_path / "linked"
    linked.symlink_to(out)
    with pytest.raises(ValueError, match="is a symbolic link"):
        _check_out_dir(linked)
    _check_out_dir(out)


def test_a_report_table_replaces_a_hard_linked_file_and_never_writes_through_it(tmp_path):
    """A hard link planted among the report's tables: the table is written beside it and
    renamed into place, so the file under its other name keeps its content."""
    import pandas as pd

    from smallbatch.report.context import ReportContext

    user = tmp_path / "thesis_table.csv"
    user.write_text("mine\n")
    out = tmp_path / "paper"
    (out / "tables").mkdir(parents=True)
    os.link(user, out / "tables" / "t.csv")
    ctx = ReportContext(
        out_dir=out,
        tracking_uri="",
        experiment="x",
        reader=None,
        scale=1.0,
        papers=pd.DataFrame(),
        runs=pd.DataFrame(),
        prior=frozenset({"tables/t.csv", "tables/t.md", "tables/t.tex"}),
    )
    ctx.write_table("t", "T", pd.DataFrame({"a": [1.5]}))
    assert user.read_text() == "mine\n"
    assert (out / "tables" / "t.csv").read_text() == "a\n1.5\n"


@pytest.mark.parametrize("plant", [symlink, hardlink, fifo], ids=["symbolic link", "hard link", "FIFO"])
def test_the_warm_servers_log_is_never_written_through_a_planted_file(plant, tmp_path, monkeypatch):
    """logs/warm_server.log planted as a link or a FIFO: refused in one line naming it, the
    planted target untouched and no server started."""
    from smallbatch.io import UnsafeTarget
    from smallbatch.local import warm

    def no_server(*args, **kwargs):
        raise AssertionError("a server was started")

    monkeypatch.setattr(warm.subprocess, "Popen", no_server)
    plant("logs/warm_server.log")(tmp_path)
    with pytest.raises(UnsafeTarget, match=r"log file .*/logs/warm_server\.log is a .*; refused"):
        warm.start(tmp_path / "logs" / "warm_server.log", 1)
    if (tmp_path / "thesis.tex").exists():
        assert (tmp_path / "thesis.tex").read_text() == "my thesis\n"


# --------------------------------------------------------------------------- the hostile study
def run_study(config: Path, cwd: Path, *args: str) -> subprocess.CompletedProcess:
    """The study of ``config`` through Snakemake (the default profile) in ``cwd`` with ``args``
    (default: 2 cores, quiet)."""
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
    env.pop("MLFLOW_TRACKING_URI", None)
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "snakemake",
            "--snakefile",
            str(ROOT / "Snakefile"),
            "--configfile",
            str(config),
            "--workflow-profile",
            str(ROOT / "workflow/profiles/default"),
            *(args or ("--cores", "2", "--quiet")),
        ],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )


HOSTILE = "x'; touch PWNED_{n}; echo $(touch PWNED_{n}b) ü 'é"


@pytest.mark.slow
def test_a_study_with_hostile_names_runs_no_payload_and_writes_only_in_results_dir(tmp_path):
    """study, tracking_uri, the data root and results_dir each hold ', ;, $( ), spaces and
    non-ASCII: the study runs, nothing of them is run as a command, and every file the jobs
    write is inside results_dir."""
    base = tmp_path / "base"
    base.mkdir()
    results = base / HOSTILE.format(n=1)
    cfg = {
        "study": HOSTILE.format(n=2),
        "results_dir": str(results),
        "tracking_uri": f"sqlite:///{results}/{HOSTILE.format(n=3)}.db",
        "data": {"root": str(results / HOSTILE.format(n=4))},
        "device": "cpu",
        "threads": 1,
        "baselines": False,
        "datasets": {"digits": {"train_subset": 256, "test_subset": 128}},
        "grid": {"losses": ["infonce"], "batch_sizes": [16, 32], "temperatures": [0.5], "seeds": [0]},
        "train": {**TINY, "steps": 6, "log_every": 2},
        "eval": {"knn_k": [5], "linear_iterations": 5},
    }
    config = tmp_path / "hostile.yaml"
    config.write_text(json.dumps(cfg))  # JSON is YAML
    top_before = set(os.listdir(ROOT))
    proc = run_study(config, ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (results / "report" / "index.md").is_file()
    assert list(base.iterdir()) == [results], "a job wrote next to results_dir"
    new_top = set(os.listdir(ROOT)) - top_before
    assert not any("PWNED" in n or n.startswith("x'") or n in ("x", "ü", "'é") for n in new_top), new_top
    for where in (ROOT, tmp_path, Path.cwd(), Path("/tmp")):
        assert not list(where.glob("PWNED*")), f"a payload ran in {where}"
    assert not [p for p in results.rglob("PWNED*") if p.name.startswith("PWNED")], "a payload ran in results_dir"
    from smallbatch.tracking import StoreReader

    reader = StoreReader(cfg["tracking_uri"])
    exp_id, name = reader.experiment(cfg["study"])
    assert name == cfg["study"]
    assert [r["status"] for r in reader.runs(exp_id) if r["tags"].get("smallbatch.kind") == "cell"] == ["finished"] * 2


@pytest.mark.slow
def test_a_link_planted_at_a_jobs_log_is_refused_or_replaced_never_written_through(tmp_path):
    """Links planted where the jobs' logs go before a study runs: a symbolic link to outside the
    results folder stops the study before any job, in one line naming it; a hard link is replaced
    by a log of its own; the planted targets keep their text either way."""
    results = tmp_path / "results"
    cfg = {
        "results_dir": str(results),
        "device": "cpu",
        "baselines": False,
        "datasets": {"digits": {"train_subset": 256, "test_subset": 128}},
        "grid": {"losses": ["infonce"], "batch_sizes": [16], "temperatures": [0.5], "seeds": [0]},
        "train": {**TINY, "steps": 4, "log_every": 2},
        "eval": {"knn_k": [5], "linear_iterations": 5},
        "experiments": {"mi": {"enabled": False}},
    }
    config = tmp_path / "links.yaml"
    config.write_text(json.dumps(cfg))
    symlink("results/logs/init_store.log", "thesis.tex")(tmp_path)
    hardlink("results/logs/report.log", "notes.txt")(tmp_path)
    proc = run_study(config, tmp_path)
    said = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "holds the link" in said and "init_store.log" in said, said[-3000:]
    assert (tmp_path / "thesis.tex").read_text() == "my thesis\n"
    assert not (results / "runs").exists(), "no job ran"
    (results / "logs" / "init_store.log").unlink()  # the user removes the link the refusal named
    proc = run_study(config, tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (tmp_path / "thesis.tex").read_text() == "my thesis\n"
    assert (tmp_path / "notes.txt").read_text() == "my thesis\n"
    for log in ("init_store.log", "report.log"):
        assert not (results / "logs" / log).is_symlink() and (results / "logs" / log).stat().st_nlink == 1


@pytest.mark.slow
def test_values_that_start_with_a_dash_reach_their_options_as_values(tmp_path):
    """study '--help', results_dir '-rf' and data.root '--download' pass validation: the
    study runs, its jobs read them as values (no job fails with an option parser's message),
    and the store's experiment is named --help."""
    cfg = {
        "study": "--help",
        "results_dir": "-rf",
        "data": {"root": "--download"},
        "device": "cpu",
        "baselines": False,
        "datasets": {"digits": {"train_subset": 256, "test_subset": 128}},
        "grid": {"losses": ["infonce"], "batch_sizes": [16], "temperatures": [0.5], "seeds": [0]},
        "train": {**TINY, "steps": 4, "log_every": 2},
        "eval": {"knn_k": [5], "linear_iterations": 5},
        "experiments": {"mi": {"enabled": False}},
    }
    config = tmp_path / "dash.yaml"
    config.write_text(json.dumps(cfg))
    proc = run_study(config, tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = tmp_path / "-rf"
    assert (results / "report" / "index.md").is_file()
    logs = "".join(p.read_text() for p in (results / "logs").rglob("*.log"))
    assert "usage: smallbatch" not in logs and "expected one argument" not in logs
    from smallbatch.tracking import StoreReader

    reader = StoreReader(f"sqlite:///{results / 'mlflow.db'}")
    exp_id, name = reader.experiment("--help")
    assert [r["status"] for r in reader.runs(exp_id) if r["tags"].get("smallbatch.kind") == "cell"] == ["finished"]


# --------------------------------------------------------------------------- one writer per cell per store
@pytest.fixture(scope="module")
def store(tmp_path_factory) -> str:
    uri = f"sqlite:///{tmp_path_factory.mktemp('store') / 'mlflow.db'}"
    assert cli.main(["init-store", "--tracking-uri", uri, "--experiment", "trust"]) == 0
    return uri


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def pretrain_argv(tmp: Path, cache: Path, uri: str, experiment: str, cell: dict, out: str = "out") -> list[str]:
    return [
        "pretrain",
        "--cell-json",
        json.dumps(cell),
        "--out",
        str(tmp / out),
        "--data-cache",
        str(cache),
        "--tracking-uri",
        uri,
        "--experiment",
        experiment,
        "--no-progress",
    ]


LEASES = [  # (who holds the cell's run, refused?)
    ("a live trainer of another folder on this host", lambda out: {"folder": "/elsewhere", "pid": os.getpid()}, True),
    ("another host's trainer, renewed just now", lambda out: {"folder": "/elsewhere", "host": "node-7"}, True),
    ("a dead trainer of another folder", lambda out: {"folder": "/elsewhere", "pid": dead_pid()}, False),
    (
        "another host's trainer, silent for an hour",
        lambda out: {"folder": "/elsewhere", "host": "node-7", "at": __import__("time").time() - 3600},
        False,
    ),
    ("this folder's own earlier trainer (its lock decides)", lambda out: {"folder": str(out.resolve())}, False),
]


@pytest.mark.parametrize("name,holder,refused", LEASES, ids=[row[0] for row in LEASES])
def test_one_trainer_per_cell_per_store(name, holder, refused, tmp_path, cache, store, capsys):
    """A run leased to a live trainer of another folder refuses a second trainer in one line
    (and it logs nothing); a stale lease, or the folder's own, is taken over and released."""
    import socket
    import time

    from smallbatch import tracking

    experiment, cell = f"lease-{LEASES.index((name, holder, refused))}", tiny_cell()
    run = tracking.open_cell_run(store, experiment, cell, kind="cell")
    lease = {"host": socket.gethostname(), "pid": 1, "at": time.time(), **holder(tmp_path / "out")}
    run.set_tags({tracking.TAG_LEASE: json.dumps(lease)})
    argv = pretrain_argv(tmp_path, cache, store, experiment, cell)
    if refused:
        line = one_line(capsys, argv)
        assert re.fullmatch(
            rf"cell {cell['id']} is being trained into the MLflow store {re.escape(store)} from another "
            rf"folder, /elsewhere \(process \d+ on [\w.-]+, seen \d+ s ago\); one trainer per cell per "
            r"store: let it finish, or give this study its own store or experiment",
            line,
        ), line
        assert run.metrics() == {} and json.loads(run.tags()[tracking.TAG_LEASE]) == lease
    else:
        assert cli.main(argv) == 0
        assert tracking.count_cell_runs(store, experiment, cell["id"]) == 1
        tags = run.tags()
        assert tags[tracking.TAG_LEASE] == "" and tags[tracking.TAG_PRETRAIN] == "finished"
        assert "train/final_loss" in run.metrics()


@pytest.mark.slow  # several of the package's processes (pyproject: markers)
def test_the_same_cell_in_two_folders_against_one_store_refuses_the_second(tmp_path, cache, store, capsys):
    """The probe's case with two real trainers: folder a trains; folder b's trainer stops in
    one line while a holds the run; nothing of b reaches the run."""
    import signal
    import time

    from smallbatch import tracking

    cell = tiny_cell(steps=100000)
    first = subprocess.Popen(
        [str(BIN / "smallbatch"), *pretrain_argv(tmp_path, cache, store, "two-folders", cell, "a")],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + HANG_S
        lease = ""
        while not lease:  # the event: a's lease is in the store
            assert first.poll() is None and time.monotonic() < deadline, (
                first.stderr.read() if first.poll() else "timeout"
            )
            runs = tracking.count_cell_runs(store, "two-folders", cell["id"])
            if runs:
                lease = tracking.find_cell_run(store, "two-folders", cell).tags().get(tracking.TAG_LEASE, "")
        line = one_line(capsys, pretrain_argv(tmp_path, cache, store, "two-folders", cell, "b"))
        assert f"from another folder, {(tmp_path / 'a').resolve()} (process {first.pid} " in line, line
        assert not (tmp_path / "b" / "state.pt").exists()
    finally:
        first.send_signal(signal.SIGTERM)
        first.wait(HANG_S)
    assert tracking.count_cell_runs(store, "two-folders", cell["id"]) == 1


# --------------------------------------------------------------------------- what a run says
@pytest.mark.skipif(torch.cuda.is_available(), reason="fp16 on device auto trains where CUDA is")
def test_a_cell_failing_in_setup_ends_its_run_failed_with_the_error(tmp_path, cache, store, capsys):
    from smallbatch import tracking

    # fp16 needs CUDA: on device auto (a cell on cpu is refused before any run) it fails after the run is opened
    cell = rehashed({**edited("train", precision="fp16"), "device": "auto"})
    line = one_line(capsys, pretrain_argv(tmp_path, cache, store, "setup-fails", cell))
    reader = tracking.StoreReader(store)
    (run,) = reader.runs(reader.experiment("setup-fails")[0])
    assert run["status"] == "failed" and "fp16" in run["tags"][tracking.TAG_ERROR], run
    assert run["tags"][tracking.TAG_ERROR].split(": ", 1)[1] in line
    assert run["tags"].get(tracking.TAG_LEASE, "") == ""


def test_a_cells_run_records_the_unit_of_its_accuracies(store):
    """The report reads a run's accuracies by the unit the run records, never by their values."""
    from smallbatch import tracking

    run = tracking.open_cell_run(store, "unit", tiny_cell(), kind="cell")
    assert run.tags()[tracking.TAG_ACCURACY_UNIT] == "percent"


def test_rerunning_a_finished_cell_never_reopens_its_run(tmp_path, cache, store):
    from smallbatch import tracking

    cell = tiny_cell()
    argv = pretrain_argv(tmp_path, cache, store, "rerun", cell)
    assert cli.main(argv) == 0
    first = tracking.find_cell_run(store, "rerun", cell)
    first.set_status("finished")  # as the probes leave it
    assert cli.main(argv) == 0
    reader = tracking.StoreReader(store)
    runs = {r["run_id"]: r for r in reader.runs(reader.experiment("rerun")[0])}
    assert len(runs) == 2 and runs[first.run_id]["status"] == "finished"
    assert first.client.get_run(first.run_id).info.status == "FINISHED"


# --------------------------------------------------------------------------- the warm-start server
SERVER = """
import json, sys
from smallbatch.local import warm
from smallbatch.pipeline import cli

def report_threads(argv):  # the job: which thread counts its libraries run with
    import numpy  # noqa: F401  (imported by the server already)
    from threadpoolctl import threadpool_info
    print(json.dumps({i["internal_api"]: i["num_threads"] for i in threadpool_info()}))
    return 0

if sys.argv[2] == "threads":
    import numpy  # noqa: F401  (OpenBLAS sizes its pool from this process's OMP_NUM_THREADS=2)
warm.PRELOAD = ()  # nothing heavy: these tests are about the protocol
sys.exit(warm.serve(sys.argv[1], report_threads if sys.argv[2] == "threads" else cli.main, None, 120))
"""


@pytest.fixture
def serve(tmp_path):
    """Start a warm-start server on a socket under tmp_path (mode 'plain' or 'threads');
    returns (process, socket path, log path); the server is killed afterwards."""
    started = []

    def start(mode: str = "plain", folder: Path | None = None):
        path, log = (folder or tmp_path) / "s.sock", tmp_path / "server.log"
        env = {
            **{k: v for k, v in os.environ.items() if k != "SMALLBATCH_WARM"},
            "OMP_NUM_THREADS": "2",
            "OPENBLAS_NUM_THREADS": "2",
        }
        with open(log, "w") as out:  # the child keeps its own copy of the descriptor
            proc = subprocess.Popen(
                [sys.executable, "-c", SERVER, str(path), mode], stdout=out, stderr=subprocess.STDOUT, env=env
            )
        started.append(proc)
        wait_for(lambda: "ready on" in log.read_text(), proc, "the server to be ready")
        return proc, path, log

    yield start
    for proc in started:
        proc.kill()
        proc.wait()


def wait_for(event, proc=None, what: str = "", limit: float = HANG_S) -> None:
    """Poll for an event (a hang guard, not a timing assertion)."""
    import time

    deadline = time.monotonic() + limit
    while not event():
        assert proc is None or proc.poll() is None, f"ended while waiting for {what}"
        assert time.monotonic() < deadline, f"no {what} within {limit} s"
        time.sleep(0.05)


def test_a_stopped_server_lets_the_job_run_by_itself_and_never_starts_it_later(serve, monkeypatch):
    import signal

    from smallbatch.local import warm

    proc, path, log = serve()
    os.kill(proc.pid, signal.SIGSTOP)
    monkeypatch.setenv(warm.ENV, str(path))
    monkeypatch.setattr(warm, "ACK_TIMEOUT_S", 1.0)
    try:
        assert warm.delegate(["config-reference"]) is None  # None: "run it here"
    finally:
        os.kill(proc.pid, signal.SIGCONT)
    wait_for(
        lambda: "gave up waiting before its command started: not started" in log.read_text(),
        proc,
        "the server to drop the abandoned request",
    )
    assert not re.search(r"child \d+ started", log.read_text())


def test_a_sigkilled_servers_child_stops_with_it_and_the_client_says_so_in_one_line(serve, tmp_path, cache):

    proc, path, log = serve()
    cell = tiny_cell(steps=10**6)
    client = subprocess.Popen(
        [
            str(BIN / "smallbatch"),
            "pretrain",
            "--cell-json",
            json.dumps(cell),
            "--out",
            str(tmp_path / "out"),
            "--data-cache",
            str(cache),
            "--tracking-uri",
            "none",
            "--no-progress",
        ],
        env={**os.environ, "SMALLBATCH_WARM": str(path)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_for(lambda: " started: smallbatch pretrain" in log.read_text(), client, "the child to start")
        child = int(re.search(r"child (\d+) started", log.read_text()).group(1))
        wait_for(lambda: (tmp_path / "out" / ".lock").exists(), client, "the child to lock its cell")
        proc.kill()
        proc.wait()
        wait_for(lambda: not Path(f"/proc/{child}").exists(), None, "the orphaned child to stop")
        err = client.communicate(timeout=HANG_S)[1]
    finally:
        client.kill()
    # the job's own status: its server's end sent it SIGTERM (PR_SET_PDEATHSIG); it saved and said so
    # itself (preempted), or it was stopped before its handler was set and its client says so
    assert client.returncode == 143, err[-2000:]
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert lines[-1].startswith("smallbatch: preempted: SIGTERM received: ") or lines[-1] == (
        "smallbatch: error: the warm-start server stopped while the command ran, and stopped it (SIGTERM)"
    ), err[-2000:]


@pytest.mark.parametrize("omp", ["1", "2"])
def test_a_jobs_thread_settings_reach_blas_the_server_imported(serve, tmp_path, omp):
    """The server imported numpy with OMP_NUM_THREADS=2; a job asking for 1 runs BLAS on 1."""
    proc, path, log = serve("threads")
    env = {**os.environ, "SMALLBATCH_WARM": str(path), "OMP_NUM_THREADS": omp, "OPENBLAS_NUM_THREADS": omp}
    res = subprocess.run(
        [str(BIN / "smallbatch"), "config-reference"], env=env, capture_output=True, text=True, timeout=HANG_S
    )
    assert res.returncode == 0, res.stderr
    assert " started: smallbatch config-reference" in log.read_text(), "the job did not run in the server"
    threads = json.loads(res.stdout)
    assert threads.get("openblas", threads.get("mkl")) == int(omp), threads


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to connect as another user")
def test_the_server_serves_only_its_own_user(serve, tmp_path):
    import shutil
    import tempfile

    folder = Path(tempfile.mkdtemp(prefix="trust-", dir="/tmp"))
    try:
        _only_its_own_user(serve, folder)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _only_its_own_user(serve, folder: Path) -> None:
    proc, path, log = serve("plain", folder)
    folder.chmod(0o777)
    path.chmod(0o777)  # the file system lets anyone connect: the server's peer check must refuse
    pid = os.fork()
    if pid == 0:  # as nobody: the server must refuse, so the job would run by itself
        code = 1
        try:
            os.setgid(65534)
            os.setuid(65534)
            from smallbatch.local import warm

            os.environ[warm.ENV] = str(path)
            code = 0 if warm.delegate(["config-reference"]) is None else 3
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    wait_for(lambda: "refused a connection of another user" in log.read_text(), proc, "the refusal")
    assert not re.search(r"child \d+ started", log.read_text())


# --------------------------------------------------------------------------- a full disk
class StatvfsFull:
    f_bavail, f_frsize = 0, 4096


DISK_FULL = [  # (how the write fails, is the disk full?)
    ("ENOSPC from a plain write", OSError(28, "No space left on device"), False),
    (
        "torch.save's error on a full file system",
        RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 64"),
        True,
    ),
]


@pytest.mark.parametrize("name,error,full_fs", DISK_FULL, ids=[r[0] for r in DISK_FULL])
def test_a_full_disk_says_so_and_names_the_file(name, error, full_fs, tmp_path, monkeypatch, capsys):
    from smallbatch import io

    if full_fs:
        monkeypatch.setattr(io.os, "statvfs", lambda folder: StatvfsFull())

    def write(fh):
        raise error

    target = tmp_path / "runs" / "c" / "state.pt"
    with pytest.raises(OSError) as info:
        io.atomic_write(target, write)
    assert cli._error_line(info.value) == f"{target}: no space left on device"
    assert list(target.parent.iterdir()) == [], "a temporary file was left"


def test_another_runtime_error_on_a_disk_with_space_is_not_called_full(tmp_path):
    from smallbatch import io

    def write(fh):
        raise RuntimeError("something else")

    with pytest.raises(RuntimeError, match="something else"):
        io.atomic_write(tmp_path / "x", write)


def test_a_stopped_tracking_server_fails_the_step_in_one_line(tmp_path):
    """A server that accepts connections but never answers (SIGSTOPped): the deadline of a
    request (tracking.store_deadline, here 10 s) ends the step with one line saying so."""
    import socket
    import time

    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(16)  # the kernel completes connections; nobody ever reads or answers
    uri = f"http://127.0.0.1:{silent.getsockname()[1]}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_HTTP_REQUEST")}
    env["SMALLBATCH_STORE_TIMEOUT"] = "10"
    t0 = time.monotonic()
    try:
        res = subprocess.run(
            [str(BIN / "smallbatch"), "init-store", "--tracking-uri", uri, "--experiment", "x"],
            capture_output=True,
            text=True,
            timeout=HANG_S,
            env=env,
        )  # a hang guard
    finally:
        silent.close()
    print(f"a silent tracking server failed the step after {time.monotonic() - t0:.1f} s")
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert res.returncode == 2 and len(lines) == 1, res.stderr[-2000:]
    assert lines[0].startswith(f"smallbatch: error: MLflow tracking store {uri} failed while "), lines[0]
    assert lines[0].endswith(
        ": no whole answer within 10 s (a stalled or overloaded server; $SMALLBATCH_STORE_TIMEOUT sets the deadline)"
    ), lines[0]


# --------------------------------------------------------------------------- inputs checked against their cell
CACHES = [  # (the cache's load_dataset options, the cell's dataset options, the line expected or None: trains)
    (
        {"image_size": 16},
        {},
        r"data cache .*/digits\.pt holds image_size 16, not this cell's image_size None; "
        r"delete it to rebuild, or give the cell its own --data-cache",
    ),
    (
        {},
        {"train_subset": 400},
        r"data cache .*/digits\.pt holds train_subset None, not this cell's train_subset 400; .*",
    ),
    (
        {"train_subset": 400, "test_subset": 100},
        {"train_subset": 400, "test_subset": 200},
        r"data cache .*/digits\.pt holds test_subset 100, not this cell's test_subset 200; .*",
    ),
    ({"train_subset": 400}, {"train_subset": 400}, None),
]


@pytest.mark.parametrize("made,wanted,expect", CACHES, ids=[f"{m} for {w}" for m, w, _ in CACHES])
def test_a_data_cache_is_checked_against_the_cells_data(made, wanted, expect, tmp_path, capsys):
    cache = tmp_path / "digits.pt"
    data.save_cache(data.load_dataset("digits", None, **made), cache)
    cfg = load_config(None, {"datasets": {"digits": wanted}, "train": TINY, "device": "cpu"})
    cell = make_cell(cfg, dataset="digits", loss="infonce", loss_params={}, batch_size=16, temperature=0.5, seed=0)
    argv = pretrain_argv(tmp_path, cache, "none", "x", cell) + ["--restart"]
    if expect is None:
        assert cli.main(argv) == 0
        return
    assert re.fullmatch(expect, one_line(capsys, argv))
    assert not (tmp_path / "out" / "checkpoint.pt").exists()


@pytest.mark.slow
def test_a_second_snakemake_run_on_a_results_folder_stops_before_any_job(tmp_path):
    """Two runs on one results folder from two working directories: the second stops in one
    line naming the first, and removes nothing of it (a job's log, an output)."""
    import fcntl

    results = tmp_path / "results"
    log = results / "logs" / "init_store.log"
    log.parent.mkdir(parents=True)
    log.write_text("the first run's log\n")
    config = tmp_path / "c.yaml"
    config.write_text(
        json.dumps(
            {
                "study": "two-runs",
                "results_dir": str(results),
                "device": "cpu",
                "baselines": False,
                "datasets": {"digits": {}},
                "grid": {"losses": ["infonce"], "batch_sizes": [16], "temperatures": [0.5], "seeds": [0]},
            }
        )
    )
    fd = os.open(results / ".snakemake-run.lock", os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)  # the first run holds the folder
    os.write(fd, b"4242\n")
    try:
        res = run_study(config, tmp_path, "--cores", "1", "--directory", str(tmp_path))
    finally:
        os.close(fd)
    out = res.stdout + res.stderr
    assert res.returncode != 0
    assert (
        f"results folder {results} is in use by another Snakemake run (process 4242); wait for it to finish, "
        "or give this run another results_dir" in out
    ), out[-3000:]
    assert log.read_text() == "the first run's log\n"
    assert not (results / "mlflow.ready").exists()
