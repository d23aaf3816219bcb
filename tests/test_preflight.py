"""Preflight: a config that would fail days in is refused when the workflow is planned, in one
line per problem naming the key or variable, within the first lines of `snakemake -n`."""

from __future__ import annotations

import json
import shutil
import uuid

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from dflash_pipeline.core.config import validate_config
from dflash_pipeline.core.refusal import EnvironmentProblem, refusal_text
from dflash_pipeline.stages.preflight import (
    dataset_problems,
    model_problems,
    offline_problems,
    storage_problems,
    taps_server_problems,
)
from tests.conftest import REPO
from tests.support.engine_envs import metadata_only_env


def test_offline_float32_taps_are_refused_where_extract_computes_in_bf16():
    def run(until="evaluate", **train):
        return validate_config({"until": until, "train": train})

    (line,) = offline_problems(run(mode="offline", hidden_dtype="float32", gpus_per_job=1))
    assert line.startswith("train.hidden_dtype: float32 would store taps that extract computes in bfloat16 on cuda")
    assert "Set train.hidden_dtype: bfloat16" in line
    assert offline_problems(run(mode="offline", hidden_dtype="float32", gpus_per_job=0)) == []  # fp32 on CPU
    assert offline_problems(run(mode="offline", hidden_dtype="bfloat16", gpus_per_job=1)) == []
    assert offline_problems(run(mode="online", hidden_dtype="float32", gpus_per_job=1)) == []  # nothing stored
    # A run that stops before training extracts nothing either.
    assert offline_problems(run("tokenize", mode="offline", hidden_dtype="float32", gpus_per_job=1)) == []


def test_engine_taps_on_training_gpus_need_the_servers_memory_share():
    def run(until="evaluate", mem_fraction=None, **train):
        return validate_config({"until": until, "train": {**train, "taps_server": {"mem_fraction": mem_fraction}}})

    (line,) = taps_server_problems(run(taps_from="engine", gpus_per_job=4))
    assert line.startswith("train.taps_server.mem_fraction: null, with train.taps_from: engine on 4 GPU(s) per job")
    assert taps_server_problems(run(taps_from="engine", gpus_per_job=4, mem_fraction=0.4)) == []
    assert taps_server_problems(run(taps_from="engine", gpus_per_job=0)) == []  # CPU: no trainer on a card
    assert taps_server_problems(run(taps_from="target", gpus_per_job=4)) == []
    assert taps_server_problems(run(taps_from="engine", mode="offline", gpus_per_job=4)) == []  # extract's server
    assert taps_server_problems(run("tokenize", taps_from="engine", gpus_per_job=4)) == []  # no training


def test_a_model_folder_needs_config_tokenizer_and_weights(tmp_path, demo_model):
    assert model_problems(str(demo_model)) == []
    (line,) = model_problems(str(tmp_path / "nope"))
    assert line.startswith(f"target.model: {tmp_path}/nope does not exist")
    partial = tmp_path / "partial"
    partial.mkdir()
    (partial / "config.json").write_text("{}")
    (line,) = model_problems(str(partial))
    assert "lacks a tokenizer" in line and "weights" in line and "lacks config.json" not in line
    (line,) = model_problems("Qwen/Qwen3.6-27B", tmp_path)
    assert "looks like a hub id" in line and "hf download Qwen/Qwen3.6-27B" in line


def test_a_sharded_checkpoint_missing_files_its_index_lists_is_refused_naming_them(tmp_path, demo_model):
    """A partial download: the index is there, some of the shards it lists are not."""
    model = tmp_path / "model"
    model.mkdir()
    for name in ("config.json", "tokenizer.json"):
        shutil.copy2(demo_model / name, model / name)
    shards = [f"model-{i:05d}-of-00007.safetensors" for i in range(1, 8)]
    index = model / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": {f"layer.{i}": name for i, name in enumerate(shards)}}))
    (model / shards[0]).write_bytes(b"x")
    (line,) = model_problems(str(model))
    assert line == (
        f"target.model: {model}/model.safetensors.index.json lists 6 of its 7 weight files that are not in "
        f"the folder (a partial download?): {', '.join(shards[1:6])} and 1 more"
    )
    for name in shards[1:]:
        (model / name).write_bytes(b"x")
    assert model_problems(str(model)) == []
    index.write_text("{not json")
    (line,) = model_problems(str(model))
    assert line.startswith(f"target.model: {model}/model.safetensors.index.json is not a readable index")


def test_the_config_is_named_after_its_own_problems_not_after_the_environments():
    config_line, env_line = "target.model: /m does not exist", EnvironmentProblem("storage s3://b/r: no S3 credentials")
    assert refusal_text([env_line, config_line], "my-run.yaml").splitlines() == [
        config_line,
        "(check my-run.yaml)",
        env_line,
    ]
    assert refusal_text([env_line], "my-run.yaml") == env_line


def test_dataset_files_are_files_of_a_known_format_with_rows(tmp_path):
    (tmp_path / "folder").mkdir()
    (tmp_path / "empty.jsonl").write_bytes(b"")
    (tmp_path / "blank.jsonl").write_text("\n  \n")
    (tmp_path / "notes.txt").write_text("hello\n")
    (tmp_path / "garbage.parquet").write_bytes(b"not parquet at all")
    pq.write_table(pa.table({"id": pa.array([], pa.string())}), tmp_path / "none.parquet")
    (tmp_path / "good.jsonl").write_text('{"id": "a", "messages": []}\n')
    names = ["folder", "empty.jsonl", "blank.jsonl", "notes.txt", "garbage.parquet", "none.parquet",
             "good.jsonl", "missing.jsonl", "s3://bucket/data.jsonl"]  # fmt: skip
    problems = dataset_problems(names, tmp_path, check_s3=False)  # s3:// files: below
    assert problems == [
        "dataset.paths[0]: folder is a folder; list its files (.jsonl or .parquet) instead",
        "dataset.paths[1]: empty.jsonl is empty (0 bytes)",
        "dataset.paths[2]: blank.jsonl has no rows (only blank lines)",
        "dataset.paths[3]: notes.txt: unknown dataset format (expected .jsonl or .parquet)",
        problems[4],
        "dataset.paths[5]: none.parquet has no rows",
        "dataset.paths[7]: missing.jsonl does not exist",
    ]
    assert problems[4].startswith("dataset.paths[4]: garbage.parquet is not a readable parquet file")


def test_s3_without_credentials_or_with_wrong_ones_is_one_line(monkeypatch, s3_server, s3_env):
    assert storage_problems(f"s3://{s3_server.bucket}/run") == []
    assert storage_problems("s3://a-bucket-not-there-yet/run") == []  # created when the run starts
    monkeypatch.delenv("SNAKEMAKE_STORAGE_S3_SECRET_KEY")
    (line,) = storage_problems(f"s3://{s3_server.bucket}/run")
    # The plugin would hand boto half a pair, which boto refuses.
    assert "SNAKEMAKE_STORAGE_S3_ACCESS_KEY is set without SNAKEMAKE_STORAGE_S3_SECRET_KEY" in line
    monkeypatch.setenv("SNAKEMAKE_STORAGE_S3_SECRET_KEY", "wrong")
    (line,) = storage_problems(f"s3://{s3_server.bucket}/run")
    assert "denied" in line and "check SNAKEMAKE_STORAGE_S3_ACCESS_KEY and" in line and "\n" not in line
    monkeypatch.setenv("SNAKEMAKE_STORAGE_S3_ENDPOINT_URL", "http://127.0.0.1:9")
    (line,) = storage_problems(f"s3://{s3_server.bucket}/run")
    assert "cannot reach http://127.0.0.1:9" in line and isinstance(line, EnvironmentProblem)
    (line,) = dataset_problems([f"s3://{s3_server.bucket}/a.jsonl"])
    assert "cannot reach http://127.0.0.1:9" in line and isinstance(line, EnvironmentProblem)


def test_s3_with_only_boto_credentials_passes(s3_server, aws_env, monkeypatch):
    """AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY and AWS_ENDPOINT_URL, none of the plugin's
    variables: the plugin and the jobs take them from boto's chain, so the preflight does."""
    assert storage_problems(f"s3://{s3_server.bucket}/run") == []
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong")
    (line,) = storage_problems(f"s3://{s3_server.bucket}/run")
    assert f"at {s3_server.endpoint} denied" in line and "boto's credentials (env)" in line


def test_s3_from_an_aws_profile_passes(s3_server, aws_env, monkeypatch, tmp_path):
    from tests.support.seaweed import ACCESS_KEY, SECRET_KEY

    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    credentials = tmp_path / "credentials"
    credentials.write_text(f"[seaweed]\naws_access_key_id = {ACCESS_KEY}\naws_secret_access_key = {SECRET_KEY}\n")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(credentials))
    monkeypatch.setenv("AWS_PROFILE", "seaweed")
    assert storage_problems(f"s3://{s3_server.bucket}/run") == []
    monkeypatch.setenv("AWS_PROFILE", "nope")
    (line,) = storage_problems(f"s3://{s3_server.bucket}/run")
    assert "AWS credentials:" in line and "(nope) could not be found" in line


def test_s3_without_any_credentials_is_one_line_naming_both_ways(s3_server, no_s3_credentials):
    (line,) = storage_problems(f"s3://{s3_server.bucket}/run")
    assert line == (
        f"storage s3://{s3_server.bucket}/run: no S3 credentials: set SNAKEMAKE_STORAGE_S3_ACCESS_KEY and "
        "SNAKEMAKE_STORAGE_S3_SECRET_KEY (the Snakemake S3 plugin's variables), or provide boto's own "
        "(AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, a profile in ~/.aws (AWS_PROFILE) or an instance "
        "role), which the plugin and the jobs fall back to"
    )
    (line,) = dataset_problems([f"s3://{s3_server.bucket}/a.jsonl", f"s3://{s3_server.bucket}/b.jsonl"])
    assert line.startswith(f"dataset.paths[0]: s3://{s3_server.bucket}/a.jsonl cannot be checked: no S3 credentials")
    assert isinstance(line, EnvironmentProblem)


def test_s3_dataset_files_are_headed(s3_server, s3_env):

    client = s3_server.client()
    bucket = s3_server.bucket
    client.put_object(Bucket=bucket, Key="datasets/good.jsonl", Body=b'{"id": "a", "messages": []}\n')
    client.put_object(Bucket=bucket, Key="datasets/empty.jsonl", Body=b"")
    names = [f"s3://{bucket}/datasets/good.jsonl", f"s3://{bucket}/missing.jsonl",
             f"s3://{bucket}/datasets/empty.jsonl", f"s3://{bucket}/notes.txt", f"s3://{bucket}"]  # fmt: skip
    assert dataset_problems(names) == [
        f"dataset.paths[1]: s3://{bucket}/missing.jsonl does not exist (no object {bucket}/missing.jsonl at {s3_server.endpoint})",
        f"dataset.paths[2]: s3://{bucket}/datasets/empty.jsonl is empty (0 bytes)",
        f"dataset.paths[3]: s3://{bucket}/notes.txt: unknown dataset format (expected .jsonl or .parquet)",
        f"dataset.paths[4]: s3://{bucket} names a bucket, not a file; list its files (.jsonl or .parquet)",
    ]
    assert dataset_problems([f"s3://{bucket}/datasets/good.jsonl"], check_s3=False) == []
    assert not any(isinstance(line, EnvironmentProblem) for line in dataset_problems(names))  # the config's


# --- through `snakemake -n` ----------------------------------------------------------------------


def refused(workflow, *args, env=None) -> list[str]:
    proc = workflow.snakemake("-n", *args, env=env, check=False)
    assert proc.returncode != 0
    return (proc.stdout + proc.stderr).splitlines()


def named_early(lines: list[str], text: str) -> str:
    """The line holding ``text``, which must be among the first 30 of the output."""
    found = [i for i, line in enumerate(lines) if text in line]
    assert found, "\n".join(lines[:40])
    assert found[0] < 30, "\n".join(lines[:40])
    return lines[found[0]]


@pytest.mark.workflow
def test_a_missing_model_folder_without_build_demo_is_refused(workflow, tmp_path):
    workflow.write_config(target={"model": str(tmp_path / "Qwen3.6-27B")})
    # build_demo defaults to false: the folder is never filled with the demo target.
    config = yaml.safe_load((workflow.root / "config.yaml").read_text())
    del config["target"]["build_demo"]
    (workflow.root / "config.yaml").write_text(yaml.safe_dump(config))
    named_early(refused(workflow), f"target.model: {tmp_path}/Qwen3.6-27B does not exist")


@pytest.mark.workflow
def test_a_hub_id_is_refused(workflow):
    workflow.write_config(target={"model": "Qwen/Qwen3.6-27B", "build_demo": False})
    named_early(refused(workflow), "target.model: 'Qwen/Qwen3.6-27B' is not a folder here; it looks like a hub id")


@pytest.mark.workflow
def test_a_folder_as_dataset_is_refused(workflow):
    workflow.write_config(dataset={"paths": ["data/demo"]})
    named_early(refused(workflow), "dataset.paths[0]: data/demo is a folder")


@pytest.mark.workflow
def test_s3_without_credentials_is_refused_without_a_flood(workflow, s3_server, no_s3_credentials):
    prefix = f"s3://{s3_server.bucket}/preflight"
    lines = refused(workflow, "--profile", "profiles/s3", "--default-storage-prefix", prefix)
    named_early(lines, "no S3 credentials: set SNAKEMAKE_STORAGE_S3_ACCESS_KEY")
    assert len(lines) < 40
    assert not any(line.startswith("(check ") for line in lines), lines  # not the config's to fix


@pytest.mark.workflow
def test_a_missing_s3_dataset_is_refused(workflow, s3_server, s3_env):
    workflow.write_config(dataset={"paths": [f"s3://{s3_server.bucket}/missing.jsonl"]})
    lines = refused(workflow)
    named_early(lines, f"dataset.paths[0]: s3://{s3_server.bucket}/missing.jsonl does not exist")


@pytest.mark.workflow
def test_an_s3_run_with_only_boto_credentials_ingests(workflow, s3_server, aws_env):
    """AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY and AWS_ENDPOINT_URL alone: the preflight passes,
    the Snakemake S3 plugin (its keys unset, so boto's chain) stores the outputs, and the ingest
    job's storage layer reads the s3:// dataset."""
    import boto3

    from dflash_pipeline.core import layout
    from dflash_pipeline.core.storage import open_storage

    tag = uuid.uuid4().hex[:8]
    dataset = f"aws-only-{tag}/few.jsonl"
    boto3.client("s3", region_name="us-east-1").put_object(
        Bucket=s3_server.bucket, Key=dataset, Body=(workflow.root / workflow.few_prompts(4)).read_bytes()
    )
    workflow.write_config(dataset={"paths": [f"s3://{s3_server.bucket}/{dataset}"]})
    prefix = f"s3://{s3_server.bucket}/aws-only-{tag}/run"
    workflow.snakemake("--profile", "profiles/s3", "--default-storage-prefix", prefix, "--cores", "1", "ingest")
    summary = json.loads(open_storage(f"{prefix}/results/demo").read_text(layout.INGEST_SUMMARY))
    assert summary["files"] == [f"s3://{s3_server.bucket}/{dataset}"] and summary["rows_read"] == 4


@pytest.mark.workflow
def test_the_s3_profile_names_no_default_bucket(workflow, s3_env):
    lines = refused(workflow, "--profile", "profiles/s3")
    line = named_early(lines, "needs --default-storage-prefix")
    assert line == (
        "--default-storage-provider s3 needs --default-storage-prefix s3://<bucket>/<prefix>, where the "
        "run's objects go (the S3 profile names no default bucket)"
    )
    # One line: no traceback, no Snakemake frame, not blamed on the config.
    assert lines[-1] == line and "Traceback" not in "\n".join(lines) and "ValueError" not in "\n".join(lines), lines
    assert not any(text.startswith(("(check ", "  File ")) for text in lines), lines


@pytest.mark.workflow
def test_an_engine_that_cannot_serve_the_drafter_is_refused(workflow, tmp_path):
    vllm = metadata_only_env(tmp_path / "vllm", "vllm", "0.24.0")
    workflow.write_config(
        engines={"vllm": {"python": str(vllm)}},
        train={"layer_types": ["sliding_attention", "sliding_attention"], "sliding_window": 16},
        evaluate={"engine": "vllm"},
    )
    line = named_early(refused(workflow), "evaluate.engine: vllm 0.24.0 cannot serve this dflash drafter")
    assert "It is served by vllm >= 0.25" in line


@pytest.mark.workflow
def test_only_a_run_or_a_dry_run_is_refused(workflow, tmp_path, demo_model):
    """Preflight reads the engines, the dataset files and the storage where a plan is made, in
    the driver of a run or a dry-run: the report of a finished run, --lint or --list-rules on a
    machine without the run's engines reads none of them
    (dflash_pipeline.snakemake_patches.execution)."""
    from tests.test_run_control import finished_run

    finished_run(workflow, demo_model)  # every output in place, nothing computed
    vllm = metadata_only_env(tmp_path / "vllm", "vllm", "0.24.0")
    workflow.write_config(
        engines={"vllm": {"python": str(vllm)}},
        train={"layer_types": ["sliding_attention", "sliding_attention"], "sliding_window": 16},
        evaluate={"engine": "vllm"},
    )
    refusal = "evaluate.engine: vllm 0.24.0 cannot serve this dflash drafter"
    named_early(refused(workflow), refusal)
    run = workflow.snakemake("--touch", check=False)
    assert run.returncode != 0 and refusal in run.stdout + run.stderr
    for args in (["--report", "report.html"], ["--lint"], ["--list-rules"]):
        proc = workflow.snakemake(*args, check=False)
        output = proc.stdout + proc.stderr
        assert proc.returncode == 0 and refusal not in output, (args, output[-3000:])
    assert (workflow.root / "report.html").stat().st_size > 0


@pytest.mark.workflow
@pytest.mark.parametrize("example", sorted((REPO / "config/examples").glob("*.yaml")), ids=lambda p: p.name)
def test_the_example_configs_pass_their_own_preflight_where_their_folders_exist(
    example, workflow, tmp_path, demo_model, s3_env
):
    """The examples as written, with their model folder, s3:// dataset files and engine
    environments faked where they point (a tiny model; one prompt on the test S3 server; engine
    environments holding only the package metadata)."""
    from dflash_pipeline.core.s3 import S3Storage
    from dflash_pipeline.core.storage import open_object

    config = yaml.safe_load(example.read_text())
    for name in (n for n in config["dataset"]["paths"] if n.startswith("s3://")):
        storage, key = open_object(name)
        S3Storage(f"s3://{storage.bucket}").ensure_bucket()
        storage.write_bytes(key, b'{"id": "a", "messages": [{"role": "user", "content": "Hi"}]}\n')
    model = tmp_path / "models" / "target"
    shutil.copytree(demo_model, model)
    config["target"]["model"] = str(model)
    for engine, section in config.get("engines", {}).items():
        version = {"vllm": "0.26.0", "sglang": "0.5.17"}[engine]
        section["python"] = str(metadata_only_env(tmp_path / engine, engine, version))
    path = workflow.root / "example.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    proc = workflow.snakemake("-n", "--configfile", str(path))
    assert "evaluate.engine: vllm 0.26.0" in proc.stdout + proc.stderr


@pytest.mark.workflow
def test_a_refusal_is_one_message_naming_the_config_file_given(workflow):
    """No Snakemake frame or traceback around it, and the file to fix is the one given with
    --configfile, not config.yaml."""
    workflow.write_config(target={"model": "Qwen/Qwen3.6-27B", "build_demo": False})
    (workflow.root / "config.yaml").rename(workflow.root / "mine.yaml")
    proc = workflow.snakemake("-n", "--configfile", "mine.yaml", check=False)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 1
    assert output.count("target.model: 'Qwen/Qwen3.6-27B' is not a folder here") == 1, output
    assert "(check mine.yaml)" in output and "config.yaml" not in output, output
    assert "Traceback" not in output and 'File "' not in output and "Error in file" not in output, output


def test_a_run_fixed_key_changed_against_the_ingested_run_is_named_with_both_values():
    from dflash_pipeline.stages.prepare import run_fixed_changes, run_fixed_values

    config = validate_config({"num_shards": 3, "dataset": {"heldout_fraction": 0.1}})
    summary = {"num_shards": 2, "run_fixed": run_fixed_values(2, 0.05, "id")}
    assert run_fixed_changes(config, summary, "run/outputs/ingest-summary.json") == [
        f"config key '{key}': {now}, but this run was ingested with {then} (run/outputs/ingest-summary.json): "
        f"it decides which shard and split each sample is in, so it is fixed for the run; set it back to {then}, "
        "or start a new run (another `run` name)"
        for key, now, then in [("num_shards", 3, 2), ("dataset.heldout_fraction", 0.1, 0.05)]
    ]
    assert run_fixed_changes(config, {**summary, "run_fixed": run_fixed_values(3, 0.1, "id")}, "s") == []
    # A run ingested before the keys were recorded: its summary's num_shards alone.
    assert len(run_fixed_changes(config, {"num_shards": 2}, "s")) == 1
    assert run_fixed_changes(config, {"num_shards": 3}, "s") == []


@pytest.mark.workflow
def test_changing_num_shards_of_a_run_in_storage_is_refused_at_plan_time(workflow, demo_model):
    """Before: 2 -> 3 planned shard 00002 from the old ingest, with no prompts (rc 0)."""
    workflow.write_config(
        until="prepare",
        dataset={"paths": [workflow.few_prompts(6)]},
        target={"model": str(demo_model), "build_demo": False},
    )
    workflow.snakemake()
    workflow.write_config(num_shards=3)
    line = named_early(refused(workflow), "config key 'num_shards': 3, but this run was ingested with 2")
    assert "results/demo/outputs/ingest-summary.json" in line
    workflow.write_config(num_shards=2, dataset={"heldout_fraction": 0.2})
    named_early(refused(workflow), "config key 'dataset.heldout_fraction': 0.2, but this run was ingested with 0.1")
    workflow.write_config(dataset={"heldout_fraction": 0.1})
    assert workflow.planned_jobs() == {}
