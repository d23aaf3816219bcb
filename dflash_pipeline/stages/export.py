"""Export the last segment's drafter in the z-lab format that SGLang and vLLM load:
``config.json`` + ``model.safetensors`` with unprefixed tensor names and no embedding or LM head
(both engines take those from the target; dflash-spec.md §4.1). A DFlash2 drafter is written
as the authors' ``DFlash2DraftModel`` (dflash2-spec.md §2): 15 tensors per layer + 6, bare
codebook names, the conv/selector sizes in ``dflash_config``.

Run by hand: ``python -m dflash_pipeline.stages.export --help``."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

from dflash_pipeline.model.config import DrafterConfig
from dflash_pipeline.model.drafter import DFlashDrafter
from dflash_pipeline.core.storage import open_storage, write_atomically
from dflash_pipeline.training.checkpoint import load_model_weights

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def expected_tensor_shapes(config: DrafterConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor an engine loads, with its shape (the loader test checks against this). Built
    on the meta device: shapes without allocating the drafter (GBs for the 27B case)."""
    with torch.device("meta"):
        drafter = DFlashDrafter(config)
    return {name: tuple(t.shape) for name, t in drafter.state_dict().items()}


def export_drafter(run_url: str, manifest_path: str, config_out: str, weights_out: str, dtype: str) -> dict:
    manifest = json.loads(Path(manifest_path).read_text())
    storage = open_storage(run_url)
    # The drafter's weights only: the optimizer state is never read into memory.
    weights = load_model_weights(storage, manifest["checkpoint_prefix"])
    if weights is None:
        raise FileNotFoundError(f"no checkpoint at {storage.join(manifest['checkpoint_prefix'])}")
    config = DrafterConfig.from_zlab(manifest["drafter_config"], source=manifest_path)
    config.dtype = dtype
    expected = expected_tensor_shapes(config)
    if set(weights) != set(expected):
        raise ValueError(
            f"checkpoint tensors differ from the drafter's: missing {sorted(set(expected) - set(weights))}, "
            f"unexpected {sorted(set(weights) - set(expected))}"
        )
    tensors = {name: t.to(DTYPES[dtype]).contiguous() for name, t in weights.items()}
    # A loader fills only what the file holds; a NaN or inf here would be served silently.
    nonfinite = sorted(name for name, t in tensors.items() if not torch.isfinite(t).all())
    if nonfinite:
        raise ValueError(f"{manifest_path}: non-finite values in tensors {nonfinite} (as {dtype})")
    with write_atomically(weights_out) as tmp:
        save_file(tensors, tmp, metadata={"format": "pt"})
    with write_atomically(config_out) as tmp:
        tmp.write_text(json.dumps(config.to_zlab(), indent=2) + "\n")
    summary = {"tensors": len(tensors), "parameters": sum(t.numel() for t in tensors.values())}
    print(f"exported {summary['tensors']} tensors, {summary['parameters']:,} parameters")
    return summary


def main(argv: list[str] | None = None) -> int:
    from dflash_pipeline.stages.cli import existing_dir, json_file, or_s3, shown

    parser = argparse.ArgumentParser(prog="python -m dflash_pipeline.stages.export", description=__doc__)
    parser.add_argument("--run-url", type=or_s3(existing_dir), required=True,
                        help="run root (local folder or s3://)")
    parser.add_argument("--manifest", type=json_file, required=True,
                        help="the last segment's manifest (outputs/train-segment-KKKK.json)")
    parser.add_argument("--out", required=True, help="drafter folder to write (config.json, model.safetensors)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    args = parser.parse_args(argv)
    missing = [key for key in ("checkpoint_prefix", "drafter_config")
               if key not in json.loads(Path(args.manifest).read_text())]
    if missing:
        parser.error(f"argument --manifest: {shown(args.manifest)} is not a segment manifest "
                     f"(no {', '.join(missing)})")
    out = Path(args.out)
    try:
        export_drafter(args.run_url, args.manifest, str(out / "config.json"), str(out / "model.safetensors"),
                       args.dtype)
    except (FileNotFoundError, ValueError) as err:  # no checkpoint; tensors missing or non-finite
        print(f"{parser.prog}: error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
