# Prepare: validate, dedupe, id and shard the prompt dataset (dflash_pipeline.stages.prepare).


rule ingest:
    input:
        dataset=local_dataset_files(),
    output:
        prompts=run_path(layout.INGESTED_PROMPTS),
        summary=run_path(layout.INGEST_SUMMARY),
        quarantine=run_path(layout.QUARANTINE),
    log:
        log_path("ingest", per_shard=False),
    benchmark:
        benchmark_path("ingest", per_shard=False)
    conda:
        "../envs/cpu.yaml"
    threads: 1
    resources:
        mem_mb=4000,
    params:
        num_shards=config["num_shards"],
        dataset=config["dataset"],
    script:
        "../scripts/ingest.py"


rule prepare:
    input:
        prompts=run_path(layout.INGESTED_PROMPTS),
    output:
        prompts=shard_output("prepare"),
    log:
        log_path("prepare"),
    benchmark:
        benchmark_path("prepare")
    conda:
        "../envs/cpu.yaml"
    threads: 1
    resources:
        mem_mb=2000,
    script:
        "../scripts/prepare.py"
