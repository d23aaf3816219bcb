"""Snakemake glue for rule `report_storage`; the logic is dflash_pipeline.report."""

from dflash_pipeline.core.joblog import job_logging
from dflash_pipeline.report.figures import plot_storage, storage_by_stage
from dflash_pipeline.core.storage import ReadOnlyStorage


def run(smk) -> None:
    with job_logging(smk.log[0]):
        # The run root as it is now, outputs, logs, _progress/ and checkpoints alike.
        objects = ReadOnlyStorage.open(smk.params.run_url).list("")
        plot_storage(storage_by_stage(objects), smk.output.figure)


run(snakemake)  # noqa: F821 (injected by Snakemake)
