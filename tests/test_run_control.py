"""Run control for long runs, planned by real `snakemake -n`: editing an operational config key
leaves a finished run with nothing to do while a key that defines a stage's output reruns that
stage and what follows; a --configfile is read alone (schema defaults, not the demo's values);
the SLURM profile plans with CPU and GPU jobs on their own partitions."""

from __future__ import annotations

import importlib.util
import re
import uuid

import pytest
import yaml

from dflash_pipeline.core.config import RULE_KEYS
from tests.conftest import REPO, parse_job_table
from tests.support.ci import in_ci

pytestmark = pytest.mark.workflow

NUM_SHARDS = 2

# A different valid value for every key that defines no rule's output (see RULE_KEYS), and for
# the top-level keys that only say where and how jobs run.
OPERATIONAL_CHANGES = {
    "generation": {
        "endpoints": ["http://127.0.0.1:9"],
        "gpus_per_job": 1,
        "concurrency": 3,
        "request_timeout_s": 60,
        "hung_after_s": 120,
        "max_retries": 1,
        "max_consecutive_failures": 2,
        "max_error_fraction": 0.5,
        "part_every_samples": 5,
        "part_every_seconds": 10,
        "telemetry_every_seconds": 1,
        "server": {
            "port_base": 31000,
            "tp": 2,
            "mem_fraction": 0.5,
            "startup_timeout_s": 60,
            "extra_args": [],
            "speculative": {"algorithm": "NEXTN"},
            "reasoning_parser": "qwen3",
        },
        "retries": 0,
    },
    "train": {
        "checkpoint_every_steps": 7,
        "attention": "sdpa",
        "loss_chunk_rows": 64,
        "metrics_every_seconds": 5,
        "retries": 0,
        "checkpoint_async": False,
        "data_cache_dir": "train-data-elsewhere",
        "offline_max_bytes": 12345,
        "tracker": "tensorboard",
        "tracker_dir": "tensorboard-elsewhere",
        "tracker_project": "lab",
        # Engine taps equal the target's (tests/test_engine_taps.py): where they come from is no change.
        "taps_from": "engine",
        "taps_server": {"concurrency": 2, "mem_fraction": 0.4, "prefetch_depth": 3},
        # When a step counts as diverged: the demo's steps are all applied either way.
        "divergence": {"max_loss_ratio": 20.0},
    },
    "evaluate": {
        "engine_mem_fraction": 0.5,
        "engine_extra_args": ["--enforce-eager"],
        "engine_hung_after_s": 120,
        "engine_reference_url": "http://127.0.0.1:9",
        "target_mismatch": "warn",
    },
    # Engine-extracted taps equal the target's (tests/test_engine_taps.py): no re-extraction.
    "extract": {"taps_from": "engine"},
    "gpus": 3,
    "gpu_lock_dir": "locks-elsewhere",
    "status": {"port": 8099},
    "slurm": {"gpu_partition": "a100", "cpu_partition": "small", "account": "lab", "qos": "long"},
}

# Rules downstream of each stage in this run (offline mode, so `extract` is in the chain).
AFTER_TRAIN = {
    "train": NUM_SHARDS,
    "segment_tau": NUM_SHARDS,  # each segment's τ in the loop (as many segments as shards here)
    "export": 1,
    "evaluate": 1,
    "report_training": 1,
    "report_evaluation": 1,
    "report_headline": 1,
    "report_storage": 1,
    "all": 1,
}
AFTER_EXTRACT = {"extract": NUM_SHARDS, **AFTER_TRAIN}
AFTER_GENERATE = {
    "generate": NUM_SHARDS,
    "tokenize": NUM_SHARDS,
    "report_generation": 1,
    "report_tokenization": 1,
    **AFTER_EXTRACT,
}


def merge(config: dict, changes: dict) -> dict:
    for key, value in changes.items():
        if isinstance(value, dict) and isinstance(config.get(key), dict):
            merge(config[key], value)
        else:
            config[key] = value
    return config


def finished_run(workflow, demo_model) -> dict:
    """A run whose every job has finished, as far as the planner can tell: each output (and
    benchmark) exists and carries Snakemake's own metadata record of the job (params included),
    written by `--touch`, the same bookkeeping a real job's end writes. No job runs."""
    config = workflow.write_config(
        num_shards=NUM_SHARDS,
        target={"model": str(demo_model), "build_demo": False},
        train={"mode": "offline", "segments": 2},
    )
    plan = workflow.snakemake("-n", "--forceall").stdout
    for line in plan.splitlines():
        tag, _, files = line.strip().partition(": ")
        if tag in ("output", "benchmark"):
            for name in files.split(", "):
                path = workflow.root / name
                path.parent.mkdir(parents=True, exist_ok=True)
                path.touch()
                if name.endswith(".stats.json"):
                    # Read when the offline budget is checked (the target folder exists).
                    path.write_text('{"tokens_total": 10, "sequences_out": 1}')
    workflow.snakemake("--forceall", "--touch")
    assert workflow.planned_jobs() == {}
    return yaml.safe_load(config.read_text())


def write(workflow, config: dict) -> None:
    (workflow.root / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))


def test_operational_keys_leave_a_finished_run_with_nothing_to_do(workflow, demo_model):
    # Every operational key of every rule that reads the section is changed here (export_dtype
    # is the export rule's own param, segment_eval segment_tau's, hidden_dtype defines extract's
    # taps).
    for section in ("generation", "train", "evaluate"):
        rules = [r for r, t in RULE_KEYS.items() if t["section"] == section]
        operational = set.intersection(*(RULE_KEYS[r]["operational"] for r in rules)) - {"export_dtype", "segment_eval"}
        assert set(OPERATIONAL_CHANGES[section]) == operational, section
    base = finished_run(workflow, demo_model)
    # The copy also sorts every mapping's keys: the order of keys in the file is no change.
    changed = merge(yaml.safe_load(yaml.safe_dump(base, sort_keys=True)), OPERATIONAL_CHANGES)
    write(workflow, changed)
    # The default rerun triggers (mtime, params, input, code, software-env): no profile.
    proc = workflow.snakemake("-n")
    assert "Nothing to be done" in proc.stdout + proc.stderr, proc.stdout[-6000:]


DEFINING_CHANGES = [
    ({"generation": {"max_new_tokens": 99}}, AFTER_GENERATE),
    ({"generation": {"sampling": {"temperature": 0.7}}}, AFTER_GENERATE),
    ({"train": {"hidden_dtype": "float32"}}, AFTER_EXTRACT),
    ({"train": {"learning_rate": 0.01}}, AFTER_TRAIN),
    (
        {"train": {"export_dtype": "float32"}},
        {"export": 1, "evaluate": 1, "report_evaluation": 1, "report_headline": 1, "report_storage": 1, "all": 1},
    ),
    (
        {"train": {"segment_eval": {"prompts": 3}}},
        {"segment_tau": NUM_SHARDS, "report_training": 1, "report_headline": 1, "report_storage": 1, "all": 1},
    ),
    (
        {"evaluate": {"max_prompts": 3}},
        {"evaluate": 1, "report_evaluation": 1, "report_headline": 1, "report_storage": 1, "all": 1},
    ),
]


def test_a_defining_key_reruns_its_stage_and_what_follows(workflow, demo_model):
    base = finished_run(workflow, demo_model)  # one finished run, each change made to it alone
    for change, expected in DEFINING_CHANGES:
        write(workflow, merge(yaml.safe_load(yaml.safe_dump(base)), change))
        proc = workflow.snakemake("-n", "--quiet", "rules")
        output = proc.stdout + proc.stderr
        assert "params have changed since last execution" in output, change
        assert parse_job_table(output) == expected, change


def test_a_configfile_is_read_alone_with_the_schema_defaults(workflow, demo_model):
    """`--configfile` replaces the demo's config.yaml: keys the file leaves out take the schema's
    defaults (train.segments: 4; the demo says 2). Naming config.yaml first layers over it."""
    (workflow.root / "mine.yaml").write_text(
        yaml.safe_dump({"target": {"model": str(demo_model), "build_demo": False}})
    )
    assert workflow.planned_jobs("--configfile", "mine.yaml")["train"] == 4
    assert workflow.planned_jobs("--configfile", "config.yaml", "mine.yaml")["train"] == 2
    assert workflow.planned_jobs()["train"] == 2  # no --configfile: the demo


def job_blocks(text: str) -> dict[str, list[str]]:
    """The resources line of every planned job, per rule, from a dry-run's job listing."""
    blocks: dict[str, list[str]] = {}
    rule = None
    for line in text.splitlines():
        match = re.match(r"^(?:local)?rule (\w+):$", line.strip())
        if match:
            rule = match[1]
        elif rule and line.strip().startswith("resources:"):
            blocks.setdefault(rule, []).append(line.strip())
            rule = None
    return blocks


@pytest.mark.skipif(
    # CI installs the test extra, which has the plugin: there a missing one fails the test.
    importlib.util.find_spec("snakemake_executor_plugin_slurm") is None and not in_ci(),
    reason="snakemake-executor-plugin-slurm is not installed (pip install -e .[slurm])",
)
def test_slurm_profile_plans_on_a_fresh_checkout_with_cpu_and_gpu_partitions(workflow, demo_model):
    workflow.write_config(
        target={"model": str(demo_model), "build_demo": False},
        generation={"gpus_per_job": 1},
        train={"gpus_per_job": 1},
        slurm={"gpu_partition": "a100", "cpu_partition": "small", "account": "lab", "qos": "long",
               "gpu_constraint": "h200"},
    )  # fmt: skip
    proc = workflow.snakemake("--profile", "profiles/slurm", "-n")
    blocks = job_blocks(proc.stdout)
    gpu_rules = {"generate", "train", "segment_tau", "evaluate"}  # segment_tau runs the target too
    assert gpu_rules <= set(blocks) and "prepare" in blocks and "tokenize" in blocks
    for rule, lines in blocks.items():
        if rule == "all":
            continue
        partition = "a100" if rule in gpu_rules else "small"
        for line in lines:
            assert f"slurm_partition={partition}" in line, (rule, line)
            assert re.search(r"runtime=\d+", line), (rule, line)
            assert ("gpu=1" in line) == (rule in gpu_rules), (rule, line)
            # Account and QoS for every job; the node constraint for GPU jobs only.
            assert "slurm_account=lab" in line and "qos=long" in line, (rule, line)
            assert ("constraint=h200" in line) == (rule in gpu_rules), (rule, line)


@pytest.mark.skipif(
    # CI installs the test extra, which has the plugin: there a missing one fails the test.
    importlib.util.find_spec("snakemake_executor_plugin_slurm") is None and not in_ci(),
    reason="snakemake-executor-plugin-slurm is not installed (pip install -e .[slurm])",
)
def test_the_slurm_s3_profile_plans_every_job_with_its_partition_against_s3(workflow, demo_model, s3_server, s3_env):
    workflow.write_config(
        target={"model": str(demo_model), "build_demo": False},
        slurm={"gpu_partition": "a100", "cpu_partition": "small"},
    )
    prefix = f"s3://{s3_server.bucket}/slurm-s3-{uuid.uuid4().hex[:8]}"
    proc = workflow.snakemake("--profile", "profiles/slurm-s3", "--default-storage-prefix", prefix, "-n")
    blocks = job_blocks(proc.stdout)
    assert {"ingest", "generate", "train", "evaluate"} <= set(blocks)
    assert all("slurm_partition=small" in line for rule, lines in blocks.items() if rule != "all" for line in lines)
    assert f"{prefix}/results/demo/outputs/ingest-summary.json" in proc.stdout


def test_report_rules_run_in_the_driver():
    text = (REPO / "rules/report.smk").read_text()
    block = re.search(r"^localrules:\n((?:    \w+,\n)+)", text, re.M)
    assert block, "rules/report.smk has no localrules block"
    local = set(re.findall(r"(\w+),", block[1]))
    assert set(re.findall(r"^rule (report_\w+):", text, re.M)) | {"all"} <= local
