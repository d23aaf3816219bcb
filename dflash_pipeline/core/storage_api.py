"""The storage API every job writes through: a root (a local directory or an S3 prefix) holding
objects addressed by relative keys, and its errors.

The two implementations sit beside it, ``core.local_storage`` and ``core.s3``, and
``core.storage`` picks one from a URL; this module imports neither, so neither implementation
depends on the module that chooses between them. What the API promises (atomic writes, the
conditional writes of the run lease, S3 settings shared with Snakemake's plugin) is in
``core.storage``'s docstring.
"""

from __future__ import annotations

import contextlib
import io
import os
import tempfile
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from dflash_pipeline.core.digest import Digest


class StorageError(RuntimeError):
    """A storage operation failed; the message names the URL."""


class NotFound(StorageError):
    """The object does not exist (local file or S3 key); the message names its URL."""


@dataclass(frozen=True)
class ObjectInfo:
    """One stored object: key relative to the storage root, size in bytes, mtime (epoch s), and
    for S3 its ETag as listed (the MD5 of the bytes for a single-part upload; None locally)."""

    key: str
    size: int
    mtime: float
    etag: str | None = None


class Storage(ABC):
    """A root (a local directory or an S3 prefix) holding objects addressed by relative keys."""

    url: str

    def join(self, key: str) -> str:
        """The full URL (or local path) of ``key``."""
        return f"{self.url.rstrip('/')}/{key.lstrip('/')}"

    @abstractmethod
    def read_bytes(self, key: str) -> bytes: ...

    @abstractmethod
    def write_bytes(self, key: str, data: bytes) -> None:
        """Write ``data`` to ``key`` atomically."""

    @abstractmethod
    def upload_file(self, key: str, local_path: str | os.PathLike) -> None:
        """Copy a finished local file to ``key`` atomically."""

    @contextlib.contextmanager
    def staged_file(self, key: str) -> Iterator[Path]:
        """A local path to write ``key``'s content into; when the block succeeds it becomes the
        object at once (one upload here; local storage renames it in place, with no copy)."""
        with tempfile.TemporaryDirectory(prefix="dflash-up-") as tmpdir:
            tmp = Path(tmpdir) / Path(key).name
            yield tmp
            self.upload_file(key, tmp)

    @abstractmethod
    def download_file(self, key: str, local_path: str | os.PathLike) -> None: ...

    @abstractmethod
    def open_ranged(self, key: str) -> io.RawIOBase:
        """A seekable binary file over the object that fetches only the byte ranges read (a
        parquet reader takes the footer and its row groups, not the whole object)."""

    @abstractmethod
    def sha256(self, key: str) -> Digest:
        """The sha256 and size of the stored object, hashed as it streams past (an S3 object is
        never written to disk); NotFound when it does not exist."""

    @abstractmethod
    def exists(self, key: str) -> bool: ...

    @abstractmethod
    def list(self, prefix: str = "") -> list[ObjectInfo]:
        """Every object whose key starts with ``prefix`` (recursively), sorted by key."""

    def any_under(self, prefix: str) -> bool:
        """Whether some object's key starts with ``prefix``: an existence check, which stops at
        the first key found (on S3 a listing of one key), however many objects share it."""
        return bool(self.list(prefix))

    @abstractmethod
    def delete(self, key: str) -> None:
        """Delete ``key``; deleting a missing key is not an error."""

    # Conditional writes: the run lease (dflash_pipeline.core.lease) needs "create only if absent"
    # and "replace only if unchanged since I read it", so that two drivers can never both win.
    # A tag names one version of an object (S3: its ETag; local: a hash of its bytes).
    #
    # Each decides from what is stored, not from the answer to its last request: a request whose
    # answer was lost (a client timeout while the server was stalled) may still have landed, and
    # its retry then fails its own precondition (412 against the version it wrote, 404 on the
    # object it deleted). So a failed precondition is settled by reading the object: holding
    # exactly ``data`` it is this write's (or the same content, which is all the caller asked for);
    # gone after a delete, the version to delete is gone.
    @abstractmethod
    def read_tagged(self, key: str) -> tuple[bytes, str] | None:
        """The object's bytes and tag, or None when it does not exist."""

    @abstractmethod
    def create_if_absent(self, key: str, data: bytes) -> str | None:
        """Write ``key`` only if it does not exist; its tag once it holds ``data``, or None when
        it holds something else."""

    @abstractmethod
    def replace_if_tag(self, key: str, data: bytes, tag: str) -> str | None:
        """Overwrite ``key`` only if its current tag is ``tag``; its tag once it holds ``data``,
        or None when it holds something else or is gone."""

    @abstractmethod
    def delete_if_tag(self, key: str, tag: str) -> bool:
        """Delete ``key`` only if its current tag is ``tag``; whether the object is gone (False:
        another version is stored)."""

    def settle_write(self, key: str, data: bytes) -> str | None:
        """After a conditional write's precondition failed: the object's tag if it holds
        ``data`` (the write landed on an earlier try whose answer was lost), else None."""
        current = self.read_tagged(key)
        return current[1] if current is not None and current[0] == data else None

    def list_range(self, prefix: str, start: str = "", stop: str | None = None) -> list[ObjectInfo]:
        """Objects under ``prefix`` whose key ``k`` has ``start <= k < stop`` (no ``stop``: to
        the end), sorted. On S3 the listing starts at ``start`` and ends at ``stop``, so its
        requests grow with the objects in the range, not with the whole prefix."""
        return [o for o in self.list(prefix) if o.key >= start and (stop is None or o.key < stop)]

    def delete_prefix(self, prefix: str) -> int:
        """Delete every object under ``prefix``; returns how many were deleted."""
        objects = self.list(prefix)
        for obj in objects:
            self.delete(obj.key)
        return len(objects)

    def read_text(self, key: str) -> str:
        return self.read_bytes(key).decode("utf-8")

    def write_text(self, key: str, text: str) -> None:
        self.write_bytes(key, text.encode("utf-8"))

    @contextlib.contextmanager
    def local_copy(self, key: str) -> Iterator[Path]:
        """A local path holding the object's content for the duration of the block."""
        with tempfile.TemporaryDirectory(prefix="dflash-dl-") as tmp:
            path = Path(tmp) / Path(key).name
            self.download_file(key, path)
            yield path
