"""Snakemake glue for rule `tokenize`: dflash_pipeline.stages.tokenize.tokenize_file."""

from dflash_pipeline.core.checksums import record_outputs, verify_inputs
from dflash_pipeline.core.config import job_settings
from dflash_pipeline.core.joblog import job_logging
from dflash_pipeline.stages.tokenize import tokenize_file


def run(smk) -> None:
    with job_logging(smk.log[0]):
        # The generated shard as its job wrote it, or one error naming it (core.checksums).
        verify_inputs(smk, [smk.input.generated])
        tokenize_file(
            smk.input.generated,
            smk.params.model,
            smk.output.tokenized,
            smk.output.stats,
            smk.params.thinking,
            job_settings(smk.config, "tokenize", dict(smk.params.settings)),
            run_url=smk.params.run_url,
            shard=int(smk.wildcards.shard),
            workers=smk.threads,
            heldout_out=smk.output.heldout,
        )
        record_outputs(smk, [smk.output.tokenized, smk.output.heldout, smk.output.stats], smk.wildcards.shard)


run(snakemake)  # noqa: F821 (injected by Snakemake)
