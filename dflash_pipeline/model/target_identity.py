"""Which weights the target has: a cheap digest of its weight files, so a drafter trained against
one set of weights is not evaluated or served against another under the same ``config.json``
(a re-released checkpoint, a quantized copy).

The digest never reads a whole file: per weight file (``*.safetensors``, ``*.bin``, ``*.pt``,
``*.pth``, ``*.gguf`` in the folder, and the index JSONs beside them) its name and size, a
safetensors file's header (every tensor's name, dtype, shape and offsets) and ``SAMPLES`` windows
of ``WINDOW`` bytes at fixed, evenly spaced offsets of its data; a file in a Hugging Face hub
cache (a link to ``blobs/<sha256>``) is named by that content hash instead, which covers every
byte at no cost. A quantized copy changes its headers; re-released weights change their sampled
bytes (a change confined to bytes between the windows of an otherwise identical file is not
seen: the price of reading kilobytes per multi-GB file).

The digest is recorded where the target's weights shape what is stored: the generate shards'
parquet metadata, the taps' manifest and file metadata (``stages.extract``), each training
segment's manifest, and the exported drafter's safetensors metadata (``stages.export``).
``evaluate`` compares the export's with the target it loads (``check_at_evaluate``), and refuses
or warns in one line by ``evaluate.target_mismatch``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import struct
from pathlib import Path

log = logging.getLogger(__name__)

# The scheme's name leads every digest: a digest of another scheme is not compared.
SCHEME = "sampled-v1"
# The metadata key (safetensors and parquet) and manifest key that carry the digest.
KEY = "target_weights"
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
INDEX_SUFFIX = ".index.json"
SAMPLES = 64
WINDOW = 4096
# A safetensors header above this is no safetensors file (the format caps it at 100 MB).
MAX_HEADER = 100_000_000
# A hub cache's blob of an LFS file is named by its content's sha256.
CONTENT_HASH = re.compile(r"^[0-9a-f]{64}$")


class TargetMismatch(ValueError):
    """The target's weights are not those the drafter was trained against; one line."""


def weight_files(model_dir: str | Path) -> list[Path]:
    """The folder's weight files and their index JSONs, by name."""
    folder = Path(model_dir)
    if not folder.is_dir():
        return []
    return sorted(
        p
        for p in folder.iterdir()
        if p.is_file() and (p.name.endswith(WEIGHT_SUFFIXES) or p.name.endswith(INDEX_SUFFIX))
    )


def _safetensors_data_start(handle, size: int) -> tuple[bytes, int]:
    """The header's bytes (length prefix included) and where the data begins; no header for a
    file that is not safetensors."""
    prefix = handle.read(8)
    if len(prefix) < 8:
        return b"", 0
    (length,) = struct.unpack("<Q", prefix)
    if length > min(MAX_HEADER, size - 8):
        return b"", 0
    return prefix + handle.read(length), 8 + length


def _file_record(path: Path, hasher) -> None:
    """What the digest takes of one file, fed to ``hasher``."""
    size = path.stat().st_size
    hasher.update(f"{path.name}\0{size}\0".encode())
    blob = path.resolve().name
    if path.is_symlink() and CONTENT_HASH.match(blob):
        hasher.update(f"sha256={blob}\0".encode())
        return
    with path.open("rb") as handle:
        if path.name.endswith(INDEX_SUFFIX):
            hasher.update(handle.read())
            return
        header, start = _safetensors_data_start(handle, size) if path.suffix == ".safetensors" else (b"", 0)
        hasher.update(header)
        span = size - start
        if span <= SAMPLES * WINDOW:
            handle.seek(start)
            hasher.update(handle.read())
            return
        step = (span - WINDOW) // (SAMPLES - 1)
        for i in range(SAMPLES):
            handle.seek(start + i * step)
            hasher.update(handle.read(WINDOW))


def weights_digest(model_dir: str | Path) -> str | None:
    """The target's weights digest (``sampled-v1:<16 hex>``), or None for a folder without weight
    files (a hub id, a folder that is not there)."""
    files = weight_files(model_dir)
    if not any(p.name.endswith(WEIGHT_SUFFIXES) for p in files):
        return None
    hasher = hashlib.sha256()
    for path in files:
        _file_record(path, hasher)
    return f"{SCHEME}:{hasher.hexdigest()[:16]}"


def recorded_in_safetensors(path: str | Path) -> str | None:
    """The digest a safetensors file's metadata records (its header alone is read), or None (a
    missing file too: loading the drafter names that)."""
    if not Path(path).is_file():
        return None
    with Path(path).open("rb") as handle:
        header, _ = _safetensors_data_start(handle, Path(path).stat().st_size)
    if not header:
        return None
    return (json.loads(header[8:]).get("__metadata__") or {}).get(KEY)


def comparison(trained: str | None, current: str | None) -> dict:
    """What evaluate records: both digests and whether they match (None: not known, a digest
    missing or of another scheme)."""
    comparable = bool(trained and current and trained.split(":")[0] == current.split(":")[0])
    return {"trained_against": trained, "evaluated": current, "match": (trained == current) if comparable else None}


def mismatch_line(record: dict, drafter: str, target: str, policy: str) -> str:
    """The one line naming a mismatch, the two digests and what to do."""
    verdict = "refused" if policy == "refuse" else "evaluated anyway"
    return (
        f"{target}: the target's weights ({record['evaluated']}) are not those the drafter {drafter} was "
        f"trained against ({record['trained_against']}): a re-released or quantized copy, even under the same "
        f"config.json, serves it at a fraction of its acceptance; {verdict} (evaluate.target_mismatch: {policy}); "
        "point target.model at the weights it was trained with, or retrain against these"
    )


def check_at_evaluate(
    drafter_weights: str | Path, target_dir: str | Path, policy: str = "refuse", quantization: str | None = None
) -> dict:
    """Compare the weights digest the exported drafter records (its safetensors metadata) with the
    target's, quantized as ``quantization`` (``evaluate.target_quantization``) says: a mismatch
    raises TargetMismatch (``policy`` refuse) or is logged as a warning (warn), in one line.
    Returns the comparison the metrics record. A drafter exported before digests were recorded,
    or a target without weight files here, is compared with nothing."""
    from dflash_pipeline.model.quantized import quantized_identity

    if policy not in ("refuse", "warn"):
        raise ValueError(f"evaluate.target_mismatch is {policy!r}, not refuse or warn")
    current = quantized_identity(weights_digest(target_dir), quantization)
    record = comparison(recorded_in_safetensors(drafter_weights), current)
    if record["match"] is False:
        line = mismatch_line(record, str(Path(drafter_weights).parent), str(target_dir), policy)
        if policy == "refuse":
            raise TargetMismatch(line)
        log.warning("%s", line)
    elif record["match"] is None:
        log.info("target weights not compared: drafter records %s, target %s", *record.values())
    return record


def stored_target_weights(manifests: dict[str, dict], folder_digest: str | None) -> str | None:
    """The target weights stored taps were computed from (offline training), by their manifests
    (``stages.extract``): one digest for all of them; shards of other weights are refused in one
    line. Taps recorded before digests were, stand for the target folder's (``folder_digest``)."""
    recorded = {shard: m.get(KEY) for shard, m in sorted(manifests.items()) if m.get(KEY)}
    digests = sorted(set(recorded.values()))
    if len(digests) > 1:
        shown = ", ".join(f"shard {shard}: {digest}" for shard, digest in recorded.items())
        raise TargetMismatch(
            f"the stored taps come from different target weights ({shown}); rerun extract for the others"
        )
    if not digests:
        return folder_digest
    if folder_digest and comparison(digests[0], folder_digest)["match"] is False:
        log.warning(
            "the stored taps come from target weights %s, the target folder's are %s (its embedding and LM "
            "head are used); the segment records the taps'",
            digests[0],
            folder_digest,
        )
    return digests[0]
