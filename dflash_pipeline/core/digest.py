"""The one hash of the package's integrity records, and their one format.

Four records state what some bytes were when they were written, so that a later reader can tell
a damaged or truncated copy: the checksum record of every tracked output
(``core.checksums``), a checkpoint's index (``training.checkpoint``), a hidden-state shard's
manifest (``stages.extract``) and ``fetch``'s record of a copied object. Each states the bytes
as ``{"sha256": <hex>, "size": <bytes>}``, beside whatever else the record holds, written by
``Digest.fields`` and read by ``Digest.of``; the bytes are hashed by ``Hasher`` alone, as they
are written (a checkpoint shard), from a file (``digest_file``) or from a stored object's stream
(``Storage.sha256``).

Those two keys are the format the records have always had, so records already written, in any
run, read as they are: nothing to convert.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable
from dataclasses import dataclass

# Read size of a file being hashed: checkpoints and hidden-state shards are GBs, never read whole.
CHUNK = 1 << 24  # 16 MiB


@dataclass(frozen=True)
class Digest:
    """What a record states of some bytes: their sha256 (hex) and size."""

    sha256: str
    size: int

    def fields(self) -> dict:
        """The record's two keys."""
        return {"sha256": self.sha256, "size": self.size}

    @classmethod
    def of(cls, record: dict) -> Digest:
        """The digest a record states (KeyError or ValueError for a record without one)."""
        return cls(str(record["sha256"]), int(record["size"]))

    def problem(self, actual: Digest) -> str | None:
        """How ``actual`` (bytes read back) differs from what was recorded, in words; None when
        it is the same."""
        if actual.size != self.size:
            long = "short" if actual.size < self.size else "too long"
            return f"is {long}: {actual.size} bytes, not the {self.size} it was written with"
        if actual.sha256 != self.sha256:
            return (
                f"is damaged: its sha256 is {actual.sha256}, not the {self.sha256} it was written "
                f"with (same size, {actual.size} bytes)"
            )
        return None


class Hasher:
    """sha256 and size of bytes as they pass, fed one piece at a time."""

    def __init__(self):
        self._sha, self.size = hashlib.sha256(), 0

    def update(self, data) -> None:
        view = memoryview(data)
        self._sha.update(view)
        self.size += view.nbytes

    def update_all(self, chunks: Iterable) -> Hasher:
        for chunk in chunks:
            self.update(chunk)
        return self

    def digest(self) -> Digest:
        return Digest(self._sha.hexdigest(), self.size)


def digest_file(path: str | os.PathLike) -> Digest:
    """The digest of a local file, read in chunks."""
    with open(path, "rb") as fh:
        return Hasher().update_all(iter(lambda: fh.read(CHUNK), b"")).digest()
