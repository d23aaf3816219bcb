"""What a SLURM run (``--profile profiles/slurm``) needs from the cluster, checked before the first
``sbatch``, and the caps that keep every job's request within the nodes it is sent to.

Snakemake's SLURM executor plugin submits each job with ``sbatch`` and learns that it ended from
``sacct`` (its default status command). So:

- **Accounting must be on** (``AccountingStorageType=accounting_storage/slurmdbd``). Without it
  ``sacct`` sees no job and the driver waits for ever on jobs that finished long ago. The plugin's
  other status command, ``--slurm-status-command squeue``, works without accounting only while
  finished jobs stay in ``squeue``: ``MinJobAge`` of 120 s or more (the plugin falls back to
  ``sacct`` below that).
- **The account**: the plugin's own guess when none is given runs
  ``sacct -nu USER -o Account%256 | tail -1`` as one command (``tail -1`` reaches sacct as
  options; Slurm 22.05 answers "invalid option -- '1'") and goes on without an account. With
  ``slurm.account: null`` the run takes the user's default account from ``sacctmgr`` instead; a
  named account, QoS, partition or GPU constraint that the cluster does not have stops the run
  here, not as a job that stays PENDING.
- **Requests that fit**: a job that asks for more CPUs or memory than any node of its partition
  has stays PENDING for ever (reason ``PartitionConfig``, or sbatch refuses it). A CPU job asks
  for ``min(threads, cap)`` CPUs (``cpus_per_task``), the cap being ``slurm.max_cpus_per_job`` or
  else the fewest CPUs of a node in the job's partition (sinfo); its memory is capped at the
  smallest node's memory.
- **GPU jobs get their share of the node**: a job's rule ``threads`` (2) are far too few for an
  8-GPU train job (8 torchrun ranks and their data loaders) or an engine server with its client.
  A GPU job asks for ``gpus x cpus_per_gpu`` CPUs (at least its threads, capped as above),
  ``cpus_per_gpu`` being ``slurm.cpus_per_gpu`` or else the node's CPUs over its GPUs (sinfo, the
  fewest of each in the partition); with ``slurm.mem_per_gpu_mb`` its memory is at least
  ``gpus x`` that. A dry-run asks the cluster nothing: it shows ``UNPROBED_CPUS_PER_GPU`` per GPU
  where ``slurm.cpus_per_gpu`` is null.

Everything here is plain Python over the text of ``scontrol``, ``sinfo`` and ``sacctmgr``
(``read_cluster`` runs them), so it is tested without a cluster.
"""

from __future__ import annotations

import getpass
import os
import re
import shutil
import subprocess
from dataclasses import dataclass, field

ACCOUNTING_NONE = "accounting_storage/none"
# The plugin uses squeue for job status only when MinJobAge is at least this (seconds).
SQUEUE_MIN_JOB_AGE_S = 120


class SlurmClusterError(RuntimeError):
    """The cluster cannot be asked (no Slurm client commands, slurmctld unreachable)."""


@dataclass
class Partition:
    name: str
    cpus: int  # the fewest CPUs of a node in it
    memory_mb: int  # the least memory of a node in it
    gpus: int  # the fewest GPUs (gres gpu) of a node in it
    features: set[str] = field(default_factory=set)  # every node feature in it


@dataclass
class Cluster:
    name: str
    accounting: str
    min_job_age_s: int | None
    partitions: dict[str, Partition]
    user: str
    # None: not known (accounting off); else the user's associations.
    accounts: set[str] | None = None
    default_account: str | None = None
    qos: set[str] | None = None


def parse_config(text: str) -> dict[str, str]:
    """``scontrol show config``: its ``Key = Value`` lines."""
    found = {}
    for line in text.splitlines():
        key, sep, value = line.partition("=")
        if sep and key.strip() and " " not in key.strip():
            found[key.strip()] = value.strip()
    return found


def parse_seconds(value: str | None) -> int | None:
    """``300 sec``, ``1h``, ``300`` -> seconds."""
    match = re.match(r"^\s*(\d+)\s*([a-zA-Z]*)", value or "")
    if not match:
        return None
    number, unit = int(match.group(1)), match.group(2).lower()
    return number * 3600 if unit in ("h", "hour", "hours") else number * 60 if unit in ("min", "m") else number


def parse_gpus(gres: str) -> int:
    """GPUs in an sinfo gres field: ``gpu:2``, ``gpu:h100:8(S:0-1)``, ``gpu:a100:4,shard:8``."""
    total = 0
    for item in re.split(r",(?![^()]*\))", gres or ""):
        parts = re.sub(r"\(.*\)", "", item).split(":")
        if parts[0] == "gpu":
            total += int(parts[-1]) if len(parts) > 1 and parts[-1].isdigit() else 1
    return total


# One line per node and partition: partition|CPUs|memory MB|gres|features.
SINFO_FORMAT = "%R|%c|%m|%G|%f"


def parse_sinfo(text: str) -> dict[str, Partition]:
    partitions: dict[str, Partition] = {}
    for line in text.splitlines():
        fields = line.strip().split("|")
        if len(fields) != 5:
            continue
        name, cpus, memory, gres, features = fields
        name = name.rstrip("*")
        cpus_n = int(re.sub(r"\D.*", "", cpus) or 0)
        memory_n = int(re.sub(r"\D.*", "", memory) or 0)
        node_features = {f for f in re.split(r"[,&|]", features) if f and f != "(null)"}
        gpus = parse_gpus(gres)
        known = partitions.get(name)
        if known is None:
            partitions[name] = Partition(name, cpus_n, memory_n, gpus, node_features)
        else:
            known.cpus = min(known.cpus, cpus_n)
            known.memory_mb = min(known.memory_mb, memory_n)
            known.gpus = min(known.gpus, gpus)
            known.features |= node_features
    return partitions


def parse_associations(text: str) -> tuple[set[str], set[str]]:
    """``sacctmgr -nP show assoc user=U format=account,qos``: (accounts, QoS names)."""
    accounts, qos = set(), set()
    for line in text.splitlines():
        account, _, names = line.strip().partition("|")
        if account:
            accounts.add(account.strip().lower())
        qos |= {q.strip().lower() for q in names.split(",") if q.strip()}
    return accounts, qos


def _run(args: list[str]) -> str:
    if shutil.which(args[0]) is None:
        raise SlurmClusterError(
            f"`{args[0]}` not found: profiles/slurm submits from a machine with Slurm's client commands"
        )
    proc = subprocess.run(args, capture_output=True, text=True, timeout=60)
    if proc.returncode != 0:
        raise SlurmClusterError(f"`{' '.join(args)}` failed: {(proc.stderr or proc.stdout).strip()}")
    return proc.stdout


def read_cluster(user: str | None = None, run=_run) -> Cluster:
    """The facts of the cluster this machine submits to (scontrol, sinfo, sacctmgr)."""
    user = user or getpass.getuser()
    conf = parse_config(run(["scontrol", "show", "config"]))
    accounting = conf.get("AccountingStorageType", ACCOUNTING_NONE)
    cluster = Cluster(
        name=conf.get("ClusterName", "?"),
        accounting=accounting,
        min_job_age_s=parse_seconds(conf.get("MinJobAge")),
        partitions=parse_sinfo(run(["sinfo", "--noheader", "--Node", f"--format={SINFO_FORMAT}"])),
        user=user,
    )
    if accounting != ACCOUNTING_NONE:
        assoc = run(
            ["sacctmgr", "--noheader", "--parsable2", "show", "associations", f"user={user}", "format=account,qos"]
        )
        cluster.accounts, cluster.qos = parse_associations(assoc)
        default = run(["sacctmgr", "--noheader", "--parsable2", "show", "user", user, "format=defaultaccount"])
        cluster.default_account = default.strip().splitlines()[0].strip() if default.strip() else None
    return cluster


@dataclass
class SlurmPlan:
    """What the check decided: the account to pass, the caps per partition, the one-line summary,
    and the problems that stop the run."""

    account: str | None
    cpu_caps: dict[str, int]
    memory_caps: dict[str, int]
    line: str
    problems: list[str]
    # Per partition that GPU jobs go to: the CPUs each of a job's GPUs brings (config or node share).
    cpus_per_gpu: dict[str, int] = field(default_factory=dict)


def check_cluster(
    settings: dict, cluster: Cluster, gpus_per_partition: dict[str, int], status_command: str = "sacct"
) -> SlurmPlan:
    """Check the config's ``slurm`` section against the cluster.

    ``gpus_per_partition``: the partitions the run's jobs go to, each with the most GPUs one of
    its jobs asks for. ``status_command``: the plugin's (``--slurm-status-command``).
    """
    problems = []
    # Accounting, and what the driver learns job ends from.
    accounting_on = cluster.accounting != ACCOUNTING_NONE
    if accounting_on:
        status = f"accounting on ({cluster.accounting.split('/')[-1]}: job states from {status_command})"
    else:
        age = cluster.min_job_age_s
        status = f"accounting off (job states from squeue, MinJobAge {age} s)"
        if status_command != "squeue":
            problems.append(
                f"SLURM: accounting is off on cluster {cluster.name} (AccountingStorageType={cluster.accounting}): "
                "sacct sees no job, and the driver would wait for ever on jobs that have ended. Turn "
                "accounting on (slurmdbd), or run with --slurm-status-command squeue"
                + (
                    ""
                    if (age or 0) >= SQUEUE_MIN_JOB_AGE_S
                    else f" after raising MinJobAge to {SQUEUE_MIN_JOB_AGE_S} s or more (it is {age} s)"
                )
            )
        elif (age or 0) < SQUEUE_MIN_JOB_AGE_S:
            problems.append(
                f"SLURM: accounting is off and MinJobAge is {age} s: squeue forgets ended jobs before the "
                f"driver asks (the plugin needs {SQUEUE_MIN_JOB_AGE_S} s or more, else it falls back to sacct)"
            )
    # Account and QoS.
    account = settings.get("account")
    if account:
        if cluster.accounts is not None and account.lower() not in cluster.accounts:
            problems.append(
                f"SLURM: slurm.account {account!r} is not one of {cluster.user}'s accounts "
                f"({', '.join(sorted(cluster.accounts)) or 'none'}; sacctmgr show associations user={cluster.user})"
            )
        account_text = f"account {account}"
    elif cluster.default_account:
        account = cluster.default_account
        account_text = f"account {account} ({cluster.user}'s default; slurm.account: null)"
    else:
        account_text = "no account (the cluster's default)"
    qos = settings.get("qos")
    if qos and cluster.qos is not None and qos.lower() not in cluster.qos:
        problems.append(
            f"SLURM: slurm.qos {qos!r} is not one {cluster.user} may use ({', '.join(sorted(cluster.qos)) or 'none'})"
        )
    qos_text = f"QoS {qos}" if qos else "no QoS"
    # Partitions, GPUs, the constraint, and the caps.
    cpu_caps, memory_caps, per_gpu, described = {}, {}, {}, []
    limit = settings.get("max_cpus_per_job")
    constraint = settings.get("gpu_constraint")
    for name, gpus in sorted(gpus_per_partition.items()):
        partition = cluster.partitions.get(name)
        if partition is None:
            problems.append(
                f"SLURM: partition {name!r} does not exist on cluster {cluster.name} "
                f"(it has: {', '.join(sorted(cluster.partitions)) or 'none'}; config keys slurm.cpu_partition, slurm.gpu_partition)"
            )
            continue
        if gpus and partition.gpus < gpus:
            problems.append(
                f"SLURM: jobs ask for {gpus} GPU(s) in partition {name!r}, whose nodes have "
                f"{partition.gpus} (gres gpu): they would never start"
            )
        if gpus and constraint and not _constraint_met(constraint, partition.features):
            problems.append(
                f"SLURM: slurm.gpu_constraint {constraint!r} matches no node feature of partition "
                f"{name!r} ({', '.join(sorted(partition.features)) or 'none'})"
            )
        cap = min(partition.cpus, limit) if limit else partition.cpus
        cpu_caps[name] = max(1, cap)
        memory_caps[name] = partition.memory_mb
        gpu_text = f", {partition.gpus} GPU(s)" if partition.gpus else ""
        share_text = ""
        if gpus:
            per_gpu[name] = cpus_per_gpu(settings, partition)
            source = "slurm.cpus_per_gpu" if settings.get("cpus_per_gpu") else "the node's share"
            share_text = f"; GPU jobs {per_gpu[name]} CPUs a GPU, {source}"
        described.append(f"{name} ({partition.cpus} CPUs{gpu_text}, {partition.memory_mb} MB a node{share_text})")
    cap_text = (
        f"jobs ask for at most {limit} CPUs (slurm.max_cpus_per_job) and what a node has"
        if limit
        else "jobs ask for at most what a node of their partition has"
    )
    line = (
        f"SLURM cluster {cluster.name}: {status}; {account_text}; {qos_text}"
        + (f"; constraint {constraint}" if constraint and any(gpus_per_partition.values()) else "")
        + f"; partitions {', '.join(described) or 'none'}: {cap_text}"
    )
    return SlurmPlan(account, cpu_caps, memory_caps, line, problems, per_gpu)


def _constraint_met(constraint: str, features: set[str]) -> bool:
    """Whether any feature named in a constraint expression (``h200``, ``a100|h100``,
    ``h200&ib``) exists in the partition: enough to catch a misspelt feature."""
    names = [n for n in re.split(r"[&|,()\[\]*\d]+", constraint) if n]
    return any(n in features for n in names) if names else True


def partition_of(settings: dict, gpus: int) -> str:
    """The partition of a job that takes ``gpus`` GPUs (``slurm.gpu_partition`` or
    ``slurm.cpu_partition``)."""
    return settings["gpu_partition" if gpus else "cpu_partition"]


def partitions_used(config: dict) -> dict[str, int]:
    """The partitions a run's jobs go to, each with the most GPUs one of its jobs asks for: the
    CPU jobs', generate's, train's and extract's (one of train's GPUs)."""
    settings = config["slurm"]
    used = {partition_of(settings, 0): 0}
    train_gpus = config["train"]["gpus_per_job"]
    for gpus in (config["generation"]["gpus_per_job"], train_gpus, min(1, train_gpus)):
        if gpus:
            used[partition_of(settings, gpus)] = max(used.get(partition_of(settings, gpus), 0), gpus)
    return used


def fixed_resources(settings: dict, gpus: int) -> dict[str, str]:
    """What a job of ``gpus`` GPUs asks for that the config alone decides: its partition, the QoS
    and, for a GPU job, the node constraint (``slurm.qos``, ``slurm.gpu_constraint``)."""
    found = {"slurm_partition": partition_of(settings, gpus)}
    if settings["qos"]:
        found["qos"] = settings["qos"]
    if gpus and settings["gpu_constraint"]:
        found["constraint"] = settings["gpu_constraint"]
    return found


def plan_run(config: dict, status_command: str | None, read=read_cluster) -> SlurmPlan:
    """The driver's look at the cluster before its first sbatch (``check_cluster`` of the
    partitions the run uses). A cluster that cannot be asked, or any problem, raises ValueError
    with every problem on its own line: the run stops before a job that would never start."""
    try:
        plan = check_cluster(config["slurm"], read(), partitions_used(config), status_command or "sacct")
    except SlurmClusterError as err:
        raise ValueError(f"SLURM: {err}") from None
    if plan.problems:
        raise ValueError("\n".join(plan.problems) + "\n(check the config's `slurm` section, or the cluster)")
    return plan


def smallest_node_mb(plan: SlurmPlan | None) -> int:
    """The least memory of a node of the run's partitions (0: not read, no cap)."""
    return min(plan.memory_caps.values(), default=0) if plan else 0


def cpus_in_this_job() -> int | None:
    """Inside a Slurm job: the CPUs its allocation gives a task (None elsewhere)."""
    for key in ("SLURM_CPUS_PER_TASK", "SLURM_CPUS_ON_NODE"):
        value = os.environ.get(key, "")
        if value.isdigit() and int(value) > 0:
            return int(value)
    return None


def cap(value: int, limit: int | None) -> int:
    return min(value, limit) if limit else value


# CPUs a GPU brings to its job where slurm.cpus_per_gpu is null and no partition was read (a
# dry-run asks the cluster nothing): what the plan shows, not what the driver will submit.
UNPROBED_CPUS_PER_GPU = 4


def cpus_per_gpu(settings: dict, partition: Partition | None) -> int:
    """``slurm.cpus_per_gpu``, else the node's share: its CPUs over its GPUs (the fewest of each
    in the partition), else ``UNPROBED_CPUS_PER_GPU``."""
    if settings.get("cpus_per_gpu"):
        return int(settings["cpus_per_gpu"])
    if partition is not None and partition.gpus and partition.cpus:
        return max(1, partition.cpus // partition.gpus)
    return UNPROBED_CPUS_PER_GPU


def job_cpus(threads: int, gpus: int, per_gpu: int | None, limit: int | None) -> int:
    """A job's CPUs (sbatch ``--cpus-per-task``): a CPU job's threads; a GPU job's
    ``gpus x per_gpu``, never fewer than its threads; either capped to ``limit`` (the partition's
    node, or slurm.max_cpus_per_job), which a request above it would never fit."""
    want = max(threads, gpus * per_gpu) if gpus and per_gpu else threads
    return max(1, cap(want, limit))


def requested_cpus(
    threads: int,
    gpus: int,
    settings: dict,
    partition: str,
    plan: SlurmPlan | None = None,
    allocation: int | None = None,
) -> int:
    """The ``cpus_per_task`` resource of a job of ``partition`` taking ``gpus`` GPUs.

    - The driver of a SLURM run (``plan``): per GPU the plan's figure, capped to the partition.
    - A job's own process (``allocation``: the CPUs Slurm gave it; the job-step plugin's srun asks
      for them again): the allocation for a GPU job whose share the driver read from the node, else
      the figure capped to the allocation.
    - Elsewhere (a dry-run, another executor, which ignores the resource): ``slurm.cpus_per_gpu``
      or ``UNPROBED_CPUS_PER_GPU`` per GPU, capped to slurm.max_cpus_per_job.
    """
    limit = settings.get("max_cpus_per_job")
    if plan is not None:
        return job_cpus(threads, gpus, plan.cpus_per_gpu.get(partition), plan.cpu_caps.get(partition))
    if allocation:
        if gpus and not settings.get("cpus_per_gpu"):
            return cap(allocation, limit)
        return job_cpus(threads, gpus, settings.get("cpus_per_gpu"), cap(allocation, limit))
    return job_cpus(threads, gpus, cpus_per_gpu(settings, None), limit)


def job_memory(mb: int, gpus: int, settings: dict, node_mb: int | None = None) -> int:
    """A job's ``mem_mb``: its size-based figure (dflash_pipeline.core.resources), for a GPU job
    at least ``gpus x slurm.mem_per_gpu_mb`` where set, capped to the smallest node's memory."""
    per_gpu = settings.get("mem_per_gpu_mb")
    want = max(mb, gpus * per_gpu) if gpus and per_gpu else mb
    return min(want, node_mb) if node_mb else want


def gpu_pool_warning(limit: int | None, pool: int, local: bool) -> str | None:
    """The warning for ``--resources gpu=N`` above the pool the slot wrapper hands out (config
    ``gpus``), said only where that pool schedules devices: a local run. Under SLURM the cluster
    gives each job its GPUs and the driver's pool plays no part."""
    if limit is None or int(limit) <= pool or not local:
        return None
    return (
        f"--resources gpu={limit} exceeds the GPU pool ({pool}, config key `gpus`): GPU jobs will wait for free devices"
    )


def runs_locally(executor: str, local_exec: bool, use_threads: bool) -> bool:
    """Whether a run's jobs run on this machine. A dry-run's executor is Snakemake's ``dryrun``
    whatever the profile names; only for a remote executor (SLURM) does Snakemake turn on its
    threads for the run (snakemake.api's execute_workflow), which tells the two apart."""
    if executor == "dryrun":
        return not use_threads
    return local_exec


def job_state(state: str) -> str:
    """sacct's state without its qualifier: a scancelled job is ``CANCELLED by 0``."""
    return state.split()[0] if state and state.strip() else state
