"""Snakemake glue for rule `evaluate`; the logic is dflash_pipeline.evaluate and
dflash_pipeline.evaluation."""

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

from dflash_pipeline.evaluate import EvalOptions, run_evaluation
from dflash_pipeline.evaluation.simulated import simulated_tau
from dflash_pipeline.gpu_slots import GpuLease, device_pool
from dflash_pipeline.joblog import job_logging


def run(smk) -> None:
    settings = smk.params.settings
    drafter_dir = str(Path(smk.input.drafter_config).parent)
    out = Path(smk.output.metrics)
    with job_logging(smk.log[0]):
        # Token-by-token decoding of a small model on a CPU is latency-bound: one thread was
        # faster than two on the 2-core test machine (oversubscribed threads wait on each other).
        torch.set_num_threads(1 if not smk.resources.gpu else smk.threads)
        pool = device_pool(smk.params.gpu_pool, os.environ.get("CUDA_VISIBLE_DEVICES"))
        with GpuLease(smk.resources.gpu, pool, smk.params.gpu_lock_dir) as lease:
            os.environ["CUDA_VISIBLE_DEVICES"] = lease.visible_devices
            simulated = simulated_tau(
                drafter_dir,
                smk.params.model,
                list(smk.input.tokenized),
                max_rows=settings["simulated_rows"],
            )
            print(f"simulated (teacher-forced, held-out) acceptance length: {simulated}")
            options = EvalOptions(
                max_new_tokens=settings["max_new_tokens"],
                temperature=settings["temperature"],
                thinking=smk.params.thinking,
                lossless_margin=settings["lossless_margin"],
                engine=settings["engine"],
                limit=settings["max_prompts"],
                split="heldout",
                simulated_tau=simulated["tau"],
                parity_tolerance=settings["parity_tolerance"],
            )
            try:
                document = run_evaluation(smk.params.model, drafter_dir, smk.input.prompts, out, options)
                with tempfile.TemporaryDirectory() as tmp:
                    for path in settings["benchmark_prompts"]:
                        extra = run_evaluation(
                            smk.params.model, drafter_dir, path, Path(tmp) / "extra.json",
                            EvalOptions(**{**options.__dict__, "split": None, "simulated_tau": None}),
                        )  # fmt: skip
                        document["prompt_sets"].update(extra["prompt_sets"])
                        document["per_prompt"] += extra["per_prompt"]
                document["simulated"] = simulated
                out.write_text(json.dumps(document, indent=1) + "\n")
            except Exception:
                # Snakemake removes the output of a failed job: keep the metrics beside the log.
                if out.exists():
                    shutil.copyfile(out, Path(smk.log[0]).with_suffix(".failed-metrics.json"))
                raise


run(snakemake)  # noqa: F821 (injected by Snakemake)
