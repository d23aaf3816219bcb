"""Snakemake glue for rule `report_generation`: dflash_pipeline.stages.report.report_generation."""

from dflash_pipeline.core.checksums import verify_inputs
from dflash_pipeline.core.joblog import job_logging
from dflash_pipeline.stages.report import report_generation


def run(smk) -> None:
    with job_logging(smk.log[0]):
        verify_inputs(smk, list(smk.input.generated))
        report_generation(
            list(smk.input.generated),
            list(smk.input.benchmarks),
            smk.params.run_url,
            smk.output.throughput,
            smk.output.lengths,
            smk.output.finish,
        )


run(snakemake)  # noqa: F821 (injected by Snakemake)
