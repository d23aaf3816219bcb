"""Snakemake glue for rule `generate`: dflash_pipeline.stages.generate.run_job."""

from dflash_pipeline.core.stage_job import NO_ENGINE, stage_job
from dflash_pipeline.stages.generate import run_job, tuned_choice

smk = snakemake  # noqa: F821 (injected by Snakemake)
endpoint = dict(smk.params.generation)["engine"] == "endpoint"
absent = "no engine server is launched for generation.engine: endpoint" if endpoint else NO_ENGINE
with stage_job(smk, "generate", engine_absent=absent) as job:
    job.verify(smk.input.prompts)  # the prepare shard as its job wrote it
    # Operational keys (concurrency, intervals, server) come from the config, not params.
    settings = job.settings(smk.params.generation)
    with job.devices():
        run_job(
            smk.input.prompts,
            smk.output.generated,
            job.run_url,
            int(smk.wildcards.shard),
            smk.params.model,
            settings,
            **job.engine_args(),
            tuned=tuned_choice(job.run_url, smk.config),
            untuned_concurrency=smk.config["tune"]["untuned_concurrency"],
        )
    job.record(smk.output.generated)
