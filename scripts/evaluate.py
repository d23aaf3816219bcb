"""Snakemake glue for rule `evaluate`: dflash_pipeline.stages.evaluate.evaluate_job."""

import shutil
from pathlib import Path

import torch

from dflash_pipeline.core.config import job_settings
from dflash_pipeline.core.gpu_slots import job_devices, pool_from_config
from dflash_pipeline.core.joblog import bundle_logs, job_logging
from dflash_pipeline.stages.evaluate import evaluate_job


def run(smk) -> None:
    engine_dir = Path(smk.log.job).parent / "evaluate-engine"
    # A rerun's bundle holds this attempt's engine logs only.
    shutil.rmtree(engine_dir, ignore_errors=True)
    try:
        evaluate(smk, engine_dir)
    finally:
        bundle_logs(engine_dir, smk.log.engine, f"no serving engine was launched (evaluate.engine: "
                    f"{smk.params.settings['engine']})")


def evaluate(smk, engine_dir: Path) -> None:
    with job_logging(smk.log.job):
        # Token-by-token decoding of a small model on a CPU is latency-bound: one thread was
        # faster than two on the 2-core test machine (oversubscribed threads wait on each other).
        torch.set_num_threads(1 if not smk.resources.gpu else smk.threads)
        # The engine's memory share and extra arguments come from the config.
        settings = job_settings(smk.config, "evaluate", dict(smk.params.settings))
        with job_devices(smk.resources.gpu, *pool_from_config(smk.config)):
            evaluate_job(
                smk.params.model,
                str(Path(smk.input.drafter_config).parent),
                smk.input.prompts,
                list(smk.input.heldout),
                smk.output.metrics,
                settings,
                smk.params.thinking,
                Path(smk.log.job).with_suffix(".failed-metrics.json"),
                engine_dir,
                smk.config["engines"],
            )


run(snakemake)  # noqa: F821 (injected by Snakemake)
