"""Where every artifact of a run lives, relative to the run root.

One module owns the key layout so that the Snakefile, the jobs and the status page agree.

Why shard outputs of every stage sit in ONE folder (``shards/``), named ``<stage>-NNNNN.<ext>``:
the Snakemake S3 plugin lists only the folder of the first input of the target job; every object
outside that listing costs about three sequential requests during a dry-run. With nested
per-stage folders, 10,000 shards x 4 stages took 305 s to plan against a local S3 server; with one
flat folder, 23 s. ``rule all`` therefore lists a ``shards/`` object first.
"""

from __future__ import annotations

SHARDS_DIR = "shards"
INGEST_DIR = "ingest"
PROGRESS_DIR = "_progress"
LOGS_DIR = "logs"
BENCHMARKS_DIR = "benchmarks"

# The stages that produce one object per shard, in pipeline order, and their file extensions.
SHARD_STAGES = {
    "prompts": "parquet",
    "generated": "parquet",
    "tokenized": "parquet",
    "hidden": "manifest.json",
}


def shard_name(shard: int) -> str:
    return f"{shard:05d}"


def shard_key(stage: str, shard: int | str, ext: str | None = None) -> str:
    """Key of one shard's object, e.g. ``shards/prompts-00003.parquet``."""
    if isinstance(shard, int):
        shard = shard_name(shard)
    return f"{SHARDS_DIR}/{stage}-{shard}.{ext or SHARD_STAGES[stage]}"


def progress_prefix(stage: str, shard: int | str) -> str:
    """Folder for a job's in-flight state (parts, telemetry) that is not yet an output."""
    if isinstance(shard, int):
        shard = shard_name(shard)
    return f"{PROGRESS_DIR}/{stage}/shard-{shard}/"


INGESTED_PROMPTS = f"{INGEST_DIR}/prompts.parquet"
INGEST_SUMMARY = f"{INGEST_DIR}/summary.json"
QUARANTINE = f"{INGEST_DIR}/quarantine.jsonl"


def run_root(results_dir: str, run: str) -> str:
    """The run's folder relative to the working directory, e.g. ``results/demo``."""
    return f"{results_dir.rstrip('/')}/{run}"


def run_url(root: str, storage_provider: str | None, storage_prefix: str | None) -> str:
    """Where the run's objects really live: ``root`` locally, or below the S3 storage prefix
    (Snakemake's ``--default-storage-prefix`` maps every output path the same way)."""
    if storage_provider == "s3":
        if not storage_prefix:
            raise ValueError("--default-storage-provider s3 needs --default-storage-prefix")
        return f"{storage_prefix.rstrip('/')}/{root}"
    return root
