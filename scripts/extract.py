"""Snakemake glue for rule `extract`; the logic is dflash_pipeline.extraction."""

import os

import torch

from dflash_pipeline.extraction import extract_shard
from dflash_pipeline.gpu_slots import GpuLease, device_pool
from dflash_pipeline.joblog import job_logging
from dflash_pipeline.training.trainer import build_drafter_config


def run(smk) -> None:
    with job_logging(smk.log[0]):
        torch.set_num_threads(smk.threads)  # as many compute threads as Snakemake granted
        pool = device_pool(smk.params.gpu_pool, os.environ.get("CUDA_VISIBLE_DEVICES"))
        with GpuLease(smk.resources.gpu, pool, smk.params.gpu_lock_dir) as lease:
            os.environ["CUDA_VISIBLE_DEVICES"] = lease.visible_devices
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
