"""Reuse of earlier generated rows (progress parts, the reuse copy of a finished shard): a row is
taken only for the same sample id, generation fingerprint and prompt hash, so a prompt edited
under the same source id is generated again, and rows saved before rows carried a prompt hash
are generated again rather than trusted (dflash_pipeline.engines.regenerate)."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import re
from types import SimpleNamespace

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dflash_pipeline.core import layout
from dflash_pipeline.core.jobstate import ShardProgress
from dflash_pipeline.core.storage import open_storage
from dflash_pipeline.data.prompts import messages_prompt_hash, parse_row, prompt_hash
from dflash_pipeline.engines.client import Sampling
from dflash_pipeline.engines.regenerate import (
    GENERATED_SCHEMA,
    GenerationSettings,
    ShardGenerator,
    Wanted,
    generate_shard,
    reusable_rows,
)
from dflash_pipeline.stages.prepare import ingest, read_shard

FP = "fp-1"
# Without the prompt hash: the shape of parts and reuse objects written before it existed.
OLD_SCHEMA = pa.schema([f for f in GENERATED_SCHEMA if f.name != "prompt_hash"])
RESUMED = re.compile(r"(\d+) prompts, (\d+) resumed from earlier work, (\d+) to generate")


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def prompt(sample_id: str, *messages: dict) -> dict:
    return {"id": sample_id, "shard": 0, "split": "train", "messages": list(messages)}


def prompts_table(rows: list[dict]) -> pa.Table:
    return pa.Table.from_pylist(rows)


class EchoGenerator(ShardGenerator):
    """The real ShardGenerator (its conversation replay and the row it returns) with every
    engine request answered at once; ``asked`` records the last user turn of each request."""

    def __init__(self, fingerprint: str = FP):
        settings = GenerationSettings(
            thinking=False,
            sampling=Sampling(max_new_tokens=8, temperature=0.0),
            concurrency=4,
            part_every_samples=2,
            part_every_seconds=3600,
            telemetry_every_seconds=60,
        )
        super().__init__(SimpleNamespace(eos_token="<eos>"), None, settings, fingerprint)
        self.asked: list[str] = []

    async def _turn(self, history: list[dict]) -> tuple[dict, dict]:
        question = history[-1]["content"]
        self.asked.append(question)
        reply = {"role": "assistant", "content": f"answer to {question}", "reasoning_content": None}
        turn = {
            "message_index": len(history),
            "finish_reason": "stop",
            "think_closed": True,
            "prompt_tokens": 5,
            "completion_tokens": 3,
            "output_ids": [1, 2, 3],
        }
        return reply, turn


def run_shard(prompts: list[dict], progress: ShardProgress, generator: EchoGenerator) -> pa.Table:
    return asyncio.run(generate_shard(prompts_table(prompts), generator, progress, lambda: {}))


def finish_shard(progress: ShardProgress, table: pa.Table) -> None:
    """What a generate job does with a finished shard (stages.generate.run_job)."""
    progress.save_reusable(table)
    progress.clear_parts()


def saved_row(
    sample_id: str,
    messages: list[dict],
    *,
    digest: str | None,
    fingerprint: str = FP,
    error: str | None = None,
    answer: str = "old answer",
) -> dict:
    generated = [{**m, "reasoning_content": None} for m in messages]
    generated.append({"role": "assistant", "content": answer, "reasoning_content": None})
    return {
        "id": sample_id,
        "shard": 0,
        "split": "train",
        "messages": generated,
        "turns": [],
        "prompt_tokens": 0,
        "completion_tokens": 0,
        "error": error,
        "fingerprint": fingerprint,
        "prompt_hash": digest,
    }


def wanted_of(*prompts: dict) -> dict[str, Wanted]:
    return {p["id"]: Wanted.of(p) for p in prompts}


# --- the hash -------------------------------------------------------------------------------


def test_the_rows_hash_is_the_ingests_hash_of_the_prompt_turns(tmp_path):
    """One hash: the prompt shard's messages give the hash the ingest dedupes by (and ids
    hash-identified samples by); assistant turns are not part of it."""
    source = {
        "messages": [
            {"role": "system", "content": "Be brief."},
            user("What is 1 + 2?"),
            {"role": "assistant", "content": "placeholder"},
            user("And 3 + 4?"),
        ]
    }
    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps(source) + "\n")  # no id field: the id is the prompt hash
    ingest([str(data)], 1, str(tmp_path / "p.parquet"), str(tmp_path / "s.json"), str(tmp_path / "q.jsonl"))
    (row,) = read_shard(tmp_path / "p.parquet", 0).to_pylist()
    parsed = parse_row(source, "data.jsonl", 1)
    assert messages_prompt_hash(row["messages"]) == prompt_hash(parsed.prompt_turns) == row["id"]
    edited = [{**m, "content": "placeholder 2"} if m["role"] == "assistant" else m for m in row["messages"]]
    assert messages_prompt_hash(edited) == row["id"]
    assert messages_prompt_hash([*row["messages"][:-1], user("And 3 + 5?")]) != row["id"]


def test_generated_rows_carry_the_prompt_hash(tmp_path):
    progress = ShardProgress(open_storage(tmp_path), "generate", 0)
    prompts = [prompt("a", user("What is 1 + 1?")), prompt("b", user("What is 2 + 2?"))]
    table = run_shard(prompts, progress, EchoGenerator())
    assert table.schema == GENERATED_SCHEMA
    assert table.column("prompt_hash").to_pylist() == [messages_prompt_hash(p["messages"]) for p in prompts]


# --- the matching rule ----------------------------------------------------------------------


def test_only_rows_of_the_same_id_fingerprint_and_prompt_are_reused():
    kept, edited, other = (
        prompt("kept", user("What is 1 + 1?")),
        prompt("edited", user("What is 2 + 2?")),
        prompt("other", user("What is 3 + 3?")),
    )
    old_edited = [user("What is 2 + 3?")]  # the text "edited" had when its row was generated
    saved = pa.Table.from_pylist(
        [
            saved_row("kept", kept["messages"], digest=messages_prompt_hash(kept["messages"])),
            saved_row("edited", old_edited, digest=messages_prompt_hash(old_edited)),
            saved_row(
                "other", other["messages"], digest=messages_prompt_hash(other["messages"]), fingerprint="another model"
            ),
            saved_row("gone", [user("x")], digest=messages_prompt_hash([user("x")])),  # not wanted
        ],
        schema=GENERATED_SCHEMA,
    )
    found = reusable_rows(saved, FP, wanted_of(kept, edited, other))
    assert list(found) == ["kept"]
    assert found["kept"]["messages"][-1]["content"] == "old answer"


def test_a_row_without_a_prompt_hash_or_with_an_error_is_not_reused():
    a, b = prompt("a", user("What is 1 + 1?")), prompt("b", user("What is 2 + 2?"))
    saved = pa.Table.from_pylist(
        [
            saved_row("a", a["messages"], digest=None),
            saved_row("b", b["messages"], digest=messages_prompt_hash(b["messages"]), error="timed out"),
        ],
        schema=GENERATED_SCHEMA,
    )
    assert reusable_rows(saved, FP, wanted_of(a, b)) == {}


def test_assistant_turns_moved_under_the_same_prompt_hash_are_not_reused():
    """The hash leaves assistant turns out (like the ingest's dedupe): a row generated with a
    reply between the user turns does not stand for the prompt without one."""
    two_turns = [user("What is 1 + 1?"), {"role": "assistant", "content": ""}, user("And 2 + 2?")]
    one_turn = [user("What is 1 + 1?"), user("And 2 + 2?")]
    assert messages_prompt_hash(two_turns) == messages_prompt_hash(one_turn)
    old = saved_row("s", one_turn, digest=messages_prompt_hash(one_turn))
    saved = pa.Table.from_pylist([old], schema=GENERATED_SCHEMA)
    assert reusable_rows(saved, FP, wanted_of(prompt("s", *two_turns))) == {}
    assert list(reusable_rows(saved, FP, wanted_of(prompt("s", *one_turn)))) == ["s"]


def test_the_latest_matching_row_of_an_id_wins():
    p = prompt("s", user("What is 1 + 1?"))
    digest = messages_prompt_hash(p["messages"])
    saved = pa.Table.from_pylist(
        [
            saved_row("s", p["messages"], digest=digest, answer="first"),
            saved_row("s", p["messages"], digest=digest, answer="second"),
        ],
        schema=GENERATED_SCHEMA,
    )
    assert reusable_rows(saved, FP, wanted_of(p))["s"]["messages"][-1]["content"] == "second"


# --- through generate_shard -----------------------------------------------------------------


@pytest.mark.parametrize("saved_as", ["reuse", "parts"])
def test_an_edited_prompt_under_the_same_id_is_generated_again(tmp_path, caplog, saved_as):
    progress = ShardProgress(open_storage(tmp_path), "generate", 0)
    prompts = [prompt(f"s{i}", user(f"What is {i} + 10?")) for i in range(5)]
    first = run_shard(prompts, progress, EchoGenerator())
    if saved_as == "reuse":
        finish_shard(progress, first)  # a finished shard, re-planned after the data changed
    else:
        assert progress.part_keys()  # an interrupted attempt: its parts stay
    edited = [*prompts[:2], prompt("s2", user("What is 2 + 99?")), *prompts[3:]]
    generator = EchoGenerator()
    with caplog.at_level(logging.INFO, logger="dflash_pipeline.engines.regenerate"):
        second = run_shard(edited, progress, generator)
    assert generator.asked == ["What is 2 + 99?"]  # only the edited prompt was generated
    assert RESUMED.search(caplog.text).groups() == ("5", "4", "1")
    source = {"reuse": "earlier build's", "parts": "progress part"}[saved_as]
    assert f"1 {source} rows not reused: their prompt changed" in caplog.text
    before, after = first.to_pylist(), second.to_pylist()
    assert after[2]["messages"][0]["content"] == "What is 2 + 99?"
    assert after[2]["messages"][-1]["content"] == "answer to What is 2 + 99?"
    assert after[2]["prompt_hash"] == messages_prompt_hash(edited[2]["messages"]) != before[2]["prompt_hash"]
    assert [r for i, r in enumerate(after) if i != 2] == [r for i, r in enumerate(before) if i != 2]


def test_parts_and_reuse_objects_without_the_hash_column_are_regenerated_not_fatal(tmp_path):
    """Objects written before rows carried a prompt hash read back with nulls: their rows are
    generated again; nothing fails."""
    run = open_storage(tmp_path)
    progress = ShardProgress(run, "generate", 0)
    prompts = [prompt(f"s{i}", user(f"What is {i} + 10?")) for i in range(4)]
    old_rows = [saved_row(p["id"], p["messages"], digest=None) for p in prompts]
    for row in old_rows:
        del row["prompt_hash"]

    progress.save_reusable(pa.Table.from_pylist(old_rows[:2], schema=OLD_SCHEMA))
    progress.write_part(pa.Table.from_pylist(old_rows[2:], schema=OLD_SCHEMA))
    assert progress.load_reusable(GENERATED_SCHEMA).column("prompt_hash").null_count == 2
    assert progress.load_parts(GENERATED_SCHEMA).column("prompt_hash").null_count == 2
    generator = EchoGenerator()
    table = run_shard(prompts, progress, generator)
    assert sorted(generator.asked) == sorted(p["messages"][0]["content"] for p in prompts)
    assert all(r["messages"][-1]["content"].startswith("answer to ") for r in table.to_pylist())
    assert None not in table.column("prompt_hash").to_pylist()


def test_choosing_reads_whole_rows_only_for_the_wanted_ones():
    """Thousands of saved rows: only the rows taken are converted to Python whole."""
    rows = []
    for i in range(3000):
        messages = [user(f"q{i}")]
        row = saved_row(f"s{i}", messages, digest=messages_prompt_hash(messages))
        row["turns"] = [
            {
                "message_index": 1,
                "finish_reason": "stop",
                "think_closed": True,
                "prompt_tokens": 5,
                "completion_tokens": 256,
                "output_ids": list(range(256)),
            }
        ]
        rows.append(row)
    saved = pa.Table.from_pylist(rows, schema=GENERATED_SCHEMA)
    wanted = wanted_of(*(prompt(f"s{i}", user(f"q{i}")) for i in range(0, 3000, 100)))
    converted: list[int] = []

    class Watched:
        """The saved table, counting the rows it hands out whole."""

        num_rows = saved.num_rows
        column = saved.column

        def take(self, indices):
            converted.append(len(indices))
            return saved.take(indices)

        def to_pylist(self):
            converted.append(saved.num_rows)
            return saved.to_pylist()

    found = reusable_rows(Watched(), FP, wanted)
    assert sorted(found) == sorted(wanted) and converted == [30]


# --- the workflow ---------------------------------------------------------------------------


@pytest.mark.workflow
def test_editing_a_prompt_under_its_id_regenerates_it_and_reuses_the_rest(
    workflow, demo_model, tmp_path, session_endpoint
):
    from tests.test_generate_workflow import GENERATED, configure

    configure(workflow, demo_model, tmp_path, prompts=6, max_new_tokens=48, concurrency=6, part_every_samples=64)
    workflow.write_config(**session_endpoint)  # reuse is the subject, not the engine's launch
    workflow.snakemake()
    before = {r["id"]: r for r in pq.read_table(workflow.root / GENERATED).to_pylist()}
    data = workflow.root / "data/few.jsonl"
    rows = [json.loads(line) for line in data.read_text().splitlines()]
    old_text = rows[1]["messages"][0]["content"]
    new_text = "What is 4321 + 1234?"
    assert new_text != old_text
    rows[1]["messages"][0]["content"] = new_text  # a fix of the prompt's text, same source id
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    workflow.snakemake()
    log_text = (workflow.root / "results/demo/logs/generate/00000.log").read_text()
    assert RESUMED.findall(log_text)[-1] == ("6", "5", "1")
    assert "1 earlier build's rows not reused: their prompt changed" in log_text
    after = {r["id"]: r for r in pq.read_table(workflow.root / GENERATED).to_pylist()}
    assert set(after) == set(before)
    edited_id = rows[1]["id"]
    new, old = after[edited_id], before[edited_id]
    assert new["messages"][0]["content"] == new_text and old["messages"][0]["content"] == old_text
    assert new["prompt_hash"] == messages_prompt_hash([user(new_text)]) != old["prompt_hash"]
    assert new["error"] is None
    # The response was generated for the new question (the demo target answers the numbers asked).
    assert new["messages"][-1] != old["messages"][-1]
    for sample_id, row in after.items():
        if sample_id != edited_id:
            assert row == before[sample_id]  # reused as it was, not regenerated


# --- what a resume or a repair reads is checked -------------------------------------------


def _finished_shard(tmp_path, prompts: list[dict]) -> tuple[ShardProgress, pa.Table]:
    progress = ShardProgress(open_storage(tmp_path), "generate", 0)
    table = run_shard(prompts, progress, EchoGenerator())
    finish_shard(progress, table)
    return progress, table


def test_a_changed_byte_in_the_reuse_copy_is_named_and_its_rows_generated_again(tmp_path, caplog):
    """The laundering case: one digit of a saved answer changed in the reuse copy (the bytes
    still parse) must not reach the rebuilt shard, which would then get a valid checksum."""
    prompts = [prompt(f"s{i}", user(f"What is {i} + 2022?")) for i in range(4)]
    progress, table = _finished_shard(tmp_path, prompts)
    key = layout.reuse_key("generate", 0)
    data = progress.run.read_bytes(key)
    damaged = data.replace(b"2022", b"2092", 1)
    assert damaged != data and pq.read_table(io.BytesIO(damaged)).num_rows == 4  # still parses
    progress.run.write_bytes(key, damaged)

    generator = EchoGenerator()
    with caplog.at_level(logging.WARNING):
        rebuilt = run_shard(prompts, progress, generator)
    assert f"reuse copy {progress.run.join(key)} is damaged: its sha256 is" in caplog.text
    assert "dropped; its rows are generated again" in caplog.text
    assert sorted(generator.asked) == sorted(p["messages"][0]["content"] for p in prompts)
    assert rebuilt.to_pylist() == table.to_pylist()
    assert not progress.run.exists(key)  # a later rebuild does not meet it again


def test_damaged_or_unrecorded_parts_are_dropped_and_the_rest_resumed(tmp_path, caplog):
    run = open_storage(tmp_path)
    progress = ShardProgress(run, "generate", 0)
    prompts = [prompt(f"s{i}", user(f"What is {i} + 10?")) for i in range(3)]
    rows = [saved_row(p["id"], p["messages"], digest=Wanted.of(p).prompt_hash) for p in prompts]
    good = progress.write_part(pa.Table.from_pylist(rows[:1], schema=GENERATED_SCHEMA))
    damaged = progress.write_part(pa.Table.from_pylist(rows[1:2], schema=GENERATED_SCHEMA))
    unrecorded = progress.write_part(pa.Table.from_pylist(rows[2:], schema=GENERATED_SCHEMA))
    data = run.read_bytes(damaged)
    run.write_bytes(damaged, data[:-20] + bytes([data[-20] ^ 1]) + data[-19:])
    run.delete(unrecorded + ".sha256.json")
    with caplog.at_level(logging.WARNING):
        assert progress.load_parts(GENERATED_SCHEMA).column("id").to_pylist() == ["s0"]
    assert f"progress part {run.join(damaged)} is damaged" in caplog.text
    assert f"progress part {run.join(unrecorded)} has no checksum record" in caplog.text
    assert progress.part_keys() == [good]
    assert progress.clear_parts() == 1 and run.list(progress.prefix + "part-") == []
