"""What a run will cost, before it runs: prompts, shards, tokens, GPU-hours, bytes and wall time.

    python -m dflash_pipeline.stages.plan --configfile config/examples/qwen3.6-27b.yaml --gpus 8

Every figure says where it comes from, best source first:

* counts: the run's ingest summary when the ingest has run, else ``plan.prompts``, else the
  rows of the dataset's local files, counted here (JSONL: non-empty lines; parquet: the row count
  of the file's metadata, no data read), before the ingest's validation and deduplication;
* generated tokens per sample: finished generate shards' telemetry, else
  ``plan.mean_response_tokens``, else ``generation.max_new_tokens`` (an upper bound);
* generation throughput: finished generate shards' telemetry, else the run's tune result (the
  engine measured on the run's own prompts, ``dflash_pipeline.stages.tune``), else
  ``plan.generation_tokens_per_s_per_gpu`` (an assumption);
* training throughput: the run's own training telemetry, else ``plan.train_tokens_per_s_per_gpu``,
  else the train_step benchmark in ``bench/results`` closest to the target and the context; with
  ``train.taps_from: engine``, the drafter step's benchmark combined with the engine_taps
  benchmark of the target (the taps server shares the training GPUs), else the in-process rate;
  the online step is the record of the target in ``train.target_quantization``;
* ways to train the target (``core.bench_records.training_options``): in-process, in-process with an
  FP8 target, engine-fed and offline, each at its measured rate (or "not measured") per epoch;
* bytes: finished shards' objects in the run root, else per-token estimates; hidden states are
  K taps x hidden size x bytes per element per token (stored in offline mode only).

The config is the one Snakemake sees (``core.run_cli.open_run``): without ``--configfile``, config.yaml;
with ``--configfile A [B ...]``, those files alone, later ones updating earlier ones (nested
mappings merged, by Snakemake's own ``update_config``), never over config.yaml; keys they leave
out take dflash_pipeline/config/schema.yaml's defaults. The logic is plain functions over that validated config
and what was measured (``Measured``); the CLI only gathers those and prints.

Its length (over 400 lines): one estimate per stage, each with its source and the rule that picks
it, and the command line; split, the estimates of one table would be read in several files.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

from dflash_pipeline.core import layout
from dflash_pipeline.core.bench_records import (
    REPO,
    default_bench_dir,
    engine_on_the_training_gpus,
    pick_capture_benchmark,
    pick_train_benchmark,
    read_capture_benchmarks,
    read_train_benchmarks,
    training_options,
    OFFLINE,
)
from dflash_pipeline.core.config import trains_from_engine_taps
from dflash_pipeline.core.jobstate import StageTotals
from dflash_pipeline.core.resources import checkpoint_bytes
from dflash_pipeline.core.run_cli import add_run_arguments, open_run
from dflash_pipeline.evaluation import segment_tau
from dflash_pipeline.training.offline import hidden_bytes_per_token
from dflash_pipeline.core.storage import StorageError, is_s3_url, open_storage
from dflash_pipeline.engines.tuning import TunedChoice, read_tune_result, tune_defining, tune_key


# Rough sizes of the stage objects per token when nothing is measured yet (compressed parquet:
# text ~2 bytes per token; tokenized ids int32 + loss mask ~3 bytes per token).
TEXT_BYTES_PER_TOKEN = 2.0
TOKENIZED_BYTES_PER_TOKEN = 3.0
# A training checkpoint: fp32 weights and AdamW's two moments.
CHECKPOINT_BYTES_PER_PARAM = 12


class PlanError(ValueError):
    """The plan cannot be made; the message names the missing key or file."""


@dataclass
class Estimate:
    value: float | None
    source: str


@dataclass
class Measured:
    """What the run root and the benchmark results say (all optional)."""

    prompts: int | None = None  # from the ingest summary
    dataset_rows: int | None = None  # rows of the local dataset files (before validation)
    dataset_rows_source: str = ""  # how they were counted, or why they could not be
    train_prompts: int | None = None
    generate_shards: int = 0  # finished generate shards with telemetry
    generate_samples: int = 0
    generate_tokens: int = 0
    generate_gpu_seconds: float = 0.0
    train_tokens_per_s_per_gpu: float | None = None
    shard_bytes: dict[str, list[int]] = field(default_factory=dict)  # stage -> sizes of finished shards
    bench_train: dict | None = None  # the matching train_step record
    bench_drafter: dict | None = None  # with taps from an engine: the drafter step's record
    bench_capture: dict | None = None  # with taps from an engine: the engine_taps record
    hidden_size: int | None = None  # from the target's config.json
    tuned: TunedChoice | None = None  # the run's tune result, for the current settings
    target_bytes: int | None = None  # the target's weights (segment τ's cost until measured)
    segment_tau_seconds: list[float] = field(default_factory=list)  # finished segment τ jobs
    training_options: list[dict] = field(default_factory=list)  # bench_records.training_options


def model_case(model: str) -> str:
    """``/models/Qwen3.6-27B`` -> ``qwen3.6-27b``: how train_step benchmark cases are named."""
    return Path(str(model).rstrip("/")).name.lower()


def bench_estimate(record: dict | None, what: str) -> Estimate:
    """A train_step record's tokens/s, named by its files, case, mode, context and cards."""
    if record is None:
        return Estimate(None, f"unknown: no train_step record of the {what}; set plan.train_tokens_per_s_per_gpu")
    return Estimate(
        float(record["tokens_per_s"]),
        f"{', '.join('bench/results/' + f for f in record['file'].split(', '))}: {record['case']} "
        f"{record.get('algorithm', 'dflash')} {record['mode']} at {record['seq_len']} tokens on {record['device']}",
    )


def engine_fed_rate(drafter: dict | None, capture: dict | None, in_process: dict | None) -> Estimate:
    """The training rate with taps from an engine: the drafter step's record with the target's
    engine_taps record (``engine_on_the_training_gpus``). Without either: the in-process rate,
    said so (the engine's forward is the target's, in other kernels)."""
    if drafter is None or capture is None:
        online = bench_estimate(in_process, "in-process target")
        return Estimate(online.value, f"{online.source}; no engine_taps record of this target: the in-process rate")
    step = bench_estimate(drafter, "drafter step")
    capture_rate = float(capture["capture_tokens_per_s"])
    return Estimate(
        engine_on_the_training_gpus(step.value, capture_rate),
        f"drafter step {step.value:,.0f} tok/s ({step.source}) with the engine's forward on the same GPUs at "
        f"{capture_rate:,.0f} tok/s (bench/results/{capture['file']} on {capture['device']})",
    )


def read_hidden_size(model: str) -> int | None:
    path = Path(model) / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    size = text.get("hidden_size")
    return int(size) if isinstance(size, int) else None


def count_dataset_rows(paths: list[str], workdir: Path = REPO) -> tuple[int | None, str]:
    """(rows, how they were counted) of the dataset's files as the ingest reads them, before its
    validation and deduplication; (None, why not) when a file is remote, missing or of a format
    the ingest does not read (``dflash_pipeline.data.prompts.detect_format``). JSONL: the
    non-empty lines, as the ingest skips blank ones; parquet: the row count of the file's
    metadata (its footer: no data is read)."""
    from dflash_pipeline.data.prompts import detect_format

    if not paths:
        return None, "no dataset files"
    total, kinds = 0, set()
    for name in paths:
        if is_s3_url(str(name)):
            return None, f"dataset file {name} is remote (not counted by the plan)"
        path = Path(name) if Path(name).is_absolute() else workdir / name
        if not path.is_file():
            return None, f"dataset file {name} not found"
        try:
            kind = detect_format(str(name))
        except ValueError as err:
            return None, str(err)
        if kind == "parquet":
            import pyarrow.parquet as pq

            try:
                total += pq.read_metadata(path).num_rows
            except Exception as err:  # noqa: BLE001 (any unreadable file: not counted)
                return None, f"dataset file {name} is not a readable parquet file ({type(err).__name__})"
        else:
            total += count_jsonl_rows(path)
        kinds.add(kind)
    how = " and ".join(
        {"jsonl": "non-empty JSONL lines", "parquet": "parquet rows from the metadata"}[k] for k in sorted(kinds)
    )
    return total, f"counted by the plan: {how} of the local dataset files, before validation and deduplication"


def count_jsonl_rows(path: Path) -> int:
    """The rows the ingest reads from a JSONL file (``prompts.parse_jsonl_lines``): its non-blank
    lines, a byte order mark at the start of the first line dropped."""
    bom = b"\xef\xbb\xbf"
    rows = 0
    with open(path, "rb") as fh:
        for number, line in enumerate(fh, start=1):
            if number == 1 and line.startswith(bom):
                line = line[len(bom) :]
            rows += bool(line.strip())
    return rows


def measure_run(run_url: str, config: dict) -> Measured:
    """What a run root already holds: the ingest summary, finished shards' sizes, telemetry."""
    storage = open_storage(run_url)
    measured = Measured()
    try:
        summary = json.loads(storage.read_text(layout.INGEST_SUMMARY))
        measured.prompts = int(summary["samples"]) or None
        measured.train_prompts = measured.prompts - int(summary.get("heldout_samples", 0))
    except (StorageError, ValueError, TypeError, KeyError):
        pass  # not ingested yet
    for obj in storage.list(layout.OUTPUTS_DIR + "/"):
        match = layout.SHARD_OBJECT.match(obj.key)
        if match and match["ext"] == layout.SHARD_STAGES.get(match["stage"]):
            measured.shard_bytes.setdefault(match["stage"], []).append(obj.size)
    measured.tuned = read_tune_result(storage, tune_key(tune_defining(config)))
    gpus_per_job = config["generation"]["gpus_per_job"] or 1
    # Finished shards' counts from the stage's totals object (one read); telemetry is read only
    # for shards it lacks (a run from before it existed).
    totals = StageTotals(storage, "generate").read()
    for obj in storage.list(f"{layout.PROGRESS_DIR}/generate/"):
        match = layout.SHARD_TELEMETRY.match(obj.key)
        if not match:
            continue
        tele = totals.get(int(match["shard"]))
        if tele is not None:
            tele = {**tele, "state": "done"}
        else:
            try:
                tele = json.loads(storage.read_text(obj.key))
            except (StorageError, ValueError):
                continue
        if tele.get("state") != "done" or not tele.get("elapsed_s"):
            continue
        done = int(tele.get("samples_done", 0)) - int(tele.get("samples_resumed", 0))
        if done <= 0:
            continue
        measured.generate_shards += 1
        measured.generate_samples += done
        measured.generate_tokens += int(tele.get("tokens_generated", 0))
        measured.generate_gpu_seconds += float(tele["elapsed_s"]) * gpus_per_job
    rates = []
    for obj in storage.list(f"{layout.PROGRESS_DIR}/train/"):
        if obj.key.endswith("/telemetry.json"):
            try:
                rate = json.loads(storage.read_text(obj.key)).get("tokens_per_s")
            except (StorageError, ValueError):
                continue
            if rate:
                rates.append(float(rate))
    measured.segment_tau_seconds = segment_tau.measured_seconds(storage, range(config["train"]["segments"]))
    if rates:
        measured.train_tokens_per_s_per_gpu = sum(rates) / len(rates) / (config["train"]["gpus_per_job"] or 1)
    return measured


def make_plan(config: dict, measured: Measured, gpus: int) -> dict:
    """Every figure of the plan with its source (see the module's docstring)."""
    plan_cfg, gen, tok, train = config["plan"], config["generation"], config["tokenize"], config["train"]
    if gpus < 1:
        raise PlanError(f"--gpus must be at least 1, got {gpus}")

    if measured.prompts:
        prompts = Estimate(measured.prompts, "the run's ingest summary")
    elif plan_cfg["prompts"]:
        prompts = Estimate(plan_cfg["prompts"], "config plan.prompts")
    elif measured.dataset_rows:
        prompts = Estimate(measured.dataset_rows, measured.dataset_rows_source)
    else:
        why = f"; {measured.dataset_rows_source}" if measured.dataset_rows_source else ""
        raise PlanError(
            "config key 'plan.prompts' is needed before the ingest has run "
            f"(the expected number of prompts in the dataset{why})"
        )
    heldout = config["dataset"]["heldout_fraction"]
    train_rows = measured.train_prompts or round(prompts.value * (1 - heldout))
    shards = config["num_shards"]

    if measured.generate_samples:
        response = Estimate(
            measured.generate_tokens / measured.generate_samples,
            f"{measured.generate_shards} finished generate shards' telemetry",
        )
    elif plan_cfg["mean_response_tokens"]:
        response = Estimate(plan_cfg["mean_response_tokens"], "config plan.mean_response_tokens")
    else:
        response = Estimate(gen["max_new_tokens"], "generation.max_new_tokens (an upper bound)")
    generated_tokens = prompts.value * response.value

    if measured.generate_gpu_seconds:
        gen_rate = Estimate(
            measured.generate_tokens / measured.generate_gpu_seconds, "finished generate shards' telemetry"
        )
    elif measured.tuned is not None:
        gen_rate = Estimate(measured.tuned.tokens_per_s_per_gpu, measured.tuned.source)
    elif plan_cfg["generation_tokens_per_s_per_gpu"]:
        gen_rate = Estimate(
            plan_cfg["generation_tokens_per_s_per_gpu"],
            "config plan.generation_tokens_per_s_per_gpu (assumed, not measured)",
        )
    else:
        gen_rate = Estimate(None, "unknown: set plan.generation_tokens_per_s_per_gpu")
    gen_gpu_h = generated_tokens / gen_rate.value / 3600 if gen_rate.value else None

    # Training sequences: prompt + response, cut at the training context.
    seq_tokens = min(plan_cfg["mean_prompt_tokens"] + response.value, tok["max_length"])
    epoch_tokens = train_rows * seq_tokens
    if measured.train_tokens_per_s_per_gpu:
        train_rate = Estimate(measured.train_tokens_per_s_per_gpu, "the run's training telemetry")
    elif plan_cfg["train_tokens_per_s_per_gpu"]:
        train_rate = Estimate(plan_cfg["train_tokens_per_s_per_gpu"], "config plan.train_tokens_per_s_per_gpu")
    elif trains_from_engine_taps(train):
        train_rate = engine_fed_rate(measured.bench_drafter, measured.bench_capture, measured.bench_train)
    else:
        train_rate = bench_estimate(measured.bench_train, "target and context")
    train_gpus = max(1, train["gpus_per_job"])  # 0: one CPU process
    steps = train["segments"] * train["steps_per_segment"]
    sequences = steps * train["batch_size"] * train_gpus
    epochs = sequences / train_rows if train_rows else None
    train_tokens = sequences * seq_tokens
    epoch_gpu_h = epoch_tokens / train_rate.value / 3600 if train_rate.value else None
    train_gpu_h = train_tokens / train_rate.value / 3600 if train_rate.value else None

    # Bytes per stage: finished shards' mean size x shards, else per-token estimates.
    hidden = measured.hidden_size or plan_cfg["hidden_size"]
    per_token_hidden = hidden_bytes_per_token(train, hidden) if hidden else None
    hidden_bytes = per_token_hidden * epoch_tokens if per_token_hidden else None
    estimates = {
        "prepare": prompts.value * plan_cfg["mean_prompt_tokens"] * TEXT_BYTES_PER_TOKEN,
        "generate": prompts.value * (plan_cfg["mean_prompt_tokens"] + response.value) * TEXT_BYTES_PER_TOKEN,
        "tokenize": prompts.value * seq_tokens * TOKENIZED_BYTES_PER_TOKEN,
    }
    stage_bytes = {}
    for stage, estimate in estimates.items():
        sizes = measured.shard_bytes.get(stage)
        if sizes:
            stage_bytes[stage] = Estimate(sum(sizes) / len(sizes) * shards, f"{len(sizes)} finished shards")
        else:
            stage_bytes[stage] = Estimate(estimate, "estimate per token")
    offline = train["mode"] == "offline"
    stage_bytes["extract"] = Estimate(
        hidden_bytes if offline else 0,
        (
            f"{per_token_hidden} B per token ({train['hidden_dtype']} taps of hidden {hidden})"
            + ("" if offline else f"; online mode stores none (offline would store {_bytes(hidden_bytes)})")
        )
        if hidden
        else "unknown: the target's config.json or plan.hidden_size gives the hidden size",
    )
    params = measured.bench_train.get("drafter_params") if measured.bench_train else None
    if params:
        stage_bytes["checkpoints"] = Estimate(
            params * CHECKPOINT_BYTES_PER_PARAM,
            f"one checkpoint: {params / 1e9:.2f}B drafter params x {CHECKPOINT_BYTES_PER_PARAM} B (kept per segment)",
        )

    # Wall time: generation runs a shard per job (gpus_per_job each) on the given GPUs; training
    # runs one job of train.gpus_per_job GPUs.
    gen_parallel = max(1, min(shards, gpus // max(1, gen["gpus_per_job"])) * gen["gpus_per_job"])
    wall = {
        "generate_h": gen_gpu_h / gen_parallel if gen_gpu_h else None,
        "train_h": train_gpu_h / train_gpus if train_gpu_h else None,
    }
    if wall["generate_h"] is not None and wall["train_h"] is not None:
        wall["total_days"] = (wall["generate_h"] + wall["train_h"]) / 24
    # A run whose GPU jobs take no GPU (the CPU demo) runs on this machine's cores, not on `gpus`.
    cpu_only = gen["gpus_per_job"] == 0 and train["gpus_per_job"] == 0
    return {
        "run": config["run"],
        "gpus": gpus,
        "cpu_cores": _cpu_cores() if cpu_only else None,
        "prompts": _asdict(prompts),
        "train_rows": train_rows,
        "shards": shards,
        "samples_per_shard": math.ceil(prompts.value / shards),
        "mean_response_tokens": _asdict(response),
        "generated_tokens": generated_tokens,
        "generation": {"tokens_per_s_per_gpu": _asdict(gen_rate), "gpu_hours": gen_gpu_h},
        "train": {
            "mode": train["mode"],
            "tokens_per_s_per_gpu": _asdict(train_rate),
            "sequence_tokens": seq_tokens,
            "epoch_tokens": epoch_tokens,
            "gpu_hours_per_epoch": epoch_gpu_h,
            "steps": steps,
            "sequences": sequences,
            "epochs": epochs,
            "gpu_hours": train_gpu_h,
            "gpus_per_job": train_gpus,
        },
        "bytes": {stage: _asdict(e) for stage, e in stage_bytes.items()},
        "hidden_bytes_per_token": per_token_hidden,
        "wall": wall,
        "segment_tau": segment_tau.segment_tau_cost(config, measured.target_bytes, measured.segment_tau_seconds),
        "training_options": [
            {
                **option,
                "gpu_hours_per_epoch": epoch_tokens / option["tokens_per_s_per_gpu"] / 3600
                if option["tokens_per_s_per_gpu"]
                else None,
                "stored_bytes": per_token_hidden * epoch_tokens if option["option"] == OFFLINE and hidden else 0,
            }
            for option in measured.training_options
        ],
    }


def _cpu_cores() -> int:
    """The cores this process may use (what `snakemake --cores all` takes)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _asdict(estimate: Estimate) -> dict:
    return {"value": estimate.value, "source": estimate.source}


def _bytes(n: float | None) -> str:
    if n is None:
        return "?"
    for unit in ("B", "KB", "MB", "GB", "TB", "PB"):
        if abs(n) < 1000 or unit == "PB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} PB"


def _count(n: float) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f}{unit}"
    return f"{n:.0f}"


def _num(x: float | None, digits: int = 1) -> str:
    if x is None:
        return "?"
    return f"{x:,.{digits}f}" if abs(x) < 1e4 else f"{x:,.0f}"


def format_plan(plan: dict) -> str:
    t, g, w = plan["train"], plan["generation"], plan["wall"]
    cores = plan.get("cpu_cores")
    where = f"the CPU ({cores} cores)" if cores else f"{plan['gpus']} GPUs"
    lines = [
        f"Plan of run {plan['run']!r} on {where}",
        f"  prompts            {plan['prompts']['value']:,}  ({plan['prompts']['source']}); "
        f"{plan['train_rows']:,} for training",
        f"  shards             {plan['shards']}  (~{plan['samples_per_shard']:,} samples each)",
        f"  generated tokens   {_count(plan['generated_tokens'])}  "
        f"({_num(plan['mean_response_tokens']['value'], 0)} per sample: {plan['mean_response_tokens']['source']})",
        "Hours of the GPU jobs (run on the CPU)" if cores else "GPU-hours",
        f"  generate           {_num(g['gpu_hours'])}  at {_num(g['tokens_per_s_per_gpu']['value'], 0)} tok/s per GPU "
        f"({g['tokens_per_s_per_gpu']['source']})",
        f"  train ({t['mode']})    {_num(t['gpu_hours_per_epoch'])} per epoch of {_count(t['epoch_tokens'])} tokens "
        f"at {_num(t['tokens_per_s_per_gpu']['value'], 0)} tok/s per GPU ({t['tokens_per_s_per_gpu']['source']})",
        f"                     {_num(t['gpu_hours'])} for the configured {t['steps']:,} steps "
        f"({t['sequences']:,} sequences of ~{_num(t['sequence_tokens'], 0)} tokens = {_num(t['epochs'], 2)} epochs)",
        segment_tau.cost_line(plan["segment_tau"], bool(cores)),
        "Bytes",
    ]
    for stage, estimate in plan["bytes"].items():
        lines.append(f"  {stage:<18} {_bytes(estimate['value']):>10}  ({estimate['source']})")
    if any(option["tokens_per_s_per_gpu"] for option in plan["training_options"]):
        lines.append("Ways to train this target (bench/results; GPU-hours per epoch at each measured rate)")
        for option in plan["training_options"]:
            stored = f", stores {_bytes(option['stored_bytes'])}" if option["stored_bytes"] else ""
            peak = f", peak {option['peak_gib']} GiB" if option["peak_gib"] else ""
            lines.append(
                f"  {_num(option['gpu_hours_per_epoch']):>8}  {option['option']}: "
                f"{_num(option['tokens_per_s_per_gpu'], 0)} tok/s per GPU{peak}{stored} ({option['source']})"
            )
    lines += [
        f"Wall time on {where}",
        f"  generate           {_num(w['generate_h'])} h",
        f"  train              {_num(w['train_h'])} h on " + ("the CPU" if cores else f"{t['gpus_per_job']} GPUs"),
    ]
    if "total_days" in w:
        lines.append(f"  total              {_num(w['total_days'], 2)} days (plus tokenize, evaluate and report)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dflash_pipeline.stages.plan", description=__doc__.splitlines()[0])
    add_run_arguments(parser, run_url=True)
    parser.add_argument("--gpus", type=int, default=None, help="GPUs for the wall time (default: config gpus, else 8)")
    parser.add_argument(
        "--bench-dir",
        default=None,
        help="train_step*.json and engine_taps*.json results (default: bench/results of the checkout "
        "it runs in or is installed from; none without a checkout)",
    )
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    args = parser.parse_args(argv)
    if args.gpus is not None and args.gpus < 1:
        print(f"plan: --gpus must be at least 1, got {args.gpus}", file=sys.stderr)
        return 2
    # Relative paths as Snakemake reads them: config.yaml, the dataset and the results folder in
    # the working directory, wherever the package is installed.
    workdir = Path.cwd()
    if args.bench_dir is not None and not Path(args.bench_dir).is_dir():
        print(f"plan: --bench-dir {args.bench_dir}: no such folder", file=sys.stderr)
        return 2
    bench_dir = Path(args.bench_dir) if args.bench_dir is not None else default_bench_dir(workdir)
    run = open_run(args, parser)
    config, run_url = run.config, run.url
    try:
        measured = Measured()
        if run_url.startswith("s3://") or Path(run_url).is_dir():
            measured = measure_run(run_url, config)
        case = model_case(config["target"]["model"])
        steps = read_train_benchmarks(bench_dir) if bench_dir else []
        train = config["train"]
        context = config["tokenize"]["max_length"]
        measured.bench_train = pick_train_benchmark(
            steps, case, train["mode"], context, train["algorithm"], quantization=train["target_quantization"]
        )
        captures = read_capture_benchmarks(bench_dir) if bench_dir else []
        if trains_from_engine_taps(train):
            measured.bench_drafter = pick_train_benchmark(
                steps, case, train["mode"], context, train["algorithm"], train["taps_from"]
            )
            measured.bench_capture = pick_capture_benchmark(captures, case)
        measured.training_options = training_options(steps, captures, case, context, train["algorithm"])
        measured.hidden_size = read_hidden_size(config["target"]["model"])
        measured.target_bytes = checkpoint_bytes(config["target"]["model"])
        if not measured.prompts and not config["plan"]["prompts"]:
            measured.dataset_rows, measured.dataset_rows_source = count_dataset_rows(
                config["dataset"]["paths"], workdir
            )
        gpus = args.gpus if args.gpus is not None else config["gpus"] or 8
        plan = make_plan(config, measured, gpus)
    except (PlanError, ValueError) as err:
        print(f"plan: {err}", file=sys.stderr)
        return 2
    print(json.dumps(plan, indent=1) if args.json else format_plan(plan))
    return 0


if __name__ == "__main__":
    sys.exit(main())
