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
"""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import tempfile
import uuid
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

# Local temp files carry this marker so listings never show a half-written object.
PARTIAL_MARKER = ".partial-"
# Lock files of local conditional writes (hidden from listings like partial files).
LOCK_MARKER = ".cond-lock-"


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
    @abstractmethod
    def read_tagged(self, key: str) -> tuple[bytes, str] | None:
        """The object's bytes and tag, or None when it does not exist."""

    @abstractmethod
    def create_if_absent(self, key: str, data: bytes) -> str | None:
        """Write ``key`` only if it does not exist; its new tag, or None when it existed."""

    @abstractmethod
    def replace_if_tag(self, key: str, data: bytes, tag: str) -> str | None:
        """Overwrite ``key`` only if its current tag is ``tag``; the new tag, or None."""

    @abstractmethod
    def delete_if_tag(self, key: str, tag: str) -> bool:
        """Delete ``key`` only if its current tag is ``tag``; whether it was deleted."""

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


class LocalStorage(Storage):
    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)
        self.url = str(root)

    def _path(self, key: str) -> Path:
        path = (self.root / key).resolve() if key else self.root.resolve()
        root = self.root.resolve()
        if path != root and root not in path.parents:
            raise StorageError(f"key {key!r} escapes the storage root {self.url}")
        return path

    def read_bytes(self, key: str) -> bytes:
        try:
            return self._path(key).read_bytes()
        except FileNotFoundError as err:
            raise NotFound(f"{self.join(key)} does not exist") from err

    @contextlib.contextmanager
    def atomic_path(self, key: str) -> Iterator[Path]:
        """A temp file beside ``key``'s file, renamed over it when the block succeeds: the one
        atomic write of local storage (a reader sees the old file or the whole new one)."""
        path = self._path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}{PARTIAL_MARKER}{uuid.uuid4().hex[:8]}")
        try:
            yield tmp
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)

    @contextlib.contextmanager
    def staged_file(self, key: str) -> Iterator[Path]:
        # Written beside its destination and renamed: a multi-GB checkpoint or hidden-state
        # shard is written once, not written to /tmp and then copied.
        with self.atomic_path(key) as tmp:
            yield tmp
            _fsync(tmp)

    def write_bytes(self, key: str, data: bytes) -> None:
        with self.atomic_path(key) as tmp, open(tmp, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())

    def upload_file(self, key: str, local_path: str | os.PathLike) -> None:
        with self.atomic_path(key) as tmp:
            shutil.copyfile(local_path, tmp)
            _fsync(tmp)

    def download_file(self, key: str, local_path: str | os.PathLike) -> None:
        src = self._path(key)
        if not src.is_file():
            raise NotFound(f"{self.join(key)} does not exist")
        shutil.copyfile(src, local_path)

    def open_ranged(self, key: str) -> io.RawIOBase:
        try:
            return open(self._path(key), "rb", buffering=0)
        except FileNotFoundError as err:
            raise NotFound(f"{self.join(key)} does not exist") from err

    @contextlib.contextmanager
    def local_copy(self, key: str) -> Iterator[Path]:
        path = self._path(key)
        if not path.is_file():
            raise NotFound(f"{self.join(key)} does not exist")
        yield path  # already local: no copy

    def exists(self, key: str) -> bool:
        return self._path(key).is_file()

    def _objects(self, prefix: str) -> Iterator[ObjectInfo]:
        """The objects under ``prefix`` in the order the folders are walked."""
        root = self.root.resolve()
        if not root.is_dir():
            return
        for dirpath, _, filenames in os.walk(root):
            for name in filenames:
                if PARTIAL_MARKER in name or LOCK_MARKER in name:
                    continue
                full = Path(dirpath) / name
                key = full.relative_to(root).as_posix()
                if key.startswith(prefix):
                    try:
                        st = full.stat()
                    except FileNotFoundError:
                        continue  # removed while listing (a job replaced or cleaned it)
                    yield ObjectInfo(key, st.st_size, st.st_mtime)

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        return sorted(self._objects(prefix), key=lambda o: o.key)

    def any_under(self, prefix: str) -> bool:
        return next(self._objects(prefix), None) is not None

    def delete(self, key: str) -> None:
        self._path(key).unlink(missing_ok=True)

    @contextlib.contextmanager
    def _locked(self, key: str) -> Iterator[Path]:
        """An exclusive flock on a lock file beside ``key``: local conditional writes check and
        write under it, so two processes on this machine never both see "absent"."""
        import fcntl

        path = self._path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path.with_name(f".{path.name}{LOCK_MARKER}"), "a+b") as lock:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
            try:
                yield path
            finally:
                fcntl.flock(lock.fileno(), fcntl.LOCK_UN)

    @staticmethod
    def _tag(data: bytes) -> str:
        import hashlib

        return hashlib.sha256(data).hexdigest()

    def read_tagged(self, key: str) -> tuple[bytes, str] | None:
        try:
            data = self._path(key).read_bytes()
        except FileNotFoundError:
            return None
        return data, self._tag(data)

    def create_if_absent(self, key: str, data: bytes) -> str | None:
        with self._locked(key) as path:
            if path.is_file():
                return None
            self.write_bytes(key, data)
        return self._tag(data)

    def replace_if_tag(self, key: str, data: bytes, tag: str) -> str | None:
        with self._locked(key):
            current = self.read_tagged(key)
            if current is None or current[1] != tag:
                return None
            self.write_bytes(key, data)
        return self._tag(data)

    def delete_if_tag(self, key: str, tag: str) -> bool:
        with self._locked(key):
            current = self.read_tagged(key)
            if current is None or current[1] != tag:
                return False
            self.delete(key)
        return True


def _fsync(path: Path) -> None:
    """Flush a finished temp file to disk before it is renamed over its object: after a power
    loss the rename may survive while unflushed data does not (an object of zeros)."""
    with open(path, "rb") as fh:
        os.fsync(fh.fileno())


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
        from dflash_pipeline.core.s3 import S3Storage

        return S3Storage(str(url))
    return LocalStorage(url)


def open_object(url: str | os.PathLike) -> tuple[Storage, str]:
    """Split a full object URL (or local path) into its parent storage and the object's key."""
    url = str(url)
    if is_s3_url(url):
        from dflash_pipeline.core.s3 import S3Storage, split_s3_url

        bucket, key = split_s3_url(url)
        parent, _, name = key.rpartition("/")
        return S3Storage(f"s3://{bucket}/{parent}" if parent else f"s3://{bucket}"), name
    path = Path(url)
    return LocalStorage(path.parent), path.name


def sha256_and_size(path: str | os.PathLike) -> tuple[str, int]:
    """Hex sha256 and byte size of a local file, read in 16 MiB chunks (checkpoints and hidden
    shards are GBs): the one hash of the package's checksum records, manifests and indexes."""
    import hashlib

    digest, size = hashlib.sha256(), 0
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 24), b""):
            digest.update(chunk)
            size += len(chunk)
    return digest.hexdigest(), size


def sha256_file(path: str | os.PathLike) -> str:
    """Hex sha256 of a local file (``sha256_and_size`` without the size)."""
    return sha256_and_size(path)[0]


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
