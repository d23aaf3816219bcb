"""Tokenize stage throughput against the raw batched fast tokenizer on the same conversations.

The stage renders each turn's prompt and prompt+turn with the chat template, tokenizes the pieces
in one batched call, checks the round trip and the quality gate; the raw baseline is one batched
tokenizer call over the full rendered conversations (rendering not timed). Design target: stage
tokens/s >= 0.8 x raw.

    python bench/tokenize_throughput.py --rows 5000 --workers 2 --out bench/results/tokenize_throughput.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from dflash_pipeline.data.tokenize import render  # noqa: E402
from dflash_pipeline.demo.task import sample_problem  # noqa: E402
from dflash_pipeline.generate import GENERATED_SCHEMA  # noqa: E402
from dflash_pipeline.tokenization import ShardTokenizer, _messages  # noqa: E402


def synthetic_rows(n: int) -> list[dict]:
    rng = random.Random(0)
    rows = []
    for i in range(n):
        p = sample_problem(rng)
        rows.append({
            "id": f"r{i}", "shard": 0, "split": "train",
            "messages": [
                {"role": "user", "content": p.question, "reasoning_content": None},
                {"role": "assistant", "content": p.answer, "reasoning_content": p.reasoning},
            ],
            "turns": [{"message_index": 1, "finish_reason": "stop", "think_closed": True,
                       "prompt_tokens": 0, "completion_tokens": 0, "output_ids": None}],
            "prompt_tokens": 0, "completion_tokens": 0, "error": None, "fingerprint": "bench",
        })
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="resources/demo-target")
    parser.add_argument("--rows", type=int, default=5000)
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.model)
    rows = synthetic_rows(args.rows)
    table = pa.Table.from_pylist(rows, schema=GENERATED_SCHEMA)
    texts = [render(tok, _messages(r), False, True) for r in rows]
    results = {}
    for name, workers in (("stage_1_process", 1), ("stage_workers", args.workers)):
        t0 = time.perf_counter()
        raw_ids = tok(texts, add_special_tokens=False)["input_ids"]
        raw_s = time.perf_counter() - t0
        raw_tps = sum(map(len, raw_ids)) / raw_s
        t0 = time.perf_counter()
        _, stats = ShardTokenizer(tok, True, {"identical_response_min_count": 10**9}, workers).run(table, "bench")
        stage_tps = stats["tokens_total"] / (time.perf_counter() - t0)
        results[name] = {"workers": workers, "raw_tokens_per_s": round(raw_tps), "stage_tokens_per_s": round(stage_tps),
                         "ratio": round(stage_tps / raw_tps, 3)}
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    record = {"benchmark": "tokenize_throughput", "rows": args.rows, "tokenizer": "demo (byte-level BPE, 399 tokens)",
              **results, "device": f"cpu {os.cpu_count()} cores {platform.machine()}", "commit": commit,
              "date": time.strftime("%Y-%m-%d")}
    print(json.dumps(record, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
