# Validation, the cell table and helpers shared by all rules.
import json
import sys
from pathlib import Path


# One-line errors naming the key; validate_config also fills the schema's defaults into
# `config`.  (Snakemake's own `validate` reads the schema file alone, which lacks the loss
# names and parameters that smallbatch.config.load_schema adds from the loss registry.)
try:
    from smallbatch.config import (ConfigError, check_data_roots, check_results_dir, read_config_file,
                                   resolve_tracking_uri, validate_config)
    from smallbatch.cells import baseline_cells, expand_cells
    from smallbatch.io import json_text, write_json
except ImportError as exc:  # pragma: no cover - a user without the package installed
    raise WorkflowError(f"the smallbatch package is not importable ({exc}); run `make install` or `pip install -e .`")


# config.yaml is the default; `--configfile other.yaml` replaces it (instead of being
# merged into it, which would mix two studies).  smallbatch reads it first, so a YAML
# error names the file, line and column and an empty file says so (Snakemake's own
# messages name neither).  Files given with --configfile Snakemake reads before any
# workflow code runs: `smallbatch cells --config FILE` names the line of their errors.
if not workflow.overwrite_configfiles:
    try:
        read_config_file("config.yaml")
    except ConfigError as exc:
        raise WorkflowError(f"config error: {exc}") from None

    configfile: "config.yaml"


# Everything that can be checked before a job runs, and before the cells' files are
# written below: the schema and the checks it cannot express (validate_config), the data
# roots, a writable results_dir and a tracking URI MLflow supports.
try:
    validate_config(config)
    check_data_roots(config)
    check_results_dir(config)
    TRACKING_URI = resolve_tracking_uri(config)
except ConfigError as exc:
    raise WorkflowError(f"config error: {exc}") from None

R = config["results_dir"]
EXPERIMENT = config["study"]
CELLS = expand_cells(config)
BASELINES = baseline_cells(config)
THREADS = int(config["threads"])
GPU = 1 if config["device"] == "cuda" else 0
# features.npz is an intermediate: kept by default, a temp() file when keep_features is false
# (the full grid's files are ~1 GB per cell at 28 px with pool_grid 4).
FEATURES = f"{R}/runs/{{cell}}/features.npz"
FEATURES_OUT = FEATURES if config.get("keep_features", True) else temp(FEATURES)
CONDA_ENV = "../../envs/cuda.yaml" if GPU else "../../envs/cpu.yaml"


wildcard_constraints:
    cell=r"[A-Za-z0-9_.=+/-]+?",
    dataset=r"[a-z0-9_]+",


def sync_json(path, obj):
    """Write ``obj`` as JSON to ``path`` only when the content changes (keeps the mtime
    otherwise), so a changed cell config makes exactly that cell's outputs out of date.
    Done while the DAG is built: a `run:` rule per cell would start one Python process
    (~8 s) per cell."""
    p = Path(path)
    if p.is_file() and p.read_text() == json_text(obj):
        return
    write_json(p, obj)


for _cid, _cell in CELLS.items():
    sync_json(f"{R}/runs/{_cid}/cell.json", _cell)
for _bid, _cell in BASELINES.items():
    sync_json(f"{R}/{_bid}/cell.json", _cell)


def cell_of(wildcards):
    try:
        return CELLS[wildcards.cell]
    except KeyError:
        raise WorkflowError(f"unknown cell {wildcards.cell!r}: not in the config's grid")


def data_cache(wildcards):
    return f"{R}/data/cache/{cell_of(wildcards)['dataset']}.pt"


def cell_dir(cell_id):
    return f"{R}/runs/{cell_id}"


CELL_OUTPUTS = [f"{cell_dir(c)}/{f}.json" for c in CELLS for f in ("knn", "linear")]
BASELINE_OUTPUTS = [f"{R}/{b}/result.json" for b in BASELINES]
REPORT_INDEX = f"{R}/report/index.md"
