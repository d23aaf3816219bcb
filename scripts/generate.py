"""Snakemake glue for rule `generate`: dflash_pipeline.stages.generate.run_job."""

from dflash_pipeline.core.config import job_settings
from dflash_pipeline.core.gpu_slots import job_devices, pool_from_config
from dflash_pipeline.core.joblog import job_logging
from dflash_pipeline.stages.generate import run_job


def run(smk) -> None:
    with job_logging(smk.log.job):
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
                smk.log.engine,
                lock_dir,
                smk.config["engines"],
            )


run(snakemake)  # noqa: F821 (injected by Snakemake)
