"""Snakemake glue for rule `extract`: dflash_pipeline.stages.extract."""

import torch

from dflash_pipeline.core.checksums import record_outputs, verify_inputs
from dflash_pipeline.core.config import job_settings
from dflash_pipeline.core.gpu_slots import job_devices, pool_from_config
from dflash_pipeline.core.joblog import JobAttempt
from dflash_pipeline.stages.extract import extract_job


def run(smk) -> None:
    # Each attempt's log is kept apart (logs/attempts/extract-NNNNN/): a retry empties the declared one.
    attempt = JobAttempt.of(smk, f"extract-{smk.wildcards.shard}", smk.log[0])
    with attempt.logging(smk.log[0]):
        verify_inputs(smk, [smk.input.tokenized])  # before a GPU is taken (core.checksums)
        torch.set_num_threads(smk.threads)  # as many compute threads as Snakemake granted
        # The rest of the `train` section (the drafter's config) comes from the config.
        settings = job_settings(smk.config, "extract", dict(smk.params.settings))
        with job_devices(smk.resources.gpu, *pool_from_config(smk.config)):
            extract_job(
                smk.input.tokenized,
                smk.params.model,
                settings,
                smk.params.run_url,
                smk.wildcards.shard,
                smk.output.manifest,
                device=None if smk.resources.gpu else "cpu",
            )
        record_outputs(smk, [smk.output.manifest], smk.wildcards.shard)


run(snakemake)  # noqa: F821 (injected by Snakemake)
