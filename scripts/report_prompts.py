"""Snakemake glue for rule `report_prompts`; the logic is dflash_pipeline.report."""

from dflash_pipeline.core.joblog import job_logging
from dflash_pipeline.report.figures import plot_prompts, read_json, read_jsonl, write_quarantine_table


def run(smk) -> None:
    with job_logging(smk.log[0]):
        summary = read_json(smk.input.summary)
        quarantine = read_jsonl(smk.input.quarantine)
        plot_prompts(summary, quarantine, smk.output.figure)
        write_quarantine_table(summary, quarantine, smk.output.table)


run(snakemake)  # noqa: F821 (injected by Snakemake)
