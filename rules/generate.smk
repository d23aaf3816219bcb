# Generate: regenerate every assistant turn with the target (dflash_pipeline.stages.generate).


rule generate:
    input:
        unpack(target_model_input),
        prompts=shard_output("prepare"),
    output:
        generated=shard_output("generate"),
    log:
        log_path("generate"),
    benchmark:
        benchmark_path("generate")
    conda:
        "../envs/generate-sglang.yaml"
    threads: 2
    resources:
        gpu=config["generation"]["gpus_per_job"],
        mem_mb=8000,
    params:
        run_url=lambda wildcards: RUN_URL,
        model=config["target"]["model"],
        generation=config["generation"],
        engine_log=lambda wildcards: f"logs/engine/{config['run']}-generate-{wildcards.shard}.log",
        gpu_pool=GPU_POOL,
        gpu_lock_dir=GPU_LOCK_DIR,
        runtime_dir=GPU_LOCK_DIR,
    script:
        "../scripts/generate.py"
