"""Train one segment of the drafter: ``python -m dflash_pipeline.stages.train --help``.

Run directly for one process, or under ``torchrun --nproc_per_node N -m dflash_pipeline.stages.train``
for DDP over N GPUs (the workflow's `train` rule does this).
"""

from __future__ import annotations

import argparse
import json
import sys

from dflash_pipeline.training.trainer import SegmentJob


def parse_shard_paths(values: list[str]) -> dict[str, str]:
    """``SHARD=PATH`` pairs."""
    pairs = {}
    for value in values:
        shard, sep, path = value.partition("=")
        if not sep:
            raise SystemExit(f"expected SHARD=PATH, got {value!r}")
        pairs[shard] = path
    return pairs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--run-url", required=True, help="run root (local folder or s3://bucket/prefix)")
    parser.add_argument("--segment", type=int, required=True)
    parser.add_argument("--settings", required=True, help="JSON file with the config's `train` section")
    parser.add_argument("--target", required=True, help="target model folder")
    parser.add_argument("--tokenized", nargs="+", required=True, metavar="SHARD=PATH")
    parser.add_argument("--hidden", nargs="*", default=[], metavar="SHARD=MANIFEST")
    parser.add_argument("--manifest", required=True, help="where to write the segment manifest")
    parser.add_argument("--device", default=None)
    args = parser.parse_args(argv)
    with open(args.settings) as fh:
        settings = json.load(fh)
    SegmentJob(
        run_url=args.run_url,
        segment=args.segment,
        settings=settings,
        target_dir=args.target,
        tokenized=parse_shard_paths(args.tokenized),
        hidden=parse_shard_paths(args.hidden),
        manifest_path=args.manifest,
        device=args.device,
    ).run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
