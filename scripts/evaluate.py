"""Snakemake glue for rule `evaluate`: dflash_pipeline.stages.evaluate.evaluate_job."""

from dflash_pipeline.core.stage_job import stage_job
from dflash_pipeline.stages.evaluate import TargetMismatch, evaluate_job

smk = snakemake  # noqa: F821 (injected by Snakemake)
absent = f"no serving engine was launched (evaluate.engine: {smk.params.settings['engine']})"
# A target of other weights than the drafter's is refused in one line (the log has it whole).
with stage_job(smk, "evaluate", engine_absent=absent, refusals=(TargetMismatch,)) as job:
    job.verify(smk.input.heldout, smk.input.drafter_config, smk.input.drafter_weights)
    # Decoding a small model on a CPU is latency-bound: one thread beat two on a 2-core machine.
    job.torch_threads(smk.threads if smk.resources.gpu else 1)
    with job.devices(), job.engine_folder() as engine_files:
        evaluate_job(
            smk.params.model,
            smk.input.drafter_config,
            smk.params.ingested,
            list(smk.input.heldout),
            smk.output.metrics,
            job.settings(),
            smk.params.thinking,
            job.beside_log(".failed-metrics.json"),
            engine_files,
            smk.config["engines"],
            tracker=(smk.config["train"], job.run_url),
        )
