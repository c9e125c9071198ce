# Data preparation, tracking-store initialisation and pretraining.


localrules:
    init_store,


rule init_store:
    # Create the MLflow store's schema and experiment once, before parallel jobs
    # (parallel processes racing to create a fresh SQLite schema crash).
    output:
        f"{R}/mlflow.ready",
    params:
        uri=TRACKING_URI,
        exp=EXPERIMENT,
    log:
        f"{R}/logs/init_store.log",
    conda:
        conda_env
    shell:
        "smallbatch init-store --tracking-uri '{params.uri}' --experiment '{params.exp}' --touch {output} > {log} 2>&1"


rule prepare_data:
    # Load the data set through its real (torchvision / scikit-learn) loader once
    # and cache it as one uint8 tensor file, so training jobs skip torchvision.
    output:
        f"{R}/data/cache/{{dataset}}.pt",
    params:
        opts=lambda w: config["datasets"][w.dataset],
        root=lambda w: config["datasets"][w.dataset].get("root") or config["data"]["root"],
        download="--download" if config["data"]["download"] else "",
        size=lambda w: f"--image-size {config['datasets'][w.dataset]['image_size']}" if config["datasets"][w.dataset].get("image_size") else "",
        train=lambda w: f"--train-subset {config['datasets'][w.dataset]['train_subset']}" if config["datasets"][w.dataset].get("train_subset") else "",
        test=lambda w: f"--test-subset {config['datasets'][w.dataset]['test_subset']}" if config["datasets"][w.dataset].get("test_subset") else "",
    log:
        f"{R}/logs/prepare_data/{{dataset}}.log",
    resources:
        mem_mb=4000,
        runtime=30,
    conda:
        conda_env
    shell:
        "smallbatch prepare-data --dataset {wildcards.dataset} --data-root '{params.root}' {params.download} "
        "{params.size} {params.train} {params.test} --out {output} > {log} 2>&1"


rule pretrain:
    # One cell's pretraining: `train.devices` processes (torchrun here, srun inside a SLURM
    # allocation: smallbatch.distributed.launch_command), each with `threads` threads.
    input:
        data=data_cache,
        store=f"{R}/mlflow.ready",
    output:
        f"{R}/runs/{{cell}}/checkpoint.pt",
    params:
        cell=cell_json,
        uri=TRACKING_URI,
        exp=EXPERIMENT,
        out=lambda w: cell_dir(w.cell),
        smallbatch=lambda w: launch_command(devices(w)),
        # one process: evaluate in it too, for the evaluate job to adopt (smallbatch.prepared)
        ahead=lambda w: "--evaluate-ahead" if devices(w) == 1 and not KEEP_FEATURES else "",
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
        "{params.smallbatch} pretrain --cell-json {params.cell:q} --data-cache {input.data} --out {params.out} {params.ahead} "
        "--tracking-uri '{params.uri}' --experiment '{params.exp}' --threads {THREADS} > {log} 2>&1"
