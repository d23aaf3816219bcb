"""Snakemake glue for rule `prepare`; the logic is dflash_pipeline.stages.prepare.select_shard."""

from dflash_pipeline.core.checksums import record_outputs
from dflash_pipeline.core.joblog import job_logging
from dflash_pipeline.stages.prepare import select_shard


def run(smk) -> None:
    with job_logging(smk.log[0]):
        select_shard(smk.params.ingested, int(smk.wildcards.shard), smk.output.prompts)
        # The shard's sha256 and size, for every job that reads it (dflash_pipeline.core.checksums).
        record_outputs(smk, [smk.output.prompts], smk.wildcards.shard)


run(snakemake)  # noqa: F821 (injected by Snakemake)
