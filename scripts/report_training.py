"""Snakemake glue for rule `report_training`; the logic is dflash_pipeline.report."""

from dflash_pipeline.core.joblog import job_logging
from dflash_pipeline.report.figures import write_training_report


def run(smk) -> None:
    with job_logging(smk.log[0]):
        # The per-step metrics are the segments' own (_progress/), next to their manifests.
        write_training_report(smk.params.run_url, range(smk.params.segments), smk.output.figure)


run(snakemake)  # noqa: F821 (injected by Snakemake)
