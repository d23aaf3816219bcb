"""Snakemake glue for rule `train`: dflash_pipeline.stages.train."""

import torch

from dflash_pipeline.core.checksums import record_outputs, verify_inputs
from dflash_pipeline.core.config import job_settings
from dflash_pipeline.core.gpu_slots import job_devices, pool_from_config
from dflash_pipeline.core.joblog import JobAttempt
from dflash_pipeline.stages.train import train_job


def run(smk) -> None:
    # Each attempt's log is kept apart (logs/attempts/train-NNNN/): a retry empties the declared one.
    attempt = JobAttempt.of(smk, f"train-{smk.wildcards.segment}", smk.log[0])
    with attempt.logging(smk.log[0]):
        # Every tokenize shard (and extract manifest) as its job wrote it, before a GPU is taken.
        previous = [smk.input.previous] if "previous" in smk.input.keys() else []  # segment K-1's manifest
        verify_inputs(smk, [*smk.input.tokenized, *smk.input.get("hidden", []), *previous])
        torch.set_num_threads(smk.threads)  # as many compute threads as Snakemake granted
        # Operational keys (checkpoint interval, metrics interval...) come from the config.
        settings = job_settings(smk.config, "train", dict(smk.params.settings))
        with job_devices(smk.resources.gpu, *pool_from_config(smk.config)):
            train_job(
                smk.params.run_url,
                int(smk.wildcards.segment),
                settings,
                smk.params.model,
                list(smk.input.tokenized),
                list(smk.input.get("hidden", [])),
                smk.output.manifest,
                smk.resources.gpu,
                logs=[smk.log[0], attempt.local("job")],
            )
        # The manifest names the segment's checkpoint and its index's sha256s (core.checksums).
        record_outputs(smk, [smk.output.manifest], smk.wildcards.segment)


run(snakemake)  # noqa: F821 (injected by Snakemake)
