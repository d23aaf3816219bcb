"""Export the last segment's drafter in the z-lab format that SGLang and vLLM load:
``config.json`` + ``model.safetensors`` with unprefixed tensor names and no embedding or LM head
(both engines take those from the target; docs/training.md, "Export"). A DFlash2 drafter is written
as the authors' ``DFlash2DraftModel`` (docs/training.md, "DFlash2"): 15 tensors per layer + 6, bare
codebook names, the conv/selector sizes in ``dflash_config``.

Beside it, in ``speculators/``, the same drafter in the format of vllm-project/speculators 0.9
(``dflash_pipeline.model.speculators_format``): its ``config.json`` with ``speculators_config``,
its ``model.safetensors`` with the drafter's tensors and the verifier's embedding and LM head,
read from the target. A drafter that format cannot express (sliding and full-attention layers
mixed) is exported in the z-lab format only, and the export says why in one line. Both formats'
safetensors metadata name the weights of the target the drafter was trained against
(``target_weights``: ``model.target_identity``), which evaluate compares with its target's.

Run by hand: ``python -m dflash_pipeline.stages.export --help``."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

from dflash_pipeline.model import speculators_format, target_identity
from dflash_pipeline.model.config import DrafterConfig
from dflash_pipeline.model.drafter import DFlashDrafter
from dflash_pipeline.core.storage import open_storage, write_atomically
from dflash_pipeline.training.checkpoint import INDEX, load_model_weights, read_index

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def expected_tensor_shapes(config: DrafterConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor an engine loads, with its shape (the loader test checks against this). Built
    on the meta device: shapes without allocating the drafter (GBs for the 27B case)."""
    with torch.device("meta"):
        drafter = DFlashDrafter(config)
    return {name: tuple(t.shape) for name, t in drafter.state_dict().items()}


def check_index(storage, manifest: dict, manifest_path: str) -> None:
    """The checkpoint's index must list the files (sizes, sha256s) the segment manifest recorded:
    the manifest carries a checksum record (core.checksums), the index under checkpoints/ none."""
    index = read_index(storage, manifest["checkpoint_prefix"])
    if "files" in manifest and (index is None or index["files"] != manifest["files"]):
        where = storage.join(manifest["checkpoint_prefix"] + INDEX)
        raise ValueError(
            f"{where} does not list the files {manifest_path} recorded: the checkpoint was changed "
            "after its segment finished; rerun that segment (make verify REPAIR=1 names it)"
        )


def export_drafter(
    run_url: str,
    manifest_path: str,
    config_out: str,
    weights_out: str,
    dtype: str,
    *,
    target: str | None = None,
    speculators_out: tuple[str, str] | None = None,
) -> dict:
    """Write the z-lab export (``config_out``, ``weights_out``) and, with ``speculators_out``
    ((config, weights) paths) and the ``target`` folder, the speculators-format one. A drafter
    the speculators format cannot express gets its one-line reason printed instead (an error
    when ``speculators_out`` was asked for: the rule declares it only for drafters it can)."""
    manifest = json.loads(Path(manifest_path).read_text())
    storage = open_storage(run_url)
    # The drafter's weights only: the optimizer state is never read into memory.
    weights = load_model_weights(storage, manifest["checkpoint_prefix"])
    if weights is None:
        raise FileNotFoundError(f"no checkpoint at {storage.join(manifest['checkpoint_prefix'])}")
    check_index(storage, manifest, manifest_path)
    config = DrafterConfig.from_zlab(manifest["drafter_config"], source=manifest_path)
    config.dtype = dtype
    reason = speculators_format.refusal(config.layer_types)
    if speculators_out is not None:  # checked before anything is written
        if reason is not None:
            raise ValueError(f"{manifest_path}: {reason}")
        if target is None:
            raise ValueError("the speculators format needs the target (its embedding and LM head)")
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
    metadata = {"format": "pt", **target_metadata(manifest, target)}
    with write_atomically(weights_out) as tmp:
        save_file(tensors, tmp, metadata=metadata)
    with write_atomically(config_out) as tmp:
        tmp.write_text(json.dumps(config.to_zlab(), indent=2) + "\n")
    summary = {"tensors": len(tensors), "parameters": sum(t.numel() for t in tensors.values())}
    summary[target_identity.KEY] = metadata.get(target_identity.KEY)
    print(f"exported {summary['tensors']} tensors, {summary['parameters']:,} parameters")
    del weights  # the fp32 copy: the verifier's embedding and LM head come next
    if reason is not None:
        print(reason)
    elif speculators_out is not None:
        summary["speculators"] = export_speculators(config, tensors, target, *speculators_out, metadata)
    return summary


def target_metadata(manifest: dict, target: str | None) -> dict:
    """The weights digest of the target the drafter was trained against, for the export's
    safetensors metadata (evaluate compares it with the target it loads): the last segment's
    record, else (a segment trained before digests were recorded) the target folder's now."""
    digest = manifest.get(target_identity.KEY)
    if digest is None and target is not None:
        digest = target_identity.weights_digest(target)
    if digest is None:
        print("exported without a target weights digest (neither the segment nor a target folder gives one)")
        return {}
    print(f"target weights: {digest}")
    return {target_identity.KEY: digest}


def export_speculators(
    config: DrafterConfig, tensors: dict, target: str, config_out: str, weights_out: str, metadata: dict | None = None
) -> dict:
    """The speculators-format folder: the drafter's ``tensors`` (as exported) with the target's
    embedding and LM head, and the speculators config naming the target as the verifier."""
    verifier = speculators_format.verifier_tensors(target, config)
    document = speculators_format.speculators_config(
        config,
        speculators_format.verifier_name(target),
        speculators_format.verifier_architectures(target),
    )
    everything = speculators_format.speculators_tensors(tensors, verifier)
    with write_atomically(weights_out) as tmp:
        save_file(everything, tmp, metadata=metadata or {"format": "pt"})
    with write_atomically(config_out) as tmp:
        tmp.write_text(json.dumps(document, indent=2) + "\n")
    print(
        f"exported the speculators format ({document['speculators_model_type']}, "
        f"speculators {speculators_format.SPECULATORS_VERSION}): {len(everything)} tensors with the "
        f"verifier's {', '.join(speculators_format.VERIFIER_TENSORS)}"
    )
    return {"tensors": len(everything), "model_type": document["speculators_model_type"]}


def main(argv: list[str] | None = None) -> int:
    from dflash_pipeline.stages.cli import existing_dir, json_file, model_dir, or_s3, shown

    parser = argparse.ArgumentParser(prog="python -m dflash_pipeline.stages.export", description=__doc__)
    parser.add_argument("--run-url", type=or_s3(existing_dir), required=True, help="run root (local folder or s3://)")
    parser.add_argument(
        "--manifest",
        type=json_file,
        required=True,
        help="the last segment's manifest (outputs/train-segment-KKKK.json)",
    )
    parser.add_argument("--out", required=True, help="drafter folder to write (config.json, model.safetensors)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    parser.add_argument(
        "--target",
        type=model_dir,
        help="the target's folder: also write the speculators format in "
        f"OUT/{speculators_format.FOLDER}/ (with the target's embedding and LM head)",
    )
    args = parser.parse_args(argv)
    manifest = json.loads(Path(args.manifest).read_text())
    missing = [key for key in ("checkpoint_prefix", "drafter_config") if key not in manifest]
    if missing:
        parser.error(f"argument --manifest: {shown(args.manifest)} is not a segment manifest (no {', '.join(missing)})")
    out = Path(args.out)
    # With --target, the speculators format too where it expresses the drafter (else the export
    # prints why).
    drafter = manifest["drafter_config"]
    layer_types = drafter.get("layer_types") if isinstance(drafter, dict) else None
    speculators = None
    if args.target and speculators_format.refusal(layer_types) is None:
        folder = out / speculators_format.FOLDER
        speculators = tuple(
            str(folder / name) for name in (speculators_format.CONFIG_NAME, speculators_format.WEIGHTS_NAME)
        )
    try:
        export_drafter(
            args.run_url,
            args.manifest,
            str(out / "config.json"),
            str(out / "model.safetensors"),
            args.dtype,
            target=args.target,
            speculators_out=speculators,
        )
    except (FileNotFoundError, ValueError) as err:  # no checkpoint; tensors missing or non-finite
        print(f"{parser.prog}: error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
