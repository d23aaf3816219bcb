"""Repetition-loop check throughput on long rows: rows/s and tokens/s of
``repetition.sequences_repetition`` (spans split at ``</think>``, every span measured) on rows of
16k supervised tokens, called as the tokenize stage calls it (once per chunk of rows), next to
the demo tokenizer's own tokens/s on the same texts for scale.

Shapes: `demo-trace`, demo reasoning traces joined (the demo tokenizer's ids; the same line
shapes recur, no loop); `random`, uniformly random ids of a 151k vocabulary (Qwen3-sized; no
k-gram recurs, the fewest candidate periods); `loop`, a 22-token unit with a counter repeated
(every block a loop, the longest runs to measure). Each shape's rows are timed `--repeats`
times; the record keeps the best and the median pass, and the median CPU time of the process (on a
shared machine steadier than wall time).

    python bench/repetition.py --out bench/results/repetition.json
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

import numpy as np
from benchlib import cpu_model, emit, provenance

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from dflash_pipeline.data.quality import DEFAULT_GATE  # noqa: E402
from dflash_pipeline.data.repetition import sequences_repetition  # noqa: E402
from dflash_pipeline.demo.task import sample_problem  # noqa: E402


def demo_rows(tok, rows: int, length: int) -> tuple[list[np.ndarray], list[str]]:
    rng = random.Random(0)
    ids, texts = [], []
    for _ in range(rows):
        text = ""
        while len(text) < 4 * length:  # demo traces: ~3 characters per token
            text += sample_problem(rng).reasoning + "\n"
        row = tok(text, add_special_tokens=False)["input_ids"][:length]
        ids.append(np.array(row, np.int32))
        texts.append(tok.decode(row))
    return ids, texts


def shape_rows(shape: str, rows: int, length: int, tok) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    if shape == "demo-trace":
        return demo_rows(tok, rows, length)[0]
    if shape == "random":
        return [rng.integers(0, 151_000, length).astype(np.int32) for _ in range(rows)]
    unit = rng.integers(1000, 151_000, 22)
    out = []
    for _ in range(rows):
        reps = np.tile(unit, length // 22 + 1)[:length].copy()
        reps[11::22] = 200_000 + np.arange(len(reps[11::22]))  # the counter
        out.append(reps.astype(np.int32))
    return out


def as_response(ids: np.ndarray, think: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """A whole-response row: a 64-token prompt, <think>, most of the ids, </think>, the last 10%."""
    cut = len(ids) * 9 // 10
    seq = np.concatenate([np.full(64, 7), [think[0]], ids[:cut], [think[1]], ids[cut:]]).astype(np.int32)
    mask = np.concatenate([np.zeros(64, np.int8), np.ones(len(seq) - 64, np.int8)])
    return seq, mask


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="resources/demo-target", help="the demo target (its tokenizer)")
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--length", type=int, default=16384)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.model)
    think = tuple(tok.convert_tokens_to_ids(["<think>", "</think>"]))
    results = {}
    for shape in ("demo-trace", "random", "loop"):
        rows = [as_response(ids, think) for ids in shape_rows(shape, args.rows, args.length, tok)]
        tokens = sum(int(m.sum()) for _, m in rows)
        passes, cpu, flagged = [], [], 0
        for _ in range(args.repeats):
            t0, c0 = time.perf_counter(), time.process_time()
            found = sequences_repetition(rows, DEFAULT_GATE, *think)
            passes.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
            flagged = sum(f is not None for f in found)
        results[shape] = {
            "rows": len(rows),
            "supervised_tokens_per_row": tokens // len(rows),
            "flagged_rows": flagged,
            "rows_per_s_best": round(len(rows) / min(passes), 1),
            "rows_per_s_median": round(len(rows) / statistics.median(passes), 1),
            "tokens_per_s_best": round(tokens / min(passes)),
            "ms_per_row_best": round(1000 * min(passes) / len(rows), 2),
            "cpu_ms_per_row_median": round(1000 * statistics.median(cpu) / len(rows), 2),
        }
    # For scale: the demo tokenizer on the demo-trace texts (one batched call, as the stage makes).
    _, texts = demo_rows(tok, min(args.rows, 16), args.length)
    passes, cpu = [], []
    for _ in range(args.repeats):
        t0, c0 = time.perf_counter(), time.process_time()
        encoded = tok(texts, add_special_tokens=False)["input_ids"]
        passes.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    tokens = sum(map(len, encoded))
    results["tokenizer_demo_trace"] = {
        "rows": len(texts),
        "tokens_per_s_best": round(tokens / min(passes)),
        # CPU time of all the tokenizer's threads: on a shared machine steadier than wall time.
        "cpu_ms_per_16k_tokens_median": round(1000 * statistics.median(cpu) * 16384 / tokens, 2),
    }
    record = {
        "benchmark": "repetition",
        "settings": {key: DEFAULT_GATE[key] for key in DEFAULT_GATE if key.startswith("repetition_")},
        "results": results,
        **provenance(f"{cpu_model()}, {os.cpu_count()} cores, {platform.machine()} (shared with other jobs)"),
    }
    emit(record, args.out)


if __name__ == "__main__":
    main()
