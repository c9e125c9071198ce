# smallbatch: do contrastive learners really need large batches?
# `snakemake --cores N` runs the whole study in config.yaml (validated against
# src/smallbatch/resources/config.schema.yaml); every rule calls the `smallbatch` CLI.
from snakemake.utils import min_version

min_version("9.0")


# `snakemake --report report.html` after the study: this text, and every figure and table
# the report rule marks (workflow/rules/report.smk)
report: "workflow/report/workflow.rst"


# config.yaml is the default; `--configfile A B` replaces it with A and B laid over one
# another in order (read in common.smk by the function `smallbatch cells --config A --config B` uses).
include: "workflow/rules/common.smk"
include: "workflow/rules/pretrain.smk"
include: "workflow/rules/evaluate.smk"
include: "workflow/rules/mi.smk"
include: "workflow/rules/report.smk"


# One run per results folder, the cells' settings files, and the warm-start server
# (smallbatch.local.warm): all in common.smk, started here so that a dry run writes nothing.
onstart:
    start_run()


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
