"""Deterministic assignment of sample ids to shards and to the held-out split.

Both depend on the id alone (never on row order or dataset size), so adding data later leaves
every existing sample in its shard and in its split.
"""

from __future__ import annotations

import hashlib

TRAIN = "train"
HELDOUT = "heldout"


def _unit_hash(text: str, salt: str) -> int:
    digest = hashlib.blake2b(f"{salt}:{text}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def shard_of(sample_id: str, num_shards: int) -> int:
    return _unit_hash(sample_id, "shard") % num_shards


def split_of(sample_id: str, heldout_fraction: float) -> str:
    # An independent hash from the shard's, so every shard holds its share of held-out ids.
    return HELDOUT if _unit_hash(sample_id, "heldout") < heldout_fraction * 2**64 else TRAIN
