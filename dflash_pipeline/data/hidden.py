"""The hidden-state shard format of offline mode: one safetensors object per shard.

``taps`` [total_tokens, K*H] (bf16, or fp8 e4m3 with a per-row ``scales`` vector, or fp32),
``offsets`` [rows + 1] (row r spans offsets[r]:offsets[r+1]) and ``rows`` (the row indices in the
tokenized shard). ``StreamingSafetensors`` writes such a file row block by row block (the header
is known up front from the token counts), so a shard never has to fit in memory; ``HiddenShards``
reads the rows a training batch needs.
"""

from __future__ import annotations

import json
import struct
import tempfile
from pathlib import Path

import numpy as np
import torch

from dflash_pipeline.core.digest import Digest, digest_file
from dflash_pipeline.core.storage import Storage

HIDDEN_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float8_e4m3fn": torch.float8_e4m3fn}
_SAFETENSORS_DTYPE = {torch.bfloat16: "BF16", torch.float32: "F32", torch.float8_e4m3fn: "F8_E4M3", torch.int64: "I64"}
FP8_MAX = 448.0


class StreamingSafetensors:
    """Writes a safetensors file whose tensors are appended in order, row block by row block."""

    def __init__(self, path: Path, tensors: dict[str, tuple[torch.dtype, tuple[int, ...]]], metadata: dict):
        header, offset = {"__metadata__": metadata}, 0
        self.sizes = {}
        for name, (dtype, shape) in tensors.items():
            size = int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
            header[name] = {
                "dtype": _SAFETENSORS_DTYPE[dtype],
                "shape": list(shape),
                "data_offsets": [offset, offset + size],
            }
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


class HiddenShards:
    """Reads stored taps for training rows; each shard object is fetched once per job. A tap
    source of training (``training.tap_sources.TapSource``): nothing to fetch ahead."""

    prefetch_depth = 0

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
            problem = Digest.of(manifest).problem(digest_file(local))
            if problem:
                raise ValueError(f"{storage.join(manifest['key'])} does not match {manifest_path}: it {problem}")
            handle = safe_open(str(local), framework="pt")
            offsets = handle.get_tensor("offsets").tolist()
            rows = handle.get_tensor("rows").tolist()
            scales = handle.get_tensor("scales") if "scales" in handle.keys() else None  # noqa: SIM118 (a safetensors handle has no `in`)
            self.files[shard] = (handle, scales)
            for i, row in enumerate(rows):
                self.row_index[(shard, row)] = (offsets[i], offsets[i + 1], i)

    def prefetch(self, sequences) -> None:
        """Stored taps are read when used."""

    def taps(self, sequences, input_ids: torch.Tensor, device, dtype) -> torch.Tensor:
        length = input_ids.shape[1]
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
