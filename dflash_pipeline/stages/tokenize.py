"""Tokenize stage: exact token ids and loss masks per generated shard, and the data-quality gate.

The gate exists because of one incident: 87% of a 914K-sample dataset was an empty think block
and "OK.", and nobody noticed until days of hidden-state extraction were wasted. A shard whose
degenerate fraction is above ``tokenize.max_degenerate_fraction`` fails here, at its first shard,
with the fraction, the top reasons, example ids and the most common response.

The work is ``dflash_pipeline.data.tokenized`` (masks, chunks, workers) and
``dflash_pipeline.data.quality`` (the gate); this module reads the generated shard, writes the
tokenized one and its stats, and keeps live telemetry under ``_progress/tokenize/shard-NNNNN/``.
``bench/tokenize_throughput.py`` measures the stage against the bare batched tokenizer.

Run by hand: ``python -m dflash_pipeline.stages.tokenize --help``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

import pyarrow.parquet as pq

from dflash_pipeline.core.jobstate import ShardProgress, Telemetry
from dflash_pipeline.core.storage import open_storage, write_atomically
from dflash_pipeline.data.quality import DegenerateShard
from dflash_pipeline.data.tokenized import ShardTokenizer

log = logging.getLogger(__name__)

def tokenize_file(
    generated: str,
    model: str,
    out: str,
    stats_out: str,
    thinking: bool,
    settings: dict,
    run_url: str | None = None,
    shard: int | None = None,
    workers: int | None = None,
) -> dict:
    """Tokenize one generated shard; with ``run_url`` and ``shard``, live telemetry goes under
    the run's ``_progress/tokenize/``."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    table = pq.read_table(generated)
    name = generated.rsplit("/", 1)[-1]
    if run_url and shard is not None:
        telemetry = ShardProgress(open_storage(run_url), "tokenize", shard).telemetry(table.num_rows)
    else:
        telemetry = Telemetry(None, "", {}, table.num_rows)  # counts only: nowhere to write
    telemetry.write("running")
    try:
        shard_tokenizer = ShardTokenizer(tokenizer, thinking, settings, workers or os.cpu_count() or 1)
        result, summary = shard_tokenizer.run(table, name, telemetry.update)
    except BaseException as err:
        if isinstance(err, DegenerateShard):
            log.error("%s", err)
        telemetry.write("failed")
        raise
    with write_atomically(out) as tmp:
        pq.write_table(result, tmp)
    with write_atomically(stats_out) as tmp:
        tmp.write_text(json.dumps(summary, indent=1) + "\n")
    telemetry.write("done")
    log.info(
        "%s: %d samples -> %d sequences, %d degenerate (%s), %d supervised tokens",
        name, summary["samples"], summary["sequences_out"], summary["degenerate_samples"],
        summary["reasons"], summary["supervised_tokens_total"],
    )
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dflash_pipeline.stages.tokenize", description=__doc__)
    parser.add_argument("generated")
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--stats", required=True)
    parser.add_argument("--thinking", choices=["on", "off"], default="on")
    parser.add_argument("--settings-json", default="{}", help="the `tokenize` config as JSON")
    parser.add_argument("--run-url", default=None, help="run root (local folder or s3://) for live telemetry")
    parser.add_argument("--shard", type=int, default=None, help="shard number, for live telemetry")
    parser.add_argument("--workers", type=int, default=None, help="worker processes (default: all cores)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    try:
        tokenize_file(args.generated, args.model, args.out, args.stats, args.thinking == "on",
                      json.loads(args.settings_json), args.run_url, args.shard, args.workers)
    except DegenerateShard:
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
