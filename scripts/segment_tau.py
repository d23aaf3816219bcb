"""Snakemake glue for rule `segment_tau`: dflash_pipeline.stages.segment_tau."""

from dflash_pipeline.core.stage_job import stage_job
from dflash_pipeline.stages.segment_tau import segment_tau_job

smk = snakemake  # noqa: F821 (injected by Snakemake)
with stage_job(smk, "segment_tau") as job:
    job.verify(smk.input.manifest)  # the manifest and its checkpoint's index, before a GPU is taken
    # Decoding a small model on a CPU is latency-bound (as evaluate's loop): one thread there.
    job.torch_threads(smk.threads if smk.resources.gpu else 1)
    with job.devices():
        segment_tau_job(
            job.run_url,
            int(smk.wildcards.segment),
            smk.input.manifest,
            smk.params.model,
            smk.params.ingested,
            smk.output.tau,
            dict(smk.params.settings),
            smk.params.thinking,
        )
