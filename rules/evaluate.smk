# Evaluate: acceptance length in a real speculative-decoding loop on held-out prompts, the
# lossless check and the train/serve parity gate (dflash_pipeline.stages.evaluate).


rule evaluate:
    input:
        unpack(target_model_input),
        drafter_config=run_path(layout.DRAFTER_CONFIG),
        drafter_weights=run_path(layout.DRAFTER_WEIGHTS),
        # The ingest job's summary (small) orders this job after ingest and reruns it when the
        # ingested table changes; the held-out prompts are read from the table by byte range
        # until evaluate.max_prompts are found (params.ingested), not downloaded whole.
        summary=run_path(layout.INGEST_SUMMARY),
        # Only the held-out rows of each tokenize shard (small objects), for the simulated tau.
        heldout=expand(
            shard_output("tokenize", layout.TOKENIZE_HELDOUT_EXT), shard=SHARDS
        ),
    output:
        metrics=run_path(layout.EVAL_METRICS),
    log:
        job=log_path("evaluate", per_shard=False),
        # The serving engine's logs and captured /metrics, bundled into one declared log so an
        # S3 run keeps them (a failed parity gate is read there). A retried job's earlier
        # attempts keep theirs under logs/attempts/evaluate/ (their last lines lead this one).
        engine=run_path(f"{layout.LOGS_DIR}/evaluate-engine.log"),
    benchmark:
        benchmark_path("evaluate", per_shard=False)
    conda:
        "../envs/pipeline.yaml"
    threads: 2
    resources:
        **slurm(min(1, config["train"]["gpus_per_job"])),
        gpu=min(1, config["train"]["gpus_per_job"]),
        mem_mb=job_memory("evaluate", min(1, config["train"]["gpus_per_job"])),
        runtime=config["resources"]["runtime_minutes"]["evaluate"],
        # Snakemake's attempt number (a `--retries` run): each attempt keeps its logs apart.
        attempt=lambda wildcards, attempt: attempt,
    params:
        # Where an attempt keeps its logs (logs/attempts/evaluate/ in the run root).
        run_url=lambda wildcards: RUN_URL,
        ingested=lambda wildcards: f"{RUN_URL}/{layout.INGESTED_PROMPTS}",
        model=config["target"]["model"],
        thinking=config["generation"]["thinking"],
        # What defines the metrics; the engine's memory share and extra arguments the job
        # reads from the config.
        settings=rule_params(config, "evaluate"),
    script:
        "../scripts/evaluate.py"
