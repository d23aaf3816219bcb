# Train: the drafter as a chain of checkpoint segments, then its export (dflash_pipeline.training).
# Offline mode first stores the target's taps per shard (rule `extract`).


rule extract:
    input:
        unpack(target_model_input),
        tokenized=shard_output("tokenize"),
    output:
        manifest=shard_output("extract"),
    log:
        log_path("extract"),
    benchmark:
        benchmark_path("extract")
    conda:
        "../envs/gpu-train.yaml"
    threads: 2
    resources:
        gpu=min(1, config["train"]["gpus_per_job"]),
        mem_mb=16000,
    params:
        run_url=lambda wildcards: RUN_URL,
        model=config["target"]["model"],
        settings=config["train"],
        gpu_pool=GPU_POOL,
        gpu_lock_dir=GPU_LOCK_DIR,
    script:
        "../scripts/extract.py"


rule train:
    input:
        unpack(train_inputs),
    output:
        manifest=run_path(layout.segment_manifest_key("{segment}")),
    log:
        run_path(f"{layout.LOGS_DIR}/train/segment-{{segment}}.log"),
    benchmark:
        run_path(layout.benchmark_key("train", "{segment}"))
    conda:
        "../envs/gpu-train.yaml"
    threads: 2
    resources:
        gpu=config["train"]["gpus_per_job"],
        mem_mb=16000,
    params:
        run_url=lambda wildcards: RUN_URL,
        model=config["target"]["model"],
        settings=config["train"],
        gpu_pool=GPU_POOL,
        gpu_lock_dir=GPU_LOCK_DIR,
    script:
        "../scripts/train.py"


rule export:
    input:
        manifest=segment_manifest(config["train"]["segments"] - 1),
    output:
        config=run_path(layout.DRAFTER_CONFIG),
        weights=run_path(layout.DRAFTER_WEIGHTS),
    log:
        log_path("export", per_shard=False),
    benchmark:
        benchmark_path("export", per_shard=False)
    conda:
        "../envs/gpu-train.yaml"
    threads: 1
    resources:
        mem_mb=8000,
    params:
        run_url=lambda wildcards: RUN_URL,
        dtype=config["train"]["export_dtype"],
    script:
        "../scripts/export.py"
