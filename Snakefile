# smallbatch: do contrastive learners really need large batches?
# `snakemake --cores N` runs the whole study in config.yaml (validated against
# workflow/schemas/config.schema.yaml); every rule calls the `smallbatch` CLI.
from snakemake.utils import min_version

min_version("9.0")


# config.yaml is the default (read in common.smk, which checks it first);
# `--configfile other.yaml` replaces it.
include: "workflow/rules/common.smk"
include: "workflow/rules/pretrain.smk"
include: "workflow/rules/evaluate.smk"
include: "workflow/rules/mi.smk"
include: "workflow/rules/report.smk"


# Warm start (smallbatch.warm): a local run serves its jobs from one process that has
# imported torch, MLflow and faiss once; jobs on a cluster run as plain processes.
WARM = {}


onstart:
    lock_results_folder()  # one run per results folder (common.smk)
    if config["warm_start"] and workflow.local_exec:
        from smallbatch.pipeline import warm

        WARM["server"] = warm.start(f"{R}/logs/warm_server.log", THREADS)


def stop_warm_server():
    if WARM:
        from smallbatch.pipeline import warm

        warm.stop(WARM.pop("server"))


onsuccess:
    stop_warm_server()


onerror:
    stop_warm_server()


rule all:
    # Every cell's outputs are targets themselves (not only the report's inputs), so
    # deleting one cell's files reruns that cell even though the report exists.
    default_target: True
    input:
        CELL_OUTPUTS,
        BASELINE_OUTPUTS,
        MI_OUTPUTS,
        REPORT_INDEX,
