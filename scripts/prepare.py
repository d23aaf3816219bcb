"""Snakemake glue for rule `prepare`; the logic is dflash_pipeline.stages.prepare.select_shard."""

from dflash_pipeline.core.checksums import record_outputs, verify_inputs, verify_stored_size
from dflash_pipeline.core.joblog import job_logging
from dflash_pipeline.stages.prepare import select_shard


def run(smk) -> None:
    with job_logging(smk.log[0]):
        # The ingest summary whole; the ingested table, read by byte range, against its recorded
        # size (verify hashes it whole, once, not every prepare job).
        verify_inputs(smk, [smk.input.summary])
        verify_stored_size(smk, smk.params.ingested)
        select_shard(smk.params.ingested, int(smk.wildcards.shard), smk.output.prompts)
        # The shard's sha256 and size, for every job that reads it (dflash_pipeline.core.checksums).
        record_outputs(smk, [smk.output.prompts], smk.wildcards.shard)


run(snakemake)  # noqa: F821 (injected by Snakemake)
