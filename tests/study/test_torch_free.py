"""Reading a study needs no torch: the report's import, the config's checks, the cells'
expansion and every check of a cell's settings (:mod:`smallbatch.study.checks`) run without it,
each in a fresh interpreter (a module imported by another test would hide it)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
STUDY = ROOT / "config.yaml"
#: the study with a loss parameter off its registry default: checked by the registry's bounds and
#: relations (:func:`smallbatch.losses.registry.params_problem`), not by building the loss
OTHER_PARAMS = {"loss_params": {"eqco": {"alpha": 64}, "dclw": {"sigma": 0.25}}}
READ_STUDY = """
import json, sys
from smallbatch.study.cellcheck import cell_problem
from smallbatch.study.cells import expand_cells
from smallbatch.study.config import load_config
from smallbatch.study.cell import Cell
cfg = load_config(sys.argv[1], json.loads(sys.argv[2]))
cells = expand_cells(cfg)
problems = [cell_problem(Cell.of(c)) for c in cells.values()]  # the schema's, then every one of smallbatch.study.checks
print(json.dumps([len(cells), sum(p is not None for p in problems), "torch" in sys.modules]))
"""


def _run(code: str, *args: str) -> list:
    res = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_the_report_imports_without_torch():
    assert _run("import json, sys, smallbatch.report; print(json.dumps(['torch' in sys.modules]))") == [False]


def test_the_study_config_its_cells_and_their_checks_run_without_torch():
    n_cells, n_problems, torch_loaded = _run(READ_STUDY, str(STUDY), json.dumps(OTHER_PARAMS))
    assert n_cells > 10 and n_problems == 0
    assert not torch_loaded


@pytest.mark.parametrize("module", ["smallbatch.data.load", "smallbatch.training.loop"])
def test_the_check_sees_a_module_that_loads_torch(module):  # the two tests above can fail
    assert _run(f"import json, sys, {module}; print(json.dumps(['torch' in sys.modules]))") == [True]
