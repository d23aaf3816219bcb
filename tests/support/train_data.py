"""Tokenized shards for training tests: demo-task conversations, prompt unsupervised, the whole
assistant turn (think block and end-of-turn token) supervised, in the tokenize stage's schema."""

from __future__ import annotations

import random
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from dflash_pipeline.demo import task
from dflash_pipeline.data.tokenized import TOKENIZED_SCHEMA


def write_tokenized_shard(model_dir: Path, path: Path, count: int, seed: int = 0, heldout_every: int = 0) -> Path:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    rng = random.Random(seed)
    rows = []
    for i in range(count):
        problem = task.sample_problem(rng)
        prompt = f"<|im_start|>user\n{problem.question}<|im_end|>\n<|im_start|>assistant\n"
        response = task.assistant_text(problem, thinking=True) + "<|im_end|>"
        p_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        r_ids = tokenizer(response, add_special_tokens=False)["input_ids"]
        ids = p_ids + r_ids
        mask = [0] * len(p_ids) + [1] * len(r_ids)
        rows.append(
            {
                "id": f"s{seed}-{i}",
                "split": "heldout" if heldout_every and i % heldout_every == 0 else "train",
                "turn": -1,
                "input_ids": ids,
                "loss_mask": mask,
                "num_tokens": len(ids),
                "num_supervised": sum(mask),
                "truncated": False,
            }
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows, schema=TOKENIZED_SCHEMA), path)
    return path
