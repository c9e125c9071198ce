# Data preparation, tracking-store initialisation and pretraining.


localrules:
    init_store,
    settings,


rule settings:
    # <folder>/.settings-<hash>: the settings the folder's job computes with (common.smk:
    # PLAN.settings); a missing one (new or changed settings) reruns that job and all after it.
    output:
        f"{R}/{{folder}}/.settings-{{hash}}",
    log:
        f"{R}/logs/settings/{{folder}}.settings-{{hash}}.log",
    run:
        write_settings(wildcards.folder, output[0], log[0])


rule init_store:
    # Create the MLflow store's schema and experiment once, before parallel jobs
    # (parallel processes racing to create a fresh SQLite schema crash).
    output:
        f"{R}/mlflow.ready",
    params:
        uri=STORE_URI_OF_OUTPUT,
        exp=EXPERIMENT,
    log:
        f"{R}/logs/init_store.log",
    conda:
        conda_env
    shell:
        "rm -f -- {log:q} && smallbatch init-store --tracking-uri={params.uri:q} --experiment={params.exp:q} --touch={output:q} > {log:q} 2>&1"


rule prepare_data:
    # Load the data set through its real (torchvision / scikit-learn) loader once
    # and cache it as one uint8 tensor file, so training jobs skip torchvision.
    input:
        settings=lambda w: stamp_of(f"data/cache/{w.dataset}"),
    output:
        f"{R}/data/cache/{{dataset}}.pt",
    params:
        opts=lambda w: config["datasets"][w.dataset],
        root=lambda w: config["datasets"][w.dataset].get("root") or config["data"]["root"],
        download=flag("--download", bool(config["data"]["download"])),
        size=lambda w: flag("--image-size", config["datasets"][w.dataset].get("image_size")),
        train=lambda w: flag("--train-subset", config["datasets"][w.dataset].get("train_subset")),
        test=lambda w: flag("--test-subset", config["datasets"][w.dataset].get("test_subset")),
    log:
        f"{R}/logs/prepare_data/{{dataset}}.log",
    resources:
        mem_mb=4000,
        runtime=30,
    conda:
        conda_env
    shell:
        "rm -f -- {log:q} && smallbatch prepare-data --dataset={wildcards.dataset:q} --data-root={params.root:q} {params.download:q} "
        "{params.size:q} {params.train:q} {params.test:q} --out={output:q} > {log:q} 2>&1"


# (a job per step; under one_job_per_cell the rule run_cell of evaluate.smk pretrains and evaluates)
if not ONE_JOB_PER_CELL:

    rule pretrain:
        # One cell's pretraining: `train.devices` processes (torchrun here, srun inside a SLURM
        # allocation: smallbatch.training.launch.launch_command), each with `threads` threads.
        input:
            data=data_cache,
            store=f"{R}/mlflow.ready",
            settings=lambda w: stamp_of(f"runs/{w.cell}"),  # a cell trained under other settings reruns
        output:
            f"{R}/runs/{{cell}}/checkpoint.pt",
        params:
            cell=cell_file,  # the job reads its cell from <cell>/cell.json (common.smk: write_cell_files)
            hash=cell_hash,  # not on the command line: a changed cell changes this param, which reruns it
            uri=STORE_URI,
            exp=EXPERIMENT,
            out=out_dir,
            launch=lambda w: launch_command(devices(w)),  # shell-safe by construction (common.smk)
            # each of the cell's processes gets its share of the job's threads
            threads=lambda w, threads: max(1, threads // devices(w)),
        log:
            f"{R}/logs/pretrain/{{cell}}.log",
        threads: lambda w: THREADS * devices(w)
        priority: pretrain_priority
        resources:
            gpu_permille=gpu_permille,
            gres=gres,
            # several processes: SLURM tasks of `threads` CPUs each (one per GPU), launched by srun
            tasks=lambda w: devices(w) if devices(w) > 1 else None,
            cpus_per_task=lambda w: THREADS if devices(w) > 1 else None,
            tasks_per_gpu=tasks_per_gpu,
            mpi=lambda w: "srun" if devices(w) > 1 else None,
            mem_mb=4000,
            runtime=120,
        conda:
            conda_env
        shell:
            "rm -f -- {log:q} && {params.launch} pretrain --cell={params.cell:q} --data-cache={input.data:q} --out={params.out:q} "
            "--tracking-uri={params.uri:q} --experiment={params.exp:q} --threads={params.threads:q} "
            "> {log:q} 2>&1"
