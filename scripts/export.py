"""Snakemake glue for rule `export`: dflash_pipeline.stages.export."""

from dflash_pipeline.core.stage_job import stage_job
from dflash_pipeline.stages.export import export_drafter

smk = snakemake  # noqa: F821 (injected by Snakemake)
with stage_job(smk, "export") as job:
    job.verify(smk.input.manifest)
    # Declared only for drafters the speculators format can express (rules/train.smk).
    speculators = [smk.output[k] for k in ("speculators_config", "speculators_weights") if k in smk.output.keys()]  # noqa: SIM118 (`in` a Namedlist looks at values)
    export_drafter(
        job.run_url,
        smk.input.manifest,
        smk.output.config,
        smk.output.weights,
        smk.params.dtype,
        target=smk.params.target,
        speculators_out=tuple(speculators) or None,
    )
    # What evaluate and the serving engines load (core.checksums).
    job.record(smk.output.config, smk.output.weights, speculators)
