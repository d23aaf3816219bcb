"""One storage API for local directories and ``s3://`` URIs.

Snakemake moves the declared (small) outputs of every rule itself. Everything else a job writes
(in-flight generation parts, telemetry, training checkpoints, hidden-state shards) goes through
this module, so the same code runs against a local run directory and against S3.

Rules the rest of the pipeline relies on:

* every write is atomic: a reader sees the old object, or the whole new one, never a prefix
  (local: temp file in the same directory + ``os.replace``; S3: one PUT or a completed multipart
  upload, which S3 makes visible all at once);
* S3 endpoint and credentials come from the same environment variables as
  ``snakemake-storage-plugin-s3`` (``SNAKEMAKE_STORAGE_S3_*``), so the plugin and the jobs can
  never disagree about where the run lives;
* the bucket keeps a permanent sentinel object, because the S3 plugin deletes a bucket once it
  is empty.
"""

from __future__ import annotations

import contextlib
import functools
import io
import logging
import os
import shutil
import tempfile
import uuid
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

S3_ENV_PREFIX = "SNAKEMAKE_STORAGE_S3_"
# botocore's standard mode backs off exponentially up to 20 s per attempt: 15 attempts ride out
# an outage of about three minutes (the profiles give the S3 plugin the same); DFLASH_S3_MAX_ATTEMPTS
# changes it.
S3_MAX_ATTEMPTS = int(os.environ.get("DFLASH_S3_MAX_ATTEMPTS") or 15)
BUCKET_SENTINEL_KEY = ".dflash-pipeline-bucket"
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

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        root = self.root.resolve()
        if not root.is_dir():
            return []
        found = []
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
                    found.append(ObjectInfo(key, st.st_size, st.st_mtime))
        return sorted(found, key=lambda o: o.key)

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


def s3_settings_from_env(env: dict[str, str] | None = None) -> dict[str, str | None]:
    """The S3 plugin's settings, read from the same environment variables it reads."""
    env = os.environ if env is None else env
    return {
        "endpoint_url": env.get(S3_ENV_PREFIX + "ENDPOINT_URL") or None,
        "access_key": env.get(S3_ENV_PREFIX + "ACCESS_KEY") or None,
        "secret_key": env.get(S3_ENV_PREFIX + "SECRET_KEY") or None,
        "token": env.get(S3_ENV_PREFIX + "TOKEN") or None,
        "region": env.get(S3_ENV_PREFIX + "REGION") or "us-east-1",
    }


_retry_log = logging.getLogger("dflash_pipeline.storage")


def _log_retry(max_attempts, attempts=None, caught_exception=None, response=None, operation=None, **_):
    """botocore's ``needs-retry`` event, seen by every attempt: a failed one is logged before
    botocore's own handler backs off and retries it, so a job's log shows an outage it rode
    out (returns None: the decision stays botocore's)."""
    status = (response[1] if response else {}).get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
    if caught_exception is None and status < 500 and status != 429:
        return None
    cause = type(caught_exception).__name__ if caught_exception is not None else f"HTTP {status}"
    name = getattr(operation, "name", "request")
    # botocore's max_attempts counts the retries: one first try, then up to that many more.
    tries = max_attempts + 1
    then = "retrying with backoff" if (attempts or 0) < tries else "giving up"
    _retry_log.warning("S3 %s failed (%s), try %s of %d; %s", name, cause, attempts, tries, then)
    return None


def s3_client(max_attempts: int | None = None, **timeouts):
    """A boto3 S3 client configured as the S3 plugin is (``SNAKEMAKE_STORAGE_S3_*``), retrying
    ``max_attempts`` times (default ``S3_MAX_ATTEMPTS``) with botocore's backoff, each failed
    attempt logged; ``timeouts``: botocore's connect_timeout / read_timeout.

    The default client (no arguments) is made once per process and endpoint and shared (boto3
    clients are thread-safe): a job opens many storages, each of which would otherwise build
    its own client, connection pool and credential chain."""
    settings = s3_settings_from_env()
    if max_attempts is None and not timeouts:
        return _shared_client(tuple(sorted(settings.items())))
    return _new_client(settings, max_attempts or S3_MAX_ATTEMPTS, timeouts)


@functools.lru_cache(maxsize=8)
def _shared_client(settings: tuple):
    return _new_client(dict(settings), S3_MAX_ATTEMPTS, {})


def _new_client(settings: dict, max_attempts: int, timeouts: dict):
    import boto3
    from botocore.config import Config

    # Non-AWS servers (SeaweedFS, MinIO) store boto's default checksum trailers inside the
    # object; the S3 plugin switches them off the same way.
    config = Config(
        retries={"max_attempts": max_attempts, "mode": "standard"},
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",
        **timeouts,
    )
    client = boto3.client(
        "s3",
        endpoint_url=settings["endpoint_url"],
        aws_access_key_id=settings["access_key"],
        aws_secret_access_key=settings["secret_key"],
        aws_session_token=settings["token"],
        region_name=settings["region"],
        config=config,
    )
    client.meta.events.register("needs-retry.s3", functools.partial(_log_retry, max_attempts))
    return client


def _listed(obj: dict, base: str) -> ObjectInfo:
    """An entry of an S3 listing, its key relative to the storage root ``base``."""
    return ObjectInfo(
        obj["Key"][len(base) :], obj["Size"], obj["LastModified"].timestamp(), obj["ETag"].strip('"')
    )


def _client_error_code(err: BaseException | None) -> str:
    response = getattr(err, "response", None) or {}
    code = response.get("Error", {}).get("Code", "")
    return str(code or response.get("ResponseMetadata", {}).get("HTTPStatusCode", ""))


def _key_before(key: str) -> str:
    """A string that sorts just before ``key``: its last character decremented."""
    if not key:
        return key
    last = key[-1]
    return key[:-1] + (chr(ord(last) - 1) if ord(last) > 0 else "")


def split_s3_url(url: str) -> tuple[str, str]:
    """``s3://bucket/a/b`` -> (``bucket``, ``a/b``)."""
    if not url.startswith("s3://"):
        raise StorageError(f"{url!r} is not an s3:// URL")
    bucket, _, prefix = url[len("s3://") :].partition("/")
    if not bucket:
        raise StorageError(f"{url!r} names no bucket")
    return bucket, prefix.strip("/")


class S3Storage(Storage):
    def __init__(self, url: str, client=None):
        self.bucket, self.prefix = split_s3_url(url)
        self.url = f"s3://{self.bucket}/{self.prefix}" if self.prefix else f"s3://{self.bucket}"
        self.client = client or s3_client()

    def _key(self, key: str) -> str:
        key = key.lstrip("/")
        return f"{self.prefix}/{key}" if self.prefix else key

    def _call(self, what: str, key: str, fn, *args, **kwargs):
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            return fn(*args, **kwargs)
        except ClientError as err:
            code = err.response.get("Error", {}).get("Code", "")
            if code in ("NoSuchKey", "404", "NotFound"):
                raise NotFound(f"{self.join(key)} does not exist") from err
            raise StorageError(f"{what} {self.join(key)} failed: {code or err}") from err
        except BotoCoreError as err:
            raise StorageError(f"{what} {self.join(key)} failed: {err}") from err

    def read_bytes(self, key: str) -> bytes:
        resp = self._call(
            "reading", key, self.client.get_object, Bucket=self.bucket, Key=self._key(key)
        )
        return resp["Body"].read()

    def write_bytes(self, key: str, data: bytes) -> None:
        self._call(
            "writing",
            key,
            self.client.put_object,
            Bucket=self.bucket,
            Key=self._key(key),
            Body=data,
        )

    def upload_file(self, key: str, local_path: str | os.PathLike) -> None:
        # Multipart uploads become visible only when completed: still one atomic object.
        self._call(
            "uploading", key, self.client.upload_file, str(local_path), self.bucket, self._key(key)
        )

    def download_file(self, key: str, local_path: str | os.PathLike) -> None:
        self._call(
            "downloading",
            key,
            self.client.download_file,
            self.bucket,
            self._key(key),
            str(local_path),
        )

    def open_ranged(self, key: str) -> io.RawIOBase:
        head = self._call("checking", key, self.client.head_object, Bucket=self.bucket, Key=self._key(key))
        return S3RangedFile(self, key, int(head["ContentLength"]), head.get("ETag"))

    def exists(self, key: str) -> bool:
        try:
            self._call("checking", key, self.client.head_object, Bucket=self.bucket, Key=self._key(key))
            return True
        except NotFound:
            return False

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        base = f"{self.prefix}/" if self.prefix else ""
        paginator = self.client.get_paginator("list_objects_v2")
        found = []
        pages = self._call(
            "listing",
            prefix,
            lambda: list(paginator.paginate(Bucket=self.bucket, Prefix=base + prefix)),
        )
        for page in pages:
            for obj in page.get("Contents", []):
                found.append(_listed(obj, base))
        return sorted(found, key=lambda o: o.key)

    def list_range(self, prefix: str, start: str = "", stop: str | None = None) -> list[ObjectInfo]:
        base = f"{self.prefix}/" if self.prefix else ""
        kwargs = {"Bucket": self.bucket, "Prefix": base + prefix}
        if start > prefix:
            # StartAfter is exclusive; any key below `start` will do, since the keys are
            # filtered below: one that sorts just before it skips everything else.
            kwargs["StartAfter"] = base + _key_before(start)
        found = []
        paginator = self.client.get_paginator("list_objects_v2")

        def collect():
            for page in paginator.paginate(**kwargs):
                for obj in page.get("Contents", []):
                    key = obj["Key"][len(base) :]
                    if stop is not None and key >= stop:
                        return
                    if key >= start:
                        found.append(_listed(obj, base))

        self._call("listing", prefix, collect)
        return found

    def delete(self, key: str) -> None:
        self._call(
            "deleting", key, self.client.delete_object, Bucket=self.bucket, Key=self._key(key)
        )

    # Conditional writes use S3's If-None-Match: * (create only if absent) and If-Match: <ETag>
    # (replace or delete only if unchanged); SeaweedFS 4.x, AWS and MinIO honour both and
    # answer 412 PreconditionFailed otherwise.
    def _conditional(self, what: str, key: str, fn, **kwargs):
        """Run a conditional request: its response, or None when the condition did not hold."""
        try:
            return self._call(what, key, fn, Bucket=self.bucket, Key=self._key(key), **kwargs)
        except StorageError as err:
            code = _client_error_code(err.__cause__)
            if code in ("PreconditionFailed", "412", "ConditionalRequestConflict", "409"):
                return None
            if code in ("NotImplemented", "501"):
                raise StorageError(
                    f"{what} {self.join(key)} failed: the S3 server does not support conditional "
                    "writes (If-None-Match / If-Match), which the run lease needs"
                ) from err
            if isinstance(err, NotFound):
                return None  # If-Match on a missing object
            raise

    def read_tagged(self, key: str) -> tuple[bytes, str] | None:
        try:
            resp = self._call(
                "reading", key, self.client.get_object, Bucket=self.bucket, Key=self._key(key)
            )
        except NotFound:
            return None
        return resp["Body"].read(), resp["ETag"]

    def create_if_absent(self, key: str, data: bytes) -> str | None:
        resp = self._conditional("creating", key, self.client.put_object, Body=data, IfNoneMatch="*")
        return None if resp is None else resp["ETag"]

    def replace_if_tag(self, key: str, data: bytes, tag: str) -> str | None:
        resp = self._conditional("replacing", key, self.client.put_object, Body=data, IfMatch=tag)
        return None if resp is None else resp["ETag"]

    def delete_if_tag(self, key: str, tag: str) -> bool:
        return self._conditional("deleting", key, self.client.delete_object, IfMatch=tag) is not None

    def ensure_bucket(self) -> None:
        """Create the bucket if needed and put the permanent sentinel object into it."""
        from botocore.exceptions import ClientError

        try:
            self.client.head_bucket(Bucket=self.bucket)
        except ClientError as err:
            # Only a bucket that is not there is created: a 403 (no access to someone else's
            # bucket, or wrong credentials) is an error, never a reason to create one.
            if _client_error_code(err) not in ("404", "NoSuchBucket", "NotFound"):
                raise StorageError(
                    f"s3://{self.bucket}: no access ({_client_error_code(err)}); check the "
                    f"{S3_ENV_PREFIX}* credentials"
                ) from err
            self._call("creating bucket", "", self.client.create_bucket, Bucket=self.bucket)
        try:
            self.client.head_object(Bucket=self.bucket, Key=BUCKET_SENTINEL_KEY)
        except ClientError:
            self.client.put_object(
                Bucket=self.bucket,
                Key=BUCKET_SENTINEL_KEY,
                Body=(
                    b"Kept on purpose: the Snakemake S3 plugin deletes a bucket once it is empty.\n"
                ),
            )


class S3RangedFile(io.RawIOBase):
    """A read-only, seekable view of one S3 object: each read is one ranged GET (``If-Match``
    on the ETag seen when it was opened, so an object replaced meanwhile fails the read instead
    of mixing two versions). ``bytes_fetched`` counts what came over the network."""

    def __init__(self, storage: S3Storage, key: str, size: int, etag: str | None):
        super().__init__()
        self.storage, self.key, self.size, self.etag = storage, key, size, etag
        self.position = 0
        self.bytes_fetched = 0
        self.requests = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.position

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.position, io.SEEK_END: self.size}[whence]
        self.position = max(0, base + offset)
        return self.position

    def readinto(self, buffer) -> int:
        want = min(len(buffer), self.size - self.position)
        if want <= 0:
            return 0
        extra = {"IfMatch": self.etag} if self.etag else {}
        resp = self.storage._call(
            "reading", self.key, self.storage.client.get_object, Bucket=self.storage.bucket,
            Key=self.storage._key(self.key), Range=f"bytes={self.position}-{self.position + want - 1}", **extra,
        )  # fmt: skip
        data = resp["Body"].read()
        buffer[: len(data)] = data
        self.position += len(data)
        self.bytes_fetched += len(data)
        self.requests += 1
        return len(data)


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
    return S3Storage(str(url)) if is_s3_url(url) else LocalStorage(url)


def open_object(url: str | os.PathLike) -> tuple[Storage, str]:
    """Split a full object URL (or local path) into its parent storage and the object's key."""
    url = str(url)
    if is_s3_url(url):
        bucket, key = split_s3_url(url)
        parent, _, name = key.rpartition("/")
        return S3Storage(f"s3://{bucket}/{parent}" if parent else f"s3://{bucket}"), name
    path = Path(url)
    return LocalStorage(path.parent), path.name



def sha256_file(path: str | os.PathLike) -> str:
    """Hex sha256 of a local file, read in 16 MiB chunks (checkpoints and hidden shards are GBs)."""
    import hashlib

    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 24), b""):
            digest.update(chunk)
    return digest.hexdigest()


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
