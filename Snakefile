# smallbatch: do contrastive learners really need large batches?
# `snakemake --cores N` runs the whole study in config.yaml (validated against
# workflow/schemas/config.schema.yaml); every rule calls the `smallbatch` CLI.
from snakemake.utils import min_version

min_version("9.0")


configfile: "config.yaml"


include: "workflow/rules/common.smk"
include: "workflow/rules/pretrain.smk"
include: "workflow/rules/evaluate.smk"
include: "workflow/rules/report.smk"


rule all:
    default_target: True
    input:
        REPORT_INDEX,
