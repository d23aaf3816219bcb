"""Tokenize stage throughput against the raw batched fast tokenizer on the same conversations.

The stage renders each turn's prompt and prompt+turn with the chat template, tokenizes the whole
text once (prompt pieces apart, to check them), runs the quality gate and builds the output
table; the raw baseline is one batched tokenizer call (rendering not timed) over the texts the
stage's sequences cover. Design target: stage tokens/s >= 0.8 x raw. A second, leaner baseline is
the tokenizers library's own batch call (ids only, no transformers wrapper): `ratio_to_raw_backend`.

Shapes of data: `short`, the demo's conversations (~85 tokens each, where rendering the chat
template dominates); `long`, the same shape with a thinking trace of 2-4k tokens, as a real
reasoning target produces; `long-engine-ids`, the long rows with the engine's own token ids (as
SGLang and vLLM return them), which the stage keeps after the prompt and round-trips. Raw and
stage runs alternate, `--repeats` times; the recorded ratio is the median of each repeat's
raw/stage time ratio (the machine may be shared), next to the best times of each.

    python bench/tokenize_throughput.py --workers 1 2 --out bench/results/tokenize_throughput.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

from benchlib import cpu_model, emit, provenance

import pyarrow as pa
from tokenizers import Tokenizer

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from dflash_pipeline.data.loss_masks import conversation_pieces, conversation_pieces_many  # noqa: E402
from dflash_pipeline.demo.task import sample_problem  # noqa: E402
from dflash_pipeline.engines.regenerate import GENERATED_SCHEMA  # noqa: E402
from dflash_pipeline.data.tokenized import ShardTokenizer, _messages  # noqa: E402

# Demo reasoning traces per long response: ~2-4k tokens of the demo tokenizer.
LONG_TRACES = (45, 90)


def synthetic_rows(n: int, shape: str = "short") -> list[dict]:
    rng = random.Random(0)
    rows = []
    for i in range(n):
        p = sample_problem(rng)
        reasoning = p.reasoning
        if shape == "long":
            reasoning = "\n".join(sample_problem(rng).reasoning for _ in range(rng.randint(*LONG_TRACES)))
        rows.append(
            {
                "id": f"r{i}",
                "shard": 0,
                "split": "train",
                "messages": [
                    {"role": "user", "content": p.question, "reasoning_content": None},
                    {"role": "assistant", "content": p.answer, "reasoning_content": reasoning},
                ],
                "turns": [
                    {
                        "message_index": 1,
                        "finish_reason": "stop",
                        "think_closed": True,
                        "prompt_tokens": 0,
                        "completion_tokens": 0,
                        "output_ids": None,
                    }
                ],
                "prompt_tokens": 0,
                "completion_tokens": 0,
                "error": None,
                "fingerprint": "bench",
            }
        )
    return rows


def with_engine_ids(tok, rows: list[dict]) -> list[dict]:
    """The rows as an engine that returns its token ids (SGLang, vLLM) leaves them: the stage then
    takes those ids after the rendered prompt and checks their round trip."""
    for row in rows:
        message = row["messages"][1]
        text = f"<think>\n{message['reasoning_content']}\n</think>\n\n{message['content']}"
        row["turns"][0]["output_ids"] = tok(text, add_special_tokens=False)["input_ids"]
    return rows


def measure(tok, rows: list[dict], workers: int, repeats: int) -> dict:
    table = pa.Table.from_pylist(rows, schema=GENERATED_SCHEMA)
    # The texts the stage's sequences cover: each conversation up to its end-of-turn token.
    texts = ["".join(text for text, _ in conversation_pieces(tok, _messages(r), True, True)[0][1]) for r in rows]
    settings = {"identical_response_min_count": 10**9}
    raw_s, backend_s, stage_s, render_s, tokens, degenerate = [], [], [], [], 0, 0
    # The leaner floor: the tokenizers library's own batch call, ids only, no transformers wrapper.
    backend = Tokenizer.from_str(tok.backend_tokenizer.to_str())
    backend.no_padding()
    backend.no_truncation()
    conversations = [_messages(r) for r in rows]
    for _ in range(repeats):
        # The chat-template renderings alone (one process), which the raw baseline does not pay.
        t0 = time.perf_counter()
        conversation_pieces_many(tok, conversations, True, True)
        render_s.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        raw_ids = tok(texts, add_special_tokens=False)["input_ids"]
        raw_s.append(time.perf_counter() - t0)
        tokens = sum(map(len, raw_ids))
        t0 = time.perf_counter()
        backend_ids = [e.ids for e in backend.encode_batch_fast(texts, add_special_tokens=False)]
        backend_s.append(time.perf_counter() - t0)
        if backend_ids != raw_ids:
            raise SystemExit("the backend's ids differ from the tokenizer call's")
        t0 = time.perf_counter()
        _, stats = ShardTokenizer(tok, True, settings, workers).run(table, "bench")
        stage_s.append(time.perf_counter() - t0)
        degenerate = stats["degenerate_samples"]
        # Both must have tokenized the same texts, or the ratio means nothing.
        if stats["tokens_total"] != tokens:
            raise SystemExit(f"stage kept {stats['tokens_total']} tokens, raw tokenized {tokens}")
    raw_tps, stage_tps = tokens / min(raw_s), tokens / min(stage_s)
    # The ratio of each repeat's adjacent raw and stage runs, then the median: on a shared machine
    # the load drifts between repeats, and a ratio of two best times can pair unlike moments.
    paired = statistics.median(r / s for r, s in zip(raw_s, stage_s))
    ceiling = statistics.median(r / (r + d) for r, d in zip(raw_s, render_s))
    return {
        "workers": workers,
        "tokens": tokens,
        "tokens_per_row": round(tokens / len(rows), 1),
        "degenerate_samples": degenerate,
        "raw_tokens_per_s": round(raw_tps),
        "stage_tokens_per_s": round(stage_tps),
        "ratio": round(paired, 3),
        "ratio_of_best_times": round(stage_tps / raw_tps, 3),
        "raw_backend_tokens_per_s": round(tokens / min(backend_s)),
        "ratio_to_raw_backend": round(statistics.median(b / s for b, s in zip(backend_s, stage_s)), 3),
        "render_tokens_per_s": round(tokens / min(render_s)),
        # Best ratio a stage could reach in one process if all it did beyond the raw call were
        # these renderings.
        "ratio_ceiling_rendering": round(ceiling, 3),
        "raw_s": [round(s, 3) for s in raw_s],
        "raw_backend_s": [round(s, 3) for s in backend_s],
        "stage_s": [round(s, 3) for s in stage_s],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="resources/demo-target")
    parser.add_argument("--rows", type=int, default=5000, help="rows of the short shape")
    parser.add_argument("--long-rows", type=int, default=500, help="rows of the long shape")
    parser.add_argument(
        "--shape", nargs="+", choices=["short", "long", "long-engine-ids"], default=["short", "long", "long-engine-ids"]
    )
    parser.add_argument(
        "--workers",
        type=int,
        nargs="+",
        default=[1, os.cpu_count() or 1],
        help="worker processes of the stage, one measurement each",
    )
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.model)
    results = {}
    load_before = os.getloadavg()
    for shape in args.shape:
        rows = synthetic_rows(args.rows if shape == "short" else args.long_rows, shape.split("-")[0])
        if shape == "long-engine-ids":
            rows = with_engine_ids(tok, rows)
        for workers in args.workers:
            results[f"{shape}_{workers}_workers"] = {"rows": len(rows), **measure(tok, rows, workers, args.repeats)}
            print(shape, workers, json.dumps(results[f"{shape}_{workers}_workers"]), file=sys.stderr)
    record = {
        "benchmark": "tokenize_throughput",
        "tokenizer": "demo (byte-level BPE, 399 tokens)",
        "results": results,
        **provenance(f"{cpu_model()}, {os.cpu_count()} cores, {platform.machine()}"),
        # Other work on the machine skews every number; this says how busy it was.
        "load_average_1min": {"start": round(load_before[0], 2), "end": round(os.getloadavg()[0], 2)},
    }
    emit(record, args.out)


if __name__ == "__main__":
    main()
