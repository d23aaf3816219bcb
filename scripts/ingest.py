"""Snakemake glue for rule `ingest`; the logic is dflash_pipeline.stages.prepare.ingest."""

from dflash_pipeline.core.stage_job import stage_job
from dflash_pipeline.stages.prepare import PrepareError, ingest

smk = snakemake  # noqa: F821 (injected by Snakemake)
dataset = smk.params.dataset
# A refused dataset: the log has the refusal whole, a traceback would repeat it.
with stage_job(smk, "ingest", refusals=(PrepareError,)) as job:
    ingest(
        dataset["paths"],
        smk.params.num_shards,
        smk.output.prompts,
        smk.output.summary,
        smk.output.quarantine,
        heldout_fraction=dataset["heldout_fraction"],
        max_bad_fraction=dataset["max_bad_fraction"],
        max_row_bytes=dataset["max_row_bytes"],
        id_field=dataset["id_field"],
        # The outputs of a refused dataset are deleted with the failed job; these stay.
        refused_copy=job.beside_log(""),
    )
    job.record(smk.output.prompts, smk.output.summary, smk.output.quarantine)  # read by prepare and evaluate
