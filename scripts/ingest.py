"""Snakemake glue for rule `ingest`; the logic is dflash_pipeline.stages.prepare.ingest."""

import sys
from pathlib import Path

from dflash_pipeline.core.checksums import record_outputs
from dflash_pipeline.core.joblog import job_logging
from dflash_pipeline.stages.prepare import PrepareError, ingest


def run(smk) -> None:
    dataset = smk.params.dataset
    try:
        with job_logging(smk.log[0]):
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
                refused_copy=Path(smk.log[0]).with_suffix(""),
            )
            # Read by every prepare job and by evaluate (dflash_pipeline.core.checksums).
            record_outputs(smk, [smk.output.prompts, smk.output.summary, smk.output.quarantine])
    except PrepareError:
        # job_logging has written the refusal to the log and stderr; a traceback would repeat it.
        sys.exit(1)


run(snakemake)  # noqa: F821 (injected by Snakemake)
