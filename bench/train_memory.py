"""Peak memory per rank of a training job over a large tokenized set: the memory-mapped reader
(dflash_pipeline.training.data) against the in-memory reader it replaced.

A synthetic tokenized set in the tokenize stage's schema (parquet shards, ids in the demo
vocabulary, lengths uniform in [tokens/3, 5*tokens/3], so ~``tokens`` on average) and two CPU
ranks (torchrun, gloo) training a tiny drafter on the demo target for ``--steps`` steps through
the real ``SegmentJob``. Each rank samples its own /proc/self/status and reports VmHWM (peak
RSS: anonymous memory and the mapped file pages it touched) and the peak of RssAnon; "beyond the
model" subtracts the same job's peak on a 64-row set. The batch order of both readers is
compared on the set the in-memory reader still fits.

    python bench/train_memory.py --data /scratch/train-memory --rows 1000000 --tokens 3000 \\
        --shards 400 --legacy-rows 100000 --out bench/results/train_memory.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from multiprocessing import Pool
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from benchlib import cpu_model, emit, provenance  # noqa: E402

GIB = 2**30
CASES = {  # name: (reader, which set)
    "model_only": ("mapped", "tiny"),  # the job with (almost) no data: the model and runtime
    "in_memory_small": ("in-memory", "small"),
    "mapped_small": ("mapped", "small"),
    "mapped_full_cold": ("mapped", "full"),  # converts every shard first
    "mapped_full_warm": ("mapped", "full"),  # the next segment: the copies exist
}


# --- the synthetic set --------------------------------------------------------------------------
def write_shard(args) -> str:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from dflash_pipeline.data.tokenized import TOKENIZED_SCHEMA

    path, shard, rows, tokens, vocab = args
    if Path(path).exists():
        return path
    rng = np.random.default_rng(shard)
    lengths = rng.integers(tokens // 3, 5 * tokens // 3 + 1, rows).astype(np.int32)
    prompts = rng.integers(20, 300, rows).astype(np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)])
    ids = rng.integers(4, vocab, int(offsets[-1]), dtype=np.int32)
    mask = np.ones(int(offsets[-1]), np.int8)
    # Prompt positions unsupervised: zero the first prompts[i] of each row.
    starts = np.repeat(offsets[:-1], prompts)
    within = np.arange(int(prompts.sum())) - np.repeat(np.cumsum(prompts) - prompts, prompts)
    mask[starts + within] = 0
    split = np.where(np.arange(rows) % 100 == 0, "heldout", "train")
    table = pa.Table.from_arrays(
        [
            pa.array([f"syn-{shard:05d}-{i}" for i in range(rows)]),
            pa.array(split.tolist()),
            pa.array(np.full(rows, -1, np.int32)),
            pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), pa.array(ids)),
            pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), pa.array(mask)),
            pa.array(lengths),
            pa.array((lengths - prompts).astype(np.int32)),
            pa.array(np.zeros(rows, bool)),
        ],
        schema=TOKENIZED_SCHEMA,
    )
    tmp = f"{path}.tmp"
    pq.write_table(table, tmp)  # as the tokenize stage writes its shards
    os.replace(tmp, path)
    return path


def synthetic_set(folder: Path, rows: int, tokens: int, shards: int, vocab: int, workers: int) -> dict[str, str]:
    folder.mkdir(parents=True, exist_ok=True)
    per = -(-rows // shards)
    jobs = [
        (str(folder / f"tokenize-{i:05d}.parquet"), i, min(per, rows - i * per), tokens, vocab)
        for i in range(shards)
        if rows - i * per > 0
    ]
    with Pool(workers) as pool:
        paths = pool.map(write_shard, jobs, chunksize=1)
    return {Path(p).name.split("-")[1].split(".")[0]: p for p in paths}


# --- one rank -----------------------------------------------------------------------------------
def _status() -> dict[str, int]:
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem"):
            out[key] = int(value.split()[0]) * 1024
    return out


class Sampler(threading.Thread):
    def __init__(self):
        super().__init__(daemon=True)
        self.peak = {"RssAnon": 0, "RssFile": 0}
        self.running = True

    def run(self):
        while self.running:
            status = _status()
            for key in self.peak:
                self.peak[key] = max(self.peak[key], status.get(key, 0))
            time.sleep(0.01)


class _InMemorySet(list):
    """The old reader's list, with the ``lengths`` the trainer now takes from its set."""

    @property
    def lengths(self):
        return [row.length for row in self]


def worker(args) -> None:
    import torch

    from dflash_pipeline.core import layout
    from dflash_pipeline.core.config import validate_config
    from dflash_pipeline.training import trainer

    torch.set_num_threads(1)
    sampler = Sampler()
    sampler.start()
    if args.reader == "in-memory":
        from tests.support.legacy_training_data import read_training_sequences as legacy

        # The trainer as it was: every rank reads the whole set into its own memory.
        trainer.read_training_sequences = lambda paths, **_: _InMemorySet(legacy(paths))
    paths = json.loads(Path(args.paths).read_text())
    settings = validate_config({"train": {}})["train"]
    settings.update(
        mode="online",
        segments=1,
        steps_per_segment=args.steps,
        checkpoint_every_steps=10**9,
        batch_size=1,
        gpus_per_job=0,
        num_layers=1,
        intermediate_size=128,
        block_size=4,
        num_anchors=16,
        metrics_every_seconds=5,
        attention="sdpa",
        export_dtype="float32",
        data_cache_dir=args.cache,
    )
    run_dir = Path(args.run_dir)
    started = time.perf_counter()
    trainer.SegmentJob(
        run_url=str(run_dir),
        segment=0,
        settings=settings,
        target_dir=args.model,
        tokenized=paths,
        manifest_path=str(run_dir / layout.segment_manifest_key(0)),
        device="cpu",
    ).run()
    wall = time.perf_counter() - started
    sampler.running = False
    sampler.join()
    status = _status()
    rank = int(os.environ.get("RANK", "0"))
    Path(args.report, f"rank-{rank}.json").write_text(
        json.dumps(
            {
                "rank": rank,
                "peak_rss_bytes": status["VmHWM"],
                "peak_rss_anon_bytes": sampler.peak["RssAnon"],
                "peak_rss_file_bytes": sampler.peak["RssFile"],
                "wall_s": round(wall, 1),
            }
        )
    )


def run_case(name: str, reader: str, paths: dict[str, str], model: str, work: Path, cache: Path, steps: int) -> dict:
    case = work / name
    subprocess.run(["rm", "-rf", str(case)], check=True)
    (case / "report").mkdir(parents=True)
    (case / "paths.json").write_text(json.dumps(paths))
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", __file__,
        "--worker", "--reader", reader, "--paths", str(case / "paths.json"), "--model", model,
        "--cache", str(cache), "--run-dir", str(case / "run"), "--report", str(case / "report"),
        "--steps", str(steps),
    ]  # fmt: skip
    started = time.perf_counter()
    proc = subprocess.run(
        command,
        capture_output=True,
        text=True,
        cwd=REPO,
        env={
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
            "OMP_NUM_THREADS": "1",
            "CUDA_VISIBLE_DEVICES": "",
        },
    )  # CPU ranks: gloo
    if proc.returncode != 0:
        raise SystemExit(f"case {name} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    ranks = [json.loads((case / "report" / f"rank-{r}.json").read_text()) for r in range(2)]
    subprocess.run(["rm", "-rf", str(case / "run")], check=True)
    return {"reader": reader, "wall_s": round(time.perf_counter() - started, 1), "ranks": ranks}


def batch_order_identical(paths: dict[str, str], cache: Path, steps: int, seed: int = 0) -> bool:
    """The first ``steps`` global batches (2 ranks x 1 row) of both readers: same rows."""
    from dflash_pipeline.training.data import BatchOrder, read_training_sequences
    from tests.support.legacy_training_data import read_training_sequences as legacy

    new = read_training_sequences(paths, cache_dir=cache)
    new_plan = BatchOrder(new.lengths, 2, seed)
    new_ids = [[new[i].sample_id for i in new_plan.global_batch_at(s)] for s in range(steps)]
    del new
    old = legacy(paths)
    old_plan = BatchOrder([r.length for r in old], 2, seed)
    old_ids = [[old[i].sample_id for i in old_plan.global_batch_at(s)] for s in range(steps)]
    return new_ids == old_ids


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", help="folder for the synthetic set and the mapped copies (required)")
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--tokens", type=int, default=3000, help="mean tokens per row")
    parser.add_argument("--shards", type=int, default=400)
    parser.add_argument(
        "--legacy-rows",
        type=int,
        default=100_000,
        help="rows (the first shards of the set) both readers are measured on",
    )
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--workers", type=int, default=2, help="processes writing the synthetic set")
    parser.add_argument("--skip-in-memory", action="store_true", help="measure the mapped reader only")
    parser.add_argument(
        "--cases",
        nargs="*",
        choices=CASES,
        default=list(CASES),
        help="the cases to run now; each case's figures are kept under --data, and the "
        "record holds every case measured there (a long run in several parts)",
    )
    parser.add_argument("--out")
    # One rank of a case (started by torchrun).
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    for flag in ("--reader", "--paths", "--model", "--cache", "--run-dir", "--report"):
        parser.add_argument(flag, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    if not args.data:
        parser.error("--data is required")

    from dflash_pipeline.demo.build_model import build_demo_model

    data = Path(args.data)
    model = build_demo_model(data / "demo-target")
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    started = time.perf_counter()
    paths = synthetic_set(data / "set", args.rows, args.tokens, args.shards, vocab, args.workers)
    made = data / "set.json"  # when the set was made: a later part of the run finds it made
    if not made.exists():
        made.write_text(json.dumps({"generate_s": round(time.perf_counter() - started, 1)}))
    generate_s = json.loads(made.read_text())["generate_s"]
    per_shard = -(-args.rows // args.shards)
    small = dict(sorted(paths.items())[: max(1, args.legacy_rows // per_shard)])
    tiny = synthetic_set(data / "tiny", 64, args.tokens, 1, vocab, 1)
    cache = data / "cache"
    if "mapped_full_cold" in args.cases:  # cold: no mapped copy exists yet
        subprocess.run(["rm", "-rf", str(cache)], check=True)
    work = data / "cases"
    subsets = {"tiny": tiny, "small": small, "full": paths}
    kept = data / "results"
    kept.mkdir(exist_ok=True)
    for name in args.cases:
        reader, subset = CASES[name]
        if reader == "in-memory" and args.skip_in_memory:
            continue
        case = run_case(name, reader, subsets[subset], str(model), work, cache, args.steps)
        case["rows"] = sum(_rows(p) for p in subsets[subset].values())
        case["shards"] = len(subsets[subset])
        (kept / f"{name}.json").write_text(json.dumps(case))
        print(name, json.dumps(case), flush=True)
    cases = {
        name: json.loads((kept / f"{name}.json").read_text()) for name in CASES if (kept / f"{name}.json").exists()
    }
    if "model_only" not in cases or not any(n.startswith("mapped_full") for n in cases):
        print("partial: run the remaining cases with the same --data", flush=True)
        return
    baseline = max(r["peak_rss_bytes"] for r in cases["model_only"]["ranks"])
    for case in cases.values():
        case["peak_rss_gib_per_rank"] = [round(r["peak_rss_bytes"] / GIB, 3) for r in case["ranks"]]
        case["beyond_model_gib_per_rank"] = [round((r["peak_rss_bytes"] - baseline) / GIB, 3) for r in case["ranks"]]
        case["peak_rss_anon_gib_per_rank"] = [round(r["peak_rss_anon_bytes"] / GIB, 3) for r in case["ranks"]]
    token_bytes = sum(p.stat().st_size for p in cache.glob("*.arrow"))
    record = {
        **provenance(f"{os.cpu_count()}-core {cpu_model()}, CPU ranks (gloo)"),
        "bench": "train_memory",
        "set": {
            "rows": args.rows,
            "mean_tokens": args.tokens,
            "shards": args.shards,
            "parquet_bytes": sum(Path(p).stat().st_size for p in paths.values()),
            "mapped_copy_bytes": token_bytes,
            "generate_s": generate_s,
        },
        "steps": args.steps,
        "ranks": 2,
        "cases": cases,
        "batch_order_identical_small": batch_order_identical(small, cache, args.steps),
        "target": "peak RSS per rank <= 2 GiB beyond the model",
    }
    emit(record, args.out)


def _rows(path: str) -> int:
    import pyarrow.parquet as pq

    return pq.ParquetFile(path).metadata.num_rows


if __name__ == "__main__":
    main()
