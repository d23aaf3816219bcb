"""The run's halt: a tokenize shard failing the quality gate stops generation, extraction and
training until a person clears it (dflash_pipeline.core.jobstate)."""

from __future__ import annotations

import asyncio
import json
import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dflash_pipeline.core import layout
from dflash_pipeline.core.jobstate import (
    RunHalted,
    ShardProgress,
    clear_halt,
    raise_if_halted,
    read_halt,
    write_halt,
)
from dflash_pipeline.core.storage import open_storage
from dflash_pipeline.data.quality import DegenerateShard
from dflash_pipeline.engines.client import Sampling
from dflash_pipeline.engines.regenerate import GENERATED_SCHEMA, GenerationSettings, generate_shard
from tests.support.generated_rows import generated_row, healthy

CAUSE = "failed the data-quality gate: 87 of 100 samples (87.0%) degenerate"


def test_the_first_cause_stays_and_only_clearing_removes_it(tmp_path):
    run = open_storage(tmp_path)
    assert read_halt(run) is None
    raise_if_halted(run, "generate shard 00001")  # not halted: nothing happens
    write_halt(run, "tokenize", 3, CAUSE, "the gate's full message", {"samples": 100})
    write_halt(run, "tokenize", 4, "failed the data-quality gate: later", "later")
    halt = read_halt(run)
    assert (halt["stage"], halt["shard"], halt["cause"]) == ("tokenize", "00003", CAUSE)
    assert json.loads((tmp_path / layout.HALT).read_text())["details"] == {"samples": 100}
    with pytest.raises(RunHalted) as err:
        raise_if_halted(run, "generate shard 00001")
    message = str(err.value)
    assert message.startswith("generate shard 00001 stopped: the run is halted since ")
    assert f"tokenize shard 00003 {CAUSE}" in message
    assert f"python -m dflash_pipeline.stages.tokenize clear-halt --run-url {tmp_path}" in message
    assert clear_halt(run)["shard"] == "00003"
    assert read_halt(run) is None and clear_halt(run) is None


def test_a_damaged_halt_object_still_halts(tmp_path):
    (tmp_path / "_progress").mkdir()
    (tmp_path / layout.HALT).write_text("{not json")
    with pytest.raises(RunHalted, match="unreadable halt object"):
        raise_if_halted(open_storage(tmp_path), "train segment 0000")


def test_a_failed_gate_halts_the_run_naming_its_shard(demo_model, tmp_path):
    from dflash_pipeline.stages.tokenize import tokenize_file

    rows = [healthy(i) for i in range(13)] + [generated_row(100 + i, "OK.", "") for i in range(87)]
    generated = tmp_path / "generate-00007.parquet"
    pq.write_table(pa.Table.from_pylist(rows, schema=GENERATED_SCHEMA), generated)
    run = tmp_path / "run"
    for shard in (7, 8):  # a second failing shard leaves the first cause in place
        with pytest.raises(DegenerateShard):
            tokenize_file(
                str(generated),
                str(demo_model),
                str(tmp_path / "t.parquet"),
                str(tmp_path / "t.stats.json"),
                True,
                {},
                run_url=str(run),
                shard=shard,
                workers=1,
            )
    halt = read_halt(open_storage(run))
    assert halt["stage"] == "tokenize" and halt["shard"] == "00007"
    assert halt["cause"].startswith("failed the data-quality gate: 87 of 100 samples (87.0%) degenerate")
    assert "most common response, 87 times: ' | OK.'" in halt["cause"]
    assert "87 of 100 samples (87.0%) are degenerate" in halt["message"]
    assert halt["details"]["reasons"]["identical_response"] == 87
    assert not (tmp_path / "t.parquet").exists()


def test_without_a_run_the_tokenize_cli_halts_nothing(demo_model, tmp_path):
    from dflash_pipeline.stages.tokenize import main

    rows = [generated_row(100 + i, "OK.", "") for i in range(20)]
    pq.write_table(pa.Table.from_pylist(rows, schema=GENERATED_SCHEMA), tmp_path / "g.parquet")
    code = main(
        [
            str(tmp_path / "g.parquet"),
            "--model",
            str(demo_model),
            "--out",
            str(tmp_path / "t.parquet"),
            "--stats",
            str(tmp_path / "s.json"),
            "--workers",
            "1",
        ]
    )
    assert code == 1 and not list(tmp_path.rglob("HALT.json"))


def test_clear_halt_command_finds_the_run_from_the_config_or_the_url(tmp_path, monkeypatch, capsys):
    from dflash_pipeline.stages.tokenize import main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "config.yaml").write_text("run: myrun\nresults_dir: res\n")
    run = open_storage(tmp_path / "res/myrun")
    write_halt(run, "tokenize", 2, CAUSE, "msg")
    assert main(["show-halt"]) == 0 and '"shard": "00002"' in capsys.readouterr().out
    assert main(["clear-halt"]) == 0
    out = capsys.readouterr().out
    assert f"res/myrun: cleared the halt of tokenize shard 00002 ({CAUSE})" in out
    assert read_halt(run) is None
    assert main(["clear-halt", "--run-url", str(tmp_path / "res/myrun")]) == 0
    assert "not halted, nothing to clear" in capsys.readouterr().out


def test_halted_generate_extract_and_train_jobs_refuse_before_loading_anything(tmp_path):
    from dflash_pipeline.stages.extract import extract_job
    from dflash_pipeline.stages.generate import main as generate_main
    from dflash_pipeline.stages.generate import run_job
    from dflash_pipeline.stages.train import train_job

    write_halt(open_storage(tmp_path), "tokenize", 0, CAUSE, "msg")
    missing = str(tmp_path / "no-such-model")  # never opened: the halt is checked first
    with pytest.raises(RunHalted, match=r"^generate shard 00004 stopped: .*tokenize shard 00000 failed"):
        run_job("none.parquet", "out.parquet", str(tmp_path), 4, missing, {}, "engine.log", ".")
    with pytest.raises(RunHalted, match=r"^extract shard 00002 stopped: "):
        extract_job("none.parquet", missing, {}, str(tmp_path), "00002", "manifest.json")
    with pytest.raises(RunHalted, match=r"^train segment 0001 stopped: "):
        train_job(str(tmp_path), 1, {}, missing, [], [], "manifest.json", 0)
    # Through the CLI: arguments that pass its checks (a prompt shard, a folder with a config),
    # and still nothing is loaded.
    from dflash_pipeline.stages.prepare import PROMPT_SCHEMA

    prompts, model = tmp_path / "p.parquet", tmp_path / "model"
    pq.write_table(PROMPT_SCHEMA.empty_table(), prompts)
    model.mkdir()
    (model / "config.json").write_text("{}")
    assert (
        generate_main(
            [
                "--prompts",
                str(prompts),
                "--out",
                "o",
                "--run-url",
                str(tmp_path),
                "--shard",
                "4",
                "--model",
                str(model),
                "--generation-json",
                "{}",
            ]
        )
        == 1
    )


class LongRequests:
    """A generator whose first four conversations finish at once and whose others stay in flight
    until cancelled; the third one's turn is when another shard's gate fails."""

    def __init__(self, run):
        self.run = run
        self.settings = GenerationSettings(
            thinking=True,
            sampling=Sampling(max_new_tokens=8, temperature=0.0),
            concurrency=12,
            part_every_samples=2,
            part_every_seconds=3600,
            telemetry_every_seconds=0.5,
        )
        self.fingerprint = "f"
        self.cancelled = 0

    async def conversation(self, row):
        i = int(row["id"][1:])
        if i == 2:
            write_halt(self.run, "tokenize", 5, CAUSE, "msg")
        if i >= 4:
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                self.cancelled += 1
                raise
        return healthy(i)


def test_a_running_generate_job_stops_at_its_next_part_and_keeps_its_finished_samples(tmp_path):
    run = open_storage(tmp_path)
    progress = ShardProgress(run, "generate", 1)
    prompts = pa.Table.from_pylist(
        [
            {
                "id": f"s{i}",
                "shard": 1,
                "split": "train",
                "messages": [{"role": "user", "content": f"What is {i} + {i}?"}],
            }
            for i in range(12)
        ]
    )
    generator = LongRequests(run)
    with pytest.raises(RunHalted, match=r"^generate shard 00001 stopped: .*tokenize shard 00005 failed"):
        # Without the halt the job would wait on its long requests forever.
        asyncio.run(asyncio.wait_for(generate_shard(prompts, generator, progress, lambda: {}), 60))
    saved = progress.load_parts(GENERATED_SCHEMA).column("id").to_pylist()
    assert sorted(saved) == ["s0", "s1", "s2", "s3"]  # every finished sample, none twice
    assert generator.cancelled == 8  # the requests in flight were given up
    assert progress.read_telemetry()["state"] == "failed"


def test_the_status_page_shows_the_halt(tmp_path):
    from dflash_pipeline.core.storage import ReadOnlyStorage
    from dflash_pipeline.status.snapshot import RunSource, SnapshotBuilder

    run = open_storage(tmp_path)
    run.write_bytes("outputs/prepare-00000.parquet", b"x")
    source = RunSource(ReadOnlyStorage(run), num_shards=1, stages=("prepare", "generate", "tokenize"))
    builder = SnapshotBuilder(source)
    assert builder.build()["halt"] is None
    write_halt(run, "tokenize", 0, CAUSE, "the full message")
    halt = builder.build()["halt"]
    assert (halt["stage"], halt["shard"], halt["cause"]) == ("tokenize", "00000", CAUSE)
    assert halt["halted_at_utc"] and "message" not in halt
    clear_halt(run)
    assert builder.build()["halt"] is None


def test_the_status_page_names_the_driver_holding_the_lease(tmp_path):
    from dflash_pipeline.core.lease import RunLease
    from dflash_pipeline.core.storage import ReadOnlyStorage
    from dflash_pipeline.status.snapshot import RunSource, SnapshotBuilder

    run = open_storage(tmp_path)
    run.write_bytes("outputs/prepare-00000.parquet", b"x")
    builder = SnapshotBuilder(RunSource(ReadOnlyStorage(run), num_shards=1, stages=("prepare", "generate", "tokenize")))
    assert builder.build()["lease"] is None
    lease = RunLease(run, ttl_s=300).acquire()
    shown = builder.build()["lease"]
    assert shown["expired"] is False and f"pid {os.getpid()}" in shown["holder"]
    assert "last heartbeat" in shown["holder"]
    lease.release()
    assert builder.build()["lease"] is None


def test_a_telemetry_write_that_fails_never_stops_the_job(tmp_path, caplog):
    from dflash_pipeline.core.jobstate import Telemetry
    from dflash_pipeline.core.storage import StorageError

    class Unreachable:
        def write_text(self, key, text):
            raise StorageError(f"writing s3://b/{key} failed: Could not connect to the endpoint URL")

    telemetry = Telemetry(Unreachable(), "_progress/generate/shard-00000/", {"shard": 0}, total=4, every_s=10)
    telemetry.write("failed")  # the job's last word, in its `finally`: logged, not raised
    assert telemetry.state == "failed" and "telemetry not written (the job goes on)" in caplog.text
