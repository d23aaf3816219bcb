"""``LocalStorage``: the ``Storage`` of a run root in a local directory (``core.storage_api``).

Every write is a temp file in the destination folder, flushed and renamed over the object, so a
reader sees the old file or the whole new one; conditional writes (the run lease) check and write
under an exclusive lock file beside the object.
"""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

from dflash_pipeline.core.digest import Digest, Hasher, digest_file
from dflash_pipeline.core.storage_api import NotFound, ObjectInfo, Storage, StorageError

# Local temp files carry this marker so listings never show a half-written object.
PARTIAL_MARKER = ".partial-"
# Lock files of local conditional writes (hidden from listings like partial files).
LOCK_MARKER = ".cond-lock-"


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

    def sha256(self, key: str) -> Digest:
        try:
            return digest_file(self._path(key))
        except (FileNotFoundError, IsADirectoryError) as err:
            raise NotFound(f"{self.join(key)} does not exist") from err

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
        return Hasher().update_all([data]).digest().sha256

    def read_tagged(self, key: str) -> tuple[bytes, str] | None:
        try:
            data = self._path(key).read_bytes()
        except FileNotFoundError:
            return None
        return data, self._tag(data)

    # The same outcomes as S3's (decided from what is stored): a call repeated after it took
    # effect answers as the first did.
    def create_if_absent(self, key: str, data: bytes) -> str | None:
        with self._locked(key) as path:
            if path.is_file():
                return self.settle_write(key, data)
            self.write_bytes(key, data)
        return self._tag(data)

    def replace_if_tag(self, key: str, data: bytes, tag: str) -> str | None:
        with self._locked(key):
            current = self.read_tagged(key)
            if current is None or current[1] != tag:
                return current[1] if current is not None and current[0] == data else None
            self.write_bytes(key, data)
        return self._tag(data)

    def delete_if_tag(self, key: str, tag: str) -> bool:
        with self._locked(key):
            current = self.read_tagged(key)
            if current is None:
                return True
            if current[1] != tag:
                return False
            self.delete(key)
        return True


def _fsync(path: Path) -> None:
    """Flush a finished temp file to disk before it is renamed over its object: after a power
    loss the rename may survive while unflushed data does not (an object of zeros)."""
    with open(path, "rb") as fh:
        os.fsync(fh.fileno())
