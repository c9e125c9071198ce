# Frozen-feature evaluation of each cell (embed + the probes of eval.probes in one process, the
# features kept in memory), and the baselines.  The single steps (`smallbatch embed`, and
# one command per probe: `knn`, `linear`, ...) stay in the CLI for reruns by hand.


if not ONE_JOB_PER_CELL:

    rule evaluate:
        # as soon as its cell is trained
        priority: 10
        input:
            ckpt=f"{R}/runs/{{cell}}/checkpoint.pt",
            data=data_cache,
            store=f"{R}/mlflow.ready",
        output:
            *EVAL_FEATURES,
            **{p: f"{R}/runs/{{cell}}/{f}" for p, f in PROBE_FILES.items()},
        params:
            cell=cell_file,  # every output lies in the cell's folder
            hash=cell_hash,
            uri=STORE_URI,
            exp=EXPERIMENT,
            out=out_dir,
            features=lambda w, output: flag("--features", output[0] if KEEP_FEATURES else None),
        log:
            f"{R}/logs/evaluate/{{cell}}.log",
        threads: THREADS
        resources:
            gpu_permille=lambda w: gpu_permille(w, 1),
            gres=gres,  # as the cell's pretraining (a group job's GRES must agree); it uses one
            mem_mb=4000,
            runtime=30,
        conda:
            conda_env
        shell:
            "rm -f -- {log:q} && smallbatch evaluate --cell={params.cell:q} --checkpoint={input.ckpt:q} --data-cache={input.data:q} "
            "--out-dir={params.out:q} {params.features:q} --tracking-uri={params.uri:q} --experiment={params.exp:q} "
            "--threads={threads:q} > {log:q} 2>&1"


    rule evaluate_snapshot:
        # a snapshot of the cell's run (train.snapshot_epochs: the weights after a shorter budget),
        # by the same probes, once the cell is trained; its results land in the cell's run as
        # snapshot/<snapshot>/... (the job checks the file's cell id, hash and budget)
        priority: 10
        input:
            ckpt=f"{R}/runs/{{cell}}/checkpoint.pt",
            data=data_cache,
            store=f"{R}/mlflow.ready",
        output:
            **{p: f"{R}/runs/{{cell}}/snapshots/{{snapshot}}.{f}" for p, f in PROBE_FILES.items()},
        params:
            cell=snapshot_cell_file,  # the cell's folder's cell.json
            hash=cell_hash,
            snapshot=snapshot_file,
            uri=STORE_URI,
            exp=EXPERIMENT,
            out=out_dir,
        log:
            f"{R}/logs/evaluate/{{cell}}/{{snapshot}}.log",
        threads: THREADS
        resources:
            gpu_permille=lambda w: gpu_permille(w, 1),
            gres=gres,
            mem_mb=4000,
            runtime=30,
        conda:
            conda_env
        shell:
            "rm -f -- {log:q} && smallbatch evaluate --cell={params.cell:q} --snapshot={wildcards.snapshot:q} "
            "--checkpoint={params.snapshot:q} --data-cache={input.data:q} --out-dir={params.out:q} "
            "--tracking-uri={params.uri:q} --experiment={params.exp:q} --threads={threads:q} > {log:q} 2>&1"

else:

    rule run_cell:
        # One job per cell (one_job_per_cell): pretraining, then each snapshot's and last the
        # final checkpoint's evaluation, in one `smallbatch run-cell` process; the final probe
        # files are its outputs (a failure leaves them unwritten: the rerun resumes the
        # finished pretraining from its state.pt and repeats the evaluations).
        input:
            data=data_cache,
            store=f"{R}/mlflow.ready",
            settings=lambda w: stamp_of(f"runs/{w.cell}"),
        output:
            *EVAL_FEATURES,
            **{p: f"{R}/runs/{{cell}}/{f}" for p, f in PROBE_FILES.items()},
        params:
            cell=cell_file,
            hash=cell_hash,
            uri=STORE_URI,
            exp=EXPERIMENT,
            out=out_dir,
            features=lambda w, output: flag("--features", output[0] if KEEP_FEATURES else None),
        log:
            f"{R}/logs/run_cell/{{cell}}.log",
        threads: THREADS
        priority: pretrain_priority
        resources:
            gpu_permille=gpu_permille,
            gres=gres,
            mem_mb=4000,
            runtime=150,
        conda:
            conda_env
        shell:
            "rm -f -- {log:q} && smallbatch run-cell --cell={params.cell:q} --data-cache={input.data:q} --out={params.out:q} "
            "{params.features:q} --tracking-uri={params.uri:q} --experiment={params.exp:q} --threads={threads:q} "
            "> {log:q} 2>&1"


rule baseline:
    input:
        data=f"{R}/data/cache/{{dataset}}.pt",
        store=f"{R}/mlflow.ready",
        settings=lambda w: stamp_of(f"baselines/{w.dataset}/{w.kind}"),
    output:
        f"{R}/baselines/{{dataset}}/{{kind}}/result.json",
    params:
        cell=cell_file,  # <baseline>/cell.json (common.smk: write_cell_files)
        hash=baseline_hash,
        uri=STORE_URI,
        exp=EXPERIMENT,
    log:
        f"{R}/logs/baseline/{{dataset}}/{{kind}}.log",
    threads: THREADS
    resources:
        mem_mb=4000,
        runtime=30,
    conda:
        conda_env
    shell:
        "rm -f -- {log:q} && smallbatch baseline --cell={params.cell:q} --data-cache={input.data:q} --out={output:q} "
        "--tracking-uri={params.uri:q} --experiment={params.exp:q} --threads={threads:q} > {log:q} 2>&1"
