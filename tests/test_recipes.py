"""The recipes of MAINTAINING.md, walked on a throwaway copy of ``src/``.

For each recipe (``## Add a ...`` with its ``Files:``, ``Tests:`` and ``Regenerate:`` lines) a toy
thing is added by editing the copy, and then:

* the files the toy edit changed are exactly the recipe's ``Files:`` (a ``<name>`` there is
  any file name);
* in a subprocess on the copy (``PYTHONPATH=<copy>/src``) the thing is wired in: the config
  validates with it, ``smallbatch cells`` plans it, ``smallbatch config-reference`` mentions it,
  and it runs (a loss's value and gradient, a probe's metric, a side experiment's cells and
  section, a key that reaches the typed cell and its hash);
* what the recipe says to regenerate is what changed: CONFIGURATION.md when the reference
  differs, the golden cell hashes when a default cell's hash moved;
* the written-out tables its ``Tests:`` line names are still in that test file.

A recipe that goes stale -- a file renamed, a step no longer enough, a table gone -- fails here.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from fnmatch import fnmatch
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
MAINTAINING = REPO / "MAINTAINING.md"
GOLDEN_HASHES = "tests/fixtures/default_cell_hashes.json"
#: the study every check plans: one digits cell of InfoNCE (its hash: the "default cell")
BASE = {"datasets": {"digits": {}}, "grid": {"losses": ["infonce"], "batch_sizes": [16], "temperatures": [0.1]}}
BASE["grid"]["seeds"] = [0]


# --------------------------------------------------------------------------- MAINTAINING.md read
def recipes() -> dict[str, dict[str, list[str]]]:
    """{recipe: {"Files": [...], "Tests": [test file, name, ...], "Regenerate": [...]}} of every
    ``## Add a <recipe>`` section (its name up to a parenthesis)."""
    out: dict[str, dict[str, list[str]]] = {}
    current = None
    for line in MAINTAINING.read_text(encoding="utf-8").splitlines():
        heading = re.match(r"## Add an? ([^(]+?)\s*(\(.*)?$", line)
        if heading:
            current = out.setdefault(heading.group(1), {})
        elif line.startswith("## "):
            current = None
        elif current is not None and re.match(r"(Files|Tests|Regenerate): ", line):
            key, _, rest = line.partition(": ")
            if key == "Tests":
                path, _, names = rest.partition(" (")
                current[key] = [path, *(n.strip() for n in names.rstrip(")").split(",") if n.strip())]
            else:
                current[key] = [p.strip() for p in rest.split(",") if p.strip() != "nothing"]
    return out


def test_maintaining_names_the_five_recipes_each_with_its_files():
    found = recipes()
    assert set(found) == set(WALKS), sorted(found)
    for name in WALKS:
        files = found[name].get("Files", [])
        assert 1 <= len(files) <= 3, f"the {name} recipe lists {len(files)} files: {files}"
        assert all(f.startswith("src/smallbatch/") for f in files), files


def _shipped_study(p: Path) -> bool:
    return p.is_relative_to(REPO / "src/smallbatch/resources/study")


def test_the_comment_rule_holds_in_src():
    """No test path, benchmark record or issue number in ``src/`` (MAINTAINING.md: history in
    git, numbers in benchmarks/results)."""
    rule = re.compile(r"\btests/\w|benchmarks/results/|\bissues? #?\d|\(#\d+\)")
    found = [
        f"{p.relative_to(REPO)}:{i}"
        for p in sorted((REPO / "src").rglob("*"))
        # the study files init-study ships are links to the repo's own Snakefile, workflow and config
        if p.suffix in (".py", ".yaml") and "__pycache__" not in p.parts and not _shipped_study(p)
        for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1)
        if rule.search(line)
    ]
    assert found == [], f"src names tests, records or issues: {found}"


# --------------------------------------------------------------------------- the copy and its edits
def _snapshot(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root.parent)): p.read_bytes()
        for p in root.rglob("*")
        if p.is_file() and "__pycache__" not in p.parts
    }


def _edit(path: Path, old: str, new: str) -> None:
    """Replace the one occurrence of ``old`` in ``path``: a step whose anchor is gone (a file
    renamed, its code rewritten) fails here, naming the file and the anchor."""
    assert path.is_file(), f"{path.name}: no such file (a recipe's file renamed?)"
    text = path.read_text(encoding="utf-8")
    assert text.count(old) == 1, f"{path.name}: {old!r} found {text.count(old)} times, not once"
    path.write_text(text.replace(old, new), encoding="utf-8")


def _append_entry(path: Path, table: str, entry: str) -> None:
    """``entry`` as the last item of the registry ``table`` (a tuple, or a dict built from one)."""
    lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
    start = next((i for i, s in enumerate(lines) if re.match(rf"{table}\b.*=", s)), None)
    assert start is not None, f"{path.name}: no {table} = ... (the registry renamed?)"
    end = next(i for i in range(start + 1, len(lines)) if lines[i].rstrip() in (")", "}"))
    at = end - 1 if lines[end].rstrip() == "}" else end  # a dict comprehension: inside its tuple
    indent = re.match(r"\s*", lines[at - 1]).group(0)
    lines.insert(at, textwrap.indent(textwrap.dedent(entry).strip("\n") + ",\n", indent))
    path.write_text("".join(lines), encoding="utf-8")


def _append(path: Path, text: str) -> None:
    with path.open("a", encoding="utf-8") as f:
        f.write("\n\n" + textwrap.dedent(text))


def _loss(src: Path) -> None:
    pkg = src / "smallbatch" / "losses"
    _append_entry(
        pkg / "registry.py",
        "SPECS",
        """
        LossSpec(
            name="scaled_infonce",
            display="Scaled InfoNCE",
            paper="van den Oord et al. 2018 (InfoNCE, scaled)",
            impl=".softmax:ScaledInfoNCE",
            params={"scale": _number("scaled_infonce: the factor on InfoNCE", 1.0, exclusiveMinimum=0)},
        )""",
    )
    _append(
        pkg / "softmax.py",
        '''
        class ScaledInfoNCE(ContrastiveLoss, spec="scaled_infonce"):
            """InfoNCE (van den Oord et al. 2018) times ``scale``."""

            def _rows(self, pos, neg, neg_mask, tau, batch_pos):
                rows = self.scale * infonce_rows(pos, neg, neg_mask, tau)
                return rows, rows
        ''',
    )
    _edit(pkg / "softmax.py", "__all__ = [", '__all__ = ["ScaledInfoNCE", ')
    _edit(pkg / "__init__.py", '"softmax": (', '"softmax": ("ScaledInfoNCE", ')


LOSS_CHECK = """
import torch
from smallbatch.losses import ScaledInfoNCE, build_loss, display_name
from smallbatch.study.cells import expand_cells
from smallbatch.study.config import ConfigError, validate_config

grid = {**BASE["grid"], "losses": ["scaled_infonce"]}
cells = expand_cells(validate_config({**BASE, "grid": grid, "loss_params": {"scaled_infonce": {"scale": 2.0}}}))
(cell,) = cells.values()
assert cell["loss"] == "scaled_infonce" and cell["loss_params"] == {"scale": 2.0}, cell
try:
    validate_config({**BASE, "grid": grid, "loss_params": {"scaled_infonce": {"scale": -1.0}}})
    raise AssertionError("a scale of -1 was planned")
except ConfigError as e:
    assert "scale" in str(e), e
assert display_name("scaled_infonce") == "Scaled InfoNCE"
torch.manual_seed(0)
z1 = torch.randn(8, 16, dtype=torch.float64, requires_grad=True)
z2 = torch.randn(8, 16, dtype=torch.float64)
out = build_loss("scaled_infonce", scale=2.0)(z1, z2, temperature=0.5)
plain = build_loss("infonce")(z1, z2, temperature=0.5)
assert isinstance(build_loss("scaled_infonce"), ScaledInfoNCE)
assert torch.isfinite(out.loss) and abs(float(out.loss) - 2 * float(plain.loss)) < 1e-9, (out.loss, plain.loss)
out.loss.backward()
assert z1.grad is not None and bool(torch.isfinite(z1.grad).all()) and float(z1.grad.abs().sum()) > 0
"""


def _probe(src: Path) -> None:
    _append_entry(
        src / "smallbatch" / "study" / "probe_registry.py",
        "SPECS",
        """
        ProbeSpec(
            name="norm",
            title="the mean norm of a cell's test features",
            impl=".norm:run_probe",
            metric="mean",
            label="feature norm",
        )""",
    )
    (src / "smallbatch" / "evaluation" / "norm.py").write_text(
        textwrap.dedent(
            '''
            """The mean norm of a cell's test features (a toy probe)."""


            def run_probe(features, settings):
                import numpy as np

                return {"mean": float(np.linalg.norm(np.asarray(features[2]), axis=1).mean())}
            '''
        ).lstrip(),
        encoding="utf-8",
    )


PROBE_CHECK = """
import numpy as np
from smallbatch.study.cell import Cell
from smallbatch.study.cells import expand_cells
from smallbatch.study.probe_registry import probe_function, report_labels

cfg = validate_config({**BASE, "eval": {"probes": ["knn", "linear", "norm"]}})
(cell,) = (Cell.of(c) for c in expand_cells(cfg).values())
assert cell.eval.probes == ("knn", "linear", "norm"), cell.eval.probes
assert report_labels()["norm"] == "feature norm"
rng = np.random.default_rng(0)
x = np.full((20, 4), 0.5)  # every row's norm is 1
feats = (rng.normal(size=(30, 4)), rng.integers(0, 3, 30), x, rng.integers(0, 3, 20))
metrics = probe_function("norm")(feats, {"seed": 0})
assert set(metrics) == {"mean"} and abs(metrics["mean"] - 1.0) < 1e-12, metrics
from smallbatch.pipeline.cli_parser import build_parser

sub = next(a for a in build_parser()._actions if a.dest == "command")
assert "norm" in sub.choices, sorted(sub.choices)  # its command: smallbatch norm
"""


def _side_experiment(src: Path) -> None:
    _append_entry(
        src / "smallbatch" / "study" / "experiments.py",
        "SPECS",
        """
        SideExperiment(
            "toy",
            "a toy side experiment: the main grid's cells again",
            "toy",
            tables=(("toy_", "Side experiment (toy)."),),
        )""",
    )
    (src / "smallbatch" / "report" / "sections" / "toy.py").write_text(
        textwrap.dedent(
            '''
            """Section 'toy': a toy side experiment's cells, counted."""

            from __future__ import annotations

            from ..context import SectionOutput
            from ..runs import select_cells


            def build(runs, ctx):
                cells = select_cells(runs, "toy", (), ctx.notes)
                if cells.empty:
                    return None
                return SectionOutput("toy", "Side experiment: toy", f"{len(cells)} cells", run_ids=set(cells["run_id"]))
            '''
        ).lstrip(),
        encoding="utf-8",
    )


SIDE_CHECK = """
import smallbatch.report as report
from smallbatch.report.captions import caption_of
from smallbatch.study.cells import expand_cells

section = {"enabled": True, "batch_sizes": [16, 32]}
cells = expand_cells(validate_config({**BASE, "grid": {**BASE["grid"], "enabled": False}, "experiments": {"toy": section}}))
assert len(cells) == 2 and {c["experiment"] for c in cells.values()} == {"toy"}, sorted(cells)
assert all(cid.startswith("toy/") for cid in cells), sorted(cells)
names = [m.__name__.rsplit(".", 1)[1] for m in report.SECTION_MODULES]
assert "toy" in names and names.index("toy") > names.index("papers"), names
from smallbatch.report.sections.toy import build
assert callable(build) and build in report.SECTIONS
assert caption_of("toy_digits", "tables") == "Side experiment (toy)."
"""


def _config_key(src: Path) -> None:
    schema = src / "smallbatch" / "resources" / "config.schema.yaml"
    key = 'lr_factor: {type: number, exclusiveMinimum: 0, default: 1.0, description: "a factor on the peak rate"}'
    axis = 'lr_factor: {type: array, minItems: 1, items: {type: number, exclusiveMinimum: 0}, description: "values of train.lr_factor"}'
    text = schema.read_text(encoding="utf-8")
    for block, line in (("\n  train:\n", key), ("\n  axes:\n", axis)):
        at = text.index(block)  # (ValueError: the block is gone)
        props = text.index("    properties:\n", at) + len("    properties:\n")
        text = text[:props] + f"      {line}\n" + text[props:]
    schema.write_text(text, encoding="utf-8")
    cell = src / "smallbatch" / "study" / "cell.py"
    body = cell.read_text(encoding="utf-8")
    cls = body.index("class TrainSettings")
    first_default = re.compile(r"^    \w+: [^=\n]+ = ", re.M).search(body, cls)
    assert first_default, "TrainSettings has no field with a default to insert before"
    cell.write_text(body[: first_default.start()] + "    lr_factor: float\n" + body[first_default.start() :])
    _edit(
        src / "smallbatch" / "training" / "loop.py",
        "peak = scaled_lr(float(settings.lr), bs, settings.lr_scaling)",
        "peak = scaled_lr(float(settings.lr), bs, settings.lr_scaling) * float(settings.lr_factor)",
    )


KEY_CHECK = """
import smallbatch.training.loop  # the reading module still imports
from smallbatch.study.cell import Cell
from smallbatch.study.cellcheck import cell_json_problem
from smallbatch.study.cells import expand_cells

(cell,) = expand_cells(validate_config({**BASE, "train": {"lr_factor": 2.0}})).values()
assert Cell.of(cell).train.lr_factor == 2.0 and cell_json_problem(cell, baseline=False) is None
default = base_cell()
assert Cell.of(default).train.lr_factor == 1.0 and cell["hash"] != default["hash"]
swept = expand_cells(validate_config({**BASE, "grid": {**BASE["grid"], "axes": {"lr_factor": [1.0, 2.0]}}}))
assert sorted(c["train"]["lr_factor"] for c in swept.values()) == [1.0, 2.0], sorted(swept)
assert len({c["hash"] for c in swept.values()}) == 2 and all("lr_factor" in cid for cid in swept), sorted(swept)
"""


def _data_set(src: Path) -> None:
    pkg = src / "smallbatch" / "data"
    _append_entry(
        pkg / "registry.py",
        "SPECS",
        """
        DatasetSpec(name="noise", display="noise", reader="random_uint8", sizes={"train": 64, "test": 32}, classes=4)""",
    )
    readers = pkg / "readers.py"
    text = readers.read_text(encoding="utf-8")
    at = re.search(r"^(#:.*\n)*READERS\b", text, re.M)
    assert at, "readers.py has no READERS (the readers' table renamed?)"
    reader = textwrap.dedent(
        """
        def _load_noise(spec, root, download, image_size):
            rng = np.random.default_rng(0)
            side, (n, m) = image_size or 8, (spec.sizes["train"], spec.sizes["test"])
            return {
                "train_x": rng.integers(0, 256, (n, side, side), dtype=np.uint8),
                "train_y": np.arange(n) % spec.classes,
                "test_x": rng.integers(0, 256, (m, side, side), dtype=np.uint8),
                "test_y": np.arange(m) % spec.classes,
                "channels_last": False,
                "num_classes": spec.classes,
                "classes": [str(c) for c in range(spec.classes)],
                "source": "numpy random, seed 0",
            }


        """
    ).lstrip()
    text = text[: at.start()] + reader + text[at.start() :]
    readers.write_text(re.sub(r"(?m)^(READERS\b.*= \{\n)", r'\1    "random_uint8": _load_noise,\n', text))
    _edit(
        pkg / "digest.py",
        '    raise ValueError(f"no digest rule',
        '    if reader == "random_uint8":\n        return "generated:numpy-seed0"\n    raise ValueError(f"no digest rule',
    )


DATA_CHECK = """
import torch
from smallbatch.data.load import load_dataset
from smallbatch.pipeline.cli_parser import build_parser
from smallbatch.study.cells import expand_cells

from smallbatch.study.config import ConfigError

small = {**BASE, "datasets": {"noise": {"train_subset": 40}}}
try:  # its sizes reach the checks made before any job: kNN's default k = 200 > 40 images
    validate_config(small)
    raise AssertionError("a k of 200 was planned on 40 images")
except ConfigError as e:
    assert "40 train images of noise" in str(e), e
(cell,) = expand_cells(validate_config({**small, "eval": {"knn_k": [5]}})).values()
assert cell["dataset"] == "noise" and cell["data_digest"] == "generated:numpy-seed0", cell
data = load_dataset("noise", None, train_subset=40)
assert data.train_x.dtype == torch.uint8 and tuple(data.train_x.shape) == (40, 1, 8, 8), data.train_x.shape
assert tuple(data.test_x.shape) == (32, 1, 8, 8) and data.num_classes == 4
sub = next(a for a in build_parser()._actions if a.dest == "command")
assert "noise" in next(a for a in sub.choices["prepare-data"]._actions if a.dest == "dataset").help
"""

#: recipe -> (the toy edit, its check, the config `smallbatch cells` plans, what the reference must name)
WALKS = {
    "loss": (
        _loss,
        LOSS_CHECK,
        {"grid": {**BASE["grid"], "losses": ["scaled_infonce"]}},
        "loss_params.scaled_infonce.scale",
    ),
    "probe": (_probe, PROBE_CHECK, {"eval": {"probes": ["norm"]}}, "norm: norm/mean"),
    "side experiment": (_side_experiment, SIDE_CHECK, {"experiments": {"toy": {"enabled": True}}}, "experiments.toy"),
    "data set": (_data_set, DATA_CHECK, {"datasets": {"noise": {}}, "eval": {"knn_k": [5]}}, ""),
    "config key": (_config_key, KEY_CHECK, {"grid": {**BASE["grid"], "axes": {"lr_factor": [2.0]}}}, "train.lr_factor"),
}

#: what every check script starts with: the copy is the package imported, and its default cell
PRELUDE = f"""
import json, sys
from pathlib import Path
import smallbatch
from smallbatch.study.config import validate_config
assert Path(smallbatch.__file__).is_relative_to(Path(sys.argv[1])), smallbatch.__file__
BASE = {BASE!r}

def base_cell():
    from smallbatch.study.cells import expand_cells

    (cell,) = expand_cells(validate_config(BASE)).values()
    return cell
"""
EPILOGUE = 'print("RESULT " + json.dumps({"hash": base_cell()["hash"]}))\n'


def _run(args: list[str], src: Path, cwd: Path) -> str:
    env = {**os.environ, "PYTHONPATH": str(src)}
    done = subprocess.run([sys.executable, *args], env=env, cwd=cwd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, (
        f"{' '.join(args[:3])}: rc {done.returncode}\n{done.stdout[-2000:]}{done.stderr[-4000:]}"
    )
    return done.stdout


def _matches(edited: set[str], patterns: list[str]) -> bool:
    """Each edited file matches its own pattern of the recipe (``<name>``: any name), none left over."""
    globs = [re.sub(r"<[^>]+>", "*", p) for p in patterns]
    left = sorted(edited)

    def assign(i: int, free: list[str]) -> bool:
        if i == len(globs):
            return not free
        return any(fnmatch(f, globs[i]) and assign(i + 1, [g for g in free if g != f]) for f in free)

    return len(left) == len(globs) and assign(0, left)


@pytest.fixture(scope="module")
def default_hash() -> str:
    """The default cell's hash by the unedited sources."""
    from smallbatch.study.cells import expand_cells
    from smallbatch.study.config import validate_config

    (cell,) = expand_cells(validate_config(json.loads(json.dumps(BASE)))).values()
    return cell["hash"]


@pytest.mark.slow
@pytest.mark.parametrize("name", list(WALKS))
def test_each_recipe_adds_its_thing_by_its_files_alone(name, tmp_path, default_hash):
    recipe = recipes()[name]
    edit, check, planned, mention = WALKS[name]
    src = tmp_path / "src"
    shutil.copytree(REPO / "src", src, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    before = _snapshot(src)
    edit(src)
    after = _snapshot(src)
    edited = {f for f in before.keys() | after.keys() if before.get(f) != after.get(f)}
    assert _matches(edited, recipe["Files"]), (
        f"the toy {name} edited {sorted(edited)}; the recipe lists {recipe['Files']}"
    )

    script = tmp_path / "check.py"
    script.write_text(PRELUDE + textwrap.dedent(check) + EPILOGUE, encoding="utf-8")
    out = _run([str(script), str(src)], src, tmp_path)
    moved = json.loads(out.rsplit("RESULT ", 1)[1])["hash"] != default_hash
    config = tmp_path / "toy.yaml"
    config.write_text(json.dumps({**BASE, "study": "toy", "results_dir": str(tmp_path / "results"), **planned}))
    cells = _run(["-m", "smallbatch", "cells", "--config", str(config)], src, tmp_path)
    assert cells.strip(), f"smallbatch cells planned nothing for the toy {name}"
    reference = _run(["-m", "smallbatch", "config-reference"], src, tmp_path)
    assert mention in reference, f"smallbatch config-reference does not mention {mention!r}"  # ("": names none)

    regenerate = set(recipe.get("Regenerate", []))
    stale = reference != (REPO / "CONFIGURATION.md").read_text(encoding="utf-8")
    assert ("CONFIGURATION.md" in regenerate) == stale, f"the toy {name} changes CONFIGURATION.md: {stale}"
    assert (GOLDEN_HASHES in regenerate) == moved, f"the toy {name} moves the default cell's hash: {moved}"
    test_file, *tables = recipe["Tests"]
    text = (REPO / test_file).read_text(encoding="utf-8")
    for table in tables:
        assert re.search(rf"^(def )?{table}\b", text, re.M), f"{test_file} has no {table}"
