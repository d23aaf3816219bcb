"""Snakemake glue for rule `generate`; the logic is dflash_pipeline.generate.run_job."""

import os

from dflash_pipeline.generate import run_job
from dflash_pipeline.gpu_slots import GpuLease, device_pool
from dflash_pipeline.joblog import job_logging


def run(smk) -> None:
    with job_logging(smk.log[0]):
        # The in-process form of the GPU slot wrapper: the lease lives as long as this job.
        pool = device_pool(smk.params.gpu_pool, os.environ.get("CUDA_VISIBLE_DEVICES"))
        with GpuLease(smk.resources.gpu, pool, smk.params.gpu_lock_dir) as lease:
            os.environ["CUDA_VISIBLE_DEVICES"] = lease.visible_devices
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
