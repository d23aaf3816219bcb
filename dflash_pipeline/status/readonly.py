"""The status server's only handle on a run: listing and reading, nothing that could write.

The page is read-only by construction: the server never holds a ``Storage`` object, only this
wrapper, which exposes the three reading calls and nothing else.
"""

from __future__ import annotations

from dflash_pipeline.storage import ObjectInfo, Storage, open_storage


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

    def read_bytes(self, key: str) -> bytes:
        return self._storage.read_bytes(key)

    def read_text(self, key: str) -> str:
        return self.read_bytes(key).decode("utf-8")
