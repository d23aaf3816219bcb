"""Copy a run's results to a local folder, e.g. from the S3 run root of a remote GPU machine to a
laptop: ``python -m dflash_pipeline.stages.fetch --run-url s3://bucket/prefix/results/<run>
--to DIR`` (or a local run folder as ``--run-url``). Keys become relative paths below DIR.

Fetched (selected by ``dflash_pipeline.core.layout``'s keys): what a person reads to judge a run,
which is small: the exported drafter (``drafter/``), ``outputs/`` (metrics, report figures and
tables, ingest summary and quarantine, tokenize gate stats, benchmarks, training-segment and
hidden-state manifests), ``logs/``, the live state under ``_progress/`` that the status page and
the report draw from (training ``metrics.jsonl``, telemetry, the halt, the lease), and the JSON
indexes of the checkpoints, which say what checkpoints exist. Left out unless asked, being the
bulk of a run's bytes and nothing to read: checkpoint shards (``--with-checkpoints``: GBs per
segment, wanted only to resume or re-export) and row data (``--with-shards``: ingested prompts,
prepare/generate/tokenize parquet shards and held-out rows, in-flight generation parts, reuse
copies, the hidden states under ``extract/``).

The run may still be going; fetch again to catch up. An object that vanishes between listing and
reading is skipped with a note; each file lands in DIR by an atomic rename, so an interrupted
fetch leaves old files or whole new ones. Deletions in the run are not mirrored.

"Already there": S3 ETags are version stamps, not content hashes. A single PUT's ETag is the MD5
of its bytes, but a multipart upload's (every checkpoint and big shard: boto splits uploads above
8 MiB) is an MD5 of part MD5s, which no local file can be checked against without the part size.
So DIR keeps ``.fetch-manifest.json``: per key, the size and tag (S3: ETag; local run: mtime) the
object was listed with when copied, and the sha256 and mtime of the file written. An object is
there when its listed size and tag equal the record's and the local file is the one written (same
mtime, else same sha256). With no record (manifest deleted, files put there by hand) a single-part
ETag is checked against the file's MD5; anything else is copied again: copying too much is the
safe way to be wrong, a wrong "same" would show stale results.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import sys
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from dflash_pipeline.core import layout
from dflash_pipeline.core.config import schema_defaults
from dflash_pipeline.core.digest import Digest, digest_file
from dflash_pipeline.core.s3 import BUCKET_SENTINEL_KEY, S3Storage
from dflash_pipeline.core.storage import (
    Storage,
    StorageError,
    open_storage,
    write_atomically,
)

MANIFEST = ".fetch-manifest.json"
# Top folders and prefixes, derived from the layout's own key functions.
CHECKPOINTS_DIR = layout.checkpoint_prefix(0).split("/", 1)[0] + "/"
HIDDEN_STATES_DIR = layout.hidden_states_key(0).split("/", 1)[0] + "/"
TRAIN_PROGRESS = layout.train_progress_prefix(0).rsplit("segment-", 1)[0]
ROW_DATA_EXTS = {e for e in layout.SHARD_STAGES.values() if e.endswith("parquet")} | {layout.TOKENIZE_HELDOUT_EXT}
MD5_ETAG = re.compile(r"[0-9a-f]{32}")


def kind(key: str) -> str:
    """``artifact`` (always fetched), ``checkpoint`` or ``shard`` (fetched on request), or
    ``record`` (a fetch manifest, when the run folder is itself a fetched copy: never fetched)."""
    if key == MANIFEST:
        return "record"
    if key.startswith((CHECKPOINTS_DIR, TRAIN_PROGRESS)):
        # Checkpoint indexes, latest-pointers, metrics.jsonl and telemetry are JSON; shards are not.
        return "artifact" if key.endswith((".json", ".jsonl")) else "checkpoint"
    match = layout.SHARD_OBJECT.match(key)
    rows = (
        key.startswith(HIDDEN_STATES_DIR)
        or key == layout.INGESTED_PROMPTS
        or (match is not None and match["ext"] in ROW_DATA_EXTS)
        # generation parts and reuse copies: the rows of shards in flight
        or (key.startswith(f"{layout.PROGRESS_DIR}/") and key.endswith(".parquet"))
    )
    return "shard" if rows else "artifact"


def selected(key: str, with_checkpoints: bool = False, with_shards: bool = False) -> bool:
    return kind(key) in {"artifact", "checkpoint" * with_checkpoints, "shard" * with_shards}


@dataclass(frozen=True)
class Listed:
    """An object as listed: its tag is what changes when it does (S3: ETag; local: mtime)."""

    key: str
    size: int
    tag: str


def describe(err: BaseException) -> str:
    """One line for an error, with the S3 error code where there is one."""
    error = (getattr(err, "response", None) or {}).get("Error", {})
    text = f"{error.get('Code')}: {error.get('Message', '')}" if error.get("Code") else str(err)
    return " ".join(text.split()) or type(err).__name__


def list_run(storage: Storage) -> list[Listed]:
    """Every object of the run with its size and tag: the ETag on S3, the mtime of a local file
    (the listing tolerates files that vanish while it runs, since the run may be writing)."""
    if not isinstance(storage, S3Storage) and not Path(storage.url).is_dir():
        raise StorageError(f"{storage.url}: no such folder")
    return [
        Listed(o.key, o.size, o.etag if o.etag is not None else f"mtime:{round(o.mtime * 1e9)}")
        for o in storage.list("")
        if not o.key.endswith("/") and o.key != BUCKET_SENTINEL_KEY
    ]


def md5_file(path: Path) -> str:
    with open(path, "rb") as fh:
        return hashlib.file_digest(fh, "md5").hexdigest()


def is_fetched(listed: Listed, path: Path, record: dict | None) -> bool:
    """Whether ``path`` already holds ``listed``'s bytes (see the module docstring)."""
    try:
        st = path.stat()
    except FileNotFoundError:
        return False
    if st.st_size != listed.size:
        return False
    if record is None:
        return bool(MD5_ETAG.fullmatch(listed.tag)) and md5_file(path) == listed.tag
    if (record.get("size"), record.get("tag")) != (listed.size, listed.tag):
        return False
    if record.get("mtime_ns") == st.st_mtime_ns:
        return True
    try:
        return Digest.of(record) == digest_file(path)
    except (KeyError, ValueError, TypeError):  # a record without its digest: copy again
        return False


def record_of(listed: Listed, path: Path) -> dict:
    """The file's digest (the package's record format, ``core.digest``), the tag the object was
    listed with, and the file's mtime."""
    st = path.stat()
    return {**digest_file(path).fields(), "tag": listed.tag, "mtime_ns": st.st_mtime_ns}


def local_path(dest: Path, key: str) -> Path | None:
    """Where ``key`` goes below ``dest``; None for a key that would leave it (S3 allows ``..``)."""
    parts = PurePosixPath(key).parts
    return None if not parts or ".." in parts or parts[0] == "/" else dest.joinpath(*parts)


def human(size: float) -> str:
    unit = 0
    while size >= 1000 and unit < 4:
        size, unit = size / 1000, unit + 1
    return f"{size:.0f} B" if unit == 0 else f"{size:.1f} {'kMGT'[unit - 1]}B"


def note(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


@dataclass
class Summary:
    copied: int = 0
    copied_bytes: int = 0
    there: int = 0
    skipped: int = 0
    failed: int = 0
    left_out: dict[str, list[int]] = field(default_factory=dict)  # kind -> [objects, bytes]


def copy_one(storage: Storage, listed: Listed, path: Path) -> dict:
    """Download to a temp file beside ``path``, rename it over ``path``; the new record."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with write_atomically(path) as tmp:
        storage.download_file(listed.key, tmp)
    return record_of(listed, path)


def fetch(
    run_url: str,
    to: str | os.PathLike,
    *,
    with_checkpoints: bool = False,
    with_shards: bool = False,
    dry_run: bool = False,
    jobs: int = schema_defaults("fetch")["jobs"],
) -> Summary:
    """Copy the selected objects of the run at ``run_url`` that DIR lacks; raises StorageError
    when the run cannot be listed (and copies nothing then)."""
    storage, dest = open_storage(run_url), Path(to)
    if not isinstance(storage, S3Storage) and dest.resolve().is_relative_to(Path(run_url).resolve()):
        raise StorageError(f"{dest} is inside the run folder {run_url}")
    objects = list_run(storage)
    if not objects:
        raise StorageError(f"{storage.url}: no objects there (not a run root?)")
    try:
        manifest = json.loads((dest / MANIFEST).read_text())
        records = dict(manifest["objects"])
    except (OSError, ValueError, KeyError, TypeError):
        records = {}  # none yet, or unreadable: every file without a record is checked anew
    summary, todo = Summary(), []
    for listed in objects:
        if not selected(listed.key, with_checkpoints, with_shards):
            count = summary.left_out.setdefault(kind(listed.key), [0, 0])
            count[0], count[1] = count[0] + 1, count[1] + listed.size
        elif (path := local_path(dest, listed.key)) is None:
            summary.skipped += 1
            note(f"skipped {listed.key!r}: not a relative path")
        elif is_fetched(listed, path, records.get(listed.key)):
            summary.there += 1
            if listed.key not in records or records[listed.key].get("mtime_ns") != path.stat().st_mtime_ns:
                records[listed.key] = record_of(listed, path)
        else:
            todo.append((listed, path))
    if dry_run:
        for listed, _ in todo:
            note(f"would copy {listed.key} ({human(listed.size)})")
        summary.copied, summary.copied_bytes = len(todo), sum(o.size for o, _ in todo)
        return summary
    pool = ThreadPoolExecutor(max_workers=max(1, jobs))
    try:
        futures = {pool.submit(copy_one, storage, listed, path): listed for listed, path in todo}
        for done, future in enumerate(as_completed(futures), 1):
            listed, counter = futures[future], f"[{done}/{len(todo)}]"
            try:
                records[listed.key] = future.result()
            except Exception as err:  # one object's trouble never stops the others
                cause = describe(err)  # deleted since listed, or replaced while being read
                if isinstance(err, FileNotFoundError) or any(
                    w in cause for w in ("does not exist", "PreconditionFailed")
                ):
                    summary.skipped += 1
                    note(f"{counter} skipped {listed.key}: gone or changed since it was listed")
                else:
                    summary.failed += 1
                    note(f"{counter} failed {listed.key}: {cause}")
                continue
            summary.copied += 1
            summary.copied_bytes += records[listed.key]["size"]
            note(f"{counter} copied {listed.key} ({human(records[listed.key]['size'])})")
    finally:
        # Interrupted (Ctrl-C): no new downloads; what finished is recorded.
        pool.shutdown(cancel_futures=True)
        dest.mkdir(parents=True, exist_ok=True)
        with write_atomically(dest / MANIFEST) as tmp:
            tmp.write_text(json.dumps({"source": storage.url, "objects": records}, indent=1, sort_keys=True))
    return summary


FLAGS = {"checkpoint": "--with-checkpoints", "shard": "--with-shards"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m dflash_pipeline.stages.fetch",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--run-url", required=True, help="s3://bucket/prefix/<results_dir>/<run> or a local run folder")
    parser.add_argument("--to", required=True, help="local folder to copy into (created if missing)")
    parser.add_argument("--with-checkpoints", action="store_true", help="also the checkpoint shards")
    parser.add_argument("--with-shards", action="store_true", help="also the row data and hidden states")
    parser.add_argument("--dry-run", action="store_true", help="list what would be copied; write nothing")
    parser.add_argument(
        "--jobs", type=int, default=schema_defaults("fetch")["jobs"], help="parallel downloads (default: %(default)s)"
    )
    args = parser.parse_args(argv)
    try:
        summary = fetch(
            args.run_url,
            args.to,
            with_checkpoints=args.with_checkpoints,
            with_shards=args.with_shards,
            dry_run=args.dry_run,
            jobs=args.jobs,
        )
    except (StorageError, OSError) as err:
        note(f"fetch: {describe(err)}")
        return 1
    for name, (count, size) in sorted(summary.left_out.items()):
        if name in FLAGS:
            note(f"left out: {count} {name} objects ({human(size)}); {FLAGS[name]} adds them")
    note(
        f"{'dry run: ' if args.dry_run else ''}{summary.copied} {'to copy' if args.dry_run else 'copied'} "
        f"({human(summary.copied_bytes)}), {summary.there} already there, {summary.skipped} skipped"
        + (f", {summary.failed} failed" if summary.failed else "")
    )
    return 1 if summary.failed else 0


if __name__ == "__main__":
    sys.exit(main())
