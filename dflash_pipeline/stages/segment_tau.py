"""Segment τ stage: one training segment's checkpoint in the speculative-decoding loop, while the
next segment trains (``python -m dflash_pipeline.stages.segment_tau --help``).

The rule ``segment_tau`` runs once per segment, after that segment's manifest is published; the
next segment depends on the manifest alone, never on this job. The measurement itself is
``dflash_pipeline.evaluation.segment_tau``; the budget is ``train.segment_eval``.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from dflash_pipeline.evaluation.segment_tau import run_segment_tau

log = logging.getLogger(__name__)


def segment_tau_settings(config: dict) -> dict:
    """What defines a segment's τ record (rule segment_tau's param): the budget
    (``train.segment_eval``), the loop's temperature (evaluate's) and the target the segment
    trained against (``train.target_quantization``: its taps were the quantized target's)."""
    return {
        "prompts": config["train"]["segment_eval"]["prompts"],
        "max_new_tokens": config["train"]["segment_eval"]["max_new_tokens"],
        "temperature": config["evaluate"]["temperature"],
        "target_quantization": config["train"]["target_quantization"],
    }


def segment_tau_job(
    run_url: str,
    segment: int,
    manifest: str,
    target: str,
    prompts: str,
    out: str | Path,
    settings: dict,
    thinking: bool,
) -> dict:
    """What the ``segment_tau`` rule runs: segment ``segment`` measured on the held-out prompts of
    ``prompts`` (the run's ingested prompts), its record written to ``out``."""
    record = run_segment_tau(run_url, segment, manifest, target, prompts, out, settings, thinking)
    log.info(
        "segment %04d (step %s): tau %s over %d prompts, %d verify steps, %d tokens, %.1f s",
        segment,
        record["step"],
        record["tau"],
        record["prompts"],
        record["verify_steps"],
        record["generated_tokens"],
        record["seconds"],
    )
    return record


def main(argv: list[str] | None = None) -> int:
    from dflash_pipeline.evaluation.prompts import PromptFileError
    from dflash_pipeline.evaluation.segment_tau import SegmentTauError
    from dflash_pipeline.stages.cli import (
        existing_dir,
        json_file,
        model_dir,
        non_negative_float,
        non_negative_int,
        or_s3,
        positive_int,
    )

    parser = argparse.ArgumentParser(prog="python -m dflash_pipeline.stages.segment_tau", description=__doc__)
    parser.add_argument("--run-url", type=or_s3(existing_dir), required=True, help="run root (local folder or s3://)")
    parser.add_argument("--segment", type=non_negative_int, required=True)
    parser.add_argument(
        "--manifest", type=json_file, required=True, help="the segment's manifest (outputs/train-segment-KKKK.json)"
    )
    parser.add_argument("--target", type=model_dir, required=True, help="target model folder")
    parser.add_argument(
        "--prompts", required=True, help="prompts parquet with a split column (the run's ingested prompts)"
    )
    parser.add_argument("--out", required=True, help="the record to write (JSON)")
    parser.add_argument("--max-prompts", type=positive_int, default=4, help="held-out prompts measured")
    parser.add_argument("--max-new-tokens", type=positive_int, default=64)
    parser.add_argument("--temperature", type=non_negative_float, default=0.0)
    parser.add_argument("--thinking", choices=("on", "off"), default="on")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    settings = {"prompts": args.max_prompts, "max_new_tokens": args.max_new_tokens, "temperature": args.temperature}
    try:
        segment_tau_job(
            args.run_url,
            args.segment,
            args.manifest,
            args.target,
            args.prompts,
            args.out,
            settings,
            args.thinking == "on",
        )
    except (PromptFileError, SegmentTauError, FileNotFoundError) as err:
        print(f"{parser.prog}: error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
