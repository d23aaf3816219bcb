"""The demo's bundled prompt set (``data/demo/prompts.jsonl``), reproducible from a seed.

It exercises what the prepare stage must handle on real data, at a size a CPU can push through
the whole pipeline in minutes: both row shapes (OpenAI ``messages`` and ShareGPT
``conversations``), system prompts, multi-turn conversations whose old assistant turns will be
regenerated, exact duplicates (dropped), and a few bad rows (quarantined, under the limit).

    python -m dflash_pipeline.demo.prompt_set --out data/demo/prompts.jsonl
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from dflash_pipeline.demo.task import assistant_text, sample_problem

SYSTEM_PROMPTS = ("You are a careful calculator.", "Show your steps, then answer.")
SHAREGPT_ROLE = {"system": "system", "user": "human", "assistant": "gpt"}


def _conversation(rng: random.Random) -> list[dict[str, str]]:
    messages = []
    if rng.random() < 0.2:
        messages.append({"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
    first = sample_problem(rng)
    messages.append({"role": "user", "content": first.question})
    if rng.random() < 0.15:  # multi-turn: an old answer, then a follow-up question
        messages.append({"role": "assistant", "content": assistant_text(first, thinking=False)})
        messages.append({"role": "user", "content": sample_problem(rng).question})
    return messages


def _as_sharegpt(messages: list[dict[str, str]]) -> dict:
    return {"conversations": [{"from": SHAREGPT_ROLE[m["role"]], "value": m["content"]} for m in messages]}


def demo_rows(n: int = 160, seed: int = 20261202) -> list[str]:
    """``n`` JSONL lines: mostly valid prompts, two exact duplicates and two bad rows."""
    rng = random.Random(seed)
    lines = []
    for i in range(n - 4):
        messages = _conversation(rng)
        row = _as_sharegpt(messages) if rng.random() < 0.3 else {"messages": messages}
        row["id"] = f"demo-{i:04d}"
        lines.append(json.dumps(row, ensure_ascii=False))
    duplicate = json.loads(lines[3])
    duplicate["id"] = "demo-dup-1"  # same prompt turns as demo-0003: dropped as a duplicate
    lines.append(json.dumps(duplicate))
    lines.append(lines[10].replace('"demo-0010"', '"demo-dup-2"'))
    lines.append('{"messages": [{"role": "user", "content": "What is 12 + 30?"}')  # cut short
    lines.append(json.dumps({"messages": [{"role": "narrator", "content": "Once upon a time"}]}))
    rng.shuffle(lines)
    return lines


def write_demo_prompts(path: str | Path, n: int = 160, seed: int = 20261202) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(demo_rows(n, seed)) + "\n", encoding="utf-8")
    return path


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="data/demo/prompts.jsonl")
    parser.add_argument("-n", type=int, default=160)
    args = parser.parse_args()
    print(write_demo_prompts(args.out, args.n))
