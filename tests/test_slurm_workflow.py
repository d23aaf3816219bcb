"""The workflow through a real Slurm (a single-node cluster with accounting, tests.support.
slurm_cluster): the demo to the evaluated drafter with every job a Slurm job (sacct's records),
requests capped to the node, the GPU flags and pool, and scancel / time-limit resumes."""

from __future__ import annotations

import getpass
import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from tests.support.ci import skip_unless_ci
from tests.support.waiting import wait_until

pytestmark = [pytest.mark.workflow, pytest.mark.slurm]

# The first status check comes this many seconds after a submission (the plugin's default, 40 s,
# is for real clusters); later checks back off by 10 s while no job ends.
FAST_STATUS = ("--slurm-init-seconds-before-status-checks", "2")
SACCT_FIELDS = (
    "JobID",
    "JobName",
    "Comment",
    "Partition",
    "Account",
    "QOS",
    "State",
    "ReqCPUS",
    "ReqMem",
    "AllocTRES",
    "Timelimit",
)


# Training steps of the fault test's segment.
STEPS = 100_000


def configure(workflow, demo_model, prompts=6, **overrides):
    """The demo, tiny: each stage's quality is other tests' business; here every job goes
    through Slurm."""
    workflow.write_config(
        dataset={"paths": [workflow.few_prompts(prompts)], "heldout_fraction": 0.34},
        target={"model": str(demo_model), "build_demo": False},
        generation={"max_new_tokens": 32, "concurrency": 2, "part_every_samples": 2, "part_every_seconds": 86400},
        train={"steps_per_segment": 3, "checkpoint_every_steps": 2},
        evaluate={"max_prompts": 2, "max_new_tokens": 16, "simulated_rows": 2, "parity_tolerance": 10.0},
        tokenize={"max_degenerate_fraction": 1.0},
        # The lock folder of the GPU slots, in the test's own folder.
        gpu_lock_dir=str(workflow.root / "locks"),
        slurm={"qos": "normal"},
    )
    workflow.write_config(**overrides)


def snakemake_env(cluster, extra=None) -> dict:
    env = dict(os.environ)
    # Jobs run `python` from PATH (sbatch passes the driver's environment): the test's first.
    env["PATH"] = f"{cluster.bin}{os.pathsep}{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(Path(__file__).parent.parent), env.get("PYTHONPATH")) if p)
    env["SLURM_CONF"] = str(cluster.conf)
    env.update(extra or {})
    return env


def start(workflow, cluster, *args, env=None, log: Path) -> subprocess.Popen:
    """The driver as a user runs it: no --cores (every job goes to Slurm); its status checks at
    most a few seconds apart (tests.support.slurm_driver)."""
    sink = open(log, "wb")
    try:
        return subprocess.Popen(
            [sys.executable, "-m", "tests.support.slurm_driver", *FAST_STATUS, *args],
            cwd=workflow.root,
            env=snakemake_env(cluster, env),
            stdout=sink,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    finally:
        sink.close()


def run(workflow, cluster, *args, env=None, check=True, timeout=1500) -> str:
    log = workflow.root / f"driver-{uuid.uuid4().hex[:6]}.log"
    child = start(workflow, cluster, *args, env=env, log=log)
    try:
        child.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, signal.SIGKILL)
        child.wait()
        raise AssertionError(f"snakemake {' '.join(args)} timed out:\n{log.read_text()[-6000:]}") from None
    out = log.read_text()
    if check and child.returncode != 0:
        raise AssertionError(f"snakemake {' '.join(args)} failed ({child.returncode}):\n{out[-8000:]}")
    return out


def run_id(out: str) -> str:
    return re.search(r"SLURM run ID: (\S+)", out).group(1)


def jobs_of(cluster, out: str) -> list[dict]:
    """sacct's record of every job this driver submitted that has ended, with its rule (from the
    comment, which sacct records only when a job ends)."""
    records = []
    for record in cluster.sacct(*SACCT_FIELDS, extra=("--name", run_id(out))):
        rule = re.match(r"rule_(\w+?)(_wildcards_|$)", record["Comment"])
        if rule is not None:
            records.append({**record, "rule": rule.group(1)})
    return records


def by_rule(records) -> dict[str, list[dict]]:
    found: dict[str, list[dict]] = {}
    for record in records:
        found.setdefault(record["rule"], []).append(record)
    return found


def tres(record, key: str) -> str | None:
    return dict(item.split("=", 1) for item in record["AllocTRES"].split(",") if "=" in item).get(key)


def attempt_logs(run_root: Path, job: str) -> str:
    """Every attempt's job log, oldest first (each attempt keeps its own: core.joblog)."""
    paths = sorted((run_root / "logs/attempts" / job).glob("*.job.log"))
    return "".join(p.read_text() for p in paths)


@pytest.mark.parametrize("profile", ["slurm", "slurm-s3"])
def test_the_demo_runs_through_sbatch_to_the_evaluated_drafter(profile, workflow, demo_model, slurm_cluster, request):
    if profile == "slurm":
        configure(workflow, demo_model, num_shards=1)
        args, env = ("--profile", "profiles/slurm"), None
    else:
        # Through S3 without a shared folder up to generate: jobs on the nodes read and write
        # the bucket (every later stage does it the same way, and the local-profile S3 test runs
        # them all).
        s3 = request.getfixturevalue("s3_server")
        configure(workflow, demo_model, num_shards=1, until="generate")
        prefix = f"slurm-{uuid.uuid4().hex[:8]}"
        args = ("--profile", "profiles/slurm-s3", "--default-storage-prefix", f"s3://{s3.bucket}/{prefix}")
        env = s3.env
    started = time.monotonic()
    out = run(workflow, slurm_cluster, *args, env=env)
    elapsed = time.monotonic() - started

    # What the plugin needs, checked and said in one line before the first sbatch.
    line = next(x for x in out.splitlines() if x.startswith("SLURM cluster dflashtest:"))
    assert out.index(line) < out.index("has been submitted with SLURM jobid")
    user = getpass.getuser()
    assert (
        f"accounting on (slurmdbd: job states from sacct); account dflash ({user}'s default; slurm.account: null)"
        in line
    ), line
    assert "QoS normal" in line and f"cpu ({slurm_cluster.cpus} CPUs" in line
    assert "trying to guess" not in out and "PartitionConfig" not in out

    # Every job a Slurm job: its rule, partition, account, QoS and requests as the profile says.
    rules = by_rule(jobs_of(slurm_cluster, out))
    expected = {"ingest": 1, "prepare": 1, "generate": 1}
    if profile == "slurm":
        expected.update(tokenize=1, train=2, segment_tau=2, export=1, evaluate=1)
    assert {rule: len(jobs) for rule, jobs in rules.items()} == expected, rules
    threads = {
        "ingest": 1,
        "prepare": 1,
        "generate": 2,
        "tokenize": 4,
        "train": 2,
        "segment_tau": 1,
        "export": 1,
        "evaluate": 2,
    }
    memory = {
        "ingest": 4000,
        "prepare": 2000,
        "tokenize": 4000,
        "generate": 8000,
        "train": 16000,
        "segment_tau": 16000,
        "export": 8000,
        "evaluate": 16000,
    }
    for rule, jobs in rules.items():
        for job in jobs:
            assert job["State"] == "COMPLETED", job
            assert (job["Partition"], job["Account"], job["QOS"]) == ("cpu", "dflash", "normal"), job
            # tokenize's 4 threads ask for the node's 2 CPUs: never more than a node has.
            assert int(job["ReqCPUS"]) == min(threads[rule], slurm_cluster.cpus), job
            assert job["ReqMem"] == f"{min(memory[rule], slurm_cluster.memory_mb)}M", job
            assert tres(job, "gres/gpu") is None, job
    # The logs where the README says, the drafter and its evaluation.
    if profile == "slurm":
        root = workflow.root / "results/demo"
        assert (root / "drafter/model.safetensors").exists()
        metrics = json.loads((root / "outputs/evaluate-metrics.json").read_text())
        assert metrics["overall"]["verify_steps"] > 0
        for log in (
            "ingest.log",
            "generate/00000.log",
            "generate-engine/00000.log",
            "tokenize/00000.log",
            "train/segment-0001.log",
            "evaluate.log",
            "evaluate-engine.log",
        ):
            assert (root / "logs" / log).stat().st_size > 0, log
        assert (root / "logs/export.log").exists()
    else:
        import boto3

        client = boto3.client(
            "s3",
            endpoint_url=s3.endpoint,
            aws_access_key_id=s3.env["SNAKEMAKE_STORAGE_S3_ACCESS_KEY"],
            aws_secret_access_key=s3.env["SNAKEMAKE_STORAGE_S3_SECRET_KEY"],
            region_name="us-east-1",
        )
        listed = client.list_objects_v2(Bucket=s3.bucket, Prefix=f"{prefix}/results/demo/")
        keys = {o["Key"].split("/results/demo/", 1)[1] for o in listed.get("Contents", [])}
        assert {
            "outputs/generate-00000.parquet",
            "logs/ingest.log",
            "logs/generate/00000.log",
            "logs/generate-engine/00000.log",
        } <= keys, keys
        assert not (workflow.root / "results").exists(), "an S3 run must leave no local results"
    print(f"{profile}: the demo through Slurm took {elapsed:.0f} s")


def test_scancel_and_the_time_limit_are_resumed_from_parts_and_checkpoints_on_gpu_slots(
    workflow, demo_model, slurm_cluster
):
    """One run, through real Slurm jobs, with generate on 1 GPU:

    - the GPU job asks Slurm for it (`--gpus=1`, the gpu partition: gres/gpu in sacct's TRES). This
      machine has no GPU (a pool of 0 from nvidia-smi): the job's slot wrapper runs only because
      it takes Slurm's CUDA_VISIBLE_DEVICES (the node's placeholder GPUs) as its pool;
    - generate is scancelled (SIGTERM, then SIGKILL) after two saved parts; its retry, a new Slurm
      job, resumes from the parts: nothing lost, nothing generated twice;
    - the train segment, with a 1-minute limit (`--set-resources train:runtime=1`), is scancelled
      after a checkpoint; its retries resume from the last checkpoint, are killed at the limit
      (TIMEOUT: SIGTERM, the trainer checkpoints and exits), and the next attempt resumes from
      there; then the test stops the run as a user would, with Ctrl-C (the segment is longer
      than it waits), and Snakemake cancels the running attempt.
    """
    from dflash_pipeline.core.jobstate import ShardProgress
    from dflash_pipeline.core.storage import open_storage

    if not slurm_cluster.gpus:
        skip_unless_ci(slurm_cluster.no_gpus_reason)
    prompts = 12
    configure(
        workflow,
        demo_model,
        prompts=prompts,
        num_shards=1,
        until="train",
        generation={"gpus_per_job": 1, "max_new_tokens": 48, "concurrency": 1, "part_every_samples": 2, "retries": 2},
        # More steps than any attempt gets through before its 1-minute limit: the limit is met
        # whatever the machine's speed. The test stops the run once an attempt has resumed
        # after a TIMEOUT (the segment is not meant to finish).
        train={"segments": 1, "steps_per_segment": STEPS, "checkpoint_every_steps": 10, "retries": 12},
    )
    run_root = workflow.root / "results/demo"
    progress = ShardProgress(open_storage(run_root), "generate", 0)

    def train_starts() -> list[int]:
        """The step each train attempt started from, in order (every attempt keeps its log)."""
        return [
            int(x)
            for x in re.findall(rf"segment 0: steps (\d+)\.\.{STEPS - 1} from", attempt_logs(run_root, "train-0000"))
        ]

    log = workflow.root / "driver.log"
    # Training on one thread (two by default): its attempts run to their 1-minute limit whatever
    # they do, so a second thread only doubled the CPU they burn meanwhile.
    driver = start(
        workflow, slurm_cluster, "--profile", "profiles/slurm", "--set-resources", "train:runtime=1",
        "--set-threads", "train=1", log=log,
    )  # fmt: skip
    try:

        def running(rule):
            """Running Slurm jobs of the rule (squeue: sacct stores the comment at the end)."""
            found = re.search(r"SLURM run ID: (\S+)", log.read_text())
            if not found:
                return []
            listed = slurm_cluster.command(
                "squeue", "--noheader", "--states=RUNNING", "--name", found.group(1), "--format=%i|%k"
            ).stdout.split()
            return [line.split("|")[0] for line in listed if line.split("|")[1].startswith(f"rule_{rule}")]

        # The files first, Slurm's queue only once they are there (each squeue or sacct costs
        # the jobs CPU time).
        wait_until(lambda: len(progress.part_keys()) >= 2 and running("generate"), 900, "two generate parts")
        slurm_cluster.command("scancel", running("generate")[0])
        # The segment's in-segment checkpoints (every 10 steps).
        checkpoint = run_root / "_progress/train/segment-0000/checkpoint/latest.json"
        wait_until(lambda: checkpoint.exists() and running("train"), 1500, "a train checkpoint")
        slurm_cluster.command("scancel", running("train")[0])

        def resumed_after_timeout() -> bool:
            # The first attempt is the scancelled one: a resume after a TIMEOUT is a third start.
            if len(train_starts()) < 3:
                return False
            states = [
                job["State"].split()[0] for job in by_rule(jobs_of(slurm_cluster, log.read_text())).get("train", [])
            ]
            return "TIMEOUT" in states and len(train_starts()) > states.index("TIMEOUT") + 1

        wait_until(resumed_after_timeout, 1500, "a train attempt resumed after the time limit")
        # Stopped as a user stops it, with Ctrl-C: Snakemake cancels its Slurm jobs (a SIGTERM
        # would let them run on to their end, here the next time limit).
        os.killpg(driver.pid, signal.SIGINT)
        driver.wait(timeout=300)
        # Every train attempt that started has ended in sacct's records (the cancelled one's
        # comment, its rule, is stored when it ends).
        wait_until(
            lambda: len(by_rule(jobs_of(slurm_cluster, log.read_text())).get("train", [])) == len(train_starts()),
            300,
            "sacct's record of every train attempt",
            poll_s=1,
        )
    finally:
        if driver.poll() is None:
            os.killpg(driver.pid, signal.SIGKILL)
            driver.wait()
        found = re.search(r"SLURM run ID: (\S+)", log.read_text())
        if found:
            slurm_cluster.command("scancel", "--name", found.group(1))
    out = log.read_text()
    rules = by_rule(jobs_of(slurm_cluster, out))
    generate = [job["State"].split()[0] for job in rules["generate"]]
    assert generate == ["CANCELLED", "COMPLETED"], rules["generate"]
    train = [job["State"].split()[0] for job in rules["train"]]
    assert train[0] == "CANCELLED" and "TIMEOUT" in train[1:], rules["train"]
    for job in rules["generate"]:
        assert job["Partition"] == "gpu" and tres(job, "gres/gpu") == "1", job
    for job in rules["train"] + rules["tokenize"]:
        assert tres(job, "gres/gpu") is None and job["Partition"] == "cpu", job
    assert all(job["Timelimit"] == "00:01:00" for job in rules["train"]), rules["train"]
    assert all(int(job["ReqCPUS"]) == 1 for job in rules["train"]), rules["train"]  # --set-threads
    line = next(x for x in out.splitlines() if x.startswith("SLURM cluster dflashtest:"))
    assert f"gpu ({slurm_cluster.cpus} CPUs, {slurm_cluster.gpus} GPU(s)" in line, line
    # The devices the wrapper leased are ones Slurm gave (the node's are 0..gpus-1).
    locks = {p.name for p in (workflow.root / "locks").glob("gpu*.lock")}
    assert locks and locks <= {f"gpu{i}.lock" for i in range(slurm_cluster.gpus)}, locks
    # Every attempt resumed from the parts before it: nothing lost, nothing generated twice.
    accounts = re.findall(
        r"(\d+) prompts, (\d+) resumed from earlier work, (\d+) to generate", attempt_logs(run_root, "generate-00000")
    )
    assert len(accounts) == 2 and accounts[0][1] == "0" and int(accounts[1][1]) >= 4, accounts
    assert all(int(total) == prompts and int(reused) + int(fresh) == prompts for total, reused, fresh in accounts)
    import pyarrow.parquet as pq

    ids = pq.read_table(run_root / "outputs/generate-00000.parquet").column("id").to_pylist()
    assert sorted(ids) == sorted(set(ids)) and len(ids) == prompts
    starts = train_starts()
    # Each attempt starts where the one before it checkpointed (after scancel and after the time
    # limit: its last checkpoint), nothing trained twice past a checkpoint, nothing lost.
    assert len(starts) == len(train) and starts[0] == 0, (starts, train)
    assert all(later > earlier for earlier, later in zip(starts, starts[1:])), starts
    after_timeout = starts[train.index("TIMEOUT") + 1]
    metrics = [
        json.loads(x) for x in (run_root / "_progress/train/segment-0000/metrics.jsonl").read_text().splitlines()
    ]
    assert [r["step"] for r in metrics if r["step"] < after_timeout] == list(range(after_timeout))
