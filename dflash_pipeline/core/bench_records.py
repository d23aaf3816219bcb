"""The benchmark records (``bench/results``) a plan prices a run from: the training step
(``bench/train_step.py``: the drafter step alone, and the online step with the target in-process,
full precision or quantized) and the taps capture of an engine (``bench/engine_taps.py``), picked
for the run's target, context and drafter algorithm; and the ways to train that target, each at
its measured rate (``training_options``).
"""

from __future__ import annotations

import json
from pathlib import Path


class BenchRecordError(ValueError):
    """A benchmark result file cannot be read; the message names it."""


REPO = Path(__file__).resolve().parents[2]
# The checkout's measured training steps (bench/train_step.py). Not package data: they are the
# record of bench runs, rewritten there; an installed package without a checkout has none (the
# training rate then comes from the run or plan.train_tokens_per_s_per_gpu).
BENCH_RESULTS = Path("bench") / "results"


def default_bench_dir(workdir: Path) -> Path | None:
    """The benchmark records the plan reads without --bench-dir: those of the checkout it runs
    in, else those of the checkout the package is imported from (an editable install), else none."""
    for folder in (workdir / BENCH_RESULTS, REPO / BENCH_RESULTS):
        if folder.is_dir():
            return folder
    return None


def pick_train_benchmark(
    records: list[dict],
    case: str,
    mode: str,
    seq_len: int,
    algorithm: str = "dflash",
    taps_from: str = "target",
    quantization: str | None = None,
) -> dict | None:
    """The train_step measurement of this target, mode and drafter algorithm, closest in context
    (None: no record of this target; another model's throughput would say nothing about this
    one). Records of one context from several result files are averaged, and all are named.
    Records older than the algorithm key are DFlash's. Offline, and online with taps from an
    engine, the trainer steps the drafter alone. The online step is the record of the target in
    ``quantization`` (``train.target_quantization``; records without the key are full precision):
    an FP8 target's forward is another cost, and it fits cards the bf16 one does not."""
    bench_mode = "online" if mode == "online" and taps_from == "target" else "drafter"
    pool = [
        r for r in records
        if r.get("mode") == bench_mode and r.get("tokens_per_s") and r.get("case") == case
        and r.get("algorithm", "dflash") == algorithm
        and (bench_mode == "drafter" or r.get("target_quantization") == quantization)
    ]  # fmt: skip
    if not pool:
        return None
    closest = min(abs(int(r.get("seq_len", 0)) - seq_len) for r in pool)
    chosen = [r for r in pool if abs(int(r.get("seq_len", 0)) - seq_len) == closest]
    return {
        **chosen[0],
        "tokens_per_s": round(sum(float(r["tokens_per_s"]) for r in chosen) / len(chosen), 1),
        "file": ", ".join(sorted({r["file"] for r in chosen})),
        "device": ", ".join(sorted({str(r.get("device")) for r in chosen})),  # every card averaged
        "algorithm": algorithm,
    }


def pick_capture_benchmark(records: list[dict], case: str) -> dict | None:
    """The engine_taps measurement of this target (a vLLM capture server's taps tokens/s on one
    GPU): the newest date's records (a later engine's rate replaces an earlier one's; one date's
    files averaged), named; None without one."""
    measured = [r for r in records if r.get("case") == case and r.get("capture_tokens_per_s")]
    if not measured:
        return None
    newest = max(str(r.get("date") or "") for r in measured)
    chosen = [r for r in measured if str(r.get("date") or "") == newest]
    return {
        **chosen[0],
        "capture_tokens_per_s": round(sum(float(r["capture_tokens_per_s"]) for r in chosen) / len(chosen), 1),
        "file": ", ".join(sorted({r["file"] for r in chosen})),
    }


def read_capture_benchmarks(bench_dir: Path) -> list[dict]:
    """The cases of ``bench/engine_taps.py``'s results (engine_taps*.json)."""
    records = []
    for path in sorted(bench_dir.glob("engine_taps*.json")):
        try:
            doc = json.loads(path.read_text())
        except (OSError, ValueError) as err:
            raise BenchRecordError(f"{path}: unreadable benchmark result ({err})") from err
        records += [
            {**case, "file": path.name, "device": doc.get("device"), "date": doc.get("date")}
            for case in doc.get("cases", [])
        ]
    return records


def engine_on_the_training_gpus(drafter_tokens_per_s: float, capture_tokens_per_s: float) -> float:
    """Training tokens/s per GPU with taps from an engine that runs on the training job's own
    GPUs (as ``train.taps_from: engine`` starts it): each GPU's time goes to the drafter's step and
    to its share of the engine's forward, 1/rate = 1/drafter + 1/capture."""
    return 1 / (1 / drafter_tokens_per_s + 1 / capture_tokens_per_s)


# Result files kept as the record of an earlier state (before an optimization), not current.
HISTORICAL_SUFFIXES = ("-first", "-before")


def read_train_benchmarks(bench_dir: Path) -> list[dict]:
    records = []
    for path in sorted(bench_dir.glob("train_step*.json")):
        if path.stem.endswith(HISTORICAL_SUFFIXES):
            continue
        try:
            doc = json.loads(path.read_text())
        except (OSError, ValueError) as err:
            raise BenchRecordError(f"{path}: unreadable benchmark result ({err})") from err
        for record in doc.get("results", []):
            records.append({**record, "file": path.name, "device": doc.get("device")})
    return records


# The ways to train a target the records can price, in the order a reader weighs them.
IN_PROCESS = "in-process target"
IN_PROCESS_FP8 = "in-process target, FP8 (train.target_quantization: fp8)"
ENGINE_FED = "taps from an engine on the training GPUs (train.taps_from: engine)"
OFFLINE = "offline: stored taps (extract, then train.mode: offline; later epochs at the drafter step's rate)"


def training_options(
    train_records: list[dict], capture_records: list[dict], case: str, seq_len: int, algorithm: str
) -> list[dict]:
    """Each way to train ``case``'s drafter with its measured tokens/s per GPU and the records it
    comes from (``value`` None: not measured). The in-process rates are the online step's; with an
    engine on the training GPUs, and offline (whose extraction runs the same engine), a GPU's time
    per token is the drafter step's plus the engine's forward (``engine_on_the_training_gpus``);
    offline also stores the taps."""
    options = []
    for name, quantization in ((IN_PROCESS, None), (IN_PROCESS_FP8, "fp8")):
        record = pick_train_benchmark(train_records, case, "online", seq_len, algorithm, "target", quantization)
        options.append(_option(name, record and record["tokens_per_s"], [record], record and record.get("peak_gib")))
    drafter = pick_train_benchmark(train_records, case, "online", seq_len, algorithm, "engine")
    capture = pick_capture_benchmark(capture_records, case)
    rate = None
    if drafter is not None and capture is not None:
        rate = round(engine_on_the_training_gpus(float(drafter["tokens_per_s"]), capture["capture_tokens_per_s"]), 1)
    for name in (ENGINE_FED, OFFLINE):
        # No peak: the drafter step's record leaves out the engine's memory on the same GPUs.
        options.append(_option(name, rate, [drafter, capture], None))
    return options


def _option(name: str, tokens_per_s: float | None, records: list[dict | None], peak_gib: float | None) -> dict:
    found = [r for r in records if r is not None]
    return {
        "option": name,
        "tokens_per_s_per_gpu": tokens_per_s,
        "peak_gib": peak_gib,
        "source": "; ".join(f"bench/results/{r['file']} on {r.get('device')}" for r in found)
        if tokens_per_s
        else "not measured",
    }
