# Side experiment `experiments.mi`: mutual-information bounds on correlated
# Gaussians (InfoNCE vs FlatNCE vs EqCo, separable/concatenated/oracle critics,
# K negatives per anchor).  CPU only, a few minutes; one MLflow run (kind 'mi')
# per row of the grid.  Switch it on with `experiments: {mi: {enabled: true}}`;
# every other key of the section is optional (defaults: the config schema, experiments.mi).
# Needs R, STORE_URI, EXPERIMENT, conda_env from common.smk.

MI_SECTION = dict((config.get("experiments") or {}).get("mi") or {})
MI_ENABLED = bool(MI_SECTION.get("enabled", False))
MI_RESULTS = f"{R}/mi/results.json"
# The report rule adds these to its inputs (empty when the experiment is off).
MI_OUTPUTS = [MI_RESULTS] if MI_ENABLED else []
if MI_ENABLED:  # its settings stamp (common.smk: PLAN)
    PLAN.stamp_section("mi", MI_SECTION, MI_RESULTS)


rule mi_bench:
    # The section travels as a param: editing it changes the param, and Snakemake's params
    # trigger reruns the benchmark.
    input:
        store=f"{R}/mlflow.ready",
        settings=lambda w: stamp_of("mi"),  # a changed section reruns it, with or without .snakemake/
    output:
        MI_RESULTS,
    params:
        section=json.dumps(MI_SECTION, sort_keys=True),
        uri=STORE_URI,
        exp=EXPERIMENT,
    log:
        f"{R}/logs/mi/mi_bench.log",
    threads: int(MI_SECTION.get("threads", 1))
    # the longest job with no dependants: started first, it does not leave one core idle at the end
    priority: 10
    resources:
        mem_mb=2000,
        runtime=60,
    conda:
        conda_env
    shell:
        "rm -f -- {log:q} && smallbatch mi --section-json={params.section:q} --out={output:q} "
        "--tracking-uri={params.uri:q} --experiment={params.exp:q} > {log:q} 2>&1"
