"""Snakemake glue for rule `report_tokenization`; the logic is dflash_pipeline.report."""

from dflash_pipeline.core.joblog import job_logging
from dflash_pipeline.report.figures import (
    plot_degenerate_reasons,
    plot_supervised_histogram,
    read_json,
    write_tokenization_table,
)


def run(smk) -> None:
    with job_logging(smk.log[0]):
        stats = [read_json(path) for path in smk.input.stats]
        plot_supervised_histogram(stats, smk.output.supervised)
        plot_degenerate_reasons(stats, smk.output.degenerate)
        write_tokenization_table(stats, smk.output.table)


run(snakemake)  # noqa: F821 (injected by Snakemake)
