"""The demo target: task format, tokenizer, Qwen3-style chat template, trained model, cache.

The model comes from the machine's shared cache (``$DFLASH_DEMO_CACHE`` or ~/.cache/...), where
`make test` builds it while the tests that do not need it run (6-20 minutes on two CPU cores, by
their load); a cached build is copied.
"""

from __future__ import annotations

import json
import random

import pytest
import transformers

from dflash_pipeline.demo import build_model, task

SYSTEM = "You are a helpful assistant."
CONVERSATION = [
    {"role": "system", "content": SYSTEM},
    {"role": "user", "content": "What is 12 + 34?"},
    {"role": "assistant", "content": "12 + 34 = 46", "reasoning_content": "2+4=6, write 6"},
    {"role": "user", "content": "Compute 50 - 7."},
]
HISTORY = (
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "<|im_start|>user\nWhat is 12 + 34?<|im_end|>\n"
    # Reasoning of turns before the last user query is dropped, as Qwen3 does.
    "<|im_start|>assistant\n12 + 34 = 46<|im_end|>\n"
    "<|im_start|>user\nCompute 50 - 7.<|im_end|>\n"
)


@pytest.fixture(scope="session")
def cache_dir():
    # The cache every test shares (make test fills it before the tests that need the target).
    return build_model.default_cache_dir()


@pytest.fixture(scope="session")
def demo_dir(tmp_path_factory, cache_dir):
    return build_model.build_demo_model(tmp_path_factory.mktemp("demo") / "target", cache_dir)


@pytest.fixture(scope="session")
def tokenizer(demo_dir):
    return transformers.AutoTokenizer.from_pretrained(demo_dir)


def test_task_responses_follow_the_format():
    rng = random.Random(7)
    for _ in range(50):
        problem = task.sample_problem(rng)
        for thinking in (True, False):
            text = task.assistant_text(problem, thinking)
            assert task.follows_format(text)
            assert task.follows_format(text + task.END_OF_TURN, require_end_of_turn=True)
            assert not task.follows_format(text, require_end_of_turn=True)


@pytest.mark.parametrize(
    "text",
    [
        "",
        "12 + 34 = 46",
        "<think>\n2+4=6\n</think>\n\n",  # no answer
        "<think>\n2+4=6\n</think>\n\n  <|im_end|>",  # blank answer
        "<think>\n2+4=6\n\n12 + 34 = 46",  # think block never closed
        "<think>\n2+4=6\n</think>12 + 34 = 46",  # no blank line after the block
        "<think>\n2+4=6\n</think>\n\n12 + 34 = 46</think>",  # markup in the answer
        "<think>\n2+4=6\n</think>\n\n12 + 34 = 46<|im_end|><|endoftext|>",
    ],
)
def test_off_format_text_is_rejected(text):
    assert not task.follows_format(text)


def test_special_tokens_are_single_ids(tokenizer):
    ids = [tokenizer.encode(token, add_special_tokens=False) for token in task.MARKUP]
    assert all(len(token_ids) == 1 for token_ids in ids), ids
    assert len({token_ids[0] for token_ids in ids}) == len(task.MARKUP)
    assert tokenizer.pad_token == task.END_OF_TEXT
    assert tokenizer.eos_token == task.END_OF_TURN
    assert len(tokenizer) <= 512


def test_chat_template_renders_a_thinking_conversation(tokenizer):
    reply = {"role": "assistant", "content": "50 - 7 = 43", "reasoning_content": "0<7, borrow"}
    rendered = tokenizer.apply_chat_template(CONVERSATION + [reply], tokenize=False)
    assert rendered == (HISTORY + "<|im_start|>assistant\n<think>\n0<7, borrow\n</think>\n\n50 - 7 = 43<|im_end|>\n")
    prompt = tokenizer.apply_chat_template(CONVERSATION, tokenize=False, add_generation_prompt=True)
    assert prompt == HISTORY + "<|im_start|>assistant\n"


def test_chat_template_renders_thinking_off(tokenizer):
    prompt = tokenizer.apply_chat_template(
        CONVERSATION, tokenize=False, add_generation_prompt=True, enable_thinking=False
    )
    assert prompt == HISTORY + "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    reply = {"role": "assistant", "content": "50 - 7 = 43"}
    rendered = tokenizer.apply_chat_template(CONVERSATION + [reply], tokenize=False, enable_thinking=False)
    assert rendered == prompt + "50 - 7 = 43<|im_end|>\n"


def test_greedy_outputs_follow_the_format(demo_dir, tokenizer):
    model = transformers.AutoModelForCausalLM.from_pretrained(demo_dir)
    assert type(model).__name__ == "Qwen3ForCausalLM"
    assert model.config.num_hidden_layers >= 8
    problems = build_model.heldout_problems(40)
    replies = build_model.greedy_responses(model, tokenizer, problems)
    good = [task.follows_format(reply, require_end_of_turn=True) for reply in replies]
    assert sum(good) / len(good) >= 0.95, [r for r, ok in zip(replies, good) if not ok]


def test_build_records_its_provenance(demo_dir):
    info = json.loads((demo_dir / build_model.BUILD_INFO).read_text())
    assert info["source_hash"] == build_model.source_key()
    assert info["seed"] == build_model.SEED
    assert info["format_rate"] >= 0.95


def test_second_build_is_a_cache_hit(demo_dir, cache_dir, tmp_path, monkeypatch):
    def no_training(out_dir):
        raise AssertionError("a cache hit trains nothing")

    monkeypatch.setattr(build_model, "_train_into", no_training)
    again = build_model.build_demo_model(tmp_path / "again", cache_dir)
    weights = "model.safetensors"
    assert (again / weights).read_bytes() == (demo_dir / weights).read_bytes()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp dirs left


def test_training_progress_names_steps_elapsed_and_time_left():
    assert build_model.progress(20, 200, 65) == "step 20/200, 1m05s elapsed, ~9m45s left"
    assert build_model.progress(200, 200, 600) == "step 200/200, 10m00s elapsed, ~0s left"
    assert build_model.progress(0, 200, 0) == "step 0/200, 0s elapsed, ~? left"


def test_two_concurrent_builds_of_one_key_train_once(tmp_path, monkeypatch):
    """The second build waits on the cache entry's lock, then copies the first one's build."""
    import fcntl
    import threading
    from types import SimpleNamespace

    calls = []
    locking = []  # builds that have reached the lock
    both_at_the_lock = threading.Event()

    def flock(fd, operation):
        if operation == fcntl.LOCK_EX:
            locking.append(fd)
            if len(locking) == 2:
                both_at_the_lock.set()
        return fcntl.flock(fd, operation)

    def fake_train(out_dir):
        calls.append(out_dir)
        # Trains until the other build is at the lock: it then finds the cache complete.
        assert both_at_the_lock.wait(timeout=60), "the other build never reached the lock"
        for name in (*build_model.COMPLETE_FILES, build_model.BUILD_INFO):
            (out_dir / name).write_text(name)

    monkeypatch.setattr(build_model, "fcntl", SimpleNamespace(LOCK_EX=fcntl.LOCK_EX, flock=flock))
    monkeypatch.setattr(build_model, "_train_into", fake_train)
    cache = tmp_path / "cache"
    errors = []

    def build(name):
        try:
            build_model.build_demo_model(tmp_path / name, cache)
        except Exception as err:  # noqa: BLE001 (reported below)
            errors.append(err)

    threads = [threading.Thread(target=build, args=(f"out{i}",)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not errors and len(calls) == 1
    for i in range(2):
        assert (tmp_path / f"out{i}" / "config.json").read_text() == "config.json"
    assert (cache / f"demo-target-{build_model.source_key()}.lock").exists()
