"""One storage API for local directories and ``s3://`` URIs.

Snakemake moves the declared (small) outputs of every rule itself. Everything else a job writes
(in-flight generation parts, telemetry, training checkpoints, hidden-state shards) goes through
this module, so the same code runs against a local run directory and against S3.

Rules the rest of the pipeline relies on:

* every write is atomic: a reader sees the old object, or the whole new one, never a prefix
  (local: temp file in the same directory + ``os.replace``; S3: one PUT or a completed multipart
  upload, which S3 makes visible all at once);
* S3 endpoint and credentials are resolved as ``snakemake-storage-plugin-s3`` resolves them
  (``SNAKEMAKE_STORAGE_S3_*``, else boto's own chain: ``AWS_*`` variables, ``~/.aws``, an
  instance role), so the plugin and the jobs can never disagree about where the run lives
  (``dflash_pipeline.core.s3``);
* the bucket keeps a permanent sentinel object, because the S3 plugin deletes a bucket once it
  is empty.

This module opens a storage from a URL: ``core.local_storage.LocalStorage`` for a path,
``core.s3.S3Storage`` for ``s3://``. Both implement ``core.storage_api``, which imports neither,
so the implementations never import the module that chooses between them (no import circle).
The API's names are importable from here too: the rest of the package imports the storage layer
from one place.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

from dflash_pipeline.core.local_storage import LocalStorage
from dflash_pipeline.core.s3 import S3Storage, split_s3_url
from dflash_pipeline.core.storage_api import NotFound, ObjectInfo, Storage, StorageError

__all__ = [
    "LocalStorage",
    "NotFound",
    "ObjectInfo",
    "ReadOnlyStorage",
    "Storage",
    "StorageError",
    "is_s3_url",
    "open_object",
    "open_storage",
    "write_atomically",
]


@contextlib.contextmanager
def write_atomically(url: str | os.PathLike) -> Iterator[Path]:
    """Yield a local temp path; when the block succeeds, it becomes the object at ``url`` at once.

    For a local ``url`` the temp file sits in the destination folder and is renamed over it;
    for S3 it is uploaded in one (multipart) upload. On error nothing is written.
    """
    storage, key = open_object(url)
    with storage.staged_file(key) as tmp:
        yield tmp


def is_s3_url(url: str | os.PathLike) -> bool:
    return str(url).startswith("s3://")


def open_storage(url: str | os.PathLike) -> Storage:
    """A storage for a local directory or an ``s3://bucket/prefix`` URL."""
    if is_s3_url(url):
        return S3Storage(str(url))
    return LocalStorage(url)


def open_object(url: str | os.PathLike) -> tuple[Storage, str]:
    """Split a full object URL (or local path) into its parent storage and the object's key."""
    url = str(url)
    if is_s3_url(url):
        bucket, key = split_s3_url(url)
        parent, _, name = key.rpartition("/")
        return S3Storage(f"s3://{bucket}/{parent}" if parent else f"s3://{bucket}"), name
    path = Path(url)
    return LocalStorage(path.parent), path.name


# The status server's only handle on a run: listing and reading, nothing that could write.
# The page is read-only by construction: the server never holds a ``Storage`` object, only this
# wrapper, which exposes the three reading calls and nothing else.
class ReadOnlyStorage:
    def __init__(self, storage: Storage):
        self._storage = storage
        # What the page may show of where the run lives: ``s3://bucket/prefix`` or a local path;
        # never the endpoint or anything from the credentials.
        self.url = storage.url

    @classmethod
    def open(cls, url: str) -> ReadOnlyStorage:
        return cls(open_storage(url))

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        return self._storage.list(prefix)

    def list_range(self, prefix: str, start: str = "", stop: str | None = None) -> list[ObjectInfo]:
        return self._storage.list_range(prefix, start, stop)

    def read_bytes(self, key: str) -> bytes:
        return self._storage.read_bytes(key)

    def read_text(self, key: str) -> str:
        return self.read_bytes(key).decode("utf-8")
