# Prepare: validate, dedupe, id and shard the prompt dataset (dflash_pipeline.stages.prepare).


rule ingest_prompts:
    input:
        dataset=local_dataset_files(),
    output:
        prompts=run_path(layout.INGESTED_PROMPTS),
        summary=run_path(layout.INGEST_SUMMARY),
        quarantine=run_path(layout.QUARANTINE),
    log:
        log_path("ingest_prompts", per_shard=False),
    benchmark:
        benchmark_path("ingest_prompts", per_shard=False)
    conda:
        "../envs/cpu.yaml"
    threads: 1
    resources:
        mem_mb=4000,
    params:
        num_shards=config["num_shards"],
        dataset=config["dataset"],
    script:
        "../scripts/ingest_prompts.py"


rule prepare_prompts:
    input:
        prompts=run_path(layout.INGESTED_PROMPTS),
    output:
        prompts=shard_output("prompts"),
    log:
        log_path("prepare_prompts"),
    benchmark:
        benchmark_path("prepare_prompts")
    conda:
        "../envs/cpu.yaml"
    threads: 1
    resources:
        mem_mb=2000,
    script:
        "../scripts/prepare_prompts.py"
