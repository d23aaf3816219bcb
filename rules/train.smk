# Train: the drafter as a chain of checkpoint segments, then its export (dflash_pipeline.training).
# Offline mode first stores the target's taps per shard (rule `extract`).

from dflash_pipeline.stages.segment_tau import segment_tau_settings
from dflash_pipeline.model import speculators_format


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
    retries: config["train"]["retries"]
    conda:
        "../envs/pipeline.yaml"
    threads: 2
    resources:
        **slurm(min(1, config["train"]["gpus_per_job"])),
        gpu=min(1, config["train"]["gpus_per_job"]),
        mem_mb=job_memory("extract", min(1, config["train"]["gpus_per_job"])),
        runtime=config["resources"]["runtime_minutes"]["extract"],
        # Each attempt keeps its own log (dflash_pipeline.core.joblog.JobAttempt).
        attempt=lambda wildcards, attempt: attempt,
    params:
        run_url=lambda wildcards: RUN_URL,
        model=config["target"]["model"],
        # Only the keys that define the stored taps (dflash_pipeline.core.config.RULE_KEYS).
        settings=rule_params(config, "extract"),
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
    # Ahead of a segment_tau job that waits for the same cores or GPUs: training goes on first.
    priority: 1
    # A retry resumes from the segment's last in-segment checkpoint.
    retries: config["train"]["retries"]
    conda:
        "../envs/pipeline.yaml"
    threads: 2
    resources:
        **slurm(config["train"]["gpus_per_job"]),
        gpu=config["train"]["gpus_per_job"],
        mem_mb=job_memory("train", config["train"]["gpus_per_job"]),
        # Minutes per segment (a cluster's time limit); a segment cut at the limit resumes
        # from its last checkpoint on retry.
        runtime=config["resources"]["runtime_minutes"]["train"],
        attempt=lambda wildcards, attempt: attempt,
    params:
        run_url=lambda wildcards: RUN_URL,
        model=config["target"]["model"],
        # Data, optimizer, schedule and drafter shape only; checkpoint_every_steps, metrics
        # interval etc. the job reads from the config, which is no rerun trigger.
        settings=rule_params(config, "train"),
    script:
        "../scripts/train.py"


# τ while it trains: each segment's checkpoint in the speculative-decoding loop, on a few
# held-out prompts (train.segment_eval). The next segment reads only the manifest, never this.
rule segment_tau:
    input:
        unpack(target_model_input),
        manifest=segment_manifest("{segment}"),
        # Orders the job after ingest; the held-out prompts are read from the ingested table by
        # byte range (params.ingested), as evaluate reads them.
        summary=run_path(layout.INGEST_SUMMARY),
    output:
        tau=run_path(layout.segment_tau_key("{segment}")),
    log:
        run_path(f"{layout.LOGS_DIR}/segment_tau/segment-{{segment}}.log"),
    benchmark:
        run_path(layout.benchmark_key("segment_tau", "{segment}"))
    conda:
        "../envs/pipeline.yaml"
    threads: 1
    resources:
        **slurm(min(1, config["train"]["gpus_per_job"])),
        gpu=min(1, config["train"]["gpus_per_job"]),
        mem_mb=job_memory("segment_tau", min(1, config["train"]["gpus_per_job"])),
        runtime=config["resources"]["runtime_minutes"]["segment_tau"],
    params:
        run_url=lambda wildcards: RUN_URL,
        ingested=lambda wildcards: f"{RUN_URL}/{layout.INGESTED_PROMPTS}",
        model=config["target"]["model"],
        thinking=config["generation"]["thinking"],
        settings=segment_tau_settings(config),
    script:
        "../scripts/segment_tau.py"


rule export:
    input:
        # The speculators format carries the target's embedding and LM head.
        unpack(target_model_input),
        manifest=segment_manifest(config["train"]["segments"] - 1),
    output:
        # Beside the z-lab export, the speculators format, for a drafter that format expresses
        # (for one it does not, the job's log says why in one line).
        **{
            name: run_path(key)
            for name, key in speculators_format.run_outputs(
                config["train"]["layer_types"]
            ).items()
        },
        config=run_path(layout.DRAFTER_CONFIG),
        weights=run_path(layout.DRAFTER_WEIGHTS),
    log:
        log_path("export", per_shard=False),
    benchmark:
        benchmark_path("export", per_shard=False)
    conda:
        "../envs/pipeline.yaml"
    threads: 1
    resources:
        **slurm(0),
        mem_mb=job_memory("export"),
        runtime=config["resources"]["runtime_minutes"]["export"],
    params:
        run_url=lambda wildcards: RUN_URL,
        dtype=config["train"]["export_dtype"],
        target=config["target"]["model"],
    script:
        "../scripts/export.py"
