"""Tokenize stage: exact token ids and loss masks per generated shard, and the data-quality gate.

The gate exists because of one incident: 87% of a 914K-sample dataset was an empty think block
and "OK.", and nobody noticed until days of hidden-state extraction were wasted. A shard whose
degenerate fraction is above ``tokenize.max_degenerate_fraction`` fails here, at its first shard,
with the fraction, the top reasons, example ids and the most common response.

The work is ``dflash_pipeline.data.tokenized`` (masks, chunks, workers) and
``dflash_pipeline.data.quality`` (the gate); this module reads the generated shard, writes the
tokenized one and its stats, and keeps live telemetry under ``_progress/tokenize/shard-NNNNN/``.
``bench/tokenize_throughput.py`` measures the stage against the bare batched tokenizer.

A failed gate also halts the run (``_progress/HALT.json``, see ``dflash_pipeline.core.jobstate``):
every other shard is being generated with the same settings, so no generate, extract or train job
starts until a person has looked and cleared it:
``python -m dflash_pipeline.stages.tokenize clear-halt --run-url RUN`` (or ``--configfile``, with
``--default-storage-prefix`` for an S3 run, to find the run the way Snakemake does).

Run by hand: ``python -m dflash_pipeline.stages.tokenize --help``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

import pyarrow.compute as pc
import pyarrow.parquet as pq

from dflash_pipeline.core import layout
from dflash_pipeline.core.config import schema_defaults
from dflash_pipeline.core.jobstate import (
    ShardProgress,
    Telemetry,
    clear_halt,
    describe_halt,
    read_halt,
    write_halt,
)
from dflash_pipeline.core.storage import StorageError, open_storage, write_atomically
from dflash_pipeline.data.quality import DegenerateShard
from dflash_pipeline.data.shard_kinds import ShardKindError, require_file_kind
from dflash_pipeline.data.sharding import HELDOUT
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
    heldout_out: str | None = None,
) -> dict:
    """Tokenize one generated shard; with ``run_url`` and ``shard``, live telemetry goes under
    the run's ``_progress/tokenize/``; with ``heldout_out``, the shard's held-out rows are also
    written there on their own (``heldout_rows``)."""
    from transformers import AutoTokenizer

    # A prepare or tokenize shard would fail deep inside (KeyError: 'turns'): refuse it first.
    require_file_kind(generated, "generate", "tokenize")
    tokenizer = AutoTokenizer.from_pretrained(model)
    table = pq.read_table(generated)
    name = generated.rsplit("/", 1)[-1]
    # The CLI's --settings-json may leave the key out.
    every_s = settings.get("telemetry_every_seconds", schema_defaults("tokenize")["telemetry_every_seconds"])
    if run_url and shard is not None:
        telemetry = ShardProgress(open_storage(run_url), "tokenize", shard).telemetry(table.num_rows, every_s)
    else:
        telemetry = Telemetry(None, "", {}, table.num_rows, every_s=every_s)  # counts only: nowhere to write
    telemetry.write("running")
    try:
        shard_tokenizer = ShardTokenizer(tokenizer, thinking, settings, workers or os.cpu_count() or 1)
        result, summary = shard_tokenizer.run(table, name, telemetry.update)
    except BaseException as err:
        if isinstance(err, DegenerateShard):
            log.error("%s", err)
            if run_url and shard is not None:
                halt_run(run_url, shard, err)
        telemetry.write("failed")
        raise
    with write_atomically(out) as tmp:
        pq.write_table(result, tmp)
    if heldout_out:
        with write_atomically(heldout_out) as tmp:
            pq.write_table(heldout_rows(result), tmp)
    with write_atomically(stats_out) as tmp:
        tmp.write_text(json.dumps(summary, indent=1) + "\n")
    telemetry.write("done")
    log.info(
        "%s: %d samples -> %d sequences, %d degenerate (%s), %d supervised tokens",
        name,
        summary["samples"],
        summary["sequences_out"],
        summary["degenerate_samples"],
        summary["reasons"],
        summary["supervised_tokens_total"],
    )
    return summary


def heldout_rows(table):
    """The held-out rows of a tokenized table, in table order and schema: evaluation samples its
    rows from them, so it opens this small object instead of the whole shard."""
    return table.filter(pc.equal(table["split"], HELDOUT))


def halt_run(run_url: str, shard: int, err: DegenerateShard) -> None:
    """Stop the run's generation: the other shards are made with the same settings."""
    storage = open_storage(run_url)
    details = {
        k: err.summary[k]
        for k in ("samples", "degenerate_samples", "degenerate_fraction", "reasons", "examples", "most_common_response")
        if k in err.summary
    }
    try:
        halt = write_halt(storage, "tokenize", shard, err.cause, str(err), details)
    except StorageError as storage_err:  # the gate's own failure is what the job must report
        log.error("could not halt the run (%s): other shards go on generating", storage_err)
        return
    if halt["shard"] != layout.shard_name(shard):
        log.error("the run was already halted by %s shard %s", halt["stage"], halt["shard"])
    else:
        log.error("halting the run: %s", describe_halt(halt, storage))


def halt_main(argv: list[str]) -> int:
    from dflash_pipeline.core.run_cli import add_run_arguments, open_run

    parser = argparse.ArgumentParser(
        prog="python -m dflash_pipeline.stages.tokenize clear-halt|show-halt",
        description="Show or clear the run's halt (_progress/HALT.json), written when a tokenize "
        "shard fails the data-quality gate or a training segment diverges.",
    )
    parser.add_argument("action", choices=["clear-halt", "show-halt"])
    add_run_arguments(parser, run_url=True)
    args = parser.parse_args(argv)
    run_url = open_run(args, parser, config_needed=False, must_exist=True).url
    storage = open_storage(run_url)
    if args.action == "show-halt":
        halt = read_halt(storage)
        print(json.dumps(halt, indent=1) if halt else f"{run_url}: not halted")
        return 0
    halt = clear_halt(storage)
    if halt is None:
        print(f"{run_url}: not halted, nothing to clear")
    else:
        print(
            f"{run_url}: cleared the halt of {halt.get('stage')} shard {halt.get('shard')} "
            f"({halt.get('cause')}); generate, extract and train jobs may start again"
        )
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("clear-halt", "show-halt"):
        return halt_main(argv)
    from dflash_pipeline.stages.cli import (
        existing_dir,
        json_object,
        non_negative_int,
        or_s3,
        positive_int,
        shard_of,
    )

    parser = argparse.ArgumentParser(
        prog="python -m dflash_pipeline.stages.tokenize",
        description=__doc__,
        epilog="Also: python -m dflash_pipeline.stages.tokenize clear-halt|show-halt --help",
    )
    parser.add_argument("generated", type=or_s3(shard_of("generate", "tokenize")), help="generated shard parquet")
    parser.add_argument("--model", type=existing_dir, required=True, help="target model folder (its tokenizer)")
    parser.add_argument("--out", required=True)
    parser.add_argument("--stats", required=True)
    parser.add_argument("--heldout", default=None, help="also write the held-out rows here")
    parser.add_argument("--thinking", choices=["on", "off"], default="on")
    parser.add_argument("--settings-json", type=json_object, default="{}", help="the `tokenize` config as JSON")
    parser.add_argument(
        "--run-url",
        default=None,
        help="run root (local folder or s3://) for live telemetry and the halt a failed gate writes",
    )
    parser.add_argument(
        "--shard", type=non_negative_int, default=None, help="shard number, for live telemetry and the halt"
    )
    parser.add_argument("--workers", type=positive_int, default=None, help="worker processes (default: all cores)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    try:
        tokenize_file(
            args.generated,
            args.model,
            args.out,
            args.stats,
            args.thinking == "on",
            args.settings_json,
            args.run_url,
            args.shard,
            args.workers,
            args.heldout,
        )
    except DegenerateShard:
        return 1
    except ShardKindError as err:  # an s3:// input, not checked while the arguments were parsed
        log.error("%s", err)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
