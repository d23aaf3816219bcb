"""Offline mode: the target's taps of every training row of a shard, stored once.

One safetensors object per shard (``extract/shard-NNNNN.safetensors``, the format of
``dflash_pipeline.data.hidden``), written by the job itself through the storage layer. The file is streamed to local disk row by row
(the header is known up front from the token counts), so a shard never has to fit in memory, and
uploaded as one object. The declared Snakemake output is a small manifest with the object's key,
size and sha256, written last.

The target computes in the dtype online training's target has on the same device
(``model.target.target_compute_dtype``: bfloat16 on a GPU, float32 on CPU); the manifest and the
file's metadata name it (``compute_dtype``, with ``device``) beside the storage dtype
(``hidden_dtype``). float32 storage of bfloat16-computed taps is refused. Both also name the
target's weights (``target_weights``, ``model.target_identity``).

With ``extract.taps_from: engine`` a vLLM server on the job's node computes the taps instead
(``engines.engine_taps``, the same server, client and per-run check as online training's
``train.taps_from: engine``, with ``train.taps_server``'s settings): the shard's first training
row is checked against the target before the first row is stored, and the file is the same.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import torch

from dflash_pipeline.data.sharding import TRAIN
from dflash_pipeline.core.digest import digest_file
from dflash_pipeline.core.storage import open_storage, write_atomically
from dflash_pipeline.core import layout
from dflash_pipeline.core.jobstate import raise_if_halted
from dflash_pipeline.core.lease import raise_if_driverless
from dflash_pipeline.data.hidden import FP8_MAX, HIDDEN_DTYPES, StreamingSafetensors
from dflash_pipeline.data.shard_kinds import ShardKindError, require_file_kind
from dflash_pipeline.model import target_identity
from dflash_pipeline.model.quantized import quantized_identity

log = logging.getLogger(__name__)


def train_rows(tokenized_path: str) -> tuple[list[int], list[np.ndarray]]:
    """The shard's training rows: their row numbers and token ids."""
    require_file_kind(tokenized_path, "tokenize", "extract")  # before a target or engine loads
    table = pq.read_table(tokenized_path, columns=["split", "input_ids"])
    rows = [i for i, s in enumerate(table["split"].to_pylist()) if s == TRAIN]
    return rows, [np.asarray(table["input_ids"][i].values, dtype=np.int64) for i in rows]


def row_batches(sequences: list[np.ndarray], max_batch_tokens: int) -> Iterator[tuple[int, int]]:
    """(start, end) of consecutive rows whose right-padded batch holds at most
    ``max_batch_tokens`` tokens (one row at least)."""
    start = 0
    while start < len(sequences):
        end, longest = start, 0
        while end < len(sequences) and (
            end == start or max(longest, len(sequences[end])) * (end - start + 1) <= max_batch_tokens
        ):
            longest = max(longest, len(sequences[end]))
            end += 1
        yield start, end
        start = end


def target_rows(target_dir: str, layer_ids: list[int], device, compute_dtype: str, quantization: str | None = None):
    """The in-process target's taps of a batch of rows: a function of the rows' token ids to
    their taps [T, K*H], one forward of the right-padded batch."""
    from dflash_pipeline.model.taps import TargetTaps
    from dflash_pipeline.model.target import load_target

    loaded = []  # on the first batch: a shard without training rows never loads the target

    def compute(sequences: list[np.ndarray]) -> list[torch.Tensor]:
        if not loaded:
            target = load_target(target_dir, device, getattr(torch, compute_dtype), quantization)
            loaded.append(TargetTaps(target, layer_ids))
        taps = loaded[0]
        batch = torch.zeros(len(sequences), max(map(len, sequences)), dtype=torch.long)
        for i, seq in enumerate(sequences):
            batch[i, : len(seq)] = torch.from_numpy(seq)
        out = taps(batch.to(device)).float()
        return [out[i, : len(seq)] for i, seq in enumerate(sequences)]

    return compute


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
    engine=None,
    engine_dtype: str | None = None,
    quantization: str | None = None,
) -> dict:
    """Store the taps of the shard's training rows. By default the target computes them here;
    with ``engine`` (an ``engines.engine_taps.EngineTaps`` of the same ``layer_ids``, computing
    in ``engine_dtype``) a taps server does, ``max_batch_tokens`` at a time; ``quantization``
    (``train.target_quantization``): the target's, either way."""
    from transformers import AutoConfig

    from dflash_pipeline.model.target import target_compute_dtype
    from dflash_pipeline.training.offline import stored_dtype_problem

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    # As online training's target on this device computes (its taps are what the stored ones
    # stand in for); float32 storage of bf16 values is refused before any work.
    compute_dtype = engine_dtype or target_compute_dtype(device)
    problem = stored_dtype_problem(hidden_dtype, device)
    if problem:
        raise ValueError(problem)
    rows, sequences = train_rows(tokenized_path)
    offsets = np.concatenate([[0], np.cumsum([len(s) for s in sequences])]).astype(np.int64)
    if engine is None:
        compute = target_rows(target_dir, layer_ids, device, compute_dtype, quantization)
    else:
        if list(engine.tap_ids) != list(layer_ids):
            raise ValueError(f"the engine client serves taps {engine.tap_ids}, not {layer_ids}")

        def compute(batch: list[np.ndarray]) -> list[torch.Tensor]:
            return [t.float() for t in engine.taps_of([seq.tolist() for seq in batch])]

    config = AutoConfig.from_pretrained(target_dir)
    width = len(layer_ids) * (getattr(config, "text_config", None) or config).hidden_size
    dtype = HIDDEN_DTYPES[hidden_dtype]
    tensors = {"taps": (dtype, (int(offsets[-1]), width))}
    if dtype == torch.float8_e4m3fn:
        tensors["scales"] = (torch.float32, (len(rows),))
    tensors["offsets"] = (torch.int64, (len(offsets),))
    tensors["rows"] = (torch.int64, (len(rows),))
    taps_from = "target" if engine is None else "engine"
    # The taps server serves target_dir too: either way these are its weights' taps.
    target_weights = quantized_identity(target_identity.weights_digest(target_dir), quantization)
    metadata = {
        "layer_ids": json.dumps(layer_ids),
        "hidden_dtype": hidden_dtype,
        "compute_dtype": compute_dtype,
        "device": torch.device(device).type,
        "shard": shard,
        "taps_from": taps_from,
        **({target_identity.KEY: target_weights} if target_weights else {}),
    }
    storage = open_storage(run_url)
    with storage.staged_file(layout.hidden_states_key(shard)) as path:
        writer = StreamingSafetensors(path, tensors, metadata)
        scales = []
        # Rows in order, several per forward (right-padded) or in flight up to max_batch_tokens.
        for start, end in row_batches(sequences, max_batch_tokens):
            for row in compute(sequences[start:end]):
                if dtype == torch.float8_e4m3fn:
                    scale = row.abs().amax().clamp_min(1e-12) / FP8_MAX
                    scales.append(float(scale))
                    row = row / scale
                writer.append("taps", row.to(dtype))
        if dtype == torch.float8_e4m3fn:
            writer.append("scales", torch.tensor(scales, dtype=torch.float32))
        writer.append("offsets", torch.from_numpy(offsets))
        writer.append("rows", torch.tensor(rows, dtype=torch.int64))
        writer.close()
        manifest = {
            "shard": shard,
            "key": layout.hidden_states_key(shard),
            "url": storage.join(layout.hidden_states_key(shard)),
            **digest_file(path).fields(),  # what training checks its copy against (data.hidden)
            "rows": len(rows),
            "tokens": int(offsets[-1]),
            "hidden_dtype": hidden_dtype,  # as stored
            "compute_dtype": compute_dtype,  # as the target (or the engine) computed them
            "device": torch.device(device).type,
            "layer_ids": list(layer_ids),
            "width": width,
            "taps_from": taps_from,
            target_identity.KEY: target_weights,  # what offline training and the export name
        }
    with write_atomically(manifest_out) as tmp_out:
        tmp_out.write_text(json.dumps(manifest, indent=1))
    return manifest


def extract_job(
    tokenized: str,
    target_dir: str,
    settings: dict,
    run_url: str,
    shard: str,
    manifest_out: str,
    device: str | None = None,
    taps_from: str = "target",
    engines: dict | None = None,
    log_file: str | None = None,
) -> dict:
    """What the `extract` rule runs: the taps the drafter of ``settings`` (the `train` config)
    reads, for one tokenized shard; refused while the run is halted (a tokenize shard failed the
    data-quality gate). With ``taps_from`` engine (``extract.taps_from``) they come from a taps
    server the job starts (``taps_engine``)."""
    run, name = open_storage(run_url), f"extract shard {layout.shard_name(shard)}"
    raise_if_halted(run, name)
    raise_if_driverless(run, name)  # a job queued by a driver that is gone since does not start
    from dflash_pipeline.engines.engine_taps import server_dtype
    from dflash_pipeline.model.config import build_drafter_config

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    layer_ids = build_drafter_config(settings, target_dir).target_layer_ids
    hidden_dtype, server = settings["hidden_dtype"], settings["taps_server"]
    quantization = settings.get("target_quantization")
    engine = nullcontext()
    if taps_from == "engine":
        engine = taps_engine(
            tokenized, target_dir, layer_ids, hidden_dtype, server, engines, device, log_file, quantization
        )
    with engine as client:
        manifest = extract_shard(
            tokenized, target_dir, layer_ids, run_url, shard, manifest_out, hidden_dtype, device=device,
            engine=client, engine_dtype=server_dtype(server, device) if client else None, quantization=quantization,
        )  # fmt: skip
    log.info("stored %d tokens x %d taps: %s bytes", manifest["tokens"], manifest["width"], f"{manifest['size']:,}")
    return manifest


@contextmanager
def taps_engine(
    tokenized: str,
    target_dir: str,
    layer_ids: list[int],
    hidden_dtype: str,
    server: dict,
    engines: dict | None,
    device: str,
    log_file: str | None,
    quantization: str | None = None,
) -> Iterator:
    """A vLLM taps server for the shard, started as online training's is (the config's
    ``train.taps_server``; ``engines`` says where vLLM is installed; its log goes beside
    ``log_file``) and checked on the shard's first training row; yields its client, or None for a
    shard without training rows (nothing to compute, so no server)."""
    from dflash_pipeline.engines.engine_taps import checked_taps_server, node_local_dir
    from dflash_pipeline.training.offline import stored_dtype_problem

    problem = stored_dtype_problem(hidden_dtype, device)
    if problem:
        raise ValueError(problem)  # before a server starts
    _, sequences = train_rows(tokenized)
    if not sequences:
        yield None
        return
    sample = sequences[0][:256].tolist()  # up to 256 tokens, as training's check takes
    with node_local_dir(server["max_cache_bytes"]) as run_dir:
        log_path = (
            Path(log_file).with_name(f"{Path(log_file).stem}-vllm-taps.log") if log_file else run_dir / "vllm-taps.log"
        )
        with checked_taps_server(
            target_dir, layer_ids, server, engines, run_dir, log_path, sample, device,
            purpose="extract.taps_from", quantization=quantization,
        ) as client:  # fmt: skip
            yield client


def main(argv: list[str] | None = None) -> int:
    from dflash_pipeline.core.run_cli import add_configfile_argument, read_configfiles
    from dflash_pipeline.stages.cli import json_object, model_dir, or_s3, shard_name, shard_of

    parser = argparse.ArgumentParser(prog="python -m dflash_pipeline.stages.extract", description=__doc__)
    parser.add_argument("tokenized", type=or_s3(shard_of("tokenize", "extract")), help="tokenized shard parquet")
    parser.add_argument("--target", type=model_dir, required=True, help="target model folder")
    given = parser.add_mutually_exclusive_group(required=True)
    add_configfile_argument(given, "read for its train, extract and engines sections")
    given.add_argument("--settings-json", type=json_object, help="the `train` config as JSON")
    parser.add_argument("--run-url", required=True, help="run root (local folder or s3://)")
    parser.add_argument("--shard", type=shard_name, required=True, help="shard name, e.g. 00003")
    parser.add_argument("--manifest", required=True, help="where to write the manifest")
    parser.add_argument("--device", default=None, help="cuda, cpu (default: cuda when available)")
    parser.add_argument(
        "--taps-from",
        choices=("target", "engine"),
        help="who computes the taps (default: --configfile's extract.taps_from, else target); "
        "engine needs --configfile (its engines section says where vLLM is installed)",
    )
    args = parser.parse_args(argv)
    config = read_configfiles(args.configfile, parser) if args.configfile else {}
    taps_from = args.taps_from or config.get("extract", {}).get("taps_from", "target")
    if taps_from == "engine" and not args.configfile:
        parser.error("--taps-from engine needs --configfile: its engines section says where vLLM is installed")
    settings = config["train"] if args.configfile else args.settings_json
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    from dflash_pipeline.core.jobstate import RunHalted

    try:
        extract_job(
            args.tokenized, args.target, settings, args.run_url, args.shard, args.manifest, args.device,
            taps_from=taps_from, engines=config.get("engines"),
        )  # fmt: skip
    except (RunHalted, ShardKindError) as err:
        log.error("%s", err)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
