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
        "../envs/pipeline.yaml"
    threads: 1
    resources:
        **slurm(0),
        mem_mb=config["resources"]["mem_mb"]["ingest"],
        runtime=config["resources"]["runtime_minutes"]["ingest"],
    params:
        # Where the run lives (its checksum records); a function of `input`, so that it is no
        # rerun trigger: the run root defines no output, and runs finished before this rule had
        # the param are not rerun for it.
        run_url=lambda wildcards, input: RUN_URL,
        num_shards=config["num_shards"],
        # Sorted keys: the order of keys in the config file says nothing about the output.
        dataset=rule_params(config, "ingest"),
    script:
        "../scripts/ingest.py"


rule prepare:
    input:
        # The ingest job's summary (small) orders this job after ingest and reruns it when the
        # ingested table changes; the table itself is read by byte range from the run root, one
        # row group per shard, not downloaded whole by every prepare job.
        summary=run_path(layout.INGEST_SUMMARY),
    output:
        prompts=shard_output("prepare"),
    log:
        log_path("prepare"),
    benchmark:
        benchmark_path("prepare")
    conda:
        "../envs/pipeline.yaml"
    threads: 1
    resources:
        **slurm(0),
        mem_mb=config["resources"]["mem_mb"]["prepare"],
        runtime=config["resources"]["runtime_minutes"]["prepare"],
    params:
        run_url=lambda wildcards, input: RUN_URL,  # no rerun trigger: see rule ingest
        ingested=lambda wildcards: f"{RUN_URL}/{layout.INGESTED_PROMPTS}",
    script:
        "../scripts/prepare.py"
