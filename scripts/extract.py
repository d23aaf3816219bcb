"""Snakemake glue for rule `extract`: dflash_pipeline.stages.extract."""

from dflash_pipeline.core.stage_job import stage_job
from dflash_pipeline.stages.extract import extract_job

smk = snakemake  # noqa: F821 (injected by Snakemake)
with stage_job(smk, "extract") as job:
    job.verify(smk.input.tokenized)  # before a GPU is taken
    job.torch_threads(smk.threads)  # as many compute threads as Snakemake granted
    # The rest of the `train` section (the drafter's config) comes from the config.
    settings = job.settings()
    with job.devices():
        extract_job(
            smk.input.tokenized,
            smk.params.model,
            settings,
            job.run_url,
            smk.wildcards.shard,
            smk.output.manifest,
            device=None if smk.resources.gpu else "cpu",
            taps_from=smk.config["extract"]["taps_from"],  # engine: a vLLM server computes them
            engines=smk.config.get("engines"),  # where vLLM is installed
            log_file=job.log_file,  # the server's log goes beside it
        )
    job.record(smk.output.manifest)
