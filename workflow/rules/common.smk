# Validation, the cell table and helpers shared by all rules.
#
# Shell quoting, the convention of every rule: no value from the config, a cell or a path
# reaches the shell unquoted.  Every `{...}` placeholder in a `shell:` carries `:q`
# (Snakemake quotes it with shlex.quote; a list becomes one quoted word per item and an
# empty list nothing), `{output:q}` and `{log:q}` included; an optional option is a list
# param made by `flag()` (smallbatch.pipeline.plan).  The one exception is `{params.launch}`, the launcher that
# smallbatch.training.launch.launch_command builds from no config value.
# An option's value is joined to it with `=` (`--experiment={params.exp:q}`), so a value
# that starts with a dash (a study named `--help`, a results_dir `-rf`) is that option's
# value, never another option.  A job's log is removed before the shell writes it
# (`rm -f -- {log:q} && ... > {log:q}`): a link, FIFO or hard link planted at a log's path
# is replaced, never written through.  tests/pipeline/test_trust.py checks every rule file.
import json
import os
import sys
from pathlib import Path


# One-line errors naming the key; load_config also fills the schema's defaults into the config.
# (Snakemake's own `validate` reads the schema file alone, which lacks the loss names and
# parameters that smallbatch.study.schema.load_schema adds from the loss registry.)
try:
    from smallbatch.study.config import (SET_KEY, ConfigError, base_notice, check_data_roots, check_results_dir,
                                   load_config, resolve_tracking_uri, sets_line, snakemake_sets,
                                   snakemake_settings)
    from smallbatch.study.cells import temperature_notes
    from smallbatch.pipeline.plan import StudyPlan, flag, hold_results_folder
    from smallbatch.io import RESULTS_ENV
    from smallbatch.pipeline import plan as _plan
    from smallbatch.errors import PluginError
    from smallbatch.report.captions import captions, labels as report_labels
    from smallbatch.training.launch import launch_command
except ImportError as exc:  # pragma: no cover - a user without the package installed
    raise WorkflowError(f"the smallbatch package is not importable ({exc}); run `make install` or `pip install -e .`")


# The config: config.yaml, or the --configfile files laid one over another in order, and the
# --config KEY=VALUE pairs over them -- read by smallbatch.study.config.load_config, as
# `smallbatch cells --config A --config B` reads them, so both plan the same cells.  Snakemake has
# merged the files into `config` itself before this code runs (key by key: an overlay could not
# drop a data set, nor a file's `replace:` list apply); that merge is replaced by load_config's.
# smallbatch reads the files itself, so what Snakemake's reading lets pass (a key given twice, an
# empty file) stops in one line naming the file, and config.yaml's YAML errors name the line and
# column (Snakemake parses --configfile files before this code runs).  Then everything that can be
# checked before a job runs, and before the cells' files are written below: the schema and the
# checks it cannot express (validate_config), the data roots, a writable results_dir and a
# tracking URI MLflow supports.
# `--config set='grid.seeds=[0] train.epochs=2'` is the CLI's `--set grid.seeds=[0] train.epochs=2`
# (Snakemake's own --config takes no dotted key): laid over the files as one more file, before
# the other --config pairs (their values read as YAML 1.2, not as Snakemake's text); the plan prints them.
CONFIG_FILES = [str(p) for p in workflow.overwrite_configfiles] or ["config.yaml"]
_settings = dict(workflow.config_settings.config)
try:
    SETS = snakemake_sets(_settings[SET_KEY]) if SET_KEY in _settings else []
    _loaded = load_config(CONFIG_FILES, snakemake_settings(_settings), SETS)
    check_data_roots(_loaded)
    check_results_dir(_loaded)
    TRACKING_URI = resolve_tracking_uri(_loaded)
except (ConfigError, PluginError) as exc:  # PluginError: an installed plugin (loss, data set) that does not load
    raise WorkflowError(f"config error: {exc}") from None
if not workflow.overwrite_configfiles:

    configfile: "config.yaml"


config.clear()
config.update(_loaded)
_note = base_notice(CONFIG_FILES)  # the first file names no study: laid over the schema's defaults
if _note:
    print(f"smallbatch: {_note}", file=sys.stderr)
if SETS:
    print(f"smallbatch: {sets_line(SETS)}", file=sys.stderr)
for _line in temperature_notes(config):  # a loss without a temperature: planned once
    print(f"smallbatch: {_line}", file=sys.stderr)

R = config["results_dir"]
# every job writes inside the results folder's real location, never through a link planted in it
# (smallbatch.io.check_inside); a job names only its files, so it learns the folder from here
os.environ[RESULTS_ENV] = os.path.abspath(os.path.expanduser(R))
EXPERIMENT = config["study"]
# The plan (smallbatch.pipeline.plan): typed cells and baselines, their settings stamps and
# outputs.  Settings stamps: <results_dir>/<folder>/.settings-<hash>, an input of the job
# that computes in that folder, written by the local rule `settings` just before it; an
# output that exists without its stamp holds results of other settings and reruns (stamp_of).
PLAN = StudyPlan.from_config(config)
CELLS, BASELINES = PLAN.cells, PLAN.baselines
# one_job_per_cell: the rule run_cell (evaluate.smk) in place of pretrain, evaluate, evaluate_snapshot
ONE_JOB_PER_CELL = PLAN.one_job_per_cell
_problem = PLAN.one_process_problem()
if _problem:
    raise WorkflowError(f"config error: {_problem}")
THREADS = int(config["threads"])


def _workflow_error(fn, *args):
    """``fn(*args)``, its ValueError shown as Snakemake's one-line WorkflowError."""
    try:
        return fn(*args)
    except ValueError as exc:
        raise WorkflowError(str(exc)) from None


def write_settings(folder, stamp, log):
    """The `settings` rule's job (StudyPlan.write_settings)."""
    _workflow_error(PLAN.write_settings, folder, stamp, log)


def stamp_of(folder):
    """The input function part of a stamped job: the stamp of ``folder``'s planned settings.
    When the job's output exists without that stamp (it was computed under other settings),
    the output is forced to rerun, as `--forcerun FILE` would (Snakemake leaves a job whose
    output exists alone when only an input is missing; it asks for the inputs while it
    builds the DAG, before it decides which jobs run)."""
    stale = _workflow_error(PLAN.stale_output, folder)
    if stale:
        forced = getattr(workflow.dag, "forcefiles", None)
        if not isinstance(forced, set):  # a Snakemake whose DAG keeps them elsewhere: say so, run nothing
            raise WorkflowError(
                f"{stale} was computed under other settings than the config's (no {PLAN.settings_stamp(folder)}); "
                f"delete {os.path.dirname(stale)} to recompute it, or give the study another results_dir"
            )
        forced.add(stale)
    return PLAN.settings_stamp(folder)


# features.npz: not written by default (the evaluation step keeps the features in memory);
# keep_features writes it next to the probes' results.
KEEP_FEATURES = bool(config["keep_features"])
FEATURES = f"{R}/runs/{{cell}}/features.npz"
EVAL_FEATURES = [FEATURES] if KEEP_FEATURES else []
# the probes' result files (eval.probes, study-wide; smallbatch.study.probe_registry): probe -> file name
PROBE_FILES = PLAN.probe_files


RUN_LOCK = {}
# Warm start (smallbatch.local.warm): a local run serves its jobs from one process that has
# imported torch, MLflow and faiss once; jobs on a cluster run as plain processes.
WARM = {}


def start_run():
    """onstart (so a dry run writes nothing): hold the results folder (one Snakemake run per
    results folder: smallbatch.pipeline.plan.hold_results_folder), write every cell's and
    baseline's cell.json (the jobs read their cell from it) and the study's plan.json (what the
    report of a study stopped early says never ran; the console's ETA reads each cell's cost),
    start the warm server."""
    RUN_LOCK["fd"] = _workflow_error(hold_results_folder, R)
    PLAN.write_cell_files()
    _workflow_error(PLAN.write_plan, EXPERIMENT)  # a link planted at plan.json: one line, no job
    if config["warm_start"] and workflow.local_exec:
        from smallbatch.local import warm

        try:
            WARM["server"] = warm.start(f"{R}/logs/warm_server.log", THREADS)
        except ValueError as exc:  # its log is a link, a FIFO or a hard link (smallbatch.io.open_regular)
            raise WorkflowError(str(exc)) from None


def stop_warm_server():
    """onsuccess / onerror."""
    if WARM:
        from smallbatch.local import warm

        warm.stop(WARM.pop("server"))


def gpu_study():
    """Do the cells train on GPUs?  device cuda; or device auto where torch sees a GPU, or
    where jobs go to a cluster (a GPU cluster's login node often has none)."""
    if config["device"] != "auto":
        return config["device"] == "cuda"
    import torch

    return torch.cuda.is_available() or _jobs_go_to_a_cluster()


def _jobs_go_to_a_cluster():
    """True when the jobs are submitted to (or run inside) a cluster executor such as SLURM.
    Snakemake only knows its executor once the workflow runs (this is asked from resource
    functions, which run then), and a dry run swaps the executor for 'dryrun' — whose
    use_threads setting still carries the intended executor's 'not local', and whose default
    resources the intended executor's 'full' set (snakemake.api.execute_workflow): a local run
    has threads too (our default profile's force-use-threads) but no default resources."""
    if workflow.remote_exec or workflow.non_local_exec:
        return True
    threads = getattr(workflow.execution_settings, "use_threads", False)
    return bool(workflow.dryrun and threads and workflow.resource_settings.default_resources is not None)


def conda_env(wildcards):
    return "../../envs/cuda.yaml" if gpu_study() else "../../envs/cpu.yaml"


CELLS_PER_GPU = int(config["cells_per_gpu"])
if config["device"] != "cpu" and workflow.local_exec and not workflow.remote_exec \
        and "gpu_permille" not in workflow.global_resources:
    # Local GPU runs: each GPU is 1000 permille; a one-device cell takes 1000/cells_per_gpu,
    # a cell on N devices N*1000, so Snakemake runs cells_per_gpu cells per GPU at once
    # (`--resources gpu_permille=...` overrides the node's count).
    import torch

    if torch.cuda.device_count():
        workflow.register_resource("gpu_permille", 1000 * torch.cuda.device_count())


wildcard_constraints:
    cell=r"[A-Za-z0-9_.=+/-]+?",
    dataset=r"[a-z0-9_]+",
    folder=r"[A-Za-z0-9_.=+/-]+?",
    hash=r"[0-9a-f]{10}",
    snapshot=r"ep[0-9.e+-]+",


def cell_of(wildcards):
    return _workflow_error(PLAN.cell, wildcards.cell)


def cell_hash(wildcards):
    """The hash of the cell's settings (smallbatch.study.cells.cell_hash), a param of its jobs: a
    changed cell changes it, and Snakemake's params trigger reruns the cell's jobs.  The
    job reads the cell itself from its cell.json (write_cell_files), so the shell line
    stays one short line."""
    return cell_of(wildcards).hash


def baseline_hash(wildcards):
    return BASELINES[f"baselines/{wildcards.dataset}/{wildcards.kind}"].hash


def cell_file(wildcards, output):
    """<the job's folder>/cell.json, next to its first output.  Derived from the output (so
    Snakemake leaves it out of the params it compares: a moved study does not rerun)."""
    return f"{os.path.dirname(output[0])}/cell.json"


def out_dir(wildcards, output):
    """The folder of the job's first output (derived, as cell_file)."""
    return os.path.dirname(output[0])


def snapshot_cell_file(wildcards, output):
    """The cell.json of a snapshot's cell: <cell folder>/cell.json, its outputs lying in
    <cell folder>/snapshots (derived, as cell_file)."""
    return f"{os.path.dirname(os.path.dirname(output[0]))}/cell.json"


def snapshot_file(wildcards, output):
    """<cell folder>/snapshots/<snapshot>.pt, which pretraining wrote (derived, as cell_file)."""
    return f"{os.path.dirname(output[0])}/{wildcards.snapshot}.pt"


def tracking_uri_at(marker):
    """The tracking URI of a store whose marker file (init_store's output) is ``marker``: the
    default SQLite store is <results_dir>/mlflow.db wherever the results folder now lies."""
    return resolve_tracking_uri({**config, "results_dir": os.path.dirname(marker)})


# The tracking URI as a rule param.  An explicit one (config tracking_uri, else
# $MLFLOW_TRACKING_URI: config.resolve_tracking_uri's order) is a plain value: pointing the
# study at another store reruns it.  The default SQLite file is derived from the path of
# the store's marker (input.store; init_store's output), which Snakemake's params trigger
# leaves out, so a copied or moved study folder plans no job.
EXPLICIT_URI = bool(config.get("tracking_uri") or os.environ.get("MLFLOW_TRACKING_URI"))
STORE_URI = TRACKING_URI if EXPLICIT_URI else (lambda wildcards, input: tracking_uri_at(input.store))
STORE_URI_OF_OUTPUT = TRACKING_URI if EXPLICIT_URI else (lambda wildcards, output: tracking_uri_at(output[0]))


def pretrain_priority(wildcards):
    return _plan.pretrain_priority(cell_of(wildcards))


def devices(wildcards):
    return int(cell_of(wildcards).train.devices)


def gpu_permille(wildcards, n=None):
    """A cell's share of the node's GPUs in permille (local runs; see above)."""
    return _plan.gpu_permille(n or devices(wildcards), CELLS_PER_GPU) if gpu_study() else None


def gres(wildcards, n=None):
    """SLURM's GPU request of a cell's job as a GRES string: strings are not summed over the
    cells of a group job, so a group of cells_per_gpu cells shares one GPU."""
    return f"gpu:{n or devices(wildcards)}" if gpu_study() else None


def tasks_per_gpu(wildcards):
    return 1 if gpu_study() and devices(wildcards) > 1 else None


def data_cache(wildcards):
    return f"{R}/data/cache/{cell_of(wildcards).dataset}.pt"


def cell_dir(cell_id):
    return PLAN.cell_dir(cell_id)


CELL_OUTPUTS = PLAN.cell_outputs()
BASELINE_OUTPUTS = PLAN.baseline_outputs()
REPORT_INDEX = f"{R}/report/index.md"
