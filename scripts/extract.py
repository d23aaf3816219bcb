"""Snakemake glue for rule `extract`: dflash_pipeline.stages.extract."""

import torch

from dflash_pipeline.core.gpu_slots import job_devices
from dflash_pipeline.core.joblog import job_logging
from dflash_pipeline.stages.extract import extract_job


def run(smk) -> None:
    with job_logging(smk.log[0]):
        torch.set_num_threads(smk.threads)  # as many compute threads as Snakemake granted
        with job_devices(smk.resources.gpu, smk.params.gpu_pool, smk.params.gpu_lock_dir):
            extract_job(
                smk.input.tokenized,
                smk.params.model,
                dict(smk.params.settings),
                smk.params.run_url,
                smk.wildcards.shard,
                smk.output.manifest,
                device=None if smk.resources.gpu else "cpu",
            )


run(snakemake)  # noqa: F821 (injected by Snakemake)
