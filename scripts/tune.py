"""Snakemake glue for rule `tune`: dflash_pipeline.stages.tune.run_job."""

from dflash_pipeline.core.stage_job import stage_job
from dflash_pipeline.stages.tune import run_job

smk = snakemake  # noqa: F821 (injected by Snakemake)
with stage_job(smk, "tune") as job:
    job.verify(smk.input.prompts)
    with job.devices():
        run_job(
            list(smk.input.prompts),
            smk.output.result,
            smk.params.model,
            smk.config["generation"],
            smk.config["tune"],
            dict(smk.params.defining),
            **job.engine_args(),
        )
