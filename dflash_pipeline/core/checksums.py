"""Checksums of every output a later job reads: recorded by the job that writes one, checked by
every job that reads one and by ``python -m dflash_pipeline.stages.verify``.

What is recorded, and where. The job that writes a tracked object records the sha256 and size of
the file it wrote (``core.digest``, the format of every integrity record of the package), with the rule, the shard (or segment) and the time, in a small JSON object of
its own in the run root. Tracked (``is_checked_key``): the shard objects (``outputs/prepare-NNNNN.
parquet``, ``generate-``, ``tokenize-`` with its ``.heldout.parquet`` and ``.stats.json``, the
``extract-`` manifests; ``layout.SHARD_STAGES``), the ingest outputs, the training segment
manifests (``outputs/train-segment-KKKK.json``, which carry their checkpoint index's files with
their sha256: the export checks the index against it) and the exported drafter's files:

    _progress/checksums/outputs/tokenize-00003.parquet.json

Why a sidecar object, and not S3 object metadata or a table:

* Snakemake (and its S3 plugin) uploads a rule's declared outputs after the job has ended: the job
  never holds the S3 object, so it cannot set the object's metadata, and the plugin sets none.
  What the job can do is write beside it through the storage layer (``open_storage(run_url)``,
  the run root every rule that records or checks is given as its ``run_url`` param), as it
  already does for ``_progress/`` telemetry; the same code then serves local and S3 runs.
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
hashes the stored object.

An object without a sidecar is refused, by readers and by ``verify``: a deleted record must not
switch the check off. A run made before records existed is adopted once, explicitly, by ``verify
--adopt`` (it hashes the stored objects and writes their records).

A reader that finds a damaged input also writes a refusal (``refusal_key``) naming the job and
the input: the workflow (rules/common.smk) does not retry such a job, since a damaged input fails
every attempt alike.

A job about to run again over outputs it made before is checked by the workflow's driver first
(``refuse_damaged_reruns``), before Snakemake removes those outputs: a refused one never runs, and
its refusal lists the outputs it keeps.
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from dflash_pipeline.core import layout
from dflash_pipeline.core.digest import Digest, digest_file
from dflash_pipeline.core.storage import NotFound, Storage, is_s3_url, open_storage

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
# The run-level objects a later job reads, each with the rule that writes it.
RUN_OBJECTS = {
    layout.INGESTED_PROMPTS: "ingest",
    layout.INGEST_SUMMARY: "ingest",
    layout.QUARANTINE: "ingest",
    layout.DRAFTER_CONFIG: "export",
    layout.DRAFTER_WEIGHTS: "export",
}
SEGMENT_MANIFEST = re.compile(r"^outputs/train-segment-(?P<segment>\d{4})\.json$")
# The speculators-format export beside the z-lab one (drafter/<folder>/<file>).
SPECULATORS_FILE = re.compile(rf"^{layout.DRAFTER_DIR}/[^/]+/[^/]+$")
REFUSALS_DIR = f"{CHECKSUMS_DIR}/refused"
# How many inputs the driver hashes at once, and how many jobs' records it reads at once, when it
# checks the jobs about to run again (local disk reads and S3 round trips; refuse_damaged_reruns).
RERUN_CHECK_PARALLEL = 8


class ChecksumError(RuntimeError):
    """A tracked object is damaged, missing or without its record; the message names it, its
    producer and the repair."""


def sidecar_key(key: str) -> str:
    """``outputs/tokenize-00003.parquet`` -> ``_progress/checksums/outputs/tokenize-00003.parquet.json``."""
    return f"{CHECKSUMS_DIR}/{key}.json"


def object_key_of_sidecar(key: str) -> str | None:
    prefix = f"{CHECKSUMS_DIR}/"
    if not key.startswith(prefix) or not key.endswith(".json"):
        return None
    return key[len(prefix) : -len(".json")]


def object_key(path: str | os.PathLike) -> str:
    """The run-root key of a tracked object from any path to it (the job's local path, Snakemake's
    local copy of an S3 object): the drafter's files sit under ``drafter/``, every other tracked
    output in the flat ``outputs/`` folder."""
    parts = Path(path).parts
    for depth in (2, 3):  # drafter/<file>, drafter/<folder>/<file>
        if len(parts) > depth and parts[-depth] == layout.DRAFTER_DIR:
            return "/".join(parts[-depth:])
    return f"{layout.OUTPUTS_DIR}/{Path(path).name}"


def is_checked_key(key: str) -> bool:
    if key in RUN_OBJECTS or SEGMENT_MANIFEST.match(key) or SPECULATORS_FILE.match(key):
        return True
    match = layout.SHARD_OBJECT.match(key)
    return bool(match) and match["ext"] in CHECKED_EXTS.get(match["stage"], ())


@dataclass(frozen=True)
class Record:
    key: str
    sha256: str
    size: int
    rule: str
    shard: str
    written_at: float

    @property
    def digest(self) -> Digest:
        return Digest(self.sha256, self.size)

    def producer(self) -> str:
        return f"rule {self.rule} (shard {self.shard})"

    @classmethod
    def parse(cls, key: str, data: bytes) -> Record:
        doc = json.loads(data)
        digest = Digest.of(doc)
        return cls(
            key,
            digest.sha256,
            digest.size,
            str(doc.get("rule", "?")),
            str(doc.get("shard", "?")),
            float(doc.get("written_at", 0.0)),
        )


def rule_and_shard_of(key: str) -> tuple[str, str]:
    """The rule that writes ``key`` and its shard, segment or ``-`` (a run-level object)."""
    match = layout.SHARD_OBJECT.match(key)
    if match:
        return match["stage"], match["shard"]
    segment = SEGMENT_MANIFEST.match(key)
    if segment:
        return "train", segment["segment"]
    if key in RUN_OBJECTS:
        return RUN_OBJECTS[key], "-"
    if SPECULATORS_FILE.match(key):
        return "export", "-"
    return "?", "-"


def producer_of(key: str) -> str:
    """``rule tokenize (shard 00003)`` from the key alone (the stage is the rule's name)."""
    rule, shard = rule_and_shard_of(key)
    if rule == "?":
        return "an unknown rule"
    if shard == "-":
        return f"rule {rule}"
    return f"rule {rule} ({'segment' if rule == 'train' else 'shard'} {shard})"


def write_record(
    storage: Storage, key: str, digest: Digest, rule: str, shard: int | str, adopted: bool = False
) -> Record:
    """Store the record of ``key`` (``Record.parse`` reads it back)."""
    record = Record(key, digest.sha256, digest.size, rule, layout.shard_name(shard), time.time())
    doc = {
        "key": key,
        **digest.fields(),
        "rule": rule,
        "shard": record.shard,
        "written_at": record.written_at,
        "written_at_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(record.written_at)),
    }
    if adopted:
        # Hashed from the stored object by verify --adopt, not by the job that wrote it.
        doc["adopted"] = True
    storage.write_text(sidecar_key(key), json.dumps(doc, indent=1) + "\n")
    return record


def record_checksum(
    run_url: str | Storage, local_path: str | os.PathLike, rule: str, shard: int | str, key: str | None = None
) -> Record:
    """Hash the file a job just wrote and store its record in the run root (before Snakemake
    uploads the file: what it states is what the job wrote)."""
    storage = run_url if isinstance(run_url, Storage) else open_storage(run_url)
    key = key or object_key(local_path)
    digest = digest_file(local_path)
    record = write_record(storage, key, digest, rule, shard)
    log.info("recorded the checksum of %s: sha256 %s, %d bytes", storage.join(key), digest.sha256[:16], digest.size)
    return record


def adopt_command(run_url: str) -> str:
    prefix = " --default-storage-prefix <the run's prefix>" if is_s3_url(run_url) else ""
    return f"python -m dflash_pipeline.stages.verify --adopt{prefix}"


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
    if is_s3_url(run_url):
        root = layout.run_root(config["results_dir"], config["run"]) if config is not None else ""
        prefix = layout.storage_prefix_of(run_url, root) if root else "<the run's --default-storage-prefix>"
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
    local_path: str | os.PathLike,
    run_url: str,
    reader: str,
    config: dict | None = None,
    key: str | None = None,
    digest_of: Callable[[Path], Digest] = digest_file,
) -> Record | None:
    """Check the local copy of a shard object that a job is about to read against the record of
    the job that wrote it. Raises ChecksumError naming the stored object (its ``s3://`` URL or
    run path, never Snakemake's local cache path), its producer and the repair command; returns
    the record. An object without a record is refused too: deleting a record must not switch
    the check off (a run made before records existed is adopted once by ``verify --adopt``).
    ``digest_of`` hashes the copy (a caller that hashed it already passes what it found)."""
    storage = open_storage(run_url)
    key = key or object_key(local_path)
    where = storage.join(key)
    record = read_record(storage, key)
    local = Path(local_path)
    if record is None:
        if not local.is_file():
            raise ChecksumError(_message(where, f"is missing (checked by {reader})", producer_of(key), run_url, config))
        raise ChecksumError(
            f"{where} has no checksum record ({storage.join(sidecar_key(key))}; checked by {reader}), so "
            f"it cannot be trusted. Rebuild it: {repair_command(run_url, config, _config_hint(config))}; only a "
            f"run made before checksums were recorded adopts its objects as stored: {adopt_command(run_url)}"
        )
    problem = record.digest.problem(digest_of(local)) if local.is_file() else "is missing"
    if problem is None:
        log.info("checksum of %s verified (sha256 %s, %d bytes)", where, record.sha256[:16], record.size)
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


# --- what a job does (core.stage_job calls these with the job's ``run_url`` param) ------------


def record_outputs(run_url: str, rule: str, paths: Iterable[str], shard: int | str = "-") -> None:
    """Record the checksums of a job's tracked outputs (call it when the stage function returned);
    ``shard`` is the job's shard or segment, ``-`` for a run-level job."""
    storage = open_storage(run_url)
    for path in paths:
        record_checksum(storage, path, rule, shard)


def verify_stored_size(run_url: str, url: str, reader: str) -> Record:
    """A job's check of a tracked object it reads by byte range from the run root, never whole
    (the ingested table, read one row group per prepare job): its record exists and its stored
    size is the recorded one. ``verify`` hashes it whole."""
    root = run_url.rstrip("/") + "/"
    if not url.startswith(root):
        raise ValueError(f"{url} is not in the run root {run_url}")
    storage, key = open_storage(run_url), url[len(root) :]
    where = storage.join(key)
    record = read_record(storage, key)
    listed = {o.key: o.size for o in storage.list(key)}
    if key not in listed:
        raise ChecksumError(_message(where, f"is missing (checked by {reader})", producer_of(key), run_url, None))
    if record is None:
        raise ChecksumError(
            f"{where} has no checksum record ({storage.join(sidecar_key(key))}; checked by {reader}). Rebuild "
            f"it: {repair_command(run_url)}; only a run made before checksums were recorded adopts its objects "
            f"as stored: {adopt_command(run_url)}"
        )
    if listed[key] != record.size:
        problem = f"is {listed[key]} bytes, not the {record.size} it was written with (checked by {reader})"
        raise ChecksumError(_message(where, problem, record.producer(), run_url, None))
    return record


def refusal_key(rule: str, wildcards: dict) -> str:
    """Where a job that refused a damaged input says so: ``_progress/checksums/refused/generate-
    shard=00001.json``. One per job (its rule and wildcards), read by the workflow's driver."""
    name = ",".join(f"{k}={v}" for k, v in sorted(wildcards.items())) or "-"
    return f"{REFUSALS_DIR}/{rule}-{name}.json"


def job_name(rule: str, wildcards: dict) -> str:
    """``rule generate (shard 00001)``, ``rule train (segment 0002)``, ``rule export``."""
    shard = wildcards.get("shard") or wildcards.get("segment")
    return f"rule {rule}" + (f" ({'segment' if 'segment' in wildcards else 'shard'} {shard})" if shard else "")


def verify_inputs(
    run_url: str,
    rule: str,
    wildcards: dict,
    config: dict,
    paths: Iterable[str],
    *,
    kept: Iterable[str] = (),
    digest_of: Callable[[Path], Digest] = digest_file,
) -> None:
    """Check the tracked inputs of the job of ``rule`` with ``wildcards`` before it reads them
    (ChecksumError on the first bad one, after the job's refusal is written: the workflow does
    not retry it). ``kept``: the outputs the job made before, which a refusal leaves in place
    (the driver's check of a job about to run again, ``refuse_damaged_reruns``); the refusal
    lists them. ``digest_of`` as for ``verify_local_copy``."""
    reader, kept = job_name(rule, wildcards), list(kept)
    storage = open_storage(run_url)
    refusal = refusal_key(rule, wildcards)
    for path in paths:
        try:
            verify_local_copy(path, run_url, reader, config=config, digest_of=digest_of)
        except ChecksumError as err:
            doc = {"rule": rule, "wildcards": wildcards, "input": object_key(path), "error": str(err)}
            if kept:
                doc["kept_outputs"] = kept
            doc["written_at"] = time.time()
            storage.write_text(refusal, json.dumps(doc, indent=1) + "\n")
            raise
    if storage.exists(refusal):
        storage.delete(refusal)  # an earlier run's refusal, repaired since


@dataclass(frozen=True)
class Rerun:
    """A job about to run again over outputs it made before: its rule and wildcards, the local
    paths of its tracked inputs (the files the job would read) and the run-root keys of the
    outputs it has."""

    rule: str
    wildcards: dict
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]


def refuse_damaged_reruns(
    run_url: str, config: dict, reruns: Iterable[Rerun], parallel: int = RERUN_CHECK_PARALLEL
) -> list[tuple[Rerun, str]]:
    """Check the tracked inputs of jobs about to run again, before their earlier outputs are
    removed: each job as ``verify_inputs`` checks it (a refusal written, listing the outputs it
    keeps, or an earlier refusal removed). Each distinct input is read once, however many of the
    jobs read it; inputs are hashed, and the jobs checked, ``parallel`` at a time. Returns the
    refused jobs, each with its one-line error: the job, the outputs it keeps, the damaged
    object, its producer and the repair command."""
    reruns = list(reruns)
    # Keyed as verify_local_copy names them (Path), so that each is found again there.
    paths = sorted({str(Path(path)) for rerun in reruns for path in rerun.inputs if Path(path).is_file()})
    with ThreadPoolExecutor(max(1, parallel)) as pool:
        digests = dict(zip(paths, pool.map(digest_file, paths)))

        def digest_of(path: Path) -> Digest:
            known = digests.get(str(path))
            return known if known is not None else digest_file(path)

        def check(rerun: Rerun) -> tuple[Rerun, str] | None:
            try:
                verify_inputs(
                    run_url, rerun.rule, rerun.wildcards, config, rerun.inputs, kept=rerun.outputs, digest_of=digest_of
                )
            except ChecksumError as err:
                kept = ", ".join(rerun.outputs)
                return (
                    rerun,
                    f"{job_name(rerun.rule, rerun.wildcards)} not run, its earlier outputs kept ({kept}): {err}",
                )
            return None

        return [found for found in pool.map(check, reruns) if found is not None]


def refused(storage: Storage, rule: str, wildcards: dict) -> dict | None:
    """The refusal the job of ``rule`` with ``wildcards`` wrote (a damaged input), or None."""
    try:
        return json.loads(storage.read_bytes(refusal_key(rule, wildcards)))
    except (NotFound, ValueError):
        return None
