"""Snakemake glue for rule `generate`: dflash_pipeline.stages.generate.run_job."""

from dflash_pipeline.core.checksums import record_outputs, verify_inputs
from dflash_pipeline.core.config import job_settings
from dflash_pipeline.core.gpu_slots import job_devices, pool_from_config
from dflash_pipeline.core.joblog import JobAttempt
from dflash_pipeline.core.storage import open_storage
from dflash_pipeline.engines.tuning import read_tune_result, tune_defining, tune_key
from dflash_pipeline.stages.generate import run_job


def run(smk) -> None:
    # Snakemake empties the declared logs when it retries the job: each attempt writes its own
    # job and engine logs (logs/attempts/generate-NNNNN/), keeps them in the run root whatever
    # happens, and the declared engine log bundles the earlier attempts' with its own.
    attempt = JobAttempt.of(smk, f"generate-{smk.wildcards.shard}", smk.log.job)
    try:
        with attempt.logging(smk.log.job):
            generate(smk, attempt)
    finally:
        engine = dict(smk.params.generation).get("engine")
        attempt.bundle(
            smk.log.engine,
            "engine",
            "no engine server is launched for generation.engine: endpoint"
            if engine == "endpoint"
            else "no engine server was started in this attempt (see the job log)",
        )


def generate(smk, attempt: JobAttempt) -> None:
    # The prepare shard as its job wrote it, or one error naming it (core.checksums).
    verify_inputs(smk, [smk.input.prompts])
    # Operational keys (concurrency, intervals, server) come from the config, not params.
    generation = job_settings(smk.config, "generate", dict(smk.params.generation))
    pool, lock_dir = pool_from_config(smk.config)
    # The in-process form of the GPU slot wrapper: the lease lives as long as this job.
    with job_devices(smk.resources.gpu, pool, lock_dir):
        run_job(
            smk.input.prompts,
            smk.output.generated,
            smk.params.run_url,
            int(smk.wildcards.shard),
            smk.params.model,
            generation,
            str(attempt.local("engine")),
            lock_dir,
            smk.config["engines"],
            engine_log_label=attempt.label(smk.log.engine),
            tuned=read_tune_result(open_storage(smk.params.run_url), tune_key(tune_defining(smk.config))),
            untuned_concurrency=smk.config["tune"]["untuned_concurrency"],
        )
    record_outputs(smk, [smk.output.generated], smk.wildcards.shard)


run(snakemake)  # noqa: F821 (injected by Snakemake)
