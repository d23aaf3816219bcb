"""Snakemake glue for rule `prepare`; the logic is dflash_pipeline.stages.prepare.select_shard."""

from dflash_pipeline.core.joblog import job_logging
from dflash_pipeline.stages.prepare import select_shard


def run(smk) -> None:
    with job_logging(smk.log[0]):
        select_shard(smk.input.prompts, int(smk.wildcards.shard), smk.output.prompts)


run(snakemake)  # noqa: F821 (injected by Snakemake)
