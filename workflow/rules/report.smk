# The papers' tables and figures, rebuilt from the MLflow store alone.


rule report:
    input:
        CELL_OUTPUTS,
        BASELINE_OUTPUTS,
        MI_OUTPUTS,
    output:
        REPORT_INDEX,
    params:
        uri=TRACKING_URI,
        exp=EXPERIMENT,
        out=f"{R}/report",
    log:
        f"{R}/logs/report.log",
    resources:
        mem_mb=4000,
        runtime=30,
    conda:
        conda_env
    shell:
        "smallbatch report --tracking-uri {params.uri:q} --experiment {params.exp:q} --out {params.out:q} > {log:q} 2>&1"
