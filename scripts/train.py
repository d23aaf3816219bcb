"""Snakemake glue for rule `train`; the logic is dflash_pipeline.training."""

import os

import torch

from dflash_pipeline.core.gpu_slots import job_devices
from dflash_pipeline.core.joblog import job_logging
from dflash_pipeline.training.launch import run_train_job
from dflash_pipeline.training.trainer import SegmentJob


def shard_paths(paths):
    # outputs/<stage>-NNNNN.<ext> -> {"NNNNN": path}
    return {os.path.basename(p).split("-")[1].split(".")[0]: p for p in paths}


def run(smk) -> None:
    with job_logging(smk.log[0]):
        torch.set_num_threads(smk.threads)  # as many compute threads as Snakemake granted
        with job_devices(smk.resources.gpu, smk.params.gpu_pool, smk.params.gpu_lock_dir):
            job = SegmentJob(
                run_url=smk.params.run_url,
                segment=int(smk.wildcards.segment),
                settings=dict(smk.params.settings),
                target_dir=smk.params.model,
                tokenized=shard_paths(smk.input.tokenized),
                hidden=shard_paths(smk.input.get("hidden", [])),
                manifest_path=smk.output.manifest,
                device=None if smk.resources.gpu else "cpu",
            )
            run_train_job(job, smk.resources.gpu)


run(snakemake)  # noqa: F821 (injected by Snakemake)
