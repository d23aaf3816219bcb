"""Offline mode: the target's taps of every training row of a shard, stored once.

One safetensors object per shard (``hidden/shard-NNNNN.safetensors``), written by the job itself
through the storage layer: ``taps`` [total_tokens, K*H] (bf16, or fp8 e4m3 with a per-row
``scales`` vector, or fp32), ``offsets`` [rows + 1] (row r spans offsets[r]:offsets[r+1]) and
``rows`` (the row indices in the tokenized shard). The file is streamed to local disk row by row
(the header is known up front from the token counts), so a shard never has to fit in memory, and
uploaded as one object. The declared Snakemake output is a small manifest with the object's key,
size and sha256, written last.
"""

from __future__ import annotations

import hashlib
import json
import struct
import tempfile
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import torch

from dflash_pipeline.data.sharding import TRAIN
from dflash_pipeline.storage import Storage, open_storage, write_atomically

HIDDEN_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float8_e4m3fn": torch.float8_e4m3fn}
_SAFETENSORS_DTYPE = {torch.bfloat16: "BF16", torch.float32: "F32", torch.float8_e4m3fn: "F8_E4M3", torch.int64: "I64"}
FP8_MAX = 448.0


def hidden_key(shard: str) -> str:
    return f"hidden/shard-{shard}.safetensors"


class StreamingSafetensors:
    """Writes a safetensors file whose tensors are appended in order, row block by row block."""

    def __init__(self, path: Path, tensors: dict[str, tuple[torch.dtype, tuple[int, ...]]], metadata: dict):
        header, offset = {"__metadata__": metadata}, 0
        self.sizes = {}
        for name, (dtype, shape) in tensors.items():
            size = int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
            header[name] = {"dtype": _SAFETENSORS_DTYPE[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
            self.sizes[name] = size
            offset += size
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        self.fh = open(path, "wb")
        self.fh.write(struct.pack("<Q", len(raw)) + raw)
        self.order = list(tensors)
        self.written = {name: 0 for name in tensors}

    def append(self, name: str, tensor: torch.Tensor) -> None:
        current = self.order[0]
        if name != current:
            raise ValueError(f"tensors must be written in order: expected {current}, got {name}")
        data = tensor.contiguous().cpu().view(torch.uint8).numpy().tobytes()
        self.fh.write(data)
        self.written[name] += len(data)
        if self.written[name] == self.sizes[name]:
            self.order.pop(0)

    def close(self) -> None:
        incomplete = [n for n in self.order if self.written[n] != self.sizes[n]]
        self.fh.close()
        if incomplete:
            raise ValueError(f"tensors {incomplete} were not fully written")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 24), b""):
            digest.update(chunk)
    return digest.hexdigest()


def extract_shard(
    tokenized_path: str,
    target_dir: str,
    layer_ids: list[int],
    run_url: str,
    shard: str,
    manifest_out: str,
    hidden_dtype: str = "bfloat16",
    max_batch_tokens: int = 16384,
    device: str | None = None,
) -> dict:
    from dflash_pipeline.model.taps import TargetTaps, load_target

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    compute = torch.bfloat16 if device.startswith("cuda") else torch.float32
    table = pq.read_table(tokenized_path, columns=["split", "input_ids"])
    rows = [i for i, s in enumerate(table["split"].to_pylist()) if s == TRAIN]
    sequences = [np.asarray(table["input_ids"][i].values, dtype=np.int64) for i in rows]
    offsets = np.concatenate([[0], np.cumsum([len(s) for s in sequences])]).astype(np.int64)
    target = load_target(target_dir, device, compute)
    taps = TargetTaps(target, layer_ids)
    text = getattr(target.config, "text_config", None) or target.config
    width = len(layer_ids) * text.hidden_size
    dtype = HIDDEN_DTYPES[hidden_dtype]
    tensors = {"taps": (dtype, (int(offsets[-1]), width))}
    if dtype == torch.float8_e4m3fn:
        tensors["scales"] = (torch.float32, (len(rows),))
    tensors["offsets"] = (torch.int64, (len(offsets),))
    tensors["rows"] = (torch.int64, (len(rows),))
    metadata = {"layer_ids": json.dumps(layer_ids), "hidden_dtype": hidden_dtype, "shard": shard}
    storage = open_storage(run_url)
    with tempfile.TemporaryDirectory(prefix="dflash-hidden-") as tmp:
        path = Path(tmp) / "hidden.safetensors"
        writer = StreamingSafetensors(path, tensors, metadata)
        scales = []
        # Rows in order, several per forward (right-padded) up to max_batch_tokens.
        start = 0
        while start < len(sequences):
            end, longest = start, 0
            while end < len(sequences) and (end == start or max(longest, len(sequences[end])) * (end - start + 1) <= max_batch_tokens):
                longest = max(longest, len(sequences[end]))
                end += 1
            batch = torch.zeros(end - start, longest, dtype=torch.long)
            for i, seq in enumerate(sequences[start:end]):
                batch[i, : len(seq)] = torch.from_numpy(seq)
            out = taps(batch.to(device)).float()
            for i, seq in enumerate(sequences[start:end]):
                row = out[i, : len(seq)]
                if dtype == torch.float8_e4m3fn:
                    scale = row.abs().amax().clamp_min(1e-12) / FP8_MAX
                    scales.append(float(scale))
                    row = row / scale
                writer.append("taps", row.to(dtype))
            start = end
        if dtype == torch.float8_e4m3fn:
            writer.append("scales", torch.tensor(scales, dtype=torch.float32))
        writer.append("offsets", torch.from_numpy(offsets))
        writer.append("rows", torch.tensor(rows, dtype=torch.int64))
        writer.close()
        manifest = {
            "shard": shard,
            "key": hidden_key(shard),
            "url": storage.join(hidden_key(shard)),
            "size": path.stat().st_size,
            "sha256": _sha256(path),
            "rows": len(rows),
            "tokens": int(offsets[-1]),
            "hidden_dtype": hidden_dtype,
            "layer_ids": list(layer_ids),
            "width": width,
        }
        storage.upload_file(hidden_key(shard), path)
    with write_atomically(manifest_out) as tmp_out:
        tmp_out.write_text(json.dumps(manifest, indent=1))
    return manifest


class HiddenShards:
    """Reads stored taps for training rows; each shard object is fetched once per job."""

    def __init__(self, storage: Storage, manifests: dict[str, str], drafter_config):
        from safetensors import safe_open

        self._tmp = tempfile.TemporaryDirectory(prefix="dflash-hidden-")
        self.files = {}
        self.row_index = {}
        for shard, manifest_path in sorted(manifests.items()):
            manifest = json.loads(Path(manifest_path).read_text())
            if manifest["layer_ids"] != list(drafter_config.target_layer_ids):
                raise ValueError(
                    f"{manifest_path}: hidden states tap layers {manifest['layer_ids']}, the drafter "
                    f"needs {drafter_config.target_layer_ids}; re-run extract"
                )
            local = Path(self._tmp.name) / f"{shard}.safetensors"
            storage.download_file(manifest["key"], local)
            if local.stat().st_size != manifest["size"] or _sha256(local) != manifest["sha256"]:
                raise ValueError(f"{storage.join(manifest['key'])} does not match {manifest_path}")
            handle = safe_open(str(local), framework="pt")
            offsets = handle.get_tensor("offsets").tolist()
            rows = handle.get_tensor("rows").tolist()
            scales = handle.get_tensor("scales") if "scales" in handle.keys() else None
            self.files[shard] = (handle, scales)
            for i, row in enumerate(rows):
                self.row_index[(shard, row)] = (offsets[i], offsets[i + 1], i)

    def taps(self, sequences, length: int, device, dtype) -> torch.Tensor:
        out = []
        for seq in sequences:
            try:
                start, end, i = self.row_index[(seq.shard, seq.row)]
            except KeyError:
                raise KeyError(f"no stored taps for row {seq.row} ({seq.sample_id}) of shard {seq.shard}") from None
            handle, scales = self.files[seq.shard]
            row = handle.get_slice("taps")[start:end].float()
            if scales is not None:
                row = row * scales[i]
            out.append(torch.nn.functional.pad(row, (0, 0, 0, length - row.shape[0])))
        return torch.stack(out).to(device=device, dtype=dtype)


def load_target_embeddings(target_dir: str, device, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's embedding and LM head, read from its safetensors without loading the model."""
    from safetensors import safe_open

    target_dir = Path(target_dir)
    index = target_dir / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
    else:
        with safe_open(str(target_dir / "model.safetensors"), framework="pt") as fh:
            weight_map = {k: "model.safetensors" for k in fh.keys()}
    def find(suffix):
        names = sorted((k for k in weight_map if k.endswith(suffix)), key=len)
        return names[0] if names else None

    embed_name, head_name = find("embed_tokens.weight"), find("lm_head.weight")
    if embed_name is None:
        raise ValueError(f"{target_dir}: no embed_tokens weight in the checkpoint")
    def load(name):
        with safe_open(str(target_dir / weight_map[name]), framework="pt") as fh:
            return fh.get_tensor(name).to(device=device, dtype=dtype)

    embed = load(embed_name)
    head = load(head_name) if head_name else embed  # tied embeddings
    return embed, head
