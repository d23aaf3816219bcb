"""Snakemake glue for rule `tune`: dflash_pipeline.stages.tune.run_job."""

from dflash_pipeline.core.checksums import verify_inputs
from dflash_pipeline.core.gpu_slots import job_devices, pool_from_config
from dflash_pipeline.core.joblog import JobAttempt
from dflash_pipeline.stages.tune import run_job


def run(smk) -> None:
    # As generate: each attempt keeps its own job and engine logs; the declared engine log
    # bundles them.
    attempt = JobAttempt.of(smk, "tune", smk.log.job)
    try:
        with attempt.logging(smk.log.job):
            verify_inputs(smk, list(smk.input.prompts))
            pool, lock_dir = pool_from_config(smk.config)
            with job_devices(smk.resources.gpu, pool, lock_dir):
                run_job(
                    list(smk.input.prompts),
                    smk.output.result,
                    smk.params.model,
                    smk.config["generation"],
                    smk.config["tune"],
                    dict(smk.params.defining),
                    str(attempt.local("engine")),
                    lock_dir,
                    smk.config["engines"],
                    engine_log_label=attempt.label(smk.log.engine),
                )
    finally:
        attempt.bundle(smk.log.engine, "engine", "no engine server was started in this attempt (see the job log)")


run(snakemake)  # noqa: F821 (injected by Snakemake)
