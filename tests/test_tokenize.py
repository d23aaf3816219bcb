"""Exact ids and loss masks against hand-built expectations (the data-quality gate's cases are in
tests/test_quality.py)."""

from __future__ import annotations


import pyarrow as pa
import pytest

from dflash_pipeline.data.loss_masks import conversation_sequences
from dflash_pipeline.engines.regenerate import GENERATED_SCHEMA
from dflash_pipeline.data.tokenized import ShardTokenizer
from tests.support.generated_rows import generated_row, healthy


def pieces(tok, *parts):
    """Expected ids and mask from (text, supervised) pieces tokenized one by one."""
    ids, mask = [], []
    for text, supervised in parts:
        piece = tok(text, add_special_tokens=False)["input_ids"]
        ids += piece
        mask += [int(supervised)] * len(piece)
    return ids, mask


def only(seqs):
    assert len(seqs) == 1
    return seqs[0][1]


def test_single_turn_thinking_with_system_prompt(tok):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 12 + 30?"},
        {"role": "assistant", "content": "12 + 30 = 42", "reasoning_content": "2+0=2, write 2\n1+3=4, write 4"},
    ]
    seq = only(conversation_sequences(tok, messages, thinking=True, per_turn=True))
    assert (seq.input_ids, seq.loss_mask) == pieces(
        tok,
        (
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 12 + 30?<|im_end|>\n<|im_start|>assistant\n",
            0,
        ),
        ("<think>\n2+0=2, write 2\n1+3=4, write 4\n</think>\n\n12 + 30 = 42<|im_end|>", 1),
    )
    assert seq.input_ids[-1] == tok.convert_tokens_to_ids("<|im_end|>") and seq.loss_mask[-1] == 1
    assert seq.round_trip_ok(tok)


def test_thinking_off_supervises_the_answer_not_the_empty_think_block_of_the_prompt(tok):
    messages = [
        {"role": "user", "content": "Add 5 and 7."},
        {"role": "assistant", "content": "5 + 7 = 12"},
    ]
    seq = only(conversation_sequences(tok, messages, thinking=False, per_turn=True))
    rendered = tok.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=True, enable_thinking=False)
    assert rendered.endswith("<think>\n\n</think>\n\n")  # scaffolding of the prompt: not supervised
    assert (seq.input_ids, seq.loss_mask) == pieces(tok, (rendered, 0), ("5 + 7 = 12<|im_end|>", 1))


def test_multi_turn_gives_one_row_per_turn_when_the_template_drops_old_reasoning(tok):
    messages = [
        {"role": "user", "content": "What is 1 + 2?"},
        {"role": "assistant", "content": "1 + 2 = 3", "reasoning_content": "1+2=3, write 3"},
        {"role": "user", "content": "And 2 + 2?"},
        {"role": "assistant", "content": "2 + 2 = 4", "reasoning_content": "2+2=4, write 4"},
    ]
    (i1, first), (i2, second) = conversation_sequences(tok, messages, thinking=True, per_turn=True)
    assert (i1, i2) == (1, 3)
    assert (first.input_ids, first.loss_mask) == pieces(
        tok,
        ("<|im_start|>user\nWhat is 1 + 2?<|im_end|>\n<|im_start|>assistant\n", 0),
        ("<think>\n1+2=3, write 3\n</think>\n\n1 + 2 = 3<|im_end|>", 1),
    )
    # In the second row the first answer is history, rendered as the template renders it:
    # without its reasoning, and not supervised.
    assert (second.input_ids, second.loss_mask) == pieces(
        tok,
        (
            "<|im_start|>user\nWhat is 1 + 2?<|im_end|>\n<|im_start|>assistant\n1 + 2 = 3<|im_end|>\n"
            "<|im_start|>user\nAnd 2 + 2?<|im_end|>\n<|im_start|>assistant\n",
            0,
        ),
        ("<think>\n2+2=4, write 4\n</think>\n\n2 + 2 = 4<|im_end|>", 1),
    )


def test_tool_turns_are_never_supervised(tok):
    messages = [
        {"role": "user", "content": "What is 40 + 2?"},
        {"role": "assistant", "content": "Let me check.", "reasoning_content": "use the tool"},
        {"role": "tool", "content": "42"},
        {"role": "assistant", "content": "40 + 2 = 42", "reasoning_content": "the tool said 42"},
    ]
    rows = conversation_sequences(tok, messages, thinking=True, per_turn=True)
    last = rows[-1][1]
    supervised = tok.decode([i for i, m in zip(last.input_ids, last.loss_mask) if m])
    assert supervised == "<think>\nthe tool said 42\n</think>\n\n40 + 2 = 42<|im_end|>"
    prompt = tok.decode([i for i, m in zip(last.input_ids, last.loss_mask) if not m])
    assert "42" in prompt and "<tool_response>" in prompt


CHATML = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_one_row_per_conversation_supervises_every_turn_with_a_stable_template(tok):
    import copy

    from dflash_pipeline.data.loss_masks import needs_rows_per_turn

    plain = copy.deepcopy(tok)
    plain.chat_template = CHATML
    assert not needs_rows_per_turn(plain)
    messages = [
        {"role": "user", "content": "What is 1 + 2?"},
        {"role": "assistant", "content": "1 + 2 = 3"},
        {"role": "user", "content": "And 2 + 2?"},
        {"role": "assistant", "content": "2 + 2 = 4"},
    ]
    seq = only(conversation_sequences(plain, messages, thinking=False, per_turn=False))
    assert (seq.input_ids, seq.loss_mask) == pieces(
        plain,
        ("<|im_start|>user\nWhat is 1 + 2?<|im_end|>\n<|im_start|>assistant\n", 0),
        ("1 + 2 = 3<|im_end|>", 1),
        ("\n<|im_start|>user\nAnd 2 + 2?<|im_end|>\n<|im_start|>assistant\n", 0),
        ("2 + 2 = 4<|im_end|>", 1),
        ("\n", 0),
    )


def test_a_template_whose_turns_change_later_is_refused_as_one_row(tok):
    from dflash_pipeline.data.loss_masks import TemplateMismatch

    messages = [
        {"role": "user", "content": "What is 1 + 2?"},
        {"role": "assistant", "content": "1 + 2 = 3"},
        {"role": "user", "content": "And 2 + 2?"},
        {"role": "assistant", "content": "2 + 2 = 4"},
    ]
    with pytest.raises(TemplateMismatch):
        conversation_sequences(tok, messages, thinking=False, per_turn=False)


def test_one_tokenization_of_the_whole_text_gives_the_piecewise_ids_and_masks(tok):
    """The stage tokenizes each whole text once and places the boundaries by offsets: on
    conversations with system prompts, non-ASCII text, several turns and tool results, the ids
    and masks are those of the pieces tokenized one by one, without falling back."""
    from dflash_pipeline.data.loss_masks import conversation_pieces_many, encode_pieces, tokenize_pieces

    conversations = [
        [
            {"role": "system", "content": "Réponds vite — 😀 "},
            {"role": "user", "content": "What is 12 + 30?"},
            {"role": "assistant", "content": "12 + 30 = 42 ✓", "reasoning_content": "2+0=2, write 2\n1+3=4, write 4"},
        ],
        [
            {"role": "user", "content": "What is 40 + 2?"},
            {"role": "assistant", "content": "Let me check.", "reasoning_content": "use the tool"},
            {"role": "tool", "content": "42"},
            {"role": "assistant", "content": "40 + 2 = 42\n", "reasoning_content": "the tool said 42"},
            {"role": "user", "content": "  And 2 + 2?"},
            {"role": "assistant", "content": " 2 + 2 = 4", "reasoning_content": "2+2=4, write 4"},
        ],
    ]
    without_reasoning = [[{"role": m["role"], "content": m["content"]} for m in c] for c in conversations]
    for thinking, given in ((True, conversations), (False, without_reasoning)):
        found = conversation_pieces_many(tok, given, thinking, per_turn=True)
        all_pieces = [parts for rows in found for _, parts in rows]
        assert len(all_pieces) == 4
        encoded = encode_pieces(tok, all_pieces)
        for e, expected in zip(encoded, tokenize_pieces(tok, all_pieces)):
            assert not e.fell_back and e.round_trip_ok
            assert (e.input_ids.tolist(), e.loss_mask.tolist()) == (expected.input_ids, expected.loss_mask)


def test_a_boundary_inside_a_token_falls_back_to_the_pieces_and_is_a_template_mismatch(tok):
    import copy

    from dflash_pipeline.data.loss_masks import conversation_pieces, encode_pieces

    plain = copy.deepcopy(tok)
    plain.chat_template = CHATML
    # The prompt ends with "\n" and the answer starts with "\n": the whole text merges them
    # into one token, so no token starts where the answer does. One turn (boundary found by the
    # prompt's tokens) and two turns in one row (boundaries found by offsets).
    first = [{"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "\n2 + 2 = 4"}]
    second = [{"role": "user", "content": "What is 1 + 1?"}, {"role": "assistant", "content": "1 + 1 = 2"}] + first
    for messages in (first, second):
        ((_, parts),) = conversation_pieces(plain, messages, thinking=False, per_turn=False)
        (encoded,) = encode_pieces(plain, [parts])
        assert encoded.fell_back and not encoded.round_trip_ok
        # The fallback keeps the pieces tokenized apart, as the round-trip check reports them.
        assert (encoded.input_ids.tolist(), encoded.loss_mask.tolist()) == pieces(plain, *parts)


def test_the_stage_writes_live_telemetry_and_the_table_matches_the_stats(tok, demo_model, tmp_path):
    import json

    import pyarrow.parquet as pq

    from dflash_pipeline.core.jobstate import ShardProgress
    from dflash_pipeline.core.storage import open_storage
    from dflash_pipeline.stages.tokenize import tokenize_file

    rows = [healthy(i) for i in range(30)] + [generated_row(90, "", "", error="gave up")]
    pq.write_table(pa.Table.from_pylist(rows, schema=GENERATED_SCHEMA), tmp_path / "generated-00003.parquet")
    run = tmp_path / "run"
    run.mkdir()
    summary = tokenize_file(
        str(tmp_path / "generated-00003.parquet"),
        str(demo_model),
        str(tmp_path / "tok.parquet"),
        str(tmp_path / "tok.stats.json"),
        True,
        {},
        run_url=str(run),
        shard=3,
        workers=1,
    )
    telemetry = ShardProgress(open_storage(str(run)), "tokenize", 3).read_telemetry()
    assert telemetry["state"] == "done" and telemetry["stage"] == "tokenize"
    assert telemetry["samples_done"] == telemetry["samples_total"] == 31
    assert telemetry["tokens_per_s"] > 0 and telemetry["eta_s"] == 0
    out = pq.read_table(tmp_path / "tok.parquet")
    assert out.num_rows == summary["sequences_out"] == 30
    assert sum(map(len, out.column("input_ids").to_pylist())) == summary["tokens_total"]
    assert summary["offset_fallbacks"] == 0 and summary["round_trip_mismatches"] == 0
    assert json.loads((tmp_path / "tok.stats.json").read_text()) == summary


def test_worker_processes_give_the_same_table_and_stats_as_one_process(tok):
    loop = "1+1=2, write 2 " * 40
    rows = [healthy(i) for i in range(36)]
    rows += [generated_row(200, "", "", error="gave up"), generated_row(203, "ok", loop)]
    table = pa.Table.from_pylist(rows, schema=GENERATED_SCHEMA)
    settings = {"max_degenerate_fraction": 0.5, "max_length": 200}  # cuts the loop row only
    one = ShardTokenizer(tok, thinking=True, settings=settings).run(table, "g")
    progress = []
    spread = ShardTokenizer(tok, thinking=True, settings=settings, workers=2, chunk_rows=8).run(
        table, "g", on_progress=lambda done, tokens: progress.append(done)
    )
    assert spread[0].equals(one[0]) and spread[1] == one[1]
    assert one[1]["truncated_sequences"] == 1 and one[1]["reasons"]["repetition_loop"] == 1
    # 37 rows to tokenize over 2 workers: chunks of 5 (four per worker at least); the error row
    # counts as done from the start.
    assert progress == [6, 11, 16, 21, 26, 31, 36, 38]


def test_engine_ids_are_kept_after_the_prompt_and_a_non_canonical_split_is_a_mismatch(tok):
    reasoning = "1+1=2, write 2\n2+2=4, write 4\n3+3=6, write 6"
    text = f"<think>\n{reasoning}\n</think>\n\n1 + 1 = 2"
    canonical = generated_row(1, "1 + 1 = 2", reasoning)
    canonical["turns"][0]["output_ids"] = tok(text, add_special_tokens=False)["input_ids"]
    # The same text with every merged token spelled out in its base byte-level tokens: it decodes
    # the same but is not how the tokenizer splits it.
    split = generated_row(2, "1 + 1 = 2", reasoning)
    added = set(tok.get_added_vocab())
    spelled = [
        [token] if token in added else list(token)
        for token in tok.convert_ids_to_tokens(canonical["turns"][0]["output_ids"])
    ]
    split["turns"][0]["output_ids"] = tok.convert_tokens_to_ids([t for parts in spelled for t in parts])
    assert len(split["turns"][0]["output_ids"]) > len(canonical["turns"][0]["output_ids"])
    # The engine wrote a blank line the template strips from stored reasoning: its ids are not
    # the rendering's tokens, but they are the tokenizer's own split of their text, so they stay.
    blank = generated_row(3, "1 + 1 = 2", reasoning)
    blank["turns"][0]["output_ids"] = tok(text.replace("<think>\n", "<think>\n\n"), add_special_tokens=False)[
        "input_ids"
    ]
    rows = [healthy(i) for i in range(20, 40)] + [canonical, split, blank]
    out, stats = ShardTokenizer(tok, thinking=True, settings={"max_degenerate_fraction": 0.5}).run(
        pa.Table.from_pylist(rows, schema=GENERATED_SCHEMA), "g"
    )
    assert stats["examples"]["template_mismatch"] == ["s2"] and stats["round_trip_mismatches"] == 1
    kept = {r["id"]: r for r in out.to_pylist()}
    prompt = tok.apply_chat_template(
        canonical["messages"][:1], tokenize=False, add_generation_prompt=True, enable_thinking=True
    )
    assert (kept["s1"]["input_ids"], kept["s1"]["loss_mask"]) == pieces(tok, (prompt, 0), (text + "<|im_end|>", 1))
    engine_text = text.replace("<think>\n", "<think>\n\n") + "<|im_end|>"
    prompt = tok.apply_chat_template(
        blank["messages"][:1], tokenize=False, add_generation_prompt=True, enable_thinking=True
    )
    assert (kept["s3"]["input_ids"], kept["s3"]["loss_mask"]) == pieces(tok, (prompt, 0), (engine_text, 1))


def split_in_two(tokenizer, ids):
    """``ids`` with their first merged token replaced by two vocabulary tokens that spell it:
    the same text, an engine's possible output, but not the tokenizer's split of it."""
    vocab, added = tokenizer.get_vocab(), set(tokenizer.get_added_vocab())
    tokens = tokenizer.convert_ids_to_tokens(ids)
    for k, token in enumerate(tokens):
        if token in added:
            continue
        for cut in range(1, len(token)):
            head, tail = token[:cut], token[cut:]
            if head in vocab and tail in vocab:
                return ids[:k] + [vocab[head], vocab[tail]] + ids[k + 1 :]
    raise AssertionError("no token of the text is a merge of two others")


def test_the_stage_supervises_the_engines_ids_not_the_tokens_of_the_stored_text(tok, demo_model, tmp_path):
    """The tokenize stage, parquet in and out: a turn whose engine split one word in two tokens
    (the same text, which tokenized again gives the tokenizer's own split) is supervised on
    exactly the engine's ids; the same row without ids, on its text's tokens. Were the ids
    ignored, both rows would come out alike."""
    import json

    import pyarrow.parquet as pq

    from dflash_pipeline.stages.tokenize import main

    reasoning = "1+1=2, write 2\n2+2=4, write 4"
    text = f"<think>\n{reasoning}\n</think>\n\n1 + 1 = 2"
    eos = tok.eos_token_id
    canonical = tok(text, add_special_tokens=False)["input_ids"]
    engine = split_in_two(tok, canonical)
    # The premise: the engine's ids spell the stored text, and re-tokenizing it does not give them.
    assert tok.decode(engine) == tok.decode(canonical) == text
    assert tok(tok.decode(engine), add_special_tokens=False)["input_ids"] == canonical != engine
    with_ids = generated_row(1, "1 + 1 = 2", reasoning)
    with_ids["turns"][0]["output_ids"] = engine + [eos]
    without_ids = {**generated_row(1, "1 + 1 = 2", reasoning), "id": "s1-text"}
    generated = tmp_path / "generate-00000.parquet"
    pq.write_table(pa.Table.from_pylist([with_ids, without_ids], schema=GENERATED_SCHEMA), generated)
    # Kept by choice: the round trip flags a split the tokenizer would not give (template_mismatch).
    reasons = [r for r in ShardTokenizer(tok, True).cfg["degenerate_reasons"] if r != "template_mismatch"]
    settings = {**LENIENT, "degenerate_reasons": reasons}
    out, stats = tmp_path / "tokenize-00000.parquet", tmp_path / "tokenize-00000.stats.json"
    argv = [str(generated), "--model", str(demo_model), "--out", str(out), "--stats", str(stats)]
    assert main([*argv, "--settings-json", json.dumps(settings), "--workers", "1"]) == 0
    rows = {r["id"]: r for r in pq.read_table(out).to_pylist()}
    prompt = tok.apply_chat_template(
        with_ids["messages"][:1], tokenize=False, add_generation_prompt=True, enable_thinking=True
    )
    prompt_ids = tok(prompt, add_special_tokens=False)["input_ids"]
    assert (rows["s1"]["input_ids"], rows["s1"]["loss_mask"]) == joined((prompt_ids, 0), (engine + [eos], 1))
    assert (rows["s1-text"]["input_ids"], rows["s1-text"]["loss_mask"]) == joined(
        (prompt_ids, 0), (canonical + [eos], 1)
    )
    assert json.loads(stats.read_text())["round_trip_mismatches"] == 1


# --------------------------------------------------------------------------------------------
# Special-token literals in generated text, turns cut at the token limit, the real Qwen3 tokenizer

# Every row is kept unless a test says otherwise: these tests look at ids and masks.
LENIENT = {"max_degenerate_fraction": 1.0, "min_supervised_tokens": 1, "identical_response_min_count": 1000}
BOTH_TOKENIZERS = pytest.mark.parametrize("tokenizer_name", ["tok", "qwen3_tokenizer"])


def conversation_row(name, messages, output_ids=None, cut=None):
    """A generated row in which every assistant message is a generated turn; ``cut`` maps the
    index of a turn the engine cut at the token limit to whether its think block had closed;
    ``output_ids`` are the engine's ids of a single-turn row."""
    cut = cut or {}
    turns = [
        {
            "message_index": i,
            "finish_reason": "length" if i in cut else "stop",
            "think_closed": cut.get(i, True),
            "prompt_tokens": 10,
            "completion_tokens": 10,
            "output_ids": output_ids,
        }
        for i, m in enumerate(messages)
        if m["role"] == "assistant"
    ]
    return {
        "id": name,
        "shard": 0,
        "split": "train",
        "messages": [
            {"role": m["role"], "content": m["content"], "reasoning_content": m.get("reasoning_content")}
            for m in messages
        ],
        "turns": turns,
        "prompt_tokens": 10,
        "completion_tokens": 10,
        "error": None,
        "fingerprint": "f",
    }


def tokenized(tokenizer, rows, thinking, **settings):
    """The stage's output as {(id, turn): (input_ids, loss_mask)}, and its stats."""
    table = pa.Table.from_pylist(rows, schema=GENERATED_SCHEMA)
    out, stats = ShardTokenizer(tokenizer, thinking, {**LENIENT, **settings}).run(table, "g")
    return {(r["id"], r["turn"]): (r["input_ids"], r["loss_mask"]) for r in out.to_pylist()}, stats


def engine_ids(tokenizer, generated, stopped):
    """The ids an engine returns for ``generated``: a literal special token in it is spelled in
    ordinary tokens (a generated special token would be one id), and the end-of-turn id ends a
    turn that stopped."""
    ids = tokenizer(generated, add_special_tokens=False, split_special_tokens=True)["input_ids"]
    return ids + [tokenizer.eos_token_id] * stopped


def as_generated(tokenizer, name, history, generated, thinking, finish, with_ids):
    """The row ``engines/regenerate.py`` stores for one turn whose engine wrote ``generated``
    (the text as the model produced it; a stopped turn's engine text ends with the end-of-turn
    token, which the split removes): with the engine's ids, or without (transformers serve)."""
    from dflash_pipeline.data.chat import assistant_message, render_prompt, split_reasoning

    prompt = render_prompt(tokenizer, history, thinking)
    stopped = finish == "stop"
    split = split_reasoning(prompt, generated + tokenizer.eos_token * stopped, tokenizer.eos_token)
    row = conversation_row(name, [*history, assistant_message(split)])
    row["turns"][0].update(
        finish_reason=finish,
        think_closed=split.think_closed,
        output_ids=engine_ids(tokenizer, generated, stopped) if with_ids else None,
    )
    return row, prompt


# (thinking, what the model generated, finish reason). Each text is what the stored row gives
# back: split_reasoning strips the newlines around the reasoning and the spaces around the answer.
GENERATIONS = [
    (True, "<think>\nFirst 2 + 2: add the units, so 2", "length"),  # cut inside the think block
    (True, "<think>\n", "length"),  # cut right after opening it
    (True, "<think>\n2 + 2 = 4\n</think>\n\n", "length"),  # cut right after closing it
    (True, "<think>\n2 + 2 = 4\n</think>\n\nThe sum is 4, because 2", "length"),  # cut in the answer
    (True, "<think>\n2 + 2 = 4\n</think>\n\nThe sum is 4.", "stop"),
    (False, "The sum of 2 and 2 is", "length"),
    (False, "The sum is 4.", "stop"),
]


@BOTH_TOKENIZERS
def test_a_turn_gives_the_same_ids_and_mask_from_the_engine_ids_and_from_its_text(tokenizer_name, request):
    """A turn cut at the token limit is supervised on exactly the tokens the model produced,
    not on the think-block end and end-of-turn token the template adds to close it; a stopped
    turn ends with the end-of-turn token. Both paths agree."""
    tokenizer = request.getfixturevalue(tokenizer_name)
    history = [{"role": "user", "content": "What is 2 + 2?"}]
    for thinking in (True, False):
        rows, expected = [], {}
        for k, (mode, generated, finish) in enumerate(GENERATIONS):
            if mode != thinking:
                continue
            for with_ids in (True, False):
                name = f"{'engine' if with_ids else 'text'}-{k}"
                row, prompt = as_generated(tokenizer, name, history, generated, thinking, finish, with_ids)
                rows.append(row)
                supervised = generated + tokenizer.eos_token * (finish == "stop")
                expected[(name, -1)] = pieces(tokenizer, (prompt, 0), (supervised, 1))
        got, stats = tokenized(tokenizer, rows, thinking)
        assert stats["reasons"] == {} and stats["round_trip_mismatches"] == 0
        assert got == expected
        for key in expected:
            if key[0].startswith("engine"):
                assert got[key] == got[("text" + key[0][len("engine") :], -1)]


def test_a_cut_turn_in_a_conversation_is_supervised_as_generated_and_is_history_as_rendered(qwen3_tokenizer):
    tok = qwen3_tokenizer
    messages = [
        {"role": "user", "content": "What is 2 + 2?"},
        {"role": "assistant", "content": "", "reasoning_content": "Let me think about"},
        {"role": "user", "content": "Just the answer, please."},
        {"role": "assistant", "content": "4", "reasoning_content": "They want it short."},
    ]
    got, _ = tokenized(tok, [conversation_row("c", messages, cut={1: False})], thinking=True)
    assert got[("c", 1)] == pieces(
        tok,
        ("<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n", 0),
        ("<think>\nLet me think about", 1),
    )
    # The engine's prompt for the next turn rendered the cut turn as the template does.
    assert got[("c", 3)] == pieces(
        tok,
        (
            "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n<|im_end|>\n"
            "<|im_start|>user\nJust the answer, please.<|im_end|>\n<|im_start|>assistant\n",
            0,
        ),
        ("<think>\nThey want it short.\n</think>\n\n4<|im_end|>", 1),
    )


def test_a_cut_turn_in_one_row_per_conversation_leaves_the_template_closing_unsupervised(tok):
    import copy

    plain = copy.deepcopy(tok)
    plain.chat_template = CHATML
    messages = [
        {"role": "user", "content": "What is 1 + 2?"},
        {"role": "assistant", "content": "1 + 2 is"},
        {"role": "user", "content": "Go on."},
        {"role": "assistant", "content": "3"},
    ]
    seq = only(conversation_sequences(plain, messages, thinking=False, per_turn=False, cut={1: "content"}))
    # The end of turn the template adds to the cut turn is history for the next one.
    assert (seq.input_ids, seq.loss_mask) == pieces(
        plain,
        ("<|im_start|>user\nWhat is 1 + 2?<|im_end|>\n<|im_start|>assistant\n", 0),
        ("1 + 2 is", 1),
        ("<|im_end|>\n<|im_start|>user\nGo on.<|im_end|>\n<|im_start|>assistant\n", 0),
        ("3<|im_end|>", 1),
        ("\n", 0),
    )


def test_special_tokens_are_the_special_ones_not_the_think_tags(tok, qwen3_tokenizer):
    from dflash_pipeline.data.loss_masks import special_token_texts

    assert set(special_token_texts(tok)) == {"<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>"}
    qwen3 = set(special_token_texts(qwen3_tokenizer))
    assert {"<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_pad|>"} <= qwen3 and len(qwen3) == 14
    assert not qwen3 & {"<think>", "</think>", "<tool_call>", "<tool_response>", "<|fim_prefix|>"}


@BOTH_TOKENIZERS
def test_a_special_token_literal_in_generated_text_never_cuts_the_turn(tokenizer_name, request):
    """Without engine ids the row is quarantined (``special_token_in_text``); with them the
    turn is kept exactly as the engine produced it. Literals in a user message are what the
    engine was given, and non-special tags in an answer are ordinary tokens: neither counts."""
    tokenizer = request.getfixturevalue(tokenizer_name)
    history = [{"role": "user", "content": "How does a turn end?"}]
    answer = "<think>\nName the token.\n</think>\n\nIt ends with <|im_end|>, then the next turn starts."
    rows, prompts = [], {}
    for name, generated, with_ids in [
        ("text-answer", answer, False),
        (
            "text-reasoning",
            "<think>\nMaybe <|im_start|> opens one.\n</think>\n\nA turn ends with its end token.",
            False,
        ),
        ("engine-answer", answer, True),
        (
            "tags-answer",
            "<think>\nTags.\n</think>\n\nA <think> block closes with </think>; a call is <tool_call>.",
            False,
        ),
    ]:
        row, prompts[name] = as_generated(tokenizer, name, history, generated, True, "stop", with_ids)
        rows.append(row)
    user = [
        {"role": "user", "content": "Why does <|im_end|> end a turn and <think> open reasoning?"},
        {"role": "assistant", "content": "They are the template's tokens.", "reasoning_content": "Explain the tokens."},
    ]
    rows.append(conversation_row("user-literal", user))
    got, stats = tokenized(tokenizer, rows, thinking=True)
    assert stats["reasons"] == {"special_token_in_text": 2}
    assert stats["examples"]["special_token_in_text"] == ["text-answer", "text-reasoning"]
    assert set(got) == {("engine-answer", -1), ("tags-answer", -1), ("user-literal", -1)}
    eos = tokenizer.eos_token_id
    assert got[("engine-answer", -1)] == (
        pieces(tokenizer, (prompts["engine-answer"], 0))[0] + rows[2]["turns"][0]["output_ids"],
        pieces(tokenizer, (prompts["engine-answer"], 0))[1] + [1] * len(rows[2]["turns"][0]["output_ids"]),
    )
    assert got[("engine-answer", -1)][0].count(eos) == 2  # the prompt's and the turn's end; not the literal
    assert got[("tags-answer", -1)] == pieces(
        tokenizer,
        (prompts["tags-answer"], 0),
        ("<think>\nTags.\n</think>\n\nA <think> block closes with </think>; a call is <tool_call>.<|im_end|>", 1),
    )
    ids, mask = got[("user-literal", -1)]
    assert (ids, mask) == pieces(
        tokenizer,
        (
            "<|im_start|>user\nWhy does <|im_end|> end a turn and <think> open reasoning?<|im_end|>\n<|im_start|>assistant\n",
            0,
        ),
        ("<think>\nExplain the tokens.\n</think>\n\nThey are the template's tokens.<|im_end|>", 1),
    )
    assert ids.count(eos) == 3  # the user's literal is the token the engine's prompt held

    # Kept by choice (the reason not degenerate), the row is supervised on its whole turn: the
    # literal no longer ends it early.
    reasons = [r for r in ShardTokenizer(tokenizer, True).cfg["degenerate_reasons"] if r != "special_token_in_text"]
    got, stats = tokenized(tokenizer, rows[:1], thinking=True, degenerate_reasons=reasons)
    assert stats["reasons"] == {"special_token_in_text": 1} and stats["degenerate_samples"] == 0
    assert got[("text-answer", -1)] == pieces(tokenizer, (prompts["text-answer"], 0), (answer + "<|im_end|>", 1))


# The real Qwen3 tokenizer and chat template against the Qwen3 chat format written out by hand.


def test_qwen3_single_turns_with_and_without_thinking_and_a_system_prompt(qwen3_tokenizer):
    tok = qwen3_tokenizer
    system = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is 12 + 30?"},
        {"role": "assistant", "content": "12 + 30 = 42", "reasoning_content": "2 + 0 = 2, then 1 + 3 = 4."},
    ]
    got, stats = tokenized(tok, [conversation_row("sys", system)], thinking=True)
    assert got == {
        ("sys", -1): pieces(
            tok,
            (
                "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nWhat is 12 + 30?<|im_end|>\n<|im_start|>assistant\n",
                0,
            ),
            ("<think>\n2 + 0 = 2, then 1 + 3 = 4.\n</think>\n\n12 + 30 = 42<|im_end|>", 1),
        )
    }
    assert stats["rows_per_turn"] is True
    off = [{"role": "user", "content": "Add 5 and 7."}, {"role": "assistant", "content": "5 + 7 = 12"}]
    got, _ = tokenized(tok, [conversation_row("off", off)], thinking=False)
    # The empty think block is the prompt's (the generation prompt with thinking off): not supervised.
    assert got == {
        ("off", -1): pieces(
            tok,
            ("<|im_start|>user\nAdd 5 and 7.<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n", 0),
            ("5 + 7 = 12<|im_end|>", 1),
        )
    }


def test_qwen3_multi_turn_rows_per_turn_with_and_without_thinking(qwen3_tokenizer):
    tok = qwen3_tokenizer
    first = "<|im_start|>user\nWhat is 1 + 2?<|im_end|>\n<|im_start|>assistant\n"
    history = first + "1 + 2 = 3<|im_end|>\n<|im_start|>user\nAnd 2 + 2?<|im_end|>\n<|im_start|>assistant\n"
    on = [
        {"role": "user", "content": "What is 1 + 2?"},
        {"role": "assistant", "content": "1 + 2 = 3", "reasoning_content": "One plus two."},
        {"role": "user", "content": "And 2 + 2?"},
        {"role": "assistant", "content": "2 + 2 = 4", "reasoning_content": "Two plus two."},
    ]
    got, _ = tokenized(tok, [conversation_row("on", on)], thinking=True)
    # The earlier answer is history without its reasoning, as Qwen3's template renders it.
    assert got == {
        ("on", 1): pieces(tok, (first, 0), ("<think>\nOne plus two.\n</think>\n\n1 + 2 = 3<|im_end|>", 1)),
        ("on", 3): pieces(tok, (history, 0), ("<think>\nTwo plus two.\n</think>\n\n2 + 2 = 4<|im_end|>", 1)),
    }
    off = [{"role": m["role"], "content": m["content"]} for m in on]
    got, _ = tokenized(tok, [conversation_row("off", off)], thinking=False)
    empty = "<think>\n\n</think>\n\n"
    assert got == {
        ("off", 1): pieces(tok, (first + empty, 0), ("1 + 2 = 3<|im_end|>", 1)),
        ("off", 3): pieces(tok, (history + empty, 0), ("2 + 2 = 4<|im_end|>", 1)),
    }


def test_qwen3_tool_turn_is_never_supervised(qwen3_tokenizer):
    tok = qwen3_tokenizer
    messages = [
        {"role": "user", "content": "What is 40 + 2? Use the calculator."},
        {"role": "assistant", "content": "Let me check.", "reasoning_content": "Call the calculator."},
        {"role": "tool", "content": "42"},
        {"role": "assistant", "content": "40 + 2 = 42", "reasoning_content": "The tool said 42."},
    ]
    got, _ = tokenized(tok, [conversation_row("tool", messages)], thinking=True)
    user = "<|im_start|>user\nWhat is 40 + 2? Use the calculator.<|im_end|>\n<|im_start|>assistant\n"
    call = "<think>\nCall the calculator.\n</think>\n\nLet me check.<|im_end|>"
    # After the last real query the template keeps the reasoning of the turn before the tool.
    assert got == {
        ("tool", 1): pieces(tok, (user, 0), (call, 1)),
        ("tool", 3): pieces(
            tok,
            (
                user
                + call
                + "\n<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n<|im_start|>assistant\n",
                0,
            ),
            ("<think>\nThe tool said 42.\n</think>\n\n40 + 2 = 42<|im_end|>", 1),
        ),
    }


def test_qwen3_non_ascii_text(qwen3_tokenizer):
    tok = qwen3_tokenizer
    messages = [
        {"role": "system", "content": "Réponds vite — naïve café ☕"},
        {"role": "user", "content": "用中文回答：2 + 2 等于几？😀"},
        {"role": "assistant", "content": "等于 4 🎉", "reasoning_content": "2 + 2 = 4，很简单 ✓"},
    ]
    got, stats = tokenized(tok, [conversation_row("zh", messages)], thinking=True)
    assert got == {
        ("zh", -1): pieces(
            tok,
            (
                "<|im_start|>system\nRéponds vite — naïve café ☕<|im_end|>\n"
                "<|im_start|>user\n用中文回答：2 + 2 等于几？😀<|im_end|>\n<|im_start|>assistant\n",
                0,
            ),
            ("<think>\n2 + 2 = 4，很简单 ✓\n</think>\n\n等于 4 🎉<|im_end|>", 1),
        )
    }
    assert stats["offset_fallbacks"] == 0 and stats["round_trip_mismatches"] == 0


# --------------------------------------------------------------------------------------------
# The engine's ids on every turn of a conversation: one row per turn, or one per conversation


def generated_conversation(tokenizer, name, exchanges, thinking, ids=None):
    """The row ``engines/regenerate.py`` stores for a conversation of (user message, what the
    model generated, finish reason) exchanges, every turn with its engine's ids (``ids(k,
    generated, stopped)`` gives turn k's, ``engine_ids`` by default); and each turn's prompt as
    the engine was given it."""
    from dflash_pipeline.data.chat import assistant_message, render_prompt, split_reasoning

    history, turns, prompts = [], [], []
    for k, (user, generated, finish) in enumerate(exchanges):
        history.append({"role": "user", "content": user})
        prompt = render_prompt(tokenizer, history, thinking)
        stopped = finish == "stop"
        split = split_reasoning(prompt, generated + tokenizer.eos_token * stopped, tokenizer.eos_token)
        output_ids = ids(k, generated, stopped) if ids else engine_ids(tokenizer, generated, stopped)
        turns.append(
            {
                "message_index": len(history),
                "finish_reason": finish,
                "think_closed": split.think_closed,
                "prompt_tokens": 10,
                "completion_tokens": 10,
                "output_ids": output_ids,
            }
        )
        history.append(assistant_message(split))
        prompts.append(prompt)
    row = conversation_row(name, history)
    row["turns"] = turns
    return row, prompts


def spelled_out(tokenizer, ids):
    """The same text with every merged token spelled in its base byte-level tokens: it decodes
    the same but is not how the tokenizer splits it."""
    added = set(tokenizer.get_added_vocab())
    parts = [[t] if t in added else list(t) for t in tokenizer.convert_ids_to_tokens(ids)]
    return tokenizer.convert_tokens_to_ids([t for p in parts for t in p])


def without_ids(row):
    """The row as ``transformers serve`` would have stored it: no engine ids."""
    return {**row, "id": f"{row['id']}-text", "turns": [{**t, "output_ids": None} for t in row["turns"]]}


def joined(*parts):
    """Ids and mask of (ids, supervised) parts in order."""
    ids, mask = [], []
    for part, is_supervised in parts:
        ids += part
        mask += [int(is_supervised)] * len(part)
    return ids, mask


def supervised(ids, mask):
    return [i for i, m in zip(ids, mask) if m]


# (thinking, exchanges): turn 2's engine wrote a blank line (thinking) or trailing spaces that
# the stored text drops, so its ids are not the rendered text's tokens; turn 3 is cut at the limit.
PER_TURN_CONVERSATIONS = [
    (
        True,
        [
            ("What is 1 + 2?", "<think>\nOne plus two.\n</think>\n\n1 + 2 = 3", "stop"),
            ("And 2 + 2?", "<think>\n\nTwo plus two.\n</think>\n\n2 + 2 = 4", "stop"),
            ("And 3 + 3?", "<think>\nThree plus three is", "length"),
        ],
    ),
    (
        False,
        [
            ("What is 1 + 2?", "1 + 2 = 3", "stop"),
            ("And 2 + 2?", "2 + 2 = 4  ", "stop"),
            ("And 3 + 3?", "3 + 3 is", "length"),
        ],
    ),
]


@pytest.mark.parametrize("thinking, exchanges", PER_TURN_CONVERSATIONS)
def test_qwen3_per_turn_rows_take_the_engine_ids_of_every_turn(qwen3_tokenizer, thinking, exchanges):
    """Each turn's row is its prompt's ids (what the engine was given) + exactly the ids the
    engine returned for it, supervised there and only there: a stopped turn ends with one
    end-of-turn id, a cut turn with its last generated id."""
    from dflash_pipeline.data.loss_masks import needs_rows_per_turn

    tok = qwen3_tokenizer
    assert needs_rows_per_turn(tok, thinking)
    row, prompts = generated_conversation(tok, "c", exchanges, thinking)
    got, stats = tokenized(tok, [row, without_ids(row)], thinking, degenerate_reasons=[])
    assert stats["reasons"] == {} and stats["round_trip_mismatches"] == 0 and stats["rows_per_turn"]
    eos = tok.eos_token_id
    for turn, prompt in zip(row["turns"], prompts):
        engine = turn["output_ids"]
        prompt_ids = tok(prompt, add_special_tokens=False)["input_ids"]
        ids, mask = got[("c", turn["message_index"])]
        assert (ids, mask) == joined((prompt_ids, 0), (engine, 1))
        assert supervised(ids, mask) == engine
        stopped = turn["finish_reason"] == "stop"
        assert (engine[-1] == eos) == stopped and ids.count(eos) == prompt_ids.count(eos) + stopped
    # Turns 1 and 3 are the tokens of their text; turn 2's engine wrote what its stored text
    # lost, and those ids are kept rather than the text tokenized again.
    assert got[("c", 1)] == got[("c-text", 1)] and got[("c", 5)] == got[("c-text", 5)]
    assert supervised(*got[("c-text", 3)]) != row["turns"][1]["output_ids"] == supervised(*got[("c", 3)])


def test_qwen3_per_turn_ids_the_tokenizer_would_not_give_are_kept_and_flagged(qwen3_tokenizer):
    """Ids that spell a word in several tokens are not the tokenizer's split of their text: the
    round trip flags the row (a template mismatch, as for one turn); kept by choice, its turn is
    those ids, not the text tokenized again."""
    tok = qwen3_tokenizer
    exchanges = PER_TURN_CONVERSATIONS[0][1][:2]

    def ids(k, text, stopped):
        canonical = engine_ids(tok, text, stopped)
        return spelled_out(tok, canonical) if k == 1 else canonical

    row, prompts = generated_conversation(tok, "s", exchanges, True, ids=ids)
    second = row["turns"][1]["output_ids"]
    assert len(second) > len(engine_ids(tok, exchanges[1][1], True)) and second[-1] == tok.eos_token_id
    got, stats = tokenized(tok, [row], thinking=True)
    assert got == {} and stats["examples"]["template_mismatch"] == ["s"] and stats["round_trip_mismatches"] == 1
    reasons = [r for r in ShardTokenizer(tok, True).cfg["degenerate_reasons"] if r != "template_mismatch"]
    got, stats = tokenized(tok, [row], thinking=True, degenerate_reasons=reasons)
    assert stats["round_trip_mismatches"] == 1 and set(got) == {("s", 1), ("s", 3)}
    prompt_ids = [tok(p, add_special_tokens=False)["input_ids"] for p in prompts]
    assert got[("s", 3)] == joined((prompt_ids[1], 0), (second, 1))
    assert got[("s", 1)] == joined((prompt_ids[0], 0), (row["turns"][0]["output_ids"], 1))


def chatml(tokenizer):
    """A copy of the tokenizer with a template that renders earlier turns as they were: one
    row per conversation."""
    import copy

    from dflash_pipeline.data.loss_masks import needs_rows_per_turn

    plain = copy.deepcopy(tokenizer)
    plain.chat_template = CHATML
    assert not needs_rows_per_turn(plain, True) and not needs_rows_per_turn(plain, False)
    return plain


# Turn 2 is cut at the limit (the template closes it with its end-of-turn token: history, not
# supervised); turn 3's engine wrote trailing spaces the stored answer drops.
WHOLE_EXCHANGES = [
    ("What is 1 + 2?", "1 + 2 = 3", "stop"),
    ("And 2 + 2?", "2 + 2 is", "length"),
    ("Go on.", "4, because 2 + 2 = 4.  ", "stop"),
]
# The text around and between those turns, as the rendered conversation has it: after a
# stopped turn's end-of-turn token, or from the end-of-turn token the template adds to a cut one.
WHOLE_BETWEEN = [
    "<|im_start|>user\nWhat is 1 + 2?<|im_end|>\n<|im_start|>assistant\n",
    "\n<|im_start|>user\nAnd 2 + 2?<|im_end|>\n<|im_start|>assistant\n",
    "<|im_end|>\n<|im_start|>user\nGo on.<|im_end|>\n<|im_start|>assistant\n",
    "\n",
]


@BOTH_TOKENIZERS
def test_one_row_per_conversation_takes_the_engine_ids_of_every_turn(tokenizer_name, request):
    """In one sequence per conversation each turn is exactly its engine's ids, and the text
    between turns, from after a turn's end-of-turn token to the next generation prompt, is
    tokenized as its own piece: no end-of-turn token is lost or doubled."""
    tok = chatml(request.getfixturevalue(tokenizer_name))
    row, _ = generated_conversation(tok, "w", WHOLE_EXCHANGES, thinking=False)
    engine = [t["output_ids"] for t in row["turns"]]
    got, stats = tokenized(tok, [row, without_ids(row)], thinking=False, degenerate_reasons=[])
    assert stats["reasons"] == {} and stats["round_trip_mismatches"] == 0 and not stats["rows_per_turn"]
    between = [tok(text, add_special_tokens=False)["input_ids"] for text in WHOLE_BETWEEN]
    ids, mask = got[("w", -1)]
    assert (ids, mask) == joined(
        (between[0], 0),
        (engine[0], 1),
        (between[1], 0),
        (engine[1], 1),
        (between[2], 0),
        (engine[2], 1),
        (between[3], 0),
    )
    assert supervised(ids, mask) == engine[0] + engine[1] + engine[2]
    eos = tok.eos_token_id
    assert engine[0][-1] == engine[2][-1] == eos and engine[1][-1] != eos
    # Three ends of user turns, one the template adds to the cut turn, two generated.
    assert ids.count(eos) == 6
    # The text path agrees where the engine's ids are the tokens of the stored text (turns 1
    # and 2), not on turn 3, whose trailing spaces only the engine's ids still hold.
    text_ids, text_mask = got[("w-text", -1)]
    answer = tok("4, because 2 + 2 = 4.<|im_end|>", add_special_tokens=False)["input_ids"]
    assert supervised(text_ids, text_mask) == engine[0] + engine[1] + answer != supervised(ids, mask)
    upto_third = len(between[0] + engine[0] + between[1] + engine[1] + between[2])
    assert (text_ids[:upto_third], text_mask[:upto_third]) == (ids[:upto_third], mask[:upto_third])


@BOTH_TOKENIZERS
def test_one_row_per_conversation_keeps_a_split_the_tokenizer_would_not_give(tokenizer_name, request):
    """A turn whose ids spell its words in several tokens stays those ids in the sequence (the
    round trip flags it, as for one turn); an end-of-turn id the engine left off is added once."""
    tok = chatml(request.getfixturevalue(tokenizer_name))

    def ids(k, text, stopped):
        if k == 0:
            return spelled_out(tok, engine_ids(tok, text, stopped))
        return engine_ids(tok, text, False)  # a stopped turn without its end-of-turn id

    row, _ = generated_conversation(tok, "w", WHOLE_EXCHANGES, thinking=False, ids=ids)
    engine = [t["output_ids"] for t in row["turns"]]
    assert len(engine[0]) > len(engine_ids(tok, WHOLE_EXCHANGES[0][1], True))
    eos = tok.eos_token_id
    assert engine[2][-1] != eos
    reasons = [r for r in ShardTokenizer(tok, False).cfg["degenerate_reasons"] if r != "template_mismatch"]
    got, stats = tokenized(tok, [row], thinking=False, degenerate_reasons=reasons)
    assert stats["round_trip_mismatches"] == 1 and stats["reasons"] == {"template_mismatch": 1}
    between = [tok(text, add_special_tokens=False)["input_ids"] for text in WHOLE_BETWEEN]
    assert got[("w", -1)] == joined(
        (between[0], 0),
        (engine[0], 1),
        (between[1], 0),
        (engine[1], 1),
        (between[2], 0),
        (engine[2] + [eos], 1),
        (between[3], 0),
    )
    assert got[("w", -1)][0].count(eos) == 6
    # With the tokenizer's own split of the first turn the same row passes the round trip.
    row["turns"][0]["output_ids"] = engine_ids(tok, WHOLE_EXCHANGES[0][1], True)
    got, stats = tokenized(tok, [row], thinking=False)
    assert stats["round_trip_mismatches"] == 0 and stats["reasons"] == {} and set(got) == {("w", -1)}


def test_turns_with_and_without_engine_ids_in_one_row_and_special_literals_only_where_text_is_tokenized(tok):
    """A row mixing turns with and without ids takes the ids where there are some and the
    text's tokens elsewhere. A special-token literal in generated text quarantines the row only
    in a turn tokenized from its text: a turn with ids is those ids (here the literal spelled
    in ordinary tokens)."""
    plain = chatml(tok)
    exchanges = [
        ("How does a turn end?", "With <|im_end|>, then the next turn starts.", "stop"),
        ("And then?", "The user speaks.", "stop"),
    ]
    row, _ = generated_conversation(plain, "mixed", exchanges, thinking=False)
    row["turns"][1]["output_ids"] = None
    got, stats = tokenized(plain, [row], thinking=False)
    assert stats["reasons"] == {} and stats["round_trip_mismatches"] == 0
    ids, mask = got[("mixed", -1)]
    first = row["turns"][0]["output_ids"]
    second = plain("The user speaks.<|im_end|>", add_special_tokens=False)["input_ids"]
    assert supervised(ids, mask) == first + second
    assert first.count(plain.eos_token_id) == 1  # the literal is ordinary tokens, the end is the id

    # The literal in the turn without ids: the text cannot say which ids the model wrote.
    swapped, _ = generated_conversation(plain, "literal-text", exchanges[::-1], thinking=False)
    swapped["turns"][1]["output_ids"] = None
    got, stats = tokenized(plain, [swapped], thinking=False)
    assert got == {} and stats["examples"]["special_token_in_text"] == ["literal-text"]


def test_a_turn_cut_before_it_wrote_anything_keeps_the_next_turns_ids_in_place(tok):
    """A turn cut at the limit with no text is an empty supervised piece of the conversation's
    row, not a missing one: the next turn's ids still take that turn's place."""
    plain = chatml(tok)
    exchanges = [("What is 2 + 2?", "", "length"), ("Go on.", "4, because 2 + 2 = 4.  ", "stop")]
    row, _ = generated_conversation(plain, "empty", exchanges, thinking=False)
    assert row["turns"][0]["output_ids"] == [] and row["messages"][1]["content"] == ""
    got, stats = tokenized(plain, [row], thinking=False)
    assert stats["reasons"] == {} and stats["round_trip_mismatches"] == 0
    second = row["turns"][1]["output_ids"]
    assert second != plain("4, because 2 + 2 = 4.<|im_end|>", add_special_tokens=False)["input_ids"]
    assert got[("empty", -1)] == joined(
        (
            plain("<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)[
                "input_ids"
            ],
            0,
        ),
        (
            plain("<|im_end|>\n<|im_start|>user\nGo on.<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)[
                "input_ids"
            ],
            0,
        ),
        (second, 1),
        (plain("\n", add_special_tokens=False)["input_ids"], 0),
    )
