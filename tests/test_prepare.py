"""Prepare stage: row validation, stable ids, dedupe, deterministic shards and held-out split."""

from __future__ import annotations

import json
import uuid

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dflash_pipeline.data.prompts import BadRow, Prompt, parse_json_line, prompt_hash
from dflash_pipeline.data.sharding import HELDOUT, shard_of, split_of
from dflash_pipeline.stages.prepare import PrepareError, ingest, read_shard, select_shard
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
    for sample_id, shard, split in zip(
        ids, table.column("shard").to_pylist(), table.column("split").to_pylist()
    ):
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
    with pytest.raises(PrepareError) as err:
        run_ingest(tmp_path, [data], max_bad_fraction=0.1)
    message = str(err.value)
    assert "2 of 8 rows (25.0%) are bad" in message
    assert f"First: {data} row 3: unknown role" in message
    assert "malformed_json 1" in message and "unknown_role 1" in message


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
