"""Snakemake glue for rule `generate`: dflash_pipeline.stages.generate.run_job."""

from dflash_pipeline.stages.generate import run_job
from dflash_pipeline.core.gpu_slots import job_devices
from dflash_pipeline.core.joblog import job_logging


def run(smk) -> None:
    with job_logging(smk.log[0]):
        # The in-process form of the GPU slot wrapper: the lease lives as long as this job.
        with job_devices(smk.resources.gpu, smk.params.gpu_pool, smk.params.gpu_lock_dir):
            run_job(
                smk.input.prompts,
                smk.output.generated,
                smk.params.run_url,
                int(smk.wildcards.shard),
                smk.params.model,
                smk.params.generation,
                smk.params.engine_log,
                smk.params.runtime_dir,
            )


run(snakemake)  # noqa: F821 (injected by Snakemake)
