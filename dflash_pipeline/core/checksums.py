"""Checksums of the run's shard objects: recorded by the job that writes one, checked by every job
that reads one and by ``python -m dflash_pipeline.stages.verify``.

What is recorded, and where. The job that writes a tracked shard object (``outputs/prepare-NNNNN.
parquet``, ``generate-``, ``tokenize-`` with its ``.heldout.parquet`` and ``.stats.json``, the
``extract-`` manifests; ``layout.SHARD_STAGES``) records the sha256 and size of the file it
wrote, with the rule, the shard and the time, in a small JSON object of its own in the run root:

    _progress/checksums/outputs/tokenize-00003.parquet.json

Why a sidecar object, and not S3 object metadata or a table:

* Snakemake (and its S3 plugin) uploads a rule's declared outputs after the job has ended: the job
  never holds the S3 object, so it cannot set the object's metadata, and the plugin sets none.
  What the job can do is write beside it through the storage layer (``open_storage(run_url)``),
  as it already does for ``_progress/`` telemetry; the same code then serves local and S3 runs.
* One object per shard object: jobs run concurrently on many machines and each writes only its
  own record (no shared file to update, no lock, no lost update). A consuming job reads exactly
  the records of its inputs (one small GET each), never the whole run; ``verify`` lists the
  folder once.
* Under ``_progress/``: beside the outputs, never declared, so Snakemake never checks, uploads or
  deletes it; and the ``outputs/`` folder keeps only what Snakemake tracks (one listing covers the
  run, dflash_pipeline.core.layout).

A sidecar states what the producing job wrote on its local disk: a byte flipped or a truncation
anywhere after that (the upload, the bucket, the consumer's download or its local cache) shows as
a mismatch when the consumer hashes its local copy (``verify_local_copy``), or when ``verify``
hashes the stored object. An object without a sidecar (made before this module existed) is
accepted with a note: such runs must keep working.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from dflash_pipeline.core import layout
from dflash_pipeline.core.storage import NotFound, Storage, is_s3_url, open_storage
from dflash_pipeline.core.s3 import S3Storage

log = logging.getLogger(__name__)

CHECKSUMS_DIR = f"{layout.PROGRESS_DIR}/checksums"
# The per-shard objects of each stage that carry a checksum (stage -> extensions). The tokenize
# stats are per-shard outputs too (report_tokenization reads them).
CHECKED_EXTS = {
    "prepare": (layout.SHARD_STAGES["prepare"],),
    "generate": (layout.SHARD_STAGES["generate"],),
    "tokenize": (layout.SHARD_STAGES["tokenize"], layout.TOKENIZE_HELDOUT_EXT, "stats.json"),
    "extract": (layout.SHARD_STAGES["extract"],),
}
CHUNK = 1 << 24  # 16 MiB


class ChecksumError(RuntimeError):
    """A shard object is damaged or missing; the message names it, its producer and the repair."""


def sidecar_key(key: str) -> str:
    """``outputs/tokenize-00003.parquet`` -> ``_progress/checksums/outputs/tokenize-00003.parquet.json``."""
    return f"{CHECKSUMS_DIR}/{key}.json"


def object_key_of_sidecar(key: str) -> str | None:
    prefix = f"{CHECKSUMS_DIR}/"
    if not key.startswith(prefix) or not key.endswith(".json"):
        return None
    return key[len(prefix) : -len(".json")]


def object_key(path: str | os.PathLike) -> str:
    """The run-root key of a shard object from any path to it (the job's local path, Snakemake's
    local copy of an S3 object): every tracked output sits in the flat ``outputs/`` folder."""
    return f"{layout.OUTPUTS_DIR}/{Path(path).name}"


def is_checked_key(key: str) -> bool:
    match = layout.SHARD_OBJECT.match(key)
    return bool(match) and match["ext"] in CHECKED_EXTS.get(match["stage"], ())


def sha256_and_size(path: str | os.PathLike) -> tuple[str, int]:
    digest, size = hashlib.sha256(), 0
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(CHUNK), b""):
            digest.update(chunk)
            size += len(chunk)
    return digest.hexdigest(), size


def stored_sha256(storage: Storage, key: str) -> tuple[str, int]:
    """sha256 and size of a stored object, streamed (an S3 object is never written to disk)."""
    if isinstance(storage, S3Storage):
        resp = storage._call("reading", key, storage.client.get_object, Bucket=storage.bucket, Key=storage._key(key))
        digest, size = hashlib.sha256(), 0

        def read():
            nonlocal size
            for chunk in resp["Body"].iter_chunks(CHUNK):
                digest.update(chunk)
                size += len(chunk)

        storage._call("reading", key, read)
        return digest.hexdigest(), size
    with storage.local_copy(key) as path:
        return sha256_and_size(path)


@dataclass(frozen=True)
class Record:
    key: str
    sha256: str
    size: int
    rule: str
    shard: str
    written_at: float

    def producer(self) -> str:
        return f"rule {self.rule} (shard {self.shard})"

    @classmethod
    def parse(cls, key: str, data: bytes) -> Record:
        doc = json.loads(data)
        return cls(
            key,
            str(doc["sha256"]),
            int(doc["size"]),
            str(doc.get("rule", "?")),
            str(doc.get("shard", "?")),
            float(doc.get("written_at", 0.0)),
        )


def producer_of(key: str) -> str:
    """``rule tokenize (shard 00003)`` from the key alone (the stage is the rule's name)."""
    match = layout.SHARD_OBJECT.match(key)
    return f"rule {match['stage']} (shard {match['shard']})" if match else "an unknown rule"


def record_checksum(
    run_url: str | Storage, local_path: str | os.PathLike, rule: str, shard: int | str, key: str | None = None
) -> Record:
    """Hash the file a job just wrote and store its record in the run root (before Snakemake
    uploads the file: what it states is what the job wrote)."""
    storage = run_url if isinstance(run_url, Storage) else open_storage(run_url)
    key = key or object_key(local_path)
    sha, size = sha256_and_size(local_path)
    record = Record(key, sha, size, rule, layout.shard_name(shard), time.time())
    doc = {
        "key": key,
        "sha256": sha,
        "size": size,
        "rule": rule,
        "shard": record.shard,
        "written_at": record.written_at,
        "written_at_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(record.written_at)),
    }
    storage.write_text(sidecar_key(key), json.dumps(doc, indent=1) + "\n")
    log.info("recorded the checksum of %s: sha256 %s, %d bytes", storage.join(key), sha[:16], size)
    return record


def read_record(storage: Storage, key: str) -> Record | None:
    """The object's record, or None when it has none (an object made before checksums)."""
    try:
        data = storage.read_bytes(sidecar_key(key))
    except NotFound:
        return None
    try:
        return Record.parse(key, data)
    except (ValueError, KeyError, TypeError) as err:
        raise ChecksumError(
            f"the checksum record {storage.join(sidecar_key(key))} is unreadable "
            f"({err}); remove it or run verify --repair"
        ) from None


def repair_command(run_url: str, config: dict | None = None, configfiles: str | None = None) -> str:
    """The commands that repair the run at ``run_url``: verify --repair (and its make target),
    with the run's S3 prefix and, when the job's config is not the default one, its config."""
    prefix = None
    if is_s3_url(run_url) and config is not None:
        root = layout.run_root(config["results_dir"], config["run"])
        if run_url.rstrip("/").endswith("/" + root):
            prefix = run_url.rstrip("/")[: -len(root) - 1]
    elif is_s3_url(run_url):
        prefix = "<the run's --default-storage-prefix>"
    args, make = [], []
    if configfiles:
        args += ["--configfile", configfiles]
        make.append(f"CONFIG={configfiles}")
    if prefix:
        args += ["--default-storage-prefix", prefix]
        make.append(f"PREFIX={prefix}")
    cli = " ".join(["python -m dflash_pipeline.stages.verify --repair", *args])
    return f"{cli}  (or: {' '.join(['make verify REPAIR=1', *make])})"


def _config_hint(config: dict | None) -> str | None:
    """``None`` when ``config`` is what ``config.yaml`` in the working directory gives (the run
    used no --configfile), else a placeholder for the user's config files."""
    if config is None:
        return None
    try:
        from dflash_pipeline.core.config import load_run_config

        if load_run_config(None, Path.cwd()) == dict(config):
            return None
    except Exception:  # noqa: BLE001 (only the hint depends on it)
        pass
    return "<this run's config files>"


def verify_local_copy(
    local_path: str | os.PathLike, run_url: str, reader: str, config: dict | None = None, key: str | None = None
) -> Record | None:
    """Check the local copy of a shard object that a job is about to read against the record of
    the job that wrote it. Raises ChecksumError naming the stored object (its ``s3://`` URL or
    run path, never Snakemake's local cache path), its producer and the repair command; returns
    the record, or None for an object without one (accepted, with a note in the job's log)."""
    storage = open_storage(run_url)
    key = key or object_key(local_path)
    where = storage.join(key)
    record = read_record(storage, key)
    local = Path(local_path)
    if record is None:
        if not local.is_file():
            raise ChecksumError(_message(where, f"is missing (checked by {reader})", producer_of(key), run_url, config))
        log.info(
            "note: %s has no checksum record (written before checksums were recorded); read unchecked by %s",
            where,
            reader,
        )
        return None
    if not local.is_file():
        problem = "is missing"
    else:
        sha, size = sha256_and_size(local)
        if size != record.size:
            problem = (
                f"is {'short' if size < record.size else 'too long'}: {size} bytes, not the "
                f"{record.size} it was written with"
            )
        elif sha != record.sha256:
            problem = (
                f"is damaged: its sha256 is {sha}, not the {record.sha256} it was written "
                f"with (same size, {size} bytes)"
            )
        else:
            log.info("checksum of %s verified (sha256 %s, %d bytes)", where, sha[:16], size)
            return record
    written = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(record.written_at))
    raise ChecksumError(
        _message(where, f"{problem} (written {written}; checked by {reader})", record.producer(), run_url, config)
    )


def _message(where: str, problem: str, producer: str, run_url: str, config: dict | None) -> str:
    return (
        f"{where} {problem}. It was produced by {producer}. Repair it (deletes it and reruns "
        f"{producer} and everything downstream): {repair_command(run_url, config, _config_hint(config))}"
    )


# --- the Snakemake glue: scripts/*.py call these two ------------------------------------------


def job_run_url(smk) -> str | None:
    """The run root of a Snakemake job: its ``run_url`` param, or (for a rule without one, e.g.
    ``prepare``) worked out from where Snakemake put its outputs: locally ``<run root>/outputs/
    <name>``; in an S3 run Snakemake's local copy ``<local storage prefix>/s3/<bucket>/<prefix>/
    <run root>/outputs/<name>`` of ``s3://<bucket>/<prefix>/<run root>/outputs/<name>``."""
    params = getattr(smk, "params", None)
    run_url = params.get("run_url") if params is not None else None
    if run_url:
        return run_url
    root = layout.run_root(smk.config["results_dir"], smk.config["run"]).strip("/")
    for path in [*smk.output, *smk.input]:
        parts = Path(os.path.normpath(path)).parts
        tail = (*Path(root).parts, layout.OUTPUTS_DIR)
        if len(parts) < len(tail) + 1 or tuple(parts[-len(tail) - 1 : -1]) != tail:
            continue
        base = parts[: -len(tail) - 1]
        if not base:
            return root
        # The S3 plugin's local copies sit under <local storage prefix>/s3/<bucket>/<key>.
        default = (".snakemake", "storage", "s3")
        index = (
            len(default) if tuple(base[: len(default)]) == default else (base.index("s3") + 1 if "s3" in base else None)
        )
        if index is not None and len(base) > index:
            return "s3://" + "/".join([*base[index:], *Path(root).parts])
        return str(Path(*base, root))
    return None


def record_outputs(smk, paths: Iterable[str], shard: int | str) -> None:
    """Record the checksums of a job's shard outputs (call it when the stage function returned)."""
    run_url = job_run_url(smk)
    if run_url is None:
        log.warning("no run root known to rule %s: checksums of %s not recorded", smk.rule, list(paths))
        return
    storage = open_storage(run_url)
    for path in paths:
        record_checksum(storage, path, smk.rule, shard)


def verify_inputs(smk, paths: Iterable[str]) -> None:
    """Check a job's shard inputs before it reads them (ChecksumError on the first bad one)."""
    run_url = job_run_url(smk)
    if run_url is None:
        log.warning("no run root known to rule %s: its inputs are read unchecked", smk.rule)
        return
    wildcards = getattr(smk, "wildcards", None)
    shard = wildcards.get("shard") if wildcards is not None else None
    reader = f"rule {smk.rule}" + (f" (shard {shard})" if shard else "")
    for path in paths:
        verify_local_copy(path, run_url, reader, config=dict(smk.config))
