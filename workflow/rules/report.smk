# The papers' tables and figures, rebuilt from the MLflow store alone.  Its outputs are
# marked for Snakemake's own report (`snakemake --report report.html`, after the study):
# every figure (PNG) and table (CSV) of results/report with a caption from workflow/report/,
# whose sentences come from smallbatch.report.captions (the params below), listed by labels:
# the caption's head and the file, not the file's path.


rule report:
    input:
        CELL_OUTPUTS,
        BASELINE_OUTPUTS,
        MI_OUTPUTS,
        store=f"{R}/mlflow.ready",
    output:
        index=report(REPORT_INDEX, caption="../report/findings.rst", category="Findings",
                     labels={"caption": "The findings in plain words, with a link to every table and figure",
                             "file": "index.md"}),
        figures=report(directory(f"{R}/report/figures"), patterns=["{name}.png"],
                       caption="../report/figure.rst", category="Figures",
                       labels=lambda w: report_labels(w.name, "figures")),
        tables=report(directory(f"{R}/report/tables"), patterns=["{name}.csv"],
                      caption="../report/table.rst", category="Tables",
                      labels=lambda w: report_labels(w.name, "tables")),
    params:
        uri=STORE_URI,
        exp=EXPERIMENT,
        out=out_dir,
        # the analysis plan (config key analysis): a change rebuilds the report, never a cell
        analysis=json.dumps(config["analysis"], sort_keys=True),
        table_captions=captions("tables"),
        figure_captions=captions("figures"),
    log:
        f"{R}/logs/report.log",
    resources:
        mem_mb=4000,
        runtime=30,
    conda:
        conda_env
    shell:
        # a study without figures (or tables) still has its (empty) folder
        "rm -f -- {log:q} && smallbatch report --tracking-uri={params.uri:q} --experiment={params.exp:q} --out={params.out:q} --analysis={params.analysis:q} > {log:q} 2>&1 "
        "&& mkdir -p -- {output.figures:q} {output.tables:q}"
