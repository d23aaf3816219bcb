"""Prepare stage: row validation, stable ids, dedupe, deterministic shards and held-out split."""

from __future__ import annotations

import io
import json
import uuid

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dflash_pipeline.data.prompts import (
    BAD_REASONS,
    BadRow,
    Prompt,
    parse_decoded_row,
    parse_json_line,
    parse_jsonl_lines,
    prompt_hash,
)
from dflash_pipeline.data.sharding import HELDOUT, shard_of, split_of
from dflash_pipeline.stages.prepare import (
    IngestResult,
    PrepareError,
    add_rows,
    assign_ids,
    build_table,
    ingest,
    read_shard,
    select_shard,
)
from dflash_pipeline.core.storage import open_storage


def user(text):
    return {"role": "user", "content": text}


def openai_row(text, **extra):
    return {"messages": [user(text), {"role": "assistant", "content": "old answer"}], **extra}


def write_jsonl(path, rows):
    path.write_bytes(b"".join(r if isinstance(r, bytes) else json.dumps(r).encode() + b"\n" for r in rows))
    return path


def parse(row, max_row_bytes=10_000):
    line = row if isinstance(row, bytes) else json.dumps(row).encode()
    return parse_json_line(line, "f.jsonl", 7, max_row_bytes)


def test_sharegpt_and_openai_rows_normalise_to_the_same_messages():
    sharegpt = parse(
        {
            "conversations": [
                {"from": "system", "value": "be brief"},
                {"from": "human", "value": "hi"},
                {"from": "gpt", "value": "hello"},
            ]
        }
    )
    openai = parse(
        {
            "messages": [
                {"role": "system", "content": "be brief"},
                user("hi"),
                {"role": "assistant", "content": "hello"},
            ]
        }
    )
    assert isinstance(sharegpt, Prompt) and sharegpt.messages == openai.messages
    assert sharegpt.messages[1] == ("user", "hi")
    assert sharegpt.source == "f.jsonl:7"


@pytest.mark.parametrize(
    ("line", "reason"),
    [
        (b'{"messages": [', "malformed_json"),
        (b'{"messages": [{"role": "user", "content": "caf\xe9"}]}', "not_utf8"),
        (json.dumps({"messages": [{"role": "wizard", "content": "x"}]}).encode(), "unknown_role"),
        (json.dumps({"messages": []}).encode(), "empty_conversation"),
        (json.dumps({"messages": [{"role": "system", "content": "x"}]}).encode(), "no_user_turn"),
        (json.dumps({"messages": [{"role": "user", "content": 3}]}).encode(), "bad_turn"),
        (json.dumps({"text": "hello"}).encode(), "no_conversation"),
        (json.dumps([1, 2]).encode(), "not_an_object"),
        (json.dumps(openai_row("x" * 500)).encode(), "too_large"),
    ],
)
def test_each_kind_of_bad_row_is_named(line, reason):
    result = parse(line, max_row_bytes=400)
    assert isinstance(result, BadRow)
    assert result.reason == reason
    assert result.describe().startswith("f.jsonl row 7: ")


def test_prompt_hash_ignores_assistant_turns():
    a = parse(openai_row("q"))
    b = parse({"messages": [user("q"), {"role": "assistant", "content": "different"}]})
    assert prompt_hash(a.prompt_turns) == prompt_hash(b.prompt_turns)


def test_shard_and_split_depend_only_on_the_id():
    ids = [f"sample-{i}" for i in range(2000)]
    shards = [shard_of(i, 8) for i in ids]
    assert shards == [shard_of(i, 8) for i in ids]
    assert set(shards) == set(range(8))
    heldout = sum(split_of(i, 0.1) == HELDOUT for i in ids)
    assert 140 < heldout < 260  # ~10% of 2000


def run_ingest(tmp_path, files, num_shards=3, **kwargs):
    out = tmp_path / f"out-{uuid.uuid4().hex[:6]}"
    out.mkdir()
    summary = ingest(
        [str(f) for f in files],
        num_shards,
        str(out / "prompts.parquet"),
        str(out / "summary.json"),
        str(out / "quarantine.jsonl"),
        **kwargs,
    )
    return out, summary


def test_ingest_dedupes_ids_and_quarantines(tmp_path):
    rows = [openai_row(f"question {i}", id=f"src-{i}") for i in range(40)]
    rows.append(openai_row("question 3", id="other"))  # same prompt turns: duplicate
    rows.append(openai_row("dup id a", id="clash"))
    rows.append(openai_row("dup id b", id="clash"))  # a source id used twice: hash ids instead
    rows.append(b"{not json\n")
    data = write_jsonl(tmp_path / "data.jsonl", rows)
    out, summary = run_ingest(tmp_path, [data], heldout_fraction=0.2)
    table = pq.read_table(out / "prompts.parquet")
    ids = table.column("id").to_pylist()
    assert len(ids) == len(set(ids)) == 42
    assert "src-5" in ids and "clash" not in ids and "other" not in ids
    assert prompt_hash([("user", "dup id a")]) in ids
    assert summary["duplicates_dropped"] == 1
    assert summary["bad_by_reason"] == {"malformed_json": 1}
    quarantined = [json.loads(x) for x in (out / "quarantine.jsonl").read_text().splitlines()]
    assert quarantined == [
        {"file": str(data), "row": 44, "reason": "malformed_json", "detail": quarantined[0]["detail"]}
    ]
    assert table.column("shard").to_pylist() == sorted(table.column("shard").to_pylist())
    for sample_id, shard, split in zip(ids, table.column("shard").to_pylist(), table.column("split").to_pylist()):
        assert shard == shard_of(sample_id, 3)
        assert split == split_of(sample_id, 0.2)
    assert sum(summary["samples_per_shard"]) == 42
    assert summary["heldout_samples"] == table.column("split").to_pylist().count(HELDOUT)


def test_adding_data_keeps_existing_samples_in_their_shard(tmp_path):
    first = write_jsonl(tmp_path / "a.jsonl", [openai_row(f"q{i}") for i in range(50)])
    more = write_jsonl(tmp_path / "b.jsonl", [openai_row(f"new {i}") for i in range(50)])
    out1, _ = run_ingest(tmp_path, [first])
    out2, _ = run_ingest(tmp_path, [first, more])
    before = pq.read_table(out1 / "prompts.parquet").to_pylist()
    after = {r["id"]: r for r in pq.read_table(out2 / "prompts.parquet").to_pylist()}
    for row in before:
        assert after[row["id"]]["shard"] == row["shard"]
        assert after[row["id"]]["split"] == row["split"]


def test_too_many_bad_rows_stop_with_file_row_and_reason(tmp_path):
    rows = [openai_row(f"q{i}") for i in range(8)]
    rows[2] = {"messages": [{"role": "robot", "content": "x"}]}
    rows[5] = b"not json at all\n"
    data = write_jsonl(tmp_path / "bad.jsonl", rows)
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(PrepareError) as err:
        ingest(
            [str(data)],
            3,
            str(out / "prompts.parquet"),
            str(out / "summary.json"),
            str(out / "quarantine.jsonl"),
            max_bad_fraction=0.1,
        )
    message = str(err.value)
    assert "2 of 8 rows (25.0%) are bad" in message
    assert f"First: {data} row 3: unknown role" in message
    assert "malformed_json 1" in message and "unknown_role 1" in message
    # Nothing is lost: the summary and the quarantine are written before the stop.
    assert not (out / "prompts.parquet").exists()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["rows_read"] == 8 and summary["samples"] == 0
    assert summary["bad_by_reason"] == {"unknown_role": 1, "malformed_json": 1}
    assert summary["stopped"] == message
    quarantined = [json.loads(x) for x in (out / "quarantine.jsonl").read_text().splitlines()]
    assert [(q["row"], q["reason"]) for q in quarantined] == [(3, "unknown_role"), (6, "malformed_json")]


def test_a_refused_dataset_keeps_its_summary_and_quarantine_beside_the_log(tmp_path):
    """A workflow deletes a failed job's outputs: the copies beside the log survive that."""
    rows = [openai_row(f"q{i}") for i in range(4)] + [{"messages": "not a list"}] * 4
    data = write_jsonl(tmp_path / "bad.jsonl", rows)
    out, logs = tmp_path / "out", tmp_path / "logs"
    out.mkdir()
    logs.mkdir()
    with pytest.raises(PrepareError) as err:
        ingest(
            [str(data)],
            2,
            str(out / "prompts.parquet"),
            str(out / "summary.json"),
            str(out / "quarantine.jsonl"),
            refused_copy=logs / "ingest",
        )
    for path in out.iterdir():  # what Snakemake does to a failed job's outputs
        path.unlink()
    kept_summary = logs / "ingest.refused-summary.json"
    kept_quarantine = logs / "ingest.refused-quarantine.jsonl"
    message = str(err.value)
    assert "4 of 8 rows (50.0%) are bad" in message
    assert str(kept_quarantine) in message and str(kept_summary) in message
    assert json.loads(kept_summary.read_text())["bad_rows"] == 4
    assert len(kept_quarantine.read_text().splitlines()) == 4


def test_parquet_input_in_sharegpt_shape(tmp_path):
    path = tmp_path / "data.parquet"
    pq.write_table(
        pa.table(
            {
                "id": ["a", "b"],
                "conversations": [
                    [{"from": "human", "value": "one"}, {"from": "gpt", "value": "1"}],
                    [{"from": "alien", "value": "two"}],
                ],
            }
        ),
        path,
    )
    out, summary = run_ingest(tmp_path, [path], max_bad_fraction=0.5)
    assert summary["samples"] == 1 and summary["bad_by_reason"] == {"unknown_role": 1}
    assert pq.read_table(out / "prompts.parquet").column("id").to_pylist() == ["a"]


def test_select_shard_writes_exactly_that_shards_rows(tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl", [openai_row(f"q{i}") for i in range(60)])
    out, summary = run_ingest(tmp_path, [data], num_shards=4)
    for shard in range(4):
        dest = tmp_path / f"prepare-{shard:05d}.parquet"
        n = select_shard(str(out / "prompts.parquet"), shard, str(dest))
        table = pq.read_table(dest)
        assert n == table.num_rows == summary["samples_per_shard"][shard]
        assert set(table.column("shard").to_pylist()) <= {shard}
    assert read_shard(out / "prompts.parquet", 0).num_rows == summary["samples_per_shard"][0]


def test_ingest_reads_a_dataset_from_s3(tmp_path, s3_server, s3_env):
    store = open_storage(f"s3://{s3_server.bucket}/datasets")
    store.write_bytes("d.jsonl", b"".join(json.dumps(openai_row(f"q{i}")).encode() + b"\n" for i in range(5)))
    _, summary = run_ingest(tmp_path, [store.join("d.jsonl")])
    assert summary["samples"] == 5 and summary["files"] == [store.join("d.jsonl")]


def test_missing_dataset_file_is_named(tmp_path):
    with pytest.raises(PrepareError, match="nope.jsonl does not exist"):
        run_ingest(tmp_path, [tmp_path / "nope.jsonl"])


# --- Rows that must never stop the ingest: each gets its own reason and its row number. ---

OK_TURNS = '[{"role": "user", "content": "hi"}]'


@pytest.mark.parametrize(
    ("line", "reason"),
    [
        # A lone surrogate is valid JSON (an escape) but no valid Unicode, in any string.
        (b'{"messages": [{"role": "user", "content": "a\\ud800b"}]}', "invalid_unicode"),
        (b'{"messages": [{"role": "us\\udfffer", "content": "hi"}]}', "invalid_unicode"),
        (b'{"id": "\\ud800", "messages": ' + OK_TURNS.encode() + b"}", "invalid_unicode"),
        (b'{"meta": {"tags": ["ok", "\\udc00"]}, "messages": ' + OK_TURNS.encode() + b"}", "invalid_unicode"),
        (b'{"\\ud83d": 1, "messages": ' + OK_TURNS.encode() + b"}", "invalid_unicode"),
        (b'{"messages": [{"role": "user", "content": "a\\u0000b"}]}', "nul_byte"),
        (b'{"id": "x\\u0000", "messages": ' + OK_TURNS.encode() + b"}", "nul_byte"),
        (
            b'{"messages": ' + OK_TURNS.encode() + b', "conversations": [{"from": "human", "value": "hi"}]}',
            "ambiguous_conversation",
        ),
        (b'{"id": {"a": 1}, "messages": ' + OK_TURNS.encode() + b"}", "bad_id"),
        (b'{"id": [1, 2], "messages": ' + OK_TURNS.encode() + b"}", "bad_id"),
        (b'{"id": 1.0, "messages": ' + OK_TURNS.encode() + b"}", "bad_id"),
        (b'{"id": true, "messages": ' + OK_TURNS.encode() + b"}", "bad_id"),
        (b'{"messages": [{"role": "user", "content": " \\n\\t "}]}', "empty_turn"),
        (b'{"messages": [{"role": "system", "content": ""}, {"role": "user", "content": "hi"}]}', "empty_turn"),
        (b'{"messages": "hello"}', "conversation_not_a_list"),
        (b'{"conversations": {"from": "human", "value": "hi"}}', "conversation_not_a_list"),
        (b'{"messages": ["hi"]}', "turn_not_an_object"),
        (b'{"conversations": [{"from": ["human"], "value": "hi"}]}', "unknown_role"),
        (b'{"messages": [{"content": "hi"}]}', "unknown_role"),
        (b"[" * 100_000, "malformed_json"),  # deeper than Python's JSON parser recurses
        (b'{"id": ' + b"1" * 5000 + b"}", "malformed_json"),  # more digits than Python converts
    ],
)
def test_each_new_kind_of_bad_row_is_named_with_its_row(line, reason):
    result = parse(line, max_row_bytes=1_000_000)
    assert isinstance(result, BadRow), result
    assert (result.reason, result.row, result.file) == (reason, 7, "f.jsonl")
    # The detail never carries the broken string itself: it can be logged and written.
    assert result.describe().startswith("f.jsonl row 7: ")
    result.describe().encode("utf-8")
    assert "\x00" not in result.describe()
    json.dumps(result.to_json(), ensure_ascii=False).encode("utf-8")


def test_integer_ids_are_their_decimal_string_and_assistant_turns_may_be_empty():
    row = parse({"id": 42, "messages": [user("q"), {"role": "assistant", "content": ""}]})
    assert isinstance(row, Prompt) and row.source_id == "42"
    assert row.messages == (("user", "q"), ("assistant", ""))
    assert parse({"id": "", "messages": [user("q")]}).source_id is None


def test_an_escaped_surrogate_pair_is_one_valid_character():
    row = parse(b'{"id": "\\ud83d\\ude00", "messages": [{"role": "user", "content": "\\ud83d\\ude00"}]}')
    assert isinstance(row, Prompt) and row.messages == (("user", "\U0001f600"),)
    assert row.source_id == "\U0001f600"


def test_a_null_conversation_field_counts_as_absent():
    row = parse({"messages": None, "conversations": [{"from": "human", "value": "hi"}]})
    assert isinstance(row, Prompt) and row.messages == (("user", "hi"),)
    assert parse({"messages": None}).reason == "no_conversation"


def test_a_byte_order_mark_on_the_first_line_is_dropped():
    lines = io.BytesIO(b"\xef\xbb\xbf" + json.dumps(openai_row("q")).encode() + b"\n")
    (row,) = parse_jsonl_lines(lines, "f.jsonl", 10_000)
    assert isinstance(row, Prompt)


def test_ingest_quarantines_every_kind_of_bad_row_with_file_and_row(tmp_path):
    rows = [openai_row(f"q{i}") for i in range(4)] + [
        b'{"id": "\\ud800", "messages": [{"role": "user", "content": "x"}]}\n',  # row 5
        b'{"messages": [{"role": "user", "content": "\\u0000"}]}\n',  # row 6
        {"messages": [user("a")], "conversations": [{"from": "human", "value": "a"}]},  # row 7
        {"id": {"k": "v"}, "messages": [user("b")]},  # row 8
        {"messages": [user("   ")]},  # row 9
        {"messages": "just a string"},  # row 10
        b'{"conversations": [{"from": {}, "value": "x"}]}\n',  # row 11
    ]
    data = write_jsonl(tmp_path / "mixed.jsonl", rows)
    out, summary = run_ingest(tmp_path, [data], max_bad_fraction=0.9)
    quarantined = [json.loads(x) for x in (out / "quarantine.jsonl").read_text().splitlines()]
    assert [(q["file"], q["row"], q["reason"]) for q in quarantined] == [
        (str(data), 5, "invalid_unicode"),
        (str(data), 6, "nul_byte"),
        (str(data), 7, "ambiguous_conversation"),
        (str(data), 8, "bad_id"),
        (str(data), 9, "empty_turn"),
        (str(data), 10, "conversation_not_a_list"),
        (str(data), 11, "unknown_role"),
    ]
    assert summary["rows_read"] == 11 and summary["samples"] == 4 and summary["bad_rows"] == 7
    assert summary["stopped"] is None


def test_parquet_rows_get_the_same_validation(tmp_path):
    path = tmp_path / "data.parquet"
    # A string column that is not UTF-8 (pyarrow only notices when it converts the batch).
    broken = pa.array([b"ok", b"caf\xe9", b"fine", b"a\x00b", b"also fine"], pa.binary()).view(pa.string())
    turns = pa.array(
        [[{"role": "user", "content": f"q{i}"}] for i in range(3)]
        + [[{"role": "user", "content": "has\x00nul"}], [{"role": "user", "content": " "}]]
    )
    pq.write_table(pa.table({"id": broken, "messages": turns, "conversations": pa.nulls(5, turns.type)}), path)
    out, summary = run_ingest(tmp_path, [path], max_bad_fraction=0.9)
    quarantined = [json.loads(x) for x in (out / "quarantine.jsonl").read_text().splitlines()]
    assert [(q["row"], q["reason"]) for q in quarantined] == [
        (2, "not_utf8"),
        (4, "nul_byte"),
        (5, "empty_turn"),
    ]
    assert sorted(pq.read_table(out / "prompts.parquet").column("id").to_pylist()) == ["fine", "ok"]


def test_parquet_float_ids_are_refused(tmp_path):
    path = tmp_path / "ids.parquet"
    pq.write_table(pa.table({"id": [1.0, None], "messages": [[user("a")], [user("b")]]}), path)
    out, summary = run_ingest(tmp_path, [path], max_bad_fraction=0.9)
    assert summary["bad_by_reason"] == {"bad_id": 1} and summary["samples"] == 1


def test_a_file_that_is_not_parquet_is_named(tmp_path):
    path = tmp_path / "fake.parquet"
    path.write_bytes(b"this is not parquet")
    with pytest.raises(PrepareError, match="fake.parquet cannot be read"):
        run_ingest(tmp_path, [path])


# --- Property: whatever a line holds, the row parser answers and the counts add up. ---

ROLE_NAMES = ["user", "assistant", "system", "tool", "human", "gpt", "function", "wizard", ""]
FIELD_NAMES = ["messages", "conversations", "id", "role", "content", "from", "value", "meta"]
# Any code point, lone surrogates included, and often the characters most likely to break things.
# (Strings are joined from lists: st.text would merge the alphabet and dilute the specials.)
CHARS = st.one_of(
    st.characters(exclude_categories=()),
    st.sampled_from(["\ud800", "\udfff", "\x00", " ", "\n", "\t", "\u3000", "\ufeff"]),
)


def strings(chars, min_size=0, max_size=12):
    return st.lists(chars, min_size=min_size, max_size=max_size).map("".join)


TEXT = st.one_of(strings(CHARS), st.sampled_from(ROLE_NAMES))
SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    TEXT,
)
VALUES = st.recursive(
    SCALARS,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.dictionaries(st.one_of(st.sampled_from(FIELD_NAMES), TEXT), inner, max_size=4),
    ),
    max_leaves=16,
)
TURNS = st.lists(
    st.one_of(
        st.fixed_dictionaries(
            {"role": st.one_of(st.sampled_from(ROLE_NAMES), VALUES), "content": st.one_of(TEXT, VALUES)}
        ),
        st.fixed_dictionaries({"from": st.sampled_from(ROLE_NAMES), "value": TEXT}),
        VALUES,
    ),
    max_size=4,
)
# Mostly plain text, sometimes a lone surrogate, a NUL or only whitespace.
CONTENT = st.one_of(
    st.text(st.characters(codec="utf-8", exclude_characters="\x00"), min_size=1, max_size=12),
    strings(st.one_of(st.characters(codec="utf-8"), CHARS)),
)
PLAUSIBLE_TURNS = st.lists(
    st.one_of(
        st.fixed_dictionaries({"role": st.sampled_from(ROLE_NAMES), "content": CONTENT}),
        st.fixed_dictionaries({"from": st.sampled_from(ROLE_NAMES), "value": CONTENT}),
    ),
    min_size=1,
    max_size=4,
)
IDS = st.one_of(st.none(), CONTENT, st.integers(), VALUES)
ROWS = st.one_of(
    VALUES,
    st.fixed_dictionaries(
        {},
        optional={"messages": st.one_of(TURNS, VALUES), "conversations": TURNS, "id": VALUES, "meta": VALUES},
    ),
    # Close to real rows, so the later checks (roles, NUL, empty turns, ids) are reached.
    st.builds(lambda turns, id_: {"messages": turns, "id": id_}, PLAUSIBLE_TURNS, IDS),
    st.builds(
        lambda turns, id_: {
            "conversations": [
                {"from": t.get("role", t.get("from")), "value": t.get("content", t.get("value"))} for t in turns
            ],
            "id": id_,
        },
        PLAUSIBLE_TURNS,
        IDS,
    ),
)
LINES = st.one_of(
    ROWS.map(lambda row: json.dumps(row).encode()),  # lone surrogates arrive as \\udXXX escapes
    st.binary(max_size=40),  # anything at all, newlines and invalid UTF-8 included
    strings(CHARS, max_size=30).map(lambda t: t.encode("utf-8", "surrogatepass")),
)


def check_prompt(prompt: Prompt) -> None:
    strings = [s for turn in prompt.messages for s in turn] + [prompt.source_id or ""]
    for text in strings:
        text.encode("utf-8")
        assert "\x00" not in text
    assert any(role == "user" for role, _ in prompt.messages)
    assert all(content.strip() for _, content in prompt.prompt_turns)


def check_bad(bad: BadRow) -> None:
    assert bad.reason in BAD_REASONS and bad.reason != "unreadable_row", bad
    bad.describe().encode("utf-8")
    json.dumps(bad.to_json())


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(LINES, max_size=6))
def test_any_jsonl_lines_are_kept_or_quarantined_and_the_counts_add_up(lines):
    blob = b"\n".join(lines) + b"\n"
    # A byte-order mark opening the file is not content: a first line of only that is blank.
    expected_rows = sum(1 for line in blob.removeprefix(b"\xef\xbb\xbf").split(b"\n") if line.rstrip(b"\r\n").strip())
    result = IngestResult()
    add_rows(result, parse_jsonl_lines(io.BytesIO(blob), "f.jsonl", 2_000), set())
    assert result.rows_read == expected_rows
    assert len(result.prompts) + len(result.bad) + result.duplicates == result.rows_read
    numbers = [b.row for b in result.bad] + [int(p.source.rsplit(":", 1)[1]) for p in result.prompts]
    assert len(set(numbers)) == len(numbers) and all(n >= 1 for n in numbers)
    for bad in result.bad:
        check_bad(bad)
    for prompt in result.prompts:
        check_prompt(prompt)
    build_table(result.prompts, assign_ids(result.prompts), 3, 0.1)  # pyarrow takes every string


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ROWS)
def test_any_decoded_row_is_kept_or_quarantined(row):
    """Rows as a parquet reader hands them over (no JSON in between): the same guarantees."""
    result = parse_decoded_row(row, "f.parquet", 3, 2_000)
    if isinstance(result, BadRow):
        assert result.row == 3
        check_bad(result)
    else:
        check_prompt(result)


def test_the_summary_counts_rows_per_file_and_names_an_empty_one(tmp_path):
    good = tmp_path / "good.jsonl"
    good.write_text("".join(json.dumps(openai_row(f"q{i}")) + "\n" for i in range(4)))
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    _, summary = run_ingest(tmp_path, [good, empty])
    assert summary["rows_per_file"] == {str(good): 4, str(empty): 0}
    assert summary["files_without_rows"] == [str(empty)]


def test_a_shard_is_read_from_s3_by_byte_range_not_whole(tmp_path, s3_server, s3_env, monkeypatch):
    """A prepare job fetches the footer and its own row group of the ingested table, not the
    whole object: with 16 shards, well under a quarter of its bytes."""
    from dflash_pipeline.core.s3 import S3Storage

    import random

    rng = random.Random(0)  # text that does not compress away: a table of ~1 MB
    words = [f"w{rng.randrange(10**6)}" for _ in range(800 * 150)]
    data = write_jsonl(tmp_path / "d.jsonl", [openai_row(" ".join(words[i * 150 : (i + 1) * 150])) for i in range(800)])
    out, summary = run_ingest(tmp_path, [data], num_shards=16)
    store = open_storage(f"s3://{s3_server.bucket}/ranged")
    store.upload_file("prompts.parquet", out / "prompts.parquet")
    opened = []
    open_ranged = S3Storage.open_ranged
    monkeypatch.setattr(S3Storage, "open_ranged", lambda self, key: opened.append(open_ranged(self, key)) or opened[-1])

    table = read_shard(store.join("prompts.parquet"), 5)
    assert table.equals(read_shard(out / "prompts.parquet", 5))
    assert table.num_rows == summary["samples_per_shard"][5] > 0
    size = (out / "prompts.parquet").stat().st_size
    # The footer (pyarrow reads the last 64 KiB) and one row group of 16.
    assert opened[0].bytes_fetched < size / 4, (opened[0].bytes_fetched, size)


def test_a_refused_ingest_job_says_each_bad_row_and_the_refusal_once(tmp_path, capfd):
    """The rule's script: each quarantined row once in the job log, the refusal once, no
    traceback on stderr, and json's "starting at" message with a single "at"."""
    import runpy
    from pathlib import Path
    from types import SimpleNamespace

    rows = [openai_row(f"q{i}") for i in range(4)] + [b'{"messages": "unterminated\n'] * 2
    rows += [{"messages": "not a list"}] * 8
    data = write_jsonl(tmp_path / "bad.jsonl", rows)
    out, logs = tmp_path / "out", tmp_path / "logs"
    out.mkdir()
    smk = SimpleNamespace(
        params=SimpleNamespace(
            num_shards=2,
            dataset={"paths": [str(data)], "heldout_fraction": 0.1, "max_bad_fraction": 0.05,
                     "max_row_bytes": 1 << 20, "id_field": "id"},
        ),
        output=SimpleNamespace(prompts=str(out / "p.parquet"), summary=str(out / "s.json"),
                               quarantine=str(out / "q.jsonl")),
        log=[str(logs / "ingest.log")],
    )  # fmt: skip
    with pytest.raises(SystemExit) as exit_:
        runpy.run_path(str(Path(__file__).parents[1] / "scripts/ingest.py"), init_globals={"snakemake": smk})
    assert exit_.value.code == 1
    log = (logs / "ingest.log").read_text()
    assert " at at " not in log and "Unterminated string starting at column" in log
    for row in range(5, 15):  # 10 bad rows: each named exactly once
        assert log.count(f"bad.jsonl row {row}:") == 1, (row, log)
    assert log.count("10 of 14 rows (71.4%) are bad") == 1
    stderr = capfd.readouterr().err
    assert stderr.count("10 of 14 rows (71.4%) are bad") == 1 and "Traceback" not in stderr
