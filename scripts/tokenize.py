"""Snakemake glue for rule `tokenize`: dflash_pipeline.stages.tokenize.tokenize_file."""

from dflash_pipeline.core.stage_job import stage_job
from dflash_pipeline.stages.tokenize import tokenize_file

smk = snakemake  # noqa: F821 (injected by Snakemake)
with stage_job(smk, "tokenize") as job:
    job.verify(smk.input.generated)  # the generated shard as its job wrote it
    tokenize_file(
        smk.input.generated,
        smk.params.model,
        smk.output.tokenized,
        smk.output.stats,
        smk.params.thinking,
        job.settings(),
        run_url=job.run_url,
        shard=int(smk.wildcards.shard),
        workers=smk.threads,
        heldout_out=smk.output.heldout,
    )
    job.record(smk.output.tokenized, smk.output.heldout, smk.output.stats)
