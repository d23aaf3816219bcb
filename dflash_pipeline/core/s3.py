"""S3 storage: the ``Storage`` of an ``s3://bucket/prefix`` run root, and its client.

The endpoint and credentials are resolved as the Snakemake S3 plugin resolves them: its
environment variables (``SNAKEMAKE_STORAGE_S3_*``) first; whatever they leave unset is left to
boto, which finds ``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``, ``~/.aws`` profiles or an
instance role, and ``AWS_ENDPOINT_URL``/``AWS_ENDPOINT_URL_S3`` (the plugin hands boto ``None``
for each unset setting, so jobs and plugin always agree). Every call rides out a storage outage
of up to ``storage.outage_tolerance_s`` (``dflash_pipeline.core.outage``), each failed try a
warning; one client is shared per process and configuration; conditional writes (``If-None-Match``,
``If-Match``) serve the run lease; ranged reads serve parquet readers.
"""

from __future__ import annotations

import functools
import io
import os

from dflash_pipeline.core import outage
from dflash_pipeline.core.digest import CHUNK, Digest, Hasher
from dflash_pipeline.core.storage_api import NotFound, ObjectInfo, Storage, StorageError

S3_ENV_PREFIX = "SNAKEMAKE_STORAGE_S3_"
BUCKET_SENTINEL_KEY = ".dflash-pipeline-bucket"


# What boto reads from the environment for S3: the shared client is cached per value of these too.
AWS_ENV_VARS = (
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_PROFILE",
    "AWS_DEFAULT_PROFILE",
    "AWS_SHARED_CREDENTIALS_FILE",
    "AWS_CONFIG_FILE",
    "AWS_ENDPOINT_URL",
    "AWS_ENDPOINT_URL_S3",
    "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
    "AWS_CONTAINER_CREDENTIALS_FULL_URI",
    "AWS_WEB_IDENTITY_TOKEN_FILE",
    "AWS_ROLE_ARN",
)
PLUGIN_KEYS = f"{S3_ENV_PREFIX}ACCESS_KEY and {S3_ENV_PREFIX}SECRET_KEY"
BOTO_CREDENTIALS = "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, a profile in ~/.aws (AWS_PROFILE) or an instance role"
NO_CREDENTIALS = (
    f"no S3 credentials: set {PLUGIN_KEYS} (the Snakemake S3 plugin's variables), or provide "
    f"boto's own ({BOTO_CREDENTIALS}), which the plugin and the jobs fall back to"
)


def s3_settings_from_env(env: dict[str, str] | None = None) -> dict[str, str | None]:
    """The S3 plugin's settings, read from the same environment variables it reads (None where
    unset: boto then resolves that setting itself, as it does for the plugin)."""
    env = os.environ if env is None else env
    return {
        "endpoint_url": env.get(S3_ENV_PREFIX + "ENDPOINT_URL") or None,
        "access_key": env.get(S3_ENV_PREFIX + "ACCESS_KEY") or None,
        "secret_key": env.get(S3_ENV_PREFIX + "SECRET_KEY") or None,
        "token": env.get(S3_ENV_PREFIX + "TOKEN") or None,
        "region": env.get(S3_ENV_PREFIX + "REGION") or "us-east-1",
    }


def s3_credentials_source(settings: dict[str, str | None] | None = None) -> str:
    """Where the plugin and the storage layer take S3 credentials from, in words: the plugin's
    variables when both keys are set, else boto's default chain (environment, ``~/.aws``,
    instance role). A ``StorageError`` of one line when neither has any, or when only one of the
    plugin's keys is set (the plugin passes it to boto, which refuses half a pair)."""
    from botocore.exceptions import BotoCoreError
    from botocore.session import Session

    settings = s3_settings_from_env() if settings is None else settings
    access, secret = settings["access_key"], settings["secret_key"]
    if access and secret:
        return PLUGIN_KEYS
    if access or secret:
        given, missing = ("ACCESS_KEY", "SECRET_KEY") if access else ("SECRET_KEY", "ACCESS_KEY")
        raise StorageError(
            f"{S3_ENV_PREFIX}{given} is set without {S3_ENV_PREFIX}{missing}: set both, or neither "
            f"to use boto's credentials ({BOTO_CREDENTIALS})"
        )
    try:
        credentials = Session().get_credentials()
    except BotoCoreError as err:  # e.g. AWS_PROFILE names no profile
        raise StorageError(f"AWS credentials: {err}") from err
    if credentials is None:
        raise StorageError(NO_CREDENTIALS)
    return f"boto's credentials ({credentials.method})"


def s3_endpoint(client) -> str:
    """The endpoint a client talks to, for messages."""
    url = client.meta.endpoint_url or ""
    return "AWS S3" if url.endswith(".amazonaws.com") else url


def s3_client(max_attempts: int | None = None, **timeouts):
    """A boto3 S3 client configured as the S3 plugin is (``SNAKEMAKE_STORAGE_S3_*``, else boto's
    own resolution). By default it rides out storage outages (``dflash_pipeline.core.outage``:
    backoff up to ``storage.outage_tolerance_s``, each try a warning); ``max_attempts`` instead
    gives up after that many retries of botocore's own (a check that must answer at once);
    ``timeouts``: botocore's connect_timeout / read_timeout.

    The default client (no arguments) is made once per process and configuration and shared
    (boto3 clients are thread-safe): a job opens many storages, each of which would otherwise
    build its own client, connection pool and credential chain."""
    settings = s3_settings_from_env()
    read_timeout = os.environ.get(READ_TIMEOUT_ENV) or None
    if max_attempts is None and not timeouts:
        aws = tuple((name, os.environ.get(name)) for name in AWS_ENV_VARS)
        return _shared_client(tuple(sorted(settings.items())), aws, read_timeout)
    return _new_client(settings, max_attempts, timeouts)


# Seconds a request waits for the server's answer before it is tried again (botocore's
# read_timeout; its default, 60, when unset): a stalled server that accepts connections but
# answers nothing is an outage only once it passes. Shorter in the tests that freeze one.
READ_TIMEOUT_ENV = "DFLASH_STORAGE_READ_TIMEOUT_S"


def _read_timeout(value: str) -> float:
    try:
        seconds = float(value)
    except ValueError:
        seconds = 0.0
    if not seconds > 0:
        raise StorageError(f"{READ_TIMEOUT_ENV}={value!r} is not a positive number of seconds")
    return seconds


@functools.lru_cache(maxsize=8)
def _shared_client(settings: tuple, aws_env: tuple, read_timeout: str | None = None):
    """``aws_env``: boto's own variables, part of the key only (boto reads them itself)."""
    return _new_client(dict(settings), None, {"read_timeout": _read_timeout(read_timeout)} if read_timeout else {})


def _new_client(settings: dict, max_attempts: int | None, timeouts: dict):
    import boto3
    from botocore.config import Config

    # Riding out an outage, botocore makes one try per call and outage.ride_out every retry.
    retries = {"total_max_attempts": 1} if max_attempts is None else {"max_attempts": max_attempts}
    # Non-AWS servers (SeaweedFS, MinIO) store boto's default checksum trailers inside the
    # object; the S3 plugin switches them off the same way.
    config = Config(
        retries={**retries, "mode": "standard"},
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",
        **timeouts,
    )
    # The plugin's settings that are set, None for the rest: boto then resolves those itself
    # (credential chain, AWS_ENDPOINT_URL*), exactly as for the plugin. A session of its own, so
    # the credentials are looked up now and not taken from boto3's process-wide default session.
    client = boto3.session.Session().client(
        "s3",
        endpoint_url=settings["endpoint_url"],
        aws_access_key_id=settings["access_key"],
        aws_secret_access_key=settings["secret_key"],
        aws_session_token=settings["token"],
        region_name=settings["region"],
        config=config,
    )
    if max_attempts is None:
        outage.install(client)
    return client


def _listed(obj: dict, base: str) -> ObjectInfo:
    """An entry of an S3 listing, its key relative to the storage root ``base``."""
    return ObjectInfo(obj["Key"][len(base) :], obj["Size"], obj["LastModified"].timestamp(), obj["ETag"].strip('"'))


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
        resp = self._call("reading", key, self.client.get_object, Bucket=self.bucket, Key=self._key(key))
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
        self._call("uploading", key, self.client.upload_file, str(local_path), self.bucket, self._key(key))

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

    def sha256(self, key: str) -> Digest:
        def stream() -> Digest:
            resp = self.client.get_object(Bucket=self.bucket, Key=self._key(key))
            return Hasher().update_all(resp["Body"].iter_chunks(CHUNK)).digest()

        # The GET and the read of its body in one call: a stream cut midway fails as a StorageError.
        return self._call("reading", key, stream)

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

    def any_under(self, prefix: str) -> bool:
        base = f"{self.prefix}/" if self.prefix else ""
        page = self._call(
            "listing", prefix, self.client.list_objects_v2, Bucket=self.bucket, Prefix=base + prefix, MaxKeys=1
        )
        return bool(page.get("Contents"))

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
        self._call("deleting", key, self.client.delete_object, Bucket=self.bucket, Key=self._key(key))

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
            resp = self._call("reading", key, self.client.get_object, Bucket=self.bucket, Key=self._key(key))
        except NotFound:
            return None
        return resp["Body"].read(), resp["ETag"]

    # A request that timed out is retried (outage.ride_out) and may have landed meanwhile: a
    # failed precondition is settled from the stored object (Storage.settle_write).
    def create_if_absent(self, key: str, data: bytes) -> str | None:
        resp = self._conditional("creating", key, self.client.put_object, Body=data, IfNoneMatch="*")
        return self.settle_write(key, data) if resp is None else resp["ETag"]

    def replace_if_tag(self, key: str, data: bytes, tag: str) -> str | None:
        resp = self._conditional("replacing", key, self.client.put_object, Body=data, IfMatch=tag)
        return self.settle_write(key, data) if resp is None else resp["ETag"]

    def delete_if_tag(self, key: str, tag: str) -> bool:
        if self._conditional("deleting", key, self.client.delete_object, IfMatch=tag) is not None:
            return True
        return self.read_tagged(key) is None  # an earlier try that deleted it lost its answer

    def ensure_bucket(self) -> None:
        """Create the bucket if needed and put the permanent sentinel object into it."""
        from botocore.exceptions import ClientError

        try:
            self.client.head_bucket(Bucket=self.bucket)
        except ClientError as err:
            # Only a bucket that is not there is created: a 403 (no access to someone else's
            # bucket, or wrong credentials) is an error, never a reason to create one.
            if _client_error_code(err) not in ("404", "NoSuchBucket", "NotFound"):
                try:
                    source = s3_credentials_source()
                except StorageError as problem:
                    source = str(problem)
                raise StorageError(
                    f"s3://{self.bucket}: no access ({_client_error_code(err)}); check the credentials ({source})"
                ) from err
            self._call("creating bucket", "", self.client.create_bucket, Bucket=self.bucket)
        try:
            self.client.head_object(Bucket=self.bucket, Key=BUCKET_SENTINEL_KEY)
        except ClientError:
            self.client.put_object(
                Bucket=self.bucket,
                Key=BUCKET_SENTINEL_KEY,
                Body=(b"Kept on purpose: the Snakemake S3 plugin deletes a bucket once it is empty.\n"),
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
