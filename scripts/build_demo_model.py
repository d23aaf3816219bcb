"""Snakemake glue for rule `build_demo_model`: dflash_pipeline.demo.build_model.build_demo_model.

A script, not a shell command: Snakemake runs it with its own interpreter (or the rule's conda
environment's), so the rule works whatever `python` the shell's PATH would find."""

from dflash_pipeline.core.stage_job import stage_job
from dflash_pipeline.demo.build_model import build_demo_model

smk = snakemake  # noqa: F821 (injected by Snakemake)
with stage_job(smk, "build_demo_model"):
    build_demo_model(smk.output.model)
