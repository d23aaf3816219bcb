"""Snakemake glue for rule `extract`; the logic is dflash_pipeline.extraction."""

import torch

from dflash_pipeline.stages.extract import extract_shard
from dflash_pipeline.core.gpu_slots import job_devices
from dflash_pipeline.core.joblog import job_logging
from dflash_pipeline.training.trainer import build_drafter_config


def run(smk) -> None:
    with job_logging(smk.log[0]):
        torch.set_num_threads(smk.threads)  # as many compute threads as Snakemake granted
        with job_devices(smk.resources.gpu, smk.params.gpu_pool, smk.params.gpu_lock_dir):
            settings = dict(smk.params.settings)
            layer_ids = build_drafter_config(settings, smk.params.model).target_layer_ids
            manifest = extract_shard(
                smk.input.tokenized,
                smk.params.model,
                layer_ids,
                smk.params.run_url,
                smk.wildcards.shard,
                smk.output.manifest,
                settings["hidden_dtype"],
                device=None if smk.resources.gpu else "cpu",
            )
            print(f"stored {manifest['tokens']} tokens x {manifest['width']} taps: {manifest['size']:,} bytes")


run(snakemake)  # noqa: F821 (injected by Snakemake)
