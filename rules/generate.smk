# Tune: measure the engine on the run's prompts (dflash_pipeline.stages.tune); generate: regenerate
# every assistant turn with the target (dflash_pipeline.stages.generate).
from dflash_pipeline.engines.tuning import tune_defining, tune_gpus


rule tune:
    input:
        unpack(target_model_input),
        prompts=tune_prompt_shards(),
    output:
        result=run_path(layout.TUNE_RESULT),
    log:
        job=log_path("tune", per_shard=False),
        engine=run_path(f"{layout.LOGS_DIR}/tune-engine.log"),
    benchmark:
        benchmark_path("tune", per_shard=False)
    # As generate's: a server that fails to start once does not hold up the run's generation.
    retries: config["generation"]["retries"]
    conda:
        "../envs/pipeline.yaml"
    threads: 2
    resources:
        # One device's share: the server's tensor parallelism, one data-parallel rank.
        **slurm(tune_gpus(config)),
        gpu=tune_gpus(config),
        mem_mb=job_memory("generate", tune_gpus(config)),
        runtime=config["resources"]["runtime_minutes"]["tune"],
        attempt=lambda wildcards, attempt: attempt,
    params:
        run_url=lambda wildcards: RUN_URL,
        model=config["target"]["model"],
        # What the result depends on (dflash_pipeline.engines.tuning.tune_defining).
        defining=tune_defining(config),
    script:
        "../scripts/tune.py"


rule generate:
    input:
        unpack(target_model_input),
        unpack(tune_input),
        prompts=shard_output("prepare"),
    output:
        generated=shard_output("generate"),
    log:
        job=log_path("generate"),
        # The engine servers' logs: a declared log, so an S3 run uploads it with the job's
        # (Snakemake stores the logs of failed jobs too). Snakemake empties both when it retries
        # the job, so every attempt writes its own under logs/attempts/generate-NNNNN/ and keeps
        # them in the run root; this one is the last attempt's, after the earlier ones' last lines.
        engine=run_path(f"{layout.LOGS_DIR}/generate-engine/{{shard}}.log"),
    benchmark:
        benchmark_path("generate")
    # A retry resumes from the shard's saved parts (a crash costs at most one part).
    retries: config["generation"]["retries"]
    conda:
        # The job is a client: the engine runs from engines.<engine>.python, its own environment.
        "../envs/pipeline.yaml"
    threads: 2
    resources:
        **slurm(config["generation"]["gpus_per_job"]),
        gpu=config["generation"]["gpus_per_job"],
        mem_mb=job_memory("generate", config["generation"]["gpus_per_job"]),
        # Minutes (a cluster's time limit): a shard is sized for ~1 GPU-hour; a job cut at
        # the limit resumes from its parts on retry.
        runtime=config["resources"]["runtime_minutes"]["generate"],
        # Snakemake's attempt number (it reaches a job through its resources only): each
        # attempt keeps its logs apart (dflash_pipeline.core.joblog.JobAttempt).
        attempt=lambda wildcards, attempt: attempt,
    params:
        run_url=lambda wildcards: RUN_URL,
        model=config["target"]["model"],
        # Only what defines the output; the rest of `generation` (concurrency, intervals,
        # server, ...) the job reads from the config, which is no rerun trigger.
        generation=rule_params(config, "generate"),
    script:
        "../scripts/generate.py"
