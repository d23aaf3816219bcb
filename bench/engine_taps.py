"""Taps from a vLLM capture server (``train.taps_from: engine``): how fast one server delivers
taps, and what that means for engine-fed training against the in-process target.

For each case the target has the shape of ``train_step.py``'s case (random weights: vLLM's
``--load-format dummy``, so no checkpoint is written), served by the pipeline's own taps server
(``engines.engine_taps.taps_server_spec``: ``extract_hidden_states`` with the project's
connector) and read by the pipeline's own client (``EngineTaps``: request, wait for the file,
check ids and layers, load, delete). Measured:

- ``capture_tokens_per_s``: tokens whose taps reach the reader per second, ``--sequences``
  distinct random sequences of the case's length, ``--concurrency`` requests in flight (the
  schema's ``train.taps_server.concurrency`` by default);
- ``latency_s``: one sequence alone (the engine idle), what a trainer that asks for its batch's
  taps when it needs them waits per step.

With ``--trainer-record`` (``train_step.py``'s result on the same card), the record also gives
per trainer GPU: in-process tokens/s (the online step); engine-fed tokens/s with the engine on the
training GPUs, as ``train.taps_from: engine`` runs it and the plan prices it; and, for a capture
server on GPUs of its own, the trainer's tokens/s and how many trainer GPUs one server keeps busy
(``gpus_per_capture_server``).

``--layers CASE=N,M`` measures a target too big for the card at N and at M of its layers (same
width, the 3:1 hybrid pattern kept, one server each) and extrapolates to its whole depth with a
fixed plus a per-layer cost (``whole_depth``; one depth scales in proportion, which also scales the
taps files' fixed cost). The record keeps each depth's measurement.

The 27B-shaped case is a Qwen3.5-style hybrid; vLLM serves that family only as its multimodal
model (``Qwen3_5ForConditionalGeneration``), so the config wraps the text shape and the server
runs with ``--language-model-only``.

    python bench/engine_taps.py --vllm-python ENV/bin/python --case qwen3-8b --case qwen3.6-27b \\
        --trainer-record bench/results/train_step-<card>.json --out bench/results/engine_taps-<card>.json
    python bench/engine_taps.py --vllm-python .venv-vllm/bin/python --case tiny --device cpu  # smoke run
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from benchlib import emit, provenance  # noqa: E402
from serving_parity import gpu_name  # noqa: E402
from train_step import CASES as TRAIN_CASES  # noqa: E402
from train_step import target_config  # noqa: E402

from dflash_pipeline.core.config import schema_defaults  # noqa: E402
from dflash_pipeline.engines.engine_taps import EngineTaps, node_local_dir, taps_server_spec  # noqa: E402
from dflash_pipeline.engines.environments import engine_env  # noqa: E402
from dflash_pipeline.engines.launch import ManagedServer, free_port  # noqa: E402
from dflash_pipeline.core.bench_records import engine_on_the_training_gpus  # noqa: E402

# A CPU-sized case to try the bench where no GPU is (vLLM's CPU build): same code path.
TINY = {
    "seq_len": 256,
    "drafter": {"target_layer_ids": [0, 2, 3]},
    "target": dict(
        kind="qwen3",
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        vocab_size=4096,
    ),
}
CASES = {**TRAIN_CASES, "tiny": TINY}
# A training job's taps server settings by default (the schema's): its node-local folder, its
# cache bound and its requests in flight.
TAPS_SERVER = schema_defaults("train")["taps_server"]
# Before the timed sequences: warm-up requests (first-shape compilation, allocator growth), then
# one sequence at a time for its wait.
WARMUP, ALONE = 2, 3


def write_target(case: dict, folder: Path) -> Path:
    """A model folder vLLM can start with dummy weights: the case's config and the demo tokenizer
    (token ids go in as ids, so the tokenizer only has to load)."""
    from dflash_pipeline.demo.build_model import build_tokenizer

    folder.mkdir(parents=True, exist_ok=True)
    config = target_config(case["target"])
    if case["target"]["kind"] == "qwen3_5":
        from transformers import Qwen3_5Config

        config = Qwen3_5Config(text_config=config.to_dict())
        config.architectures = ["Qwen3_5ForConditionalGeneration"]
    else:
        config.architectures = ["Qwen3ForCausalLM"]
    config.torch_dtype = "bfloat16"
    config.save_pretrained(folder)
    build_tokenizer().save_pretrained(folder)
    return folder


def fewer_layers(case: dict, layers: int) -> dict:
    """The case's target cut to ``layers`` decoder layers (the 3:1 hybrid pattern kept), its taps
    spread over them as the drafter's are over the whole target."""
    full = case["target"]["num_hidden_layers"]
    taps = sorted({round(k * (layers - 1) / (full - 1)) for k in case["drafter"]["target_layer_ids"]})
    return {**case, "target": {**case["target"], "num_hidden_layers": layers}, "drafter": {"target_layer_ids": taps}}


def whole_depth(points: list[tuple[int, float]], depth: int) -> tuple[float, str]:
    """A time measured at fewer decoder layers, at the target's whole ``depth``. One point scales
    in proportion: every cost grows with depth, an overestimate where part of the time does not
    (the taps file's copy, write and read, the request: one 27B-shaped sequence waited 0.359 s at 8
    layers and 0.406 s at 16 on an H100, so proportional scaling put 64 layers at 2.87 s from one
    and 1.62 s from the other). Two or more points: the least-squares line through them, a fixed
    cost plus one per layer, unless that line does not rise with depth or puts the whole target
    below the deepest time measured: then the depths were bound by a cost that does not grow with
    them (vLLM 0.34.0 captured a 27B-shaped target at 28,056 tokens/s at 8 layers and 29,191 at 16,
    both at the taps output's ~1.5 GB/s, and 18,827 at 32), and the deepest point alone, in
    proportion, is the bound that holds. Returns the time and how it was found."""
    deepest = max(points)
    if len(points) > 1:
        n = len(points)
        mean_l = sum(layer for layer, _ in points) / n
        mean_t = sum(t for _, t in points) / n
        slope = sum((layer - mean_l) * (t - mean_t) for layer, t in points) / sum(
            (layer - mean_l) ** 2 for layer, _ in points
        )
        fitted = mean_t + slope * (depth - mean_l)
        if slope > 0 and fitted >= deepest[1]:
            return fitted, "fixed + per-layer cost, least squares"
    layers, seconds = deepest
    how = (
        "in proportion to depth"
        if len(points) == 1
        else f"in proportion to the deepest ({layers} layers): no fit rising with depth"
    )
    return seconds * depth / layers, how


def at_whole_depth(records: list[dict], full_layers: int) -> dict:
    """One case measured at fewer layers (one record per depth) as the whole target's figures:
    the capture rate and one sequence's wait extrapolated (``whole_depth``), the measurements kept."""
    done = [r for r in records if "capture_tokens_per_s" in r]
    failed = [r for r in records if "capture_tokens_per_s" not in r]
    if failed:  # its error, and no figure a reader could take for the whole target's
        return {**failed[0], "whole_target_layers": full_layers, "depths": records}
    tokens_per_s, how = whole_depth([(r["target_layers"], 1 / r["capture_tokens_per_s"]) for r in done], full_layers)
    latency, latency_how = whole_depth([(r["target_layers"], r["latency_s"]) for r in done], full_layers)
    per_depth = (
        "target_layers",
        "tap_ids",
        "startup_s",
        "capture_tokens_per_s",
        "capture_seconds",
        "latency_s",
        "latency_s_all",
    )
    return {
        **{key: value for key, value in done[-1].items() if key not in per_depth},
        "target_layers": [r["target_layers"] for r in done],
        "whole_target_layers": full_layers,
        "extrapolation": how,
        "latency_extrapolation": latency_how,
        "capture_tokens_per_s": round(1 / tokens_per_s, 1),
        "latency_s": round(latency, 4),
        "depths": [{key: r[key] for key in per_depth if key in r} for r in done],
    }


def measure_case(name: str, args, work: Path) -> dict:
    """The case's figures: measured as it is, or at the fewer depths ``--layers`` gives and
    extrapolated to its whole depth."""
    if name not in args.layers:
        return measure(name, CASES[name], args, work / name)
    full_layers = CASES[name]["target"]["num_hidden_layers"]
    records = [measure(name, fewer_layers(CASES[name], n), args, work / f"{name}-{n}") for n in args.layers[name]]
    return at_whole_depth(records, full_layers)


def measure(name: str, case: dict, args, work: Path) -> dict:
    seq_len, tap_ids = case["seq_len"], case["drafter"]["target_layer_ids"]
    target = write_target(case, work / "target")
    extra = ["--load-format", "dummy"] + (["--language-model-only"] if case["target"]["kind"] == "qwen3_5" else [])
    dtype = "bfloat16" if args.device == "cuda" else "float32"
    vocab = case["target"]["vocab_size"]
    generator = torch.Generator().manual_seed(0)
    # Distinct random sequences: no prefix-cache hit makes the engine's work smaller than a real run's.
    sequences = [
        torch.randint(0, vocab, (seq_len,), generator=generator).tolist()
        for _ in range(WARMUP + ALONE + args.sequences)
    ]
    warmup, alone, timed = sequences[:WARMUP], sequences[WARMUP : WARMUP + ALONE], sequences[WARMUP + ALONE :]
    record = {
        "case": name,
        "seq_len": seq_len,
        "tap_ids": tap_ids,
        "target_layers": case["target"]["num_hidden_layers"],
        "extra_server_args": extra + args.engine_arg,
        "dtype": dtype,
    }
    started = time.monotonic()
    log = work / "server.log"
    try:
        # The server's files where a training job's go (shared memory where it has room): the
        # figures are the pipeline's, not those of whatever disk holds the work folder.
        with node_local_dir(TAPS_SERVER["max_cache_bytes"]) as run_dir:
            record["taps_folder"] = str(run_dir.parent)
            spec = taps_server_spec(
                target, tap_ids, free_port(), run_dir, python=args.vllm_python, env=engine_env("vllm", None),
                mem_fraction=args.mem_fraction, dtype=dtype, max_model_len=seq_len + 16,
                max_num_seqs=args.concurrency, extra_args=extra + args.engine_arg,
            )  # fmt: skip
            with ManagedServer(spec, log, work, startup_timeout=args.startup_timeout) as server:
                record["startup_s"] = round(time.monotonic() - started, 1)
                with EngineTaps.of_server(
                    spec, tap_ids, alive=server.alive, concurrency=args.concurrency,
                    max_cache_bytes=TAPS_SERVER["max_cache_bytes"],
                ) as client:  # fmt: skip
                    client.taps_of(warmup)
                    latencies = []
                    for seq in alone:
                        t0 = time.monotonic()
                        taps = client.taps(seq)
                        latencies.append(time.monotonic() - t0)
                    t0 = time.monotonic()
                    client.taps_of(timed)
                    seconds = time.monotonic() - t0
        record.update(
            taps_shape=list(taps.shape),
            taps_bytes_per_token=taps.element_size() * taps.shape[1],
            latency_s=round(sorted(latencies)[len(latencies) // 2], 4),  # the median
            latency_s_all=[round(t, 4) for t in latencies],
            sequences=args.sequences,
            concurrency=args.concurrency,
            capture_seconds=round(seconds, 3),
            capture_tokens_per_s=round(args.sequences * seq_len / seconds, 1),
        )
    except Exception as exc:  # a case the engine cannot serve is a finding: keep it and go on
        record["error"] = f"{type(exc).__name__}: {exc}"[-3000:]
    return record


def trainer_figures(record: dict, trainer: dict) -> dict:
    """Per trainer GPU, from train_step's rows of the same case: in-process (online) tokens/s;
    engine-fed tokens/s as the pipeline runs it, the engine on the training GPUs
    (``core.bench_records.engine_on_the_training_gpus``, what the plan uses); and with a capture server
    on GPUs of its own, the trainer's tokens/s (the drafter step or one sequence's wait, the longer:
    the loop asks for the next batch's taps while it trains on this one) and how many trainer GPUs
    one such server keeps busy."""
    rows = {
        r["mode"]: r
        for r in trainer["results"]
        if r["case"] == record["case"] and r.get("algorithm", "dflash") == "dflash"
    }
    if "drafter" not in rows or "capture_tokens_per_s" not in record:
        return {}
    seq_len, step_s = record["seq_len"], rows["drafter"]["step_s"]
    apart = seq_len / max(step_s, record["latency_s"])
    shared = engine_on_the_training_gpus(rows["drafter"]["tokens_per_s"], record["capture_tokens_per_s"])
    figures = {
        "trainer_device": trainer["device"],
        "drafter_step_s": step_s,
        "engine_fed_tokens_per_s_per_gpu": round(shared, 1),
        "capture_apart_trainer_tokens_per_s_per_gpu": round(apart, 1),
        "gpus_per_capture_server": round(record["capture_tokens_per_s"] / apart, 2),
    }
    if "online" in rows:
        figures["in_process_tokens_per_s_per_gpu"] = rows["online"]["tokens_per_s"]
        figures["in_process_peak_gib"] = rows["online"]["peak_gib"]
    return figures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vllm-python", required=True, help="the Python of vLLM's environment")
    parser.add_argument("--case", action="append", choices=sorted(CASES), help="target shapes (default: qwen3-8b)")
    parser.add_argument("--sequences", type=int, default=32, help="sequences timed per case")
    parser.add_argument(
        "--concurrency", type=int, default=TAPS_SERVER["concurrency"], help="requests in flight (train.taps_server's)"
    )
    parser.add_argument("--mem-fraction", type=float, default=0.85, help="the server's GPU memory share")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--engine-arg", action="append", default=[], help="extra server argument (repeatable)")
    parser.add_argument(
        "--layers", action="append", default=[], metavar="CASE=N[,M...]",
        help="measure CASE's target at N (and M...) decoder layers and extrapolate to its whole depth "
        "(a target too big for the card; two depths separate the per-layer cost from the fixed one)",
    )  # fmt: skip
    parser.add_argument("--startup-timeout", type=float, default=900)
    parser.add_argument("--trainer-record", help="train_step.py's result on the same card")
    parser.add_argument("--workdir", help="keep the servers' folders and logs here")
    parser.add_argument("--out", help="result JSON")
    args = parser.parse_args()
    args.layers = {
        name: [int(n) for n in depths.split(",")] for name, depths in (item.split("=", 1) for item in args.layers)
    }
    work = Path(args.workdir or tempfile.mkdtemp(prefix="engine-taps-"))
    trainer = json.loads(Path(args.trainer_record).read_text()) if args.trainer_record else None
    device = gpu_name() if args.device == "cuda" else "cpu"
    record = {"benchmark": "engine_taps", **provenance(device), "cases": []}
    for name in args.case or ["qwen3-8b"]:
        result = measure_case(name, args, work)
        if trainer:
            result.update(trainer_figures(result, trainer))
        record["cases"].append(result)
        emit(record, args.out)  # each case survives a later one's crash
    return 0 if all("error" not in c for c in record["cases"]) else 1


if __name__ == "__main__":
    sys.exit(main())
