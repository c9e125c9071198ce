# Frozen-feature evaluation of each cell, and the baselines.


rule embed:
    input:
        cell=f"{R}/runs/{{cell}}/cell.json",
        ckpt=f"{R}/runs/{{cell}}/checkpoint.pt",
        data=data_cache,
    output:
        FEATURES_OUT,
    log:
        f"{R}/logs/embed/{{cell}}.log",
    threads: THREADS
    resources:
        gpu=GPU,
        mem_mb=4000,
        runtime=30,
    conda:
        CONDA_ENV
    shell:
        "smallbatch embed --cell {input.cell} --checkpoint {input.ckpt} --data-cache {input.data} "
        "--out {output} --threads {threads} > {log} 2>&1"


rule knn:
    input:
        cell=f"{R}/runs/{{cell}}/cell.json",
        features=FEATURES,
    output:
        f"{R}/runs/{{cell}}/knn.json",
    params:
        uri=TRACKING_URI,
        exp=EXPERIMENT,
    log:
        f"{R}/logs/knn/{{cell}}.log",
    threads: 1
    resources:
        mem_mb=4000,
        runtime=30,
    conda:
        CONDA_ENV
    shell:
        "smallbatch knn --cell {input.cell} --features {input.features} --out {output} "
        "--tracking-uri '{params.uri}' --experiment '{params.exp}' > {log} 2>&1"


rule linear:
    input:
        cell=f"{R}/runs/{{cell}}/cell.json",
        features=FEATURES,
    output:
        f"{R}/runs/{{cell}}/linear.json",
    params:
        uri=TRACKING_URI,
        exp=EXPERIMENT,
    log:
        f"{R}/logs/linear/{{cell}}.log",
    threads: THREADS
    resources:
        mem_mb=4000,
        runtime=30,
    conda:
        CONDA_ENV
    shell:
        "smallbatch linear --cell {input.cell} --features {input.features} --out {output} "
        "--tracking-uri '{params.uri}' --experiment '{params.exp}' --threads {threads} > {log} 2>&1"


rule baseline:
    input:
        cell=f"{R}/baselines/{{dataset}}/{{kind}}/cell.json",
        data=f"{R}/data/cache/{{dataset}}.pt",
        store=f"{R}/mlflow.ready",
    output:
        f"{R}/baselines/{{dataset}}/{{kind}}/result.json",
    params:
        cell_hash=lambda w: BASELINES[f"baselines/{w.dataset}/{w.kind}"]["hash"],
        uri=TRACKING_URI,
        exp=EXPERIMENT,
    log:
        f"{R}/logs/baseline/{{dataset}}/{{kind}}.log",
    threads: THREADS
    resources:
        mem_mb=4000,
        runtime=30,
    conda:
        CONDA_ENV
    shell:
        "smallbatch baseline --cell {input.cell} --data-cache {input.data} --out {output} "
        "--tracking-uri '{params.uri}' --experiment '{params.exp}' --threads {threads} > {log} 2>&1"
