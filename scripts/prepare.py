"""Snakemake glue for rule `prepare`; the logic is dflash_pipeline.stages.prepare.select_shard."""

from dflash_pipeline.core.stage_job import stage_job
from dflash_pipeline.stages.prepare import select_shard

smk = snakemake  # noqa: F821 (injected by Snakemake)
with stage_job(smk, "prepare") as job:
    # The ingest summary whole; the ingested table, read by byte range, against its recorded
    # size (verify hashes it whole, once, not every prepare job).
    job.verify(smk.input.summary)
    job.verify_stored(smk.params.ingested)
    select_shard(smk.params.ingested, int(smk.wildcards.shard), smk.output.prompts)
    job.record(smk.output.prompts)  # for every job that reads the shard
