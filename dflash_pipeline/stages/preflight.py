"""Preflight: what would fail a run days in, refused when the workflow is planned, before any job.

    python -m dflash_pipeline.stages.preflight [--configfile FILE ...] [--default-storage-prefix s3://...]

The workflow runs the same checks while it parses (``rules/run_control.smk``), so ``snakemake -n``
and every real run stop at once with one line per problem, naming the key or variable, the value
and what to do. The config files are named after the config's problems, not after those of the
environment (credentials, the endpoint, the storage's answer: ``core.refusal.EnvironmentProblem``),
which no edit of the config fixes:

* the target model folder (unless the workflow builds the demo target into it): it exists and
  holds ``config.json``, a tokenizer and weights, every weight file a sharded checkpoint's index
  lists among them (a partial download is refused); a hub id is refused (every node reads the
  model from a local folder; nothing is downloaded at run time);
* the dataset files: local files of a known format, neither folders nor empty; ``s3://`` files
  exist (one HEAD each), are not empty and have a known format;
* the run's storage: S3 credentials found (the S3 plugin's variables, else boto's chain: AWS_*
  variables, ``~/.aws``, an instance role), the endpoint reachable, the bucket readable;
* the run already in storage: the keys that decide each sample's shard and split (``num_shards``,
  ``dataset.heldout_fraction``, ``dataset.id_field``) as it was ingested with;
* offline mode's stored taps: ``train.hidden_dtype`` float32 is refused where ``extract`` runs
  the target on a GPU (``train.gpus_per_job`` > 0), which computes in bfloat16;
* the experiment tracker (``train.tracker``): its library importable, else the pip extra to install;
* the engines the run launches (``engines.readiness``): installed where ``engines`` says, and the
  evaluation engine's version serves the drafter the config trains.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from dflash_pipeline.core import layout
from dflash_pipeline.core.config import trains_from_engine_taps
from dflash_pipeline.core.refusal import EnvironmentProblem, refusal_text
from dflash_pipeline.core.storage import is_s3_url
from dflash_pipeline.core.s3 import (
    NO_CREDENTIALS,
    S3_ENV_PREFIX,
    s3_client,
    s3_credentials_source,
    s3_endpoint,
    split_s3_url,
)
from dflash_pipeline.core.storage import StorageError
from dflash_pipeline.data.prompts import detect_format
from dflash_pipeline.stages.cli import looks_like_hub_id
from dflash_pipeline.engines.readiness import check_engines
from dflash_pipeline.training.offline import extract_device, stored_dtype_problem
from dflash_pipeline.training.tracker import tracker_problems

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")
WEIGHT_PATTERNS = ("*.safetensors", "*.safetensors.index.json", "pytorch_model*.bin")
# A sharded checkpoint's index (Hugging Face's layout): its weight_map names the file of each tensor.
WEIGHT_INDEX_PATTERNS = ("*.safetensors.index.json", "pytorch_model*.bin.index.json")
# Missing shard files named in the refusal; more are counted.
MISSING_SHARDS_NAMED = 5


def model_problems(model: str, workdir: Path = Path(".")) -> list[str]:
    """``target.model`` as a local Hugging Face folder: [] when it holds a config, a tokenizer
    and weights."""
    folder = workdir / model
    if not folder.exists():
        if looks_like_hub_id(model):
            return [
                f"target.model: {model!r} is not a folder here; it looks like a hub id. Every node "
                "reads the target from a local folder (nothing is downloaded at run time): download "
                f"it once (e.g. `hf download {model} --local-dir /models/{model.split('/')[-1]}`) "
                "and set target.model to that folder"
            ]
        return [
            f"target.model: {model} does not exist (set target.build_demo: true only for the demo "
            "target, which the workflow builds into that folder)"
        ]
    if not folder.is_dir():
        return [f"target.model: {model} is a file, not a model folder"]
    missing = []
    if not (folder / "config.json").is_file():
        missing.append("config.json")
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        missing.append(f"a tokenizer ({', '.join(TOKENIZER_FILES)})")
    if not any(next(folder.glob(pattern), None) for pattern in WEIGHT_PATTERNS):
        missing.append("weights (*.safetensors or pytorch_model*.bin)")
    if missing:
        return [f"target.model: {model} lacks {', '.join(missing)}"]
    return [
        problem
        for pattern in WEIGHT_INDEX_PATTERNS
        for index in sorted(folder.glob(pattern))
        if (problem := weight_index_problem(model, index))
    ]


def weight_index_problem(model: str, index: Path) -> str | None:
    """The weight files a sharded checkpoint's index lists that are not in its folder (a
    download stopped part way), or an index that cannot be read; None when all are there."""
    import json

    key = f"target.model: {model}/{index.name}"
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted(set(weight_map.values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        return f"{key} is not a readable index of weight files ({type(err).__name__}: {err})"
    if not all(isinstance(name, str) for name in files):
        return f"{key} is not a readable index of weight files (a weight_map value is not a file name)"
    absent = [name for name in files if not (index.parent / name).is_file()]
    if not absent:
        return None
    named = ", ".join(absent[:MISSING_SHARDS_NAMED])
    more = f" and {len(absent) - MISSING_SHARDS_NAMED} more" if len(absent) > MISSING_SHARDS_NAMED else ""
    return (
        f"{key} lists {len(absent)} of its {len(files)} weight files that are not in the folder "
        f"(a partial download?): {named}{more}"
    )


def dataset_problems(paths: list[str], workdir: Path = Path("."), check_s3: bool = True) -> list[str]:
    """Each local ``dataset.paths`` entry: a readable file of a known format with rows in it.
    ``s3://`` entries (read by the ingest job through the storage layer) are HEADed: present,
    not empty, of a known format; ``check_s3`` False skips them (the run's storage is already
    refused, and the same endpoint or credentials would fail each of them again)."""
    s3_entries = [(index, name) for index, name in enumerate(paths) if is_s3_url(name)]
    problems = _s3_dataset_problems(s3_entries) if check_s3 and s3_entries else []
    for index, name in enumerate(paths):
        if is_s3_url(name):
            continue
        key = f"dataset.paths[{index}]: {name}"
        path = workdir / name
        if not path.exists():
            problems.append((index, f"{key} does not exist"))
            continue
        if path.is_dir():
            problems.append((index, f"{key} is a folder; list its files (.jsonl or .parquet) instead"))
            continue
        try:
            kind = detect_format(name)
        except ValueError as err:
            problems.append((index, f"{key}: {str(err).split(': ', 1)[1]}"))
            continue
        if path.stat().st_size == 0:
            problems.append((index, f"{key} is empty (0 bytes)"))
            continue
        problem = _parquet_problem(path) if kind == "parquet" else _jsonl_problem(path)
        if problem:
            problems.append((index, f"{key} {problem}"))
    # In the order of dataset.paths (sorted() keeps an entry's own lines in order).
    return [line for _, line in sorted(problems, key=lambda found: found[0])]


def _s3_dataset_problems(entries: list[tuple[int, str]]) -> list[tuple[int, str]]:
    """(index, line) per problem of the ``s3://`` dataset files, one HEAD each; one line for
    credentials or an endpoint that would fail them all."""
    from botocore.exceptions import BotoCoreError, ClientError

    first = f"dataset.paths[{entries[0][0]}]: {entries[0][1]}"
    try:
        source = s3_credentials_source()
    except StorageError as err:
        return [(entries[0][0], EnvironmentProblem(f"{first} cannot be checked: {err}"))]
    # Few attempts: planning says at once that storage is unreachable (jobs ride out outages).
    client = s3_client(max_attempts=2, connect_timeout=10, read_timeout=30)
    endpoint = s3_endpoint(client)
    problems = []
    for index, name in entries:
        key = f"dataset.paths[{index}]: {name}"
        try:
            bucket, object_key = split_s3_url(name)
        except StorageError as err:
            problems.append((index, f"{key}: {err}"))
            continue
        if not object_key:
            problems.append((index, f"{key} names a bucket, not a file; list its files (.jsonl or .parquet)"))
            continue
        try:
            detect_format(name)
        except ValueError as err:
            problems.append((index, f"{key}: {str(err).split(': ', 1)[1]}"))
            continue
        try:
            head = client.head_object(Bucket=bucket, Key=object_key)
        except ClientError as err:
            code = str(err.response.get("Error", {}).get("Code", ""))
            if code in ("404", "NoSuchKey", "NotFound", "NoSuchBucket"):
                problems.append((index, f"{key} does not exist (no object {bucket}/{object_key} at {endpoint})"))
            else:
                problems.append(
                    (index, EnvironmentProblem(f"{key} cannot be read at {endpoint} ({code or err}); check {source}"))
                )
            continue
        except BotoCoreError as err:
            problems.append(
                (index, EnvironmentProblem(f"{key} cannot be checked: cannot reach {endpoint} ({type(err).__name__})"))
            )
            break  # the same endpoint fails every other file the same way
        if int(head.get("ContentLength", 0)) == 0:
            problems.append((index, f"{key} is empty (0 bytes)"))
    return problems


def _parquet_problem(path: Path) -> str | None:
    import pyarrow.parquet as pq

    try:
        rows = pq.read_metadata(path).num_rows
    except Exception as err:  # noqa: BLE001 (any unreadable file is the same refusal)
        return f"is not a readable parquet file ({type(err).__name__}: {err})"
    return "has no rows" if rows == 0 else None


def _jsonl_problem(path: Path) -> str | None:
    with open(path, "rb") as fh:
        if not any(line.strip() for line in fh):
            return "has no rows (only blank lines)"
    return None


def run_fixed_problems(config: dict, run_url: str) -> list[str]:
    """A run-fixed key changed against the run in storage (its ingest summary): a new num_shards
    would build the new shards from the old ingest with no prompts, a new held-out fraction would
    move samples between training and evaluation."""
    import json

    from dflash_pipeline.core.storage import NotFound, open_storage
    from dflash_pipeline.stages.prepare import run_fixed_changes

    storage = open_storage(run_url)
    try:
        summary = json.loads(storage.read_text(layout.INGEST_SUMMARY))
    except NotFound:
        return []  # a new run
    except StorageError as err:
        return [EnvironmentProblem(f"{storage.join(layout.INGEST_SUMMARY)}: unreadable ({err})")]
    except ValueError:
        return []  # not JSON: nothing recorded to compare (its checksum record says if it is damaged)
    if not isinstance(summary, dict) or summary.get("stopped"):
        return []
    return run_fixed_changes(config, summary, storage.join(layout.INGEST_SUMMARY))


def storage_problems(run_url: str) -> list[str]:
    """An S3 run root: credentials found (the S3 plugin's variables, else boto's chain, as the
    plugin and the jobs resolve them), endpoint reachable, bucket readable ([] for a local root).
    A missing bucket is no problem: the run creates it when it starts. Each is a problem of the
    environment (the run's storage comes from the command line and the environment)."""
    return [EnvironmentProblem(line) for line in _storage_problems(run_url)]


def _storage_problems(run_url: str) -> list[str]:
    if not is_s3_url(run_url):
        return []
    from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError

    bucket, _ = split_s3_url(run_url)
    try:
        source = s3_credentials_source()
    except StorageError as err:
        return [f"storage {run_url}: {err}"]
    # Few attempts: planning says at once that storage is unreachable (jobs ride out outages).
    client = s3_client(max_attempts=2, connect_timeout=10, read_timeout=30)
    endpoint = s3_endpoint(client)
    try:
        client.head_bucket(Bucket=bucket)
    except NoCredentialsError:
        return [f"storage {run_url}: {NO_CREDENTIALS}"]
    except ClientError as err:
        code = str(err.response.get("Error", {}).get("Code", ""))
        if code in ("404", "NoSuchBucket"):
            return []
        if code in ("403", "AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch"):
            return [f"storage {run_url}: access to bucket {bucket!r} at {endpoint} denied ({code}): check {source}"]
        return [f"storage {run_url}: bucket {bucket!r} at {endpoint}: {code or err}"]
    except BotoCoreError as err:
        return [
            f"storage {run_url}: cannot reach {endpoint} ({type(err).__name__}); check "
            f"{S3_ENV_PREFIX}ENDPOINT_URL (or AWS_ENDPOINT_URL) and the network"
        ]
    return []


def offline_problems(config: dict) -> list[str]:
    """A run that extracts taps (``layout.stages_built``): their stored dtype against the dtype
    the target computes them in on the device ``extract`` takes. [] for a run that stores none."""
    if "extract" not in layout.stages_built(config):
        return []
    train = config["train"]
    problem = stored_dtype_problem(train["hidden_dtype"], extract_device(train))
    return [problem] if problem else []


def taps_server_problems(config: dict) -> list[str]:
    """Online training with taps from an engine on GPUs: the taps server starts on the training
    GPUs before the trainers, so its memory share must be set (vLLM's default takes 0.9 of each
    card and the trainers would run out of memory). [] otherwise."""
    train = config["train"]
    if "train" not in layout.stages_built(config) or not trains_from_engine_taps(train):
        return []
    if train["gpus_per_job"] == 0 or train["taps_server"]["mem_fraction"] is not None:
        return []
    return [
        f"train.taps_server.mem_fraction: null, with train.taps_from: engine on {train['gpus_per_job']} "
        "GPU(s) per job: the taps server starts on the training GPUs before the trainers, and vLLM's "
        "default (0.9 of each card) would leave them about a tenth. Set the server's share: its weights "
        "(the target's over the job's GPUs) plus the KV of concurrency x GPUs sequences (an 8B target's "
        "drafter step took 25 GiB of an 80 GB card at 3,072 tokens: bench/README.md)."
    ]


def run_problems(config: dict, run_url: str, workdir: Path = Path(".")) -> tuple[list[str], list[str]]:
    """(problems, what is ready) of a validated config whose run root is ``run_url``."""
    problems = []
    if not config["target"]["build_demo"]:
        problems += model_problems(config["target"]["model"], workdir)
    storage = storage_problems(run_url)
    # An S3 run root that is refused is fixed first: its endpoint or credentials would refuse
    # each s3:// dataset file again.
    problems += dataset_problems(config["dataset"]["paths"], workdir, check_s3=not storage)
    problems += storage
    if not storage:
        problems += run_fixed_problems(config, run_url)
    problems += offline_problems(config)
    problems += taps_server_problems(config)
    problems += tracker_problems(config["train"])
    engine_problems, ready = check_engines(config)
    return problems + engine_problems, ready


def main(argv: list[str] | None = None) -> int:
    from dflash_pipeline.core.run_cli import add_run_arguments, open_run

    parser = argparse.ArgumentParser(
        prog="python -m dflash_pipeline.stages.preflight", description=__doc__.split("\n\n")[0]
    )
    add_run_arguments(parser)
    args = parser.parse_args(argv)
    # Relative paths from the working directory, as Snakemake reads them.
    run = open_run(args, parser)
    config, run_url = run.config, run.url
    problems, ready = run_problems(config, run_url)
    for line in ready:
        print(line)
    if problems:
        print(refusal_text(problems, " and ".join(args.configfile or ["config.yaml"])), file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
