"""Snakemake glue for rule `evaluate`; the logic is dflash_pipeline.stages.evaluate and
dflash_pipeline.evaluation."""

import json
import shutil
import tempfile
from pathlib import Path

import torch

from dflash_pipeline.stages.evaluate import EvalOptions, resolve_device_dtype, run_evaluation
from dflash_pipeline.evaluation.simulated import simulated_tau
from dflash_pipeline.core.gpu_slots import job_devices
from dflash_pipeline.core.joblog import job_logging
from dflash_pipeline.model.target import load_target


def run(smk) -> None:
    settings = smk.params.settings
    drafter_dir = str(Path(smk.input.drafter_config).parent)
    out = Path(smk.output.metrics)
    with job_logging(smk.log[0]):
        # Token-by-token decoding of a small model on a CPU is latency-bound: one thread was
        # faster than two on the 2-core test machine (oversubscribed threads wait on each other).
        torch.set_num_threads(1 if not smk.resources.gpu else smk.threads)
        with job_devices(smk.resources.gpu, smk.params.gpu_pool, smk.params.gpu_lock_dir):
            options = EvalOptions(
                max_new_tokens=settings["max_new_tokens"],
                temperature=settings["temperature"],
                thinking=smk.params.thinking,
                lossless_margin=settings["lossless_margin"],
                engine=settings["engine"],
                limit=settings["max_prompts"],
                split="heldout",
                parity_tolerance=settings["parity_tolerance"],
            )
            # One copy of the target serves the simulated tau and the loop.
            target = load_target(smk.params.model, *resolve_device_dtype(options))
            simulated = simulated_tau(
                drafter_dir,
                smk.params.model,
                list(smk.input.tokenized),
                max_rows=settings["simulated_rows"],
                target=target,
            )
            print(f"simulated (teacher-forced, held-out) acceptance length: {simulated}")
            options.simulated_tau = simulated["tau"]
            try:
                document = run_evaluation(
                    smk.params.model, drafter_dir, smk.input.prompts, out, options, target_model=target
                )
                with tempfile.TemporaryDirectory() as tmp:
                    for path in settings["benchmark_prompts"]:
                        extra = run_evaluation(
                            smk.params.model, drafter_dir, path, Path(tmp) / "extra.json",
                            EvalOptions(**{**options.__dict__, "split": None, "simulated_tau": None}),
                            target_model=target,
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
