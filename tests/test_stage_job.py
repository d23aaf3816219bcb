"""stage_job, the glue every rule's script runs its stage in (dflash_pipeline.core.stage_job), as
plain Python: a job object built from Snakemake's own containers, in a local run root. The
workflow tests run it inside Snakemake."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from snakemake.iocontainers import InputFiles, Log, OutputFiles, Params, ResourceList, Wildcards
from snakemake.script import Snakemake

from dflash_pipeline.core.checksums import ChecksumError, read_record
from dflash_pipeline.core.config import validate_config
from dflash_pipeline.core.joblog import ATTEMPTS_DIR
from dflash_pipeline.core.stage_job import NO_ENGINE, stage_job
from dflash_pipeline.core.storage import open_storage


def files(container, named: dict):
    """A Snakemake file container as a rule's named input/output/log gives it: a name holds one
    file or a list of them (``expand``), flat in the container."""
    flat = container()
    for name, value in named.items():
        start = len(flat)
        flat.extend([value] if isinstance(value, str) else value)
        flat._set_name(name, start, len(flat) if not isinstance(value, str) else None)
    return flat


def job(run: Path, rule: str, *, input=None, output=None, params=None, log=None, wildcards=None, resources=None):
    """The ``snakemake`` object of one job of ``rule`` whose run root is ``run``."""
    config = validate_config({"gpus": 0, "gpu_lock_dir": str(run / "locks")})
    return Snakemake(
        files(InputFiles, input or {}),
        files(OutputFiles, output or {}),
        Params(fromdict={"run_url": str(run), **(params or {})}),
        Wildcards(fromdict=wildcards or {}),
        1,
        ResourceList(fromdict={"gpu": 0, **(resources or {})}),
        files(Log, log or {"job": str(run / f"logs/{rule}.log")}),
        config,
        rule,
        None,
    )


def test_a_job_logs_records_its_outputs_and_the_next_job_verifies_them(tmp_path):
    run = tmp_path / "run"
    out = run / "outputs/prepare-00001.parquet"
    prepare = job(run, "prepare", output={"prompts": str(out)}, wildcards={"shard": "00001"})
    with stage_job(prepare, "prepare") as stage:
        stage.log.info("selecting shard 1")
        out.parent.mkdir(parents=True)
        out.write_bytes(b"rows")
        stage.record(prepare.output.prompts)
    assert "selecting shard 1" in (run / "logs/prepare.log").read_text()
    record = read_record(open_storage(run), "outputs/prepare-00001.parquet")
    assert (record.size, record.rule, record.shard) == (4, "prepare", "00001")
    # No attempt resource: no attempt logs.
    assert not (run / ATTEMPTS_DIR).exists()

    generate = job(run, "generate", input={"prompts": [str(out)]}, wildcards={"shard": "00001"})
    with stage_job(generate, "generate") as stage:
        stage.verify(generate.input.prompts)  # a list, as Snakemake gives a named list input
    out.write_bytes(b"ROWS")
    with pytest.raises(ChecksumError, match="prepare-00001.parquet is damaged"):
        with stage_job(generate, "generate") as stage:
            stage.verify(str(out))
    # The error is in the job's log, not only on stderr.
    assert "job failed:" in (run / "logs/generate.log").read_text()


def test_a_refusal_ends_the_job_with_status_1_and_the_reason_in_its_log(tmp_path, capfd):
    run = tmp_path / "run"

    class Refused(Exception):
        pass

    with pytest.raises(SystemExit) as ended:
        with stage_job(job(run, "ingest", log={"log": str(run / "logs/ingest.log")}), "ingest", refusals=(Refused,)):
            raise Refused("10 of 14 rows are bad")
    assert ended.value.code == 1
    assert "10 of 14 rows are bad" in (run / "logs/ingest.log").read_text()
    assert "Traceback" not in capfd.readouterr().err
    # Any other error still leaves as itself.
    with pytest.raises(ValueError), stage_job(job(run, "ingest"), "ingest", refusals=(Refused,)):
        raise ValueError("a bug")


def test_a_retried_job_keeps_each_attempts_logs_and_bundles_its_engine_log(tmp_path):
    run = tmp_path / "run"
    logs = {"job": str(run / "logs/generate/00002.log"), "engine": str(run / "logs/generate-engine/00002.log")}

    def attempt(number):
        return job(run, "generate", log=logs, wildcards={"shard": "00002"}, resources={"attempt": number})

    with pytest.raises(RuntimeError), stage_job(attempt(1), "generate") as first:
        Path(first.engine_log).parent.mkdir(parents=True, exist_ok=True)
        Path(first.engine_log).write_text("engine: out of memory\n")
        raise RuntimeError("the engine died")
    first_name = first.attempt.name
    with stage_job(attempt(2), "generate", engine_absent="no engine for this test") as second:
        args = second.engine_args()
        assert args["engine_log"] == second.engine_log
        assert args["runtime_dir"] == str(run / "locks") and args["engines"] == second.smk.config["engines"]
        assert logs["engine"] in args["engine_log_label"] and second.engine_log in args["engine_log_label"]
    kept = run / ATTEMPTS_DIR / "generate-00002"
    assert "the engine died" in (kept / f"{first_name}.job.log").read_text()
    assert "attempt 2 of this job" in (kept / f"{second.attempt.name}.job.log").read_text()
    # The declared engine log: the first attempt's last lines, then this attempt's (it ran none).
    engine = Path(logs["engine"]).read_text()
    assert engine.index("engine: out of memory") < engine.index("no engine for this test")


def test_an_engine_folder_is_emptied_first_and_bundled_into_the_engine_log(tmp_path):
    run = tmp_path / "run"
    logs = {"job": str(run / "logs/evaluate.log"), "engine": str(run / "logs/evaluate-engine.log")}
    evaluate = job(run, "evaluate", log=logs, resources={"attempt": 1})
    stale = run / "logs/evaluate-engine/old.log"
    stale.parent.mkdir(parents=True)
    stale.write_text("an earlier attempt's\n")
    with stage_job(evaluate, "evaluate") as stage, stage.engine_folder() as folder:
        assert not stale.exists()
        folder.mkdir(parents=True)
        (folder / "server.log").write_text("serving\n")
    assert Path(logs["engine"]).read_text() == "===== server.log =====\nserving\n"
    # A job that ran no engine at all says so in its declared engine log.
    other = tmp_path / "other"
    logs = {"job": str(other / "logs/evaluate.log"), "engine": str(other / "logs/evaluate-engine.log")}
    with stage_job(job(other, "evaluate", log=logs, resources={"attempt": 1}), "evaluate"):
        pass
    assert Path(logs["engine"]).read_text() == NO_ENGINE + "\n"


def test_settings_devices_and_a_file_beside_the_log(tmp_path, monkeypatch):
    run = tmp_path / "run"
    extract = job(run, "extract", params={"settings": {"num_layers": 3}})
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    with stage_job(extract, "extract") as stage:
        # The rule's defining keys from its param, the operational ones from the config.
        settings = stage.settings()
        assert settings["num_layers"] == 3 and settings["batch_size"] == extract.config["train"]["batch_size"]
        assert stage.settings({"num_layers": 8})["num_layers"] == 8
        with stage.devices() as lease:  # a CPU job: no device, and none visible
            assert lease.visible_devices == "" and os.environ["CUDA_VISIBLE_DEVICES"] == ""
        assert stage.beside_log(".failed.json") == run / "logs/extract.failed.json"
        with pytest.raises(ValueError, match="declares no engine log"):
            stage.engine_log  # noqa: B018 (the property raises)
