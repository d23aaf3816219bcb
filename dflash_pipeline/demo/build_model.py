"""Build the demo target: a tiny Qwen3 trained in 6-20 minutes on two CPU cores (by their load).

The model is a standard Hugging Face checkpoint (``Qwen3ForCausalLM`` + a fast tokenizer with a
Qwen3-style chat template), so every later stage loads it exactly like a real target. It is
trained on ``dflash_pipeline.demo.task`` conversations until its greedy answers keep the task's
response format (think block, answer, end of turn); the arithmetic itself may be wrong.

Builds are cached: the cache key is a hash of this file and ``task.py``, so a change to either
retrains, and anything else reuses ``<cache>/demo-target-<key>/``.

Run by hand: ``python -m dflash_pipeline.demo.build_model --out DIR``.

Its length (over 500 lines): the demo target's tokenizer, model and training are one recipe, and
the model cache is keyed by this file's code; split, a change in another file would reuse a stale
cached model.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import logging
import math
import os
import random
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    GenerationConfig,
    PreTrainedTokenizerFast,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from dflash_pipeline.demo import task
from dflash_pipeline.demo.task import Problem

log = logging.getLogger(__name__)

SEED = 0
VOCAB_SIZE = 512
# Ids 0..3 in this order; the first one pads, the end of turn stops generation.
SPECIAL_TOKENS = (task.END_OF_TEXT, task.TURN_START, task.END_OF_TURN, task.MASK)
# Single tokens too, but not special (as in Qwen3): decoding without special tokens keeps them.
THINK_TOKENS = (task.THINK_START, task.THINK_END)
# Qwen2/3's pre-tokenizer split: digits one by one, words, punctuation runs, newlines, spaces.
PRETOKENIZE_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Eight layers at least: the DFlash drafter taps several distinct target layers.
MODEL_SHAPE = {
    "hidden_size": 128,
    "num_hidden_layers": 8,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "intermediate_size": 384,
    "max_position_embeddings": 512,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    "tie_word_embeddings": False,
}


@dataclass(frozen=True)
class TrainSettings:
    steps: int = 150
    batch_size: int = 32
    lr: float = 3e-3
    warmup_steps: int = 15
    weight_decay: float = 0.01
    thinking_off_fraction: float = 0.2
    system_prompt_fraction: float = 0.3
    tokenizer_corpus: int = 2000
    eval_prompts: int = 120
    eval_batch_size: int = 60
    threads: int = 2
    log_every: int = 10


SETTINGS = TrainSettings()
SYSTEM_PROMPTS = (
    "You are a helpful assistant.",
    "You are a careful math tutor. Show your work.",
    "Answer arithmetic questions.",
)
# Written last into a build: its presence marks the build complete.
BUILD_INFO = "demo_build.json"
COMPLETE_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json")

# Qwen3's chat template, rewritten: tools go into the system turn, tool results become
# <tool_response> blocks of a user turn, and only assistant turns after the last real user
# query keep their reasoning. `enable_thinking=false` pre-fills an empty think block.
CHAT_TEMPLATE = """\
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\\n\\n' }}
    {%- endif %}
    {{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n' }}
    {{- 'You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}
    {%- for tool in tools %}
        {{- '\\n' + (tool | tojson) }}
    {%- endfor %}
    {{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and '
        'arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{"name": '
        '<function-name>, "arguments": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{#- The last user turn that is a real query, not a tool response. #}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == 'user' and message.content is string
          and not (message.content.startswith('<tool_response>')
                   and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- set content = message.content if message.content is string else '' %}
    {%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' }}
    {%- elif message.role == 'assistant' %}
        {%- set reasoning = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning = message.reasoning_content %}
        {%- elif '</think>' in content %}
            {%- set reasoning = content.split('</think>')[0].rstrip('\\n') %}
            {%- set reasoning = reasoning.split('<think>')[-1].lstrip('\\n') %}
            {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index and (loop.last or reasoning) %}
            {{- '<|im_start|>assistant\\n<think>\\n' + reasoning.strip('\\n') }}
            {{- '\\n</think>\\n\\n' + content.lstrip('\\n') }}
        {%- else %}
            {{- '<|im_start|>assistant\\n' + content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls or [] %}
            {%- if not loop.first or content %}
                {{- '\\n' }}
            {%- endif %}
            {%- set call = tool_call.function if tool_call.function else tool_call %}
            {{- '<tool_call>\\n{"name": "' + call.name + '", "arguments": ' }}
            {{- call.arguments if call.arguments is string else call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == 'tool' %}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' + content + '\\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}
"""


@dataclass(frozen=True)
class Example:
    """One training conversation, split where the model's turn starts."""

    problem: Problem
    prompt: str  # rendered by the chat template, generation prompt included
    completion: str  # the assistant's text and end-of-turn token: the only tokens with loss


# --------------------------------------------------------------------------------------------
# Public entry point and cache


def source_key() -> str:
    """Hash of the files that decide the build: change either and the cache misses."""
    digest = hashlib.sha256()
    for path in (Path(task.__file__), Path(__file__)):
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def default_cache_dir() -> Path:
    return Path(os.environ.get("DFLASH_DEMO_CACHE") or Path.home() / ".cache" / "dflash-pipeline")


def build_demo_model(
    out_dir: str | os.PathLike,
    cache_dir: str | os.PathLike | None = None,
    *,
    use_cache: bool = True,
) -> Path:
    """Write the demo target to ``out_dir`` (replacing it) and return that path.

    With the cache on, a complete ``<cache>/demo-target-<key>/`` is copied without training;
    otherwise the model is trained and the build is first published into the cache.
    """
    out_dir = Path(out_dir)
    if not use_cache:
        _publish(out_dir, _train_into, replace=True)
        return out_dir
    cached = Path(cache_dir or default_cache_dir()) / f"demo-target-{source_key()}"
    cached.parent.mkdir(parents=True, exist_ok=True)
    # Concurrent builds of one key (parallel test workers, two runs at once) train once: the
    # others wait on the lock, then copy the finished build.
    with open(cached.parent / f"{cached.name}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if is_complete(cached):
            log.info("demo target cache hit: %s", cached)
        else:
            log.info(
                "demo target not cached; training it into %s (%d steps; 6-20 minutes on 2 CPU cores, by their load)",
                cached,
                SETTINGS.steps,
            )
            _publish(cached, _train_into, replace=False)
    _publish(out_dir, lambda tmp: shutil.copytree(cached, tmp, dirs_exist_ok=True), replace=True)
    return out_dir


def is_complete(build_dir: Path) -> bool:
    return all((build_dir / name).is_file() for name in (*COMPLETE_FILES, BUILD_INFO))


def _publish(target: Path, write, *, replace: bool) -> None:
    """Let ``write`` fill a temp dir beside ``target``, then rename it into place at once.

    Without ``replace`` a complete ``target`` that appeared meanwhile (a concurrent build of
    the same key) is kept and ours dropped.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        write(tmp)
        _apply_umask(tmp)
        if target.exists():
            if not replace and is_complete(target):
                return
            shutil.rmtree(target)
        os.rename(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _apply_umask(tree: Path) -> None:
    """Give a build the usual modes: mkdtemp (and the weights writer) make owner-only files."""
    umask = os.umask(0)
    os.umask(umask)
    tree.chmod(0o777 & ~umask)
    for path in tree.rglob("*"):
        path.chmod((0o777 if path.is_dir() else 0o666) & ~umask)


# --------------------------------------------------------------------------------------------
# Training


def _train_into(out_dir: Path) -> None:
    """Train tokenizer and model from fixed seeds, check the format rate, save everything."""
    started = time.monotonic()
    torch.set_num_threads(SETTINGS.threads)
    random.seed(SEED)
    torch.manual_seed(SEED)

    tokenizer = build_tokenizer()
    examples = training_examples(tokenizer)
    model = new_model(tokenizer)
    final_loss = train(model, tokenizer, examples)
    train_seconds = time.monotonic() - started

    heldout = heldout_problems(SETTINGS.eval_prompts)
    log.info("checking the greedy replies to %d held-out prompts", len(heldout))
    rate = measure_format_rate(model, tokenizer, heldout, batch_size=SETTINGS.eval_batch_size)
    log.info("greedy format rate on %d held-out prompts: %.1f%%", len(heldout), 100 * rate)

    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    info = {
        "source_hash": source_key(),
        "seed": SEED,
        "train_seconds": round(train_seconds, 1),
        "final_loss": round(final_loss, 4),
        "heldout_prompts": len(heldout),
        "format_rate": rate,
        "torch": torch.__version__,
    }
    (out_dir / BUILD_INFO).write_text(json.dumps(info, indent=2) + "\n")


def build_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level BPE trained on task text; every piece of chat markup is one token."""
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(_tokenizer_corpus(), trainer=trainer)
    bpe.add_tokens([AddedToken(token, normalized=False, special=False) for token in THINK_TOKENS])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        pad_token=task.END_OF_TEXT,
        eos_token=task.END_OF_TURN,
        extra_special_tokens=[task.TURN_START, task.MASK],
        model_max_length=MODEL_SHAPE["max_position_embeddings"],
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def _tokenizer_corpus():
    """Texts as the model will see them, markup left out (it is already in the vocabulary)."""
    rng = random.Random(SEED + 2)
    for _ in range(SETTINGS.tokenizer_corpus):
        problem = task.sample_problem(rng)
        turns = [rng.choice(SYSTEM_PROMPTS), "user", problem.question, "assistant"]
        yield "\n".join(turns + [problem.reasoning, "", problem.answer])


def training_problems() -> list[Problem]:
    """Every problem training uses, in order; a stream of its own so it is cheap to replay."""
    rng = random.Random(SEED)
    return [task.sample_problem(rng) for _ in range(SETTINGS.steps * SETTINGS.batch_size)]


def training_examples(tokenizer: PreTrainedTokenizerFast) -> list[Example]:
    """The problems as chat conversations: mostly thinking, some with thinking off."""
    rng = random.Random(SEED + 1)
    return [_example(tokenizer, problem, rng) for problem in training_problems()]


def _example(tokenizer: PreTrainedTokenizerFast, problem: Problem, rng: random.Random) -> Example:
    thinking = rng.random() >= SETTINGS.thinking_off_fraction
    system = rng.choice(SYSTEM_PROMPTS) if rng.random() < SETTINGS.system_prompt_fraction else None
    messages = task.prompt_messages(problem, system)
    reply = {"role": "assistant", "content": problem.answer}
    reply["reasoning_content"] = problem.reasoning if thinking else ""
    render = dict(tokenize=False, enable_thinking=thinking)
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, **render)
    full = tokenizer.apply_chat_template(messages + [reply], **render)
    assert full.startswith(prompt), (prompt, full)
    # What follows the prompt is the reply and its end of turn; the template's newline after it
    # belongs to the next turn and gets no loss.
    completion = full[len(prompt) :].removesuffix("\n")
    assert completion.endswith(task.END_OF_TURN)
    return Example(problem, prompt, completion)


def new_model(tokenizer: PreTrainedTokenizerFast) -> Qwen3ForCausalLM:
    special = {
        "bos_token_id": tokenizer.pad_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }
    config = Qwen3Config(vocab_size=len(tokenizer), **MODEL_SHAPE, **special)
    model = Qwen3ForCausalLM(config)
    # Qwen3's sampling defaults; greedy decoding overrides them with do_sample=False.
    model.generation_config = GenerationConfig(**special, do_sample=True, temperature=0.6, top_p=0.95, top_k=20)
    return model


def train(model: Qwen3ForCausalLM, tokenizer: PreTrainedTokenizerFast, examples: list[Example]) -> float:
    """Next-token prediction with the loss on the assistant's tokens only; returns the last loss."""
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=SETTINGS.lr, betas=(0.9, 0.95), weight_decay=SETTINGS.weight_decay
    )
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, _lr_factor)
    model.train()
    started, loss = time.monotonic(), math.nan
    for step in range(SETTINGS.steps):
        batch = examples[step * SETTINGS.batch_size : (step + 1) * SETTINGS.batch_size]
        loss = model(**_collate(tokenizer, batch)).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        if (step + 1) % SETTINGS.log_every == 0 or step + 1 == SETTINGS.steps:
            log.info("%s  loss %.4f", progress(step + 1, SETTINGS.steps, time.monotonic() - started), loss.item())
    model.eval()
    return loss.item()


def progress(done: int, total: int, elapsed: float) -> str:
    """``step 20/200, 1m05s elapsed, ~9m45s left``: the rest estimated at the mean pace so far
    (the longest part of a first `make demo`, so the user sees how long it will take)."""
    left = elapsed / done * (total - done) if done else math.nan
    return f"step {done}/{total}, {_duration(elapsed)} elapsed, ~{_duration(left)} left"


def _duration(seconds: float) -> str:
    if math.isnan(seconds):
        return "?"
    minutes, secs = divmod(round(seconds), 60)
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


def _lr_factor(step: int) -> float:
    """Linear warmup, then cosine decay to a tenth of the peak."""
    if step < SETTINGS.warmup_steps:
        return (step + 1) / SETTINGS.warmup_steps
    progress = (step - SETTINGS.warmup_steps) / max(1, SETTINGS.steps - SETTINGS.warmup_steps)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))


def _collate(tokenizer: PreTrainedTokenizerFast, batch: list[Example]) -> dict[str, torch.Tensor]:
    """Right-padded ids; labels are -100 on prompt and padding.

    Prompt and completion are tokenized apart, as at inference where the prompt is encoded
    alone and the model continues it.
    """
    prompts = tokenizer([e.prompt for e in batch], add_special_tokens=False)["input_ids"]
    replies = tokenizer([e.completion for e in batch], add_special_tokens=False)["input_ids"]
    width = max(len(p) + len(r) for p, r in zip(prompts, replies))
    ids = torch.full((len(batch), width), tokenizer.pad_token_id)
    labels = torch.full((len(batch), width), -100)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for row, (prompt, reply) in enumerate(zip(prompts, replies)):
        length = len(prompt) + len(reply)
        ids[row, :length] = torch.tensor(prompt + reply)
        labels[row, len(prompt) : length] = torch.tensor(reply)
        mask[row, :length] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


# --------------------------------------------------------------------------------------------
# Evaluation


def heldout_problems(count: int) -> list[Problem]:
    """Problems whose arithmetic (the answer line) the demo target never saw in training."""
    seen = {problem.answer for problem in training_problems()}
    rng, problems = random.Random(SEED + 3), []
    while len(problems) < count:
        problem = task.sample_problem(rng)
        if problem.answer not in seen:
            problems.append(problem)
    return problems


@torch.no_grad()
def greedy_responses(
    model, tokenizer, problems: list[Problem], *, batch_size: int = 60, max_new_tokens: int = 128
) -> list[str]:
    """Greedy replies to thinking-mode prompts, each cut after its first end-of-turn token."""
    replies = []
    for start in range(0, len(problems), batch_size):
        chunk = problems[start : start + batch_size]
        prompts = [
            tokenizer.apply_chat_template(task.prompt_messages(p), tokenize=False, add_generation_prompt=True)
            for p in chunk
        ]
        inputs = _left_padded(tokenizer, prompts)
        output = model.generate(
            **inputs,
            do_sample=False,
            max_new_tokens=max_new_tokens,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
        for row in output[:, inputs["input_ids"].shape[1] :].tolist():
            if tokenizer.eos_token_id in row:
                row = row[: row.index(tokenizer.eos_token_id) + 1]
            replies.append(tokenizer.decode(row, skip_special_tokens=False))
    return replies


def _left_padded(tokenizer, prompts: list[str]) -> dict[str, torch.Tensor]:
    """Batch prompts padded on the left, so every row's generation starts at the same column."""
    side, tokenizer.padding_side = tokenizer.padding_side, "left"
    try:
        return tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    finally:
        tokenizer.padding_side = side


def measure_format_rate(model, tokenizer, problems: list[Problem], *, batch_size: int = 60) -> float:
    """Share of greedy replies that keep the task format and end their turn."""
    replies = greedy_responses(model, tokenizer, problems, batch_size=batch_size)
    good = [task.follows_format(r, require_end_of_turn=True) for r in replies]
    for reply, ok in zip(replies, good):
        if not ok:
            log.debug("off-format reply: %r", reply)
    return sum(good) / len(good)


# --------------------------------------------------------------------------------------------
# Command line


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, type=Path, help="directory to write the model to")
    parser.add_argument("--cache-dir", type=Path, help="build cache (default: $DFLASH_DEMO_CACHE or ~/.cache/...)")
    parser.add_argument("--no-cache", action="store_true", help="train even if a build is cached")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    started = time.monotonic()
    out = build_demo_model(args.out, args.cache_dir, use_cache=not args.no_cache)
    log.info("demo target written to %s in %.1fs", out, time.monotonic() - started)
    return 0


if __name__ == "__main__":
    sys.exit(main())
