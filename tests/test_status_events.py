"""Job events: the logger plugin records Snakemake's job events; the board folds them into states."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
from snakemake_interface_logger_plugins.common import LogEvent

from dflash_pipeline.status.events import EventWriter, JobBoard, RunEvents, event_from_record
from snakemake_logger_plugin_dflash import LogHandler, LogHandlerSettings


def record(event: LogEvent, **fields) -> logging.LogRecord:
    return logging.makeLogRecord({"msg": str(event), "event": event, **fields})


def test_records_become_events_and_other_records_are_dropped():
    info = event_from_record(
        record(
            LogEvent.JOB_INFO,
            jobid=7,
            rule_name="generate",
            wildcards={"shard": "00003"},
            log=["results/demo/logs/generate/00003.log"],
            output="results/demo/outputs/generate-00003.parquet",
            resources={"gpu": 2, "mem_mb": 1000},
        ),
        now=10.0,
    )
    assert info == {
        "event": "job_info",
        "time": 10.0,
        "jobid": 7,
        "rule": "generate",
        "wildcards": {"shard": "00003"},
        "log": ["results/demo/logs/generate/00003.log"],
        "output": ["results/demo/outputs/generate-00003.parquet"],
        "gpus": 2,  # the headline's GPU-hours count it
    }
    assert event_from_record(record(LogEvent.JOB_STARTED, jobs=[7, 8]))["jobids"] == [7, 8]
    assert event_from_record(record(LogEvent.PROGRESS, done=3, total=9))["done"] == 3
    # The shell command may carry anything: it is not recorded.
    assert event_from_record(record(LogEvent.SHELLCMD, shellcmd="echo secret")) is None
    assert event_from_record(logging.makeLogRecord({"msg": "plain text"})) is None


def fold(events: list[dict]) -> RunEvents:
    run = RunEvents()
    for event in events:
        run.apply(event)
    return run


def job_info(jobid, rule="generate", shard="00000"):
    return {
        "event": "job_info",
        "time": 1,
        "jobid": jobid,
        "rule": rule,
        "wildcards": {"shard": shard},
        "log": [],
        "output": [],
    }


def test_a_job_started_before_its_details_is_running_then_done_or_failed():
    run = fold(
        [
            {"event": "workflow_started", "time": 0},
            {"event": "job_started", "time": 1, "jobids": [1, 2]},  # Snakemake's actual order
            job_info(1),
            job_info(2, shard="00001"),
            {"event": "job_finished", "time": 5, "jobid": 1},
            {"event": "job_error", "time": 6, "jobid": 2, "rule": "generate", "log": ["x.log"], "message": "boom"},
        ]
    )
    assert run.jobs[1].state == "done" and run.jobs[1].started_at == 1
    assert run.jobs[2].state == "failed" and run.jobs[2].message == "boom"
    assert run.jobs[2].wildcards == {"shard": "00001"}
    assert run.state == "running, with failures"


def test_jobs_still_running_when_snakemake_exits_are_interrupted_and_a_new_run_starts_clean():
    run = fold(
        [
            {"event": "workflow_started", "time": 0},
            {"event": "job_started", "time": 1, "jobids": [1]},
            job_info(1),
            {"event": "run_ended", "time": 2},
        ]
    )
    assert run.jobs[1].state == "interrupted" and run.state == "stopped"
    run.apply({"event": "workflow_started", "time": 3})
    assert run.jobs == {} and run.state == "running"


def test_board_reads_only_complete_lines_and_picks_up_appended_ones(tmp_path):
    path = tmp_path / "events.jsonl"
    board = JobBoard(path)
    assert board.refresh().state == "unknown"  # no file yet
    writer = EventWriter(path)
    writer.write({"event": "workflow_started", "time": 0})
    writer.write({"event": "progress", "time": 1, "done": 1, "total": 4})
    with open(path, "a") as fh:
        fh.write('{"event": "progress", "time": 2, "done": 2')  # a line still being written
    assert board.refresh().steps_done == 1
    with open(path, "a") as fh:
        fh.write(', "total": 4}\n')
    assert board.refresh().steps_done == 2
    writer.close()
    assert board.refresh().ended_at is not None


class _OutputSettings:
    dryrun = False


def test_plugin_handler_appends_job_events_to_its_file(tmp_path):
    path = tmp_path / "logs" / "events.jsonl"
    handler = LogHandler(_OutputSettings(), LogHandlerSettings(events_file=str(path)))
    handler.emit(record(LogEvent.WORKFLOW_STARTED, workflow_id="abc"))
    handler.emit(record(LogEvent.JOB_FINISHED, job_id=3))
    handler.emit(logging.makeLogRecord({"msg": "chatter"}))
    handler.close()
    events = [json.loads(line) for line in path.read_text().splitlines()]
    assert [e["event"] for e in events] == ["workflow_started", "job_finished", "run_ended"]


@pytest.mark.workflow
def test_snakemake_with_logger_dflash_records_started_finished_and_failed_jobs(tmp_path):
    (tmp_path / "Snakefile").write_text(
        "rule all:\n    input: 'ok-1.txt', 'ok-2.txt', 'bad.txt'\n\n"
        "rule ok:\n    output: 'ok-{n}.txt'\n    shell: 'echo {wildcards.n} > {output}'\n\n"
        "rule bad:\n    output: 'bad.txt'\n    log: 'logs/bad.log'\n"
        "    shell: 'echo the reason it failed > {log}; exit 3'\n"
    )
    env = dict(os.environ)
    # The plugin is found by module name on the path, as when the package is installed.
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parent.parent), env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "snakemake",
            "--cores",
            "1",
            "--keep-going",
            "--logger",
            "dflash",
            "--logger-dflash-events-file",
            "events.jsonl",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode != 0  # rule bad fails on purpose
    run = JobBoard(tmp_path / "events.jsonl").refresh()
    by_rule = {}
    for job in run.jobs.values():
        by_rule.setdefault(job.rule, []).append(job.state)
    assert sorted(by_rule["ok"]) == ["done", "done"]
    assert by_rule["bad"] == ["failed"]
    bad = next(j for j in run.jobs.values() if j.rule == "bad")
    assert bad.log == ["logs/bad.log"]
    assert run.ended_at is not None and run.state == "failed"


def test_plugin_records_nothing_in_a_dry_run(tmp_path):
    settings = _OutputSettings()
    settings.dryrun = True
    handler = LogHandler(settings, LogHandlerSettings(events_file=str(tmp_path / "events.jsonl")))
    handler.emit(record(LogEvent.JOB_STARTED, jobs=[1]))
    handler.close()
    assert not (tmp_path / "events.jsonl").exists()
