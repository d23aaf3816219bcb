"""What a SLURM job asks for (dflash_pipeline.core.slurm): a GPU job's CPUs and memory follow its
GPUs (an 8-GPU train job is 8 torchrun ranks and their data loaders, not the rule's 2 threads), CPU
jobs keep their threads, every request fits a node; and the GPU pool warning, true only where the
pool schedules devices (a local run). Plain Python, and dry-runs that need no cluster."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import sys
from pathlib import Path

import pytest
import yaml

from dflash_pipeline.core.config import validate_config
from dflash_pipeline.core.slurm import (
    UNPROBED_CPUS_PER_GPU,
    Cluster,
    Partition,
    SlurmClusterError,
    check_cluster,
    cpus_per_gpu,
    fixed_resources,
    gpu_pool_warning,
    job_cpus,
    job_memory,
    partitions_used,
    plan_run,
    requested_cpus,
    runs_locally,
    smallest_node_mb,
)
from tests.conftest import REPO
from tests.test_run_control import job_blocks
from tests.support.ci import in_ci
from tests.support.engine_envs import metadata_only_env

EXAMPLE = REPO / "config/examples/qwen3.6-27b.yaml"
POOL_WARNING = "exceeds the GPU pool"
needs_plugin = pytest.mark.skipif(
    # CI installs the test extra, which has the plugin: there a missing one fails the test.
    importlib.util.find_spec("snakemake_executor_plugin_slurm") is None and not in_ci(),
    reason="snakemake-executor-plugin-slurm is not installed (pip install -e .[slurm])",
)


def h100_cluster() -> Cluster:
    """CPU nodes of 64 CPUs; GPU nodes of 8 GPUs and 128 CPUs (one of them 96: the fewest count)."""
    return Cluster(
        name="lab",
        accounting="accounting_storage/slurmdbd",
        min_job_age_s=300,
        partitions={
            "cpu": Partition("cpu", 64, 256_000, 0),
            "gpu": Partition("gpu", 96, 1_000_000, 8, {"h100"}),
        },
        user="alice",
        accounts={"dflash"},
        default_account="dflash",
        qos={"normal"},
    )


def settings(**changes) -> dict:
    return validate_config({"slurm": changes})["slurm"]


def test_the_new_keys_default_to_the_nodes_share_and_the_size_based_memory():
    assert settings()["cpus_per_gpu"] is None and settings()["mem_per_gpu_mb"] is None
    assert settings(cpus_per_gpu=12, mem_per_gpu_mb=64000)["cpus_per_gpu"] == 12


def test_cpus_per_gpu_is_the_key_else_the_nodes_share_else_the_unprobed_figure():
    gpu = h100_cluster().partitions["gpu"]
    assert cpus_per_gpu(settings(), gpu) == 12  # 96 CPUs / 8 GPUs
    assert cpus_per_gpu(settings(cpus_per_gpu=6), gpu) == 6
    assert cpus_per_gpu(settings(), None) == UNPROBED_CPUS_PER_GPU
    assert cpus_per_gpu(settings(), Partition("odd", 4, 1000, 8)) == 1  # never 0


def test_a_gpu_job_asks_per_gpu_a_cpu_job_its_threads_both_capped():
    assert job_cpus(threads=2, gpus=8, per_gpu=12, limit=96) == 96
    assert job_cpus(threads=2, gpus=8, per_gpu=16, limit=96) == 96  # never more than a node has
    assert job_cpus(threads=2, gpus=1, per_gpu=12, limit=96) == 12
    assert job_cpus(threads=4, gpus=1, per_gpu=2, limit=96) == 4  # at least the rule's threads
    assert job_cpus(threads=4, gpus=0, per_gpu=12, limit=2) == 2  # a CPU job: threads, capped
    assert job_cpus(threads=2, gpus=0, per_gpu=None, limit=None) == 2


def test_the_driver_asks_the_nodes_share_for_gpu_jobs_and_threads_for_cpu_jobs():
    plan = check_cluster(settings(), h100_cluster(), {"cpu": 0, "gpu": 8})
    assert plan.problems == [] and plan.cpus_per_gpu == {"gpu": 12}
    assert "gpu (96 CPUs, 8 GPU(s), 1000000 MB a node; GPU jobs 12 CPUs a GPU, the node's share)" in plan.line
    assert requested_cpus(2, 8, settings(), "gpu", plan) == 96  # train: 8 GPUs, the whole node's CPUs
    assert requested_cpus(2, 1, settings(), "gpu", plan) == 12  # generate: one GPU's share
    assert requested_cpus(4, 0, settings(), "cpu", plan) == 4  # CPU jobs unchanged
    # The key, and slurm.max_cpus_per_job over both.
    keyed = settings(cpus_per_gpu=4, max_cpus_per_job=24)
    plan = check_cluster(keyed, h100_cluster(), {"cpu": 0, "gpu": 8})
    assert "GPU jobs 4 CPUs a GPU, slurm.cpus_per_gpu)" in plan.line
    assert requested_cpus(2, 8, keyed, "gpu", plan) == 24
    assert requested_cpus(2, 1, keyed, "gpu", plan) == 4


def test_inside_a_job_the_request_follows_the_allocation():
    """The job-step plugin's srun asks for cpus_per_task again inside the allocation: the
    allocation for a node-share GPU job, never more than it."""
    assert requested_cpus(2, 8, settings(), "gpu", allocation=96) == 96
    assert requested_cpus(2, 8, settings(cpus_per_gpu=4), "gpu", allocation=96) == 32
    assert requested_cpus(2, 8, settings(cpus_per_gpu=16), "gpu", allocation=96) == 96
    assert requested_cpus(4, 0, settings(), "cpu", allocation=2) == 2


def test_without_the_cluster_a_gpu_job_shows_the_unprobed_figure_or_the_key():
    assert requested_cpus(2, 8, settings(), "gpu") == 8 * UNPROBED_CPUS_PER_GPU
    assert requested_cpus(2, 8, settings(cpus_per_gpu=10, max_cpus_per_job=64), "gpu") == 64
    assert requested_cpus(1, 0, settings(cpus_per_gpu=10), "cpu") == 1


def test_memory_per_gpu_is_a_floor_under_the_size_based_figure_capped_to_the_node():
    assert job_memory(16000, 8, settings()) == 16000
    assert job_memory(16000, 8, settings(mem_per_gpu_mb=64000)) == 512000
    assert job_memory(600000, 8, settings(mem_per_gpu_mb=64000)) == 600000
    assert job_memory(16000, 8, settings(mem_per_gpu_mb=64000), node_mb=400000) == 400000
    assert job_memory(4000, 0, settings(mem_per_gpu_mb=64000)) == 4000  # CPU jobs unchanged


def test_the_pool_warning_is_said_for_a_local_run_only():
    assert POOL_WARNING in gpu_pool_warning(8, 0, local=True)
    assert gpu_pool_warning(8, 0, local=False) is None  # SLURM: the cluster gives each job its GPUs
    assert gpu_pool_warning(8, 8, local=True) is None
    assert gpu_pool_warning(None, 0, local=True) is None


def test_a_job_goes_to_its_partition_with_the_qos_and_a_gpu_job_with_the_constraint():
    assert fixed_resources(settings(), 0) == {"slurm_partition": "cpu"}
    assert fixed_resources(settings(qos="long", gpu_constraint="h100"), 8) == {
        "slurm_partition": "gpu",
        "qos": "long",
        "constraint": "h100",
    }
    assert fixed_resources(settings(qos="long", gpu_constraint="h100"), 0) == {"slurm_partition": "cpu", "qos": "long"}


def test_the_partitions_used_carry_the_most_gpus_a_job_asks_for():
    cpu_run = validate_config({"generation": {"gpus_per_job": 0}, "train": {"gpus_per_job": 0}})
    assert partitions_used(cpu_run) == {"cpu": 0}
    gpu_run = validate_config({"generation": {"gpus_per_job": 1}, "train": {"gpus_per_job": 8}})
    assert partitions_used(gpu_run) == {"cpu": 0, "gpu": 8}
    one = validate_config(
        {"slurm": {"gpu_partition": "cpu"}, "generation": {"gpus_per_job": 2}, "train": {"gpus_per_job": 1}}
    )
    assert partitions_used(one) == {"cpu": 2}  # GPU jobs in the CPU jobs' partition


def test_the_driver_plan_reads_the_cluster_once_and_stops_on_any_problem():
    config = validate_config({"generation": {"gpus_per_job": 1}, "train": {"gpus_per_job": 8}})
    plan = plan_run(config, None, read=h100_cluster)
    assert plan.account == "dflash" and plan.cpu_caps == {"cpu": 64, "gpu": 96}
    assert smallest_node_mb(plan) == 256_000 and smallest_node_mb(None) == 0
    bad = validate_config({"slurm": {"qos": "long"}, "train": {"gpus_per_job": 16}})
    with pytest.raises(ValueError) as refused:
        plan_run(bad, "sacct", read=h100_cluster)
    lines = str(refused.value).splitlines()
    assert len(lines) == 3 and lines[-1] == "(check the config's `slurm` section, or the cluster)", lines
    assert "slurm.qos 'long'" in lines[0] and "16 GPU(s) in partition 'gpu'" in lines[1], lines

    def unreachable():
        raise SlurmClusterError("`scontrol show config` failed: no cluster here")

    with pytest.raises(ValueError, match="^SLURM: `scontrol show config` failed: no cluster here$"):
        plan_run(config, None, read=unreachable)


def test_a_dry_run_of_a_remote_profile_is_told_from_a_local_one_by_its_threads():
    assert runs_locally("dryrun", local_exec=True, use_threads=False)
    assert not runs_locally("dryrun", local_exec=True, use_threads=True)  # -n under profiles/slurm
    assert runs_locally("local", local_exec=True, use_threads=False)
    assert not runs_locally("slurm", local_exec=False, use_threads=True)


def job_resources(text: str) -> dict[str, list[dict[str, str]]]:
    """Each planned job's resources, per rule, from a dry-run's job listing."""
    return {
        rule: [{k: v.strip() for k, v in re.findall(r"(\w+)=([^,]+)", line[len("resources:") :])} for line in lines]
        for rule, lines in job_blocks(text).items()
    }


def example_config(workflow, tmp_path, demo_model) -> str:
    """The 27B example as written, its model folder and engine environments faked where it
    points, its dataset a local file and 2 shards (the plan's size is not the point)."""
    config = yaml.safe_load(EXAMPLE.read_text())
    model = tmp_path / "models" / "target"
    shutil.copytree(demo_model, model)
    config["target"]["model"] = str(model)
    for engine, section in config["engines"].items():
        version = {"vllm": "0.26.0", "sglang": "0.5.17"}[engine]
        section["python"] = str(metadata_only_env(tmp_path / engine, engine, version))
    config["dataset"]["paths"] = [workflow.few_prompts(4)]
    config["num_shards"] = 2
    path = workflow.root / "example.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return str(path)


@needs_plugin
@pytest.mark.workflow
def test_the_27b_examples_8_gpu_train_job_asks_slurm_for_cpus_to_match(workflow, tmp_path, demo_model):
    """`--profile profiles/slurm -n` of the 27B example: the train job (8 GPUs) asks for 8 x 4
    CPUs (no cluster read: the unprobed figure), generate one GPU's, CPU jobs their threads; no
    pool warning though the machine has no GPU (the cluster, not the pool, schedules GPUs)."""
    configfile = example_config(workflow, tmp_path, demo_model)
    proc = workflow.snakemake(
        "--configfile", configfile, "--profile", "profiles/slurm", "--resources", "gpu=8", "--config", "gpus=0", "-n"
    )
    jobs = job_resources(proc.stdout)
    assert {"train", "generate", "tokenize"} <= set(jobs), sorted(jobs)
    for job in jobs["train"]:
        assert job["gpu"] == "8" and job["slurm_partition"] == "gpu", job
        assert int(job["cpus_per_task"]) == 8 * UNPROBED_CPUS_PER_GPU >= 8, job
    for job in jobs["generate"]:
        assert job["gpu"] == "1" and int(job["cpus_per_task"]) == UNPROBED_CPUS_PER_GPU, job
    for job in jobs["tokenize"]:
        # Its rule's 4 threads (the tests' --cores 2 scales them down), nothing per GPU.
        assert job["slurm_partition"] == "cpu" and int(job["cpus_per_task"]) == 2, job
    assert POOL_WARNING not in proc.stdout + proc.stderr
    # The key, with the per-GPU memory floor.
    with open(configfile) as f:
        config = yaml.safe_load(f)
    config["slurm"] = {"cpus_per_gpu": 12, "mem_per_gpu_mb": 100000}
    with open(configfile, "w") as f:
        yaml.safe_dump(config, f, sort_keys=False)
    jobs = job_resources(workflow.snakemake("--configfile", configfile, "--profile", "profiles/slurm", "-n").stdout)
    assert {int(job["cpus_per_task"]) for job in jobs["train"]} == {96}
    assert {int(job["mem_mb"]) for job in jobs["train"]} == {800000}
    assert {int(job["cpus_per_task"]) for job in jobs["generate"]} == {12}


@needs_plugin
@pytest.mark.workflow
def test_a_real_slurm_driver_says_no_pool_warning(workflow, demo_model, tmp_path):
    """The SLURM executor itself (no dry-run), up to its first look at the cluster: a stand-in
    `scontrol` that finds no cluster stops the driver before any sbatch, and by then the executor
    is known and the pool warning would have been said."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text("#!/bin/sh\necho 'no cluster here' >&2\nexit 1\n")
    (bin_dir / "scontrol").chmod(0o755)
    workflow.write_config(target={"model": str(demo_model), "build_demo": False}, gpus=0)
    env = {"PATH": f"{bin_dir}{os.pathsep}{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    proc = workflow.snakemake("--profile", "profiles/slurm", "--resources", "gpu=8", env=env, check=False)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "SLURM: `scontrol show config` failed: no cluster here" in output, output[-3000:]
    assert POOL_WARNING not in output


@pytest.mark.workflow
def test_the_pool_warning_still_prints_for_a_local_run(workflow, demo_model):
    """A local run whose `--resources gpu=N` exceeds the pool: its GPU jobs would wait. The
    demo (gpus_per_job 0) plans as before: CPU jobs keep their threads."""
    workflow.write_config(target={"model": str(demo_model), "build_demo": False}, gpus=0)
    proc = workflow.snakemake("--resources", "gpu=8", "-n")
    assert POOL_WARNING in proc.stdout + proc.stderr
    jobs = job_resources(proc.stdout)
    # Threads as the rules say (4 for tokenize), scaled to the tests' --cores 2.
    assert {job["cpus_per_task"] for job in jobs["train"]} == {"2"}
    assert {job["cpus_per_task"] for job in jobs["tokenize"]} == {"2"}
    # The local executor itself, on a job that takes no GPU.
    proc = workflow.snakemake("ingest", "--resources", "gpu=8")
    assert POOL_WARNING in proc.stdout + proc.stderr
