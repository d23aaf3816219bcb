"""Where every artifact of a run lives, relative to the run root.

One module owns the key layout so that the Snakefile, the jobs and the status page agree.

Why every output Snakemake tracks sits in ONE flat folder (``outputs/``), named
``<stage>-NNNNN.<ext>`` for shard objects and ``<stage>-<name>`` for run-level ones: the Snakemake
S3 plugin lists objects once, under the folder of the first storage file the DAG happens to
inventory (in practice the input of the deepest job, not a target of ``rule all``); every object
outside that listing costs three sequential requests (HEAD object, HEAD bucket, LIST) during a
dry-run. With one folder for everything, whichever file comes first, the single listing covers
the whole run. (Measured: 1,000 shards took 8.7 s and 3,014 requests to plan with the ingest
outputs in a folder of their own, because that folder was listed first.)
Benchmark files are existence-checked too, so they live in the same folder; logs, ``_progress/``
and checkpoints live beside it and are never checked by Snakemake.
"""

from __future__ import annotations

import re

OUTPUTS_DIR = "outputs"
PROGRESS_DIR = "_progress"
LOGS_DIR = "logs"

# The stages a run goes through, in order: the values of the config's `until` (dflash_pipeline/config/schema.yaml
# lists the same), the order of the status page and of the report.
STAGES = ("prepare", "generate", "tokenize", "train", "evaluate")

# The stages that produce one object per shard, in pipeline order, and their file extensions.
# A stage's name is the name of the rule that builds its objects, of its script, of its module in
# ``dflash_pipeline.stages``, of its folder under ``_progress/`` and of its config `until` value.
SHARD_STAGES = {
    "prepare": "parquet",
    "generate": "parquet",
    "tokenize": "parquet",
    "extract": "manifest.json",
}


def stages_built(config: dict) -> tuple[str, ...]:
    """The stages a run of ``config`` (a validated config) builds, in pipeline order, each named
    like its rule: those of ``STAGES`` up to ``until``; ``tune`` before ``generate`` where the
    run measures its engine first (``tune.enabled`` and a server the run launches, not
    ``endpoint``); ``extract`` before ``train`` where training is offline. The one answer the
    rules, the preflight, verify, the status page and the report read."""
    tunes = config["tune"]["enabled"] and config["generation"]["engine"] != "endpoint"
    offline = config["train"]["mode"] == "offline"
    built: list[str] = []
    for stage in STAGES[: STAGES.index(config["until"]) + 1]:
        if stage == "generate" and tunes:
            built.append("tune")
        if stage == "train" and offline:
            built.append("extract")
        built.append(stage)
    return tuple(built)


def shard_name(shard: int | str) -> str:
    """``3`` -> ``"00003"``; a name (a wildcard such as ``"{shard}"``) stays as it is."""
    return shard if isinstance(shard, str) else f"{shard:05d}"


def shard_key(stage: str, shard: int | str, ext: str | None = None) -> str:
    """Key of one shard's object, e.g. ``outputs/prepare-00003.parquet``."""
    shard = shard_name(shard)
    return f"{OUTPUTS_DIR}/{stage}-{shard}.{ext or SHARD_STAGES[stage]}"


# A tokenize shard's held-out rows, also in an object of their own (``outputs/tokenize-NNNNN.
# heldout.parquet``, ~1% of the shard): evaluation samples its rows from these, not from every
# tokenized shard.
TOKENIZE_HELDOUT_EXT = "heldout.parquet"


def heldout_key(shard: int | str) -> str:
    """Key of a tokenize shard's held-out rows, e.g. ``outputs/tokenize-00003.heldout.parquet``."""
    return shard_key("tokenize", shard, TOKENIZE_HELDOUT_EXT)


def benchmark_key(rule_name: str, shard: int | str | None = None) -> str:
    """Key of a job's Snakemake benchmark (runtime and memory), e.g.
    ``outputs/benchmark.prepare-00003.tsv``."""
    suffix = f"-{shard_name(shard)}" if shard is not None else ""
    return f"{OUTPUTS_DIR}/benchmark.{rule_name}{suffix}.tsv"


def progress_prefix(stage: str, shard: int | str) -> str:
    """Folder for a job's in-flight state (parts, telemetry) that is not yet an output."""
    shard = shard_name(shard)
    return f"{PROGRESS_DIR}/{stage}/shard-{shard}/"


def stage_totals_key(stage: str) -> str:
    """One small object per shard stage holding each finished shard's final counts
    (``dflash_pipeline.core.jobstate.StageTotals``): the status page reads it instead of
    every finished shard's telemetry."""
    return f"{PROGRESS_DIR}/{stage}/totals.json"


def reuse_key(stage: str, shard: int | str) -> str:
    """A copy of a finished shard kept outside Snakemake's reach: Snakemake deletes an output
    before it rebuilds it (e.g. after data was added), and the job must not redo finished rows."""
    shard = shard_name(shard)
    return f"{PROGRESS_DIR}/reuse/{stage}-{shard}.parquet"


def hidden_states_key(shard: int | str) -> str:
    """The big object behind an extract shard's manifest: the target's taps of its rows."""
    shard = shard_name(shard)
    return f"extract/shard-{shard}.safetensors"


# The run's halt: written when a tokenize shard fails the data-quality gate; while it exists no
# generate, extract or train job starts, and running generate jobs stop at their next part.
HALT = f"{PROGRESS_DIR}/HALT.json"
# The run lease: which Snakemake driver runs this run (dflash_pipeline.core.lease).
RUN_LEASE = f"{PROGRESS_DIR}/LEASE.json"

INGESTED_PROMPTS = f"{OUTPUTS_DIR}/ingest-prompts.parquet"
INGEST_SUMMARY = f"{OUTPUTS_DIR}/ingest-summary.json"
QUARANTINE = f"{OUTPUTS_DIR}/ingest-quarantine.jsonl"
# The engine settings measured before the first generate job (dflash_pipeline.stages.tune).
TUNE_RESULT = f"{OUTPUTS_DIR}/tune-result.json"


def run_root(results_dir: str, run: str) -> str:
    """The run's folder relative to the working directory, e.g. ``results/demo``."""
    return f"{results_dir.rstrip('/')}/{run}"


class StoragePrefixMissing(ValueError):
    """An S3 run planned without its bucket and prefix (a forgotten --default-storage-prefix)."""


def run_url(root: str, storage_provider: str | None, storage_prefix: str | None) -> str:
    """Where the run's objects really live: ``root`` locally, or below the S3 storage prefix
    (Snakemake's ``--default-storage-prefix`` maps every output path the same way)."""
    if storage_provider == "s3":
        if not storage_prefix:
            raise StoragePrefixMissing(
                "--default-storage-provider s3 needs --default-storage-prefix s3://<bucket>/<prefix>, "
                "where the run's objects go (the S3 profile names no default bucket)"
            )
        return f"{storage_prefix.rstrip('/')}/{root}"
    return root


def storage_prefix_of(url: str, root: str) -> str | None:
    """The ``--default-storage-prefix`` that ``run_url`` put before ``root`` to make ``url`` (its
    inverse): None for a local run, or a URL that does not end in ``root``."""
    url, suffix = url.rstrip("/"), "/" + root.strip("/")
    if not url.startswith("s3://") or not url.endswith(suffix):
        return None
    return url[: -len(suffix)]


# Training runs as a chain of checkpoint segments (dflash_pipeline.training). Snakemake tracks a
# small manifest per segment; the checkpoint itself and the live metrics are written by the job.
def segment_name(segment: int | str) -> str:
    return segment if isinstance(segment, str) else f"{segment:04d}"


def segment_manifest_key(segment: int | str) -> str:
    """Declared output of training segment K, e.g. ``outputs/train-segment-0003.json``."""
    segment = segment_name(segment)
    return f"{OUTPUTS_DIR}/train-segment-{segment}.json"


def segment_tau_key(segment: int | str) -> str:
    """Declared output of rule segment_tau for segment K: that checkpoint's acceptance length in
    the speculative-decoding loop, e.g. ``outputs/segment_tau-0003.json``."""
    segment = segment_name(segment)
    return f"{OUTPUTS_DIR}/segment_tau-{segment}.json"


SEGMENT_TAU = re.compile(rf"^{OUTPUTS_DIR}/segment_tau-(?P<segment>\d{{4}})\.json$")


def checkpoint_prefix(segment: int | str) -> str:
    """Folder of segment K's finished checkpoint (weights, optimizer, scheduler, data, RNG)."""
    segment = segment_name(segment)
    return f"checkpoints/segment-{segment}/"


def train_progress_prefix(segment: int | str) -> str:
    """In-flight state of segment K: periodic checkpoints, ``metrics.jsonl`` (one JSON object per
    optimizer step) and ``telemetry.json``."""
    segment = segment_name(segment)
    return f"{PROGRESS_DIR}/train/segment-{segment}/"


TRAIN_METRICS = "metrics.jsonl"
# train.tracker tensorboard: the event files of every segment and of evaluate (a local run root
# gets them written there; an S3 one, uploaded from the job's local folder).
TENSORBOARD_DIR = f"{LOGS_DIR}/tensorboard"
# train.tracker mlflow: the run id every later job of the run reopens.
TRACKER_STATE = f"{PROGRESS_DIR}/tracker.json"
# The exported drafter (z-lab format) that SGLang and vLLM load: a folder of two files.
DRAFTER_DIR = "drafter"
DRAFTER_CONFIG = f"{DRAFTER_DIR}/config.json"
DRAFTER_WEIGHTS = f"{DRAFTER_DIR}/model.safetensors"
EVAL_METRICS = f"{OUTPUTS_DIR}/evaluate-metrics.json"


# Figures and tables of the HTML report, flagged with report() by rules/report.smk. They sit in
# the outputs folder too: Snakemake checks them in every dry-run, like any other output.
def report_key(name: str) -> str:
    """Key of a report item, e.g. ``outputs/report-generation-lengths.svg``."""
    return f"{OUTPUTS_DIR}/report-{name}"


SHARD_OBJECT = re.compile(r"^outputs/(?P<stage>[a-z_]+)-(?P<shard>\d{5})\.(?P<ext>.+)$")
# A shard job's live telemetry (``progress_prefix(stage, shard) + "telemetry.json"``).
SHARD_TELEMETRY = re.compile(r"^_progress/(?P<stage>[a-z_]+)/shard-(?P<shard>\d{5})/telemetry\.json$")


def storage_category(key: str) -> str:
    """The storage-use bucket of a key: a shard stage, another output kind, or a top folder."""
    match = SHARD_OBJECT.match(key)
    if match:
        return match["stage"]
    if key.startswith(f"{OUTPUTS_DIR}/"):
        name = key.split("/", 1)[1]
        return re.split(r"[-.]", name, maxsplit=1)[0]  # ingest, benchmark, train, eval, report
    return key.split("/", 1)[0] if "/" in key else "other"
