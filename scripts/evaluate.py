"""Snakemake glue for rule `evaluate`: dflash_pipeline.stages.evaluate.evaluate_job."""

import shutil
from pathlib import Path

import torch

from dflash_pipeline.core.checksums import verify_inputs
from dflash_pipeline.core.config import job_settings
from dflash_pipeline.core.gpu_slots import job_devices, pool_from_config
from dflash_pipeline.core.joblog import JobAttempt, bundle_logs
from dflash_pipeline.stages.evaluate import evaluate_job
from dflash_pipeline.training.tracker import log_evaluation


def run(smk) -> None:
    engine_dir = Path(smk.log.job).parent / "evaluate-engine"
    # The folder holds this attempt's engine files only; an earlier attempt's were bundled into
    # its own engine log under logs/attempts/evaluate/, kept in the run root with its job log
    # (Snakemake empties the declared logs when it starts the job again).
    shutil.rmtree(engine_dir, ignore_errors=True)
    attempt = JobAttempt.of(smk, "evaluate", smk.log.job)
    absent = f"no serving engine was launched (evaluate.engine: {smk.params.settings['engine']})"
    try:
        with attempt.logging(smk.log.job):
            try:
                evaluate(smk, engine_dir)
            finally:
                # Before the attempt's logs are kept (when the logging block ends).
                bundle_logs(engine_dir, attempt.local("engine"), absent)
    finally:
        # This attempt's bundle, after the last lines of any earlier attempt's logs.
        attempt.bundle(smk.log.engine, "engine", absent)


def evaluate(smk, engine_dir: Path) -> None:
    # The held-out rows as their tokenize jobs wrote them (core.checksums).
    verify_inputs(smk, [*smk.input.heldout, smk.input.drafter_config, smk.input.drafter_weights])
    # Token-by-token decoding of a small model on a CPU is latency-bound: one thread was
    # faster than two on the 2-core test machine (oversubscribed threads wait on each other).
    torch.set_num_threads(1 if not smk.resources.gpu else smk.threads)
    # The engine's memory share and extra arguments come from the config.
    settings = job_settings(smk.config, "evaluate", dict(smk.params.settings))
    try:
        with job_devices(smk.resources.gpu, *pool_from_config(smk.config)):
            evaluate_job(
                smk.params.model,
                str(Path(smk.input.drafter_config).parent),
                smk.params.ingested,
                list(smk.input.heldout),
                smk.output.metrics,
                settings,
                smk.params.thinking,
                Path(smk.log.job).with_suffix(".failed-metrics.json"),
                engine_dir,
                smk.config["engines"],
            )
    finally:
        # The experiment tracker (train.tracker) gets the headline figures, a failed gate's too:
        # the metrics JSON is written before a gate fails.
        log_evaluation(smk.config["train"], smk.params.run_url, smk.output.metrics)


run(snakemake)  # noqa: F821 (injected by Snakemake)
