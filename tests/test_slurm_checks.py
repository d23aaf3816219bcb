"""What a SLURM run needs from the cluster (dflash_pipeline.core.slurm), on the text that
scontrol, sinfo and sacctmgr print: no cluster needed."""

from __future__ import annotations

import pytest

from dflash_pipeline.core.slurm import (
    Cluster,
    Partition,
    SlurmClusterError,
    cap,
    check_cluster,
    cpus_in_this_job,
    job_state,
    parse_associations,
    parse_config,
    parse_gpus,
    parse_seconds,
    parse_sinfo,
    read_cluster,
)

SETTINGS = {
    "gpu_partition": "gpu",
    "cpu_partition": "cpu",
    "account": None,
    "qos": None,
    "gpu_constraint": None,
    "max_cpus_per_job": None,
}


def cluster(**changes) -> Cluster:
    base = Cluster(
        name="lab",
        accounting="accounting_storage/slurmdbd",
        min_job_age_s=300,
        partitions={
            "cpu": Partition("cpu", 2, 23000, 0, set()),
            "gpu": Partition("gpu", 16, 500000, 8, {"h200", "ib"}),
        },
        user="alice",
        accounts={"dflash", "other"},
        default_account="dflash",
        qos={"normal", "long"},
    )
    for key, value in changes.items():
        setattr(base, key, value)
    return base


def test_sinfo_per_node_lines_give_the_smallest_node_of_each_partition():
    text = (
        "cpu*|2|23081|(null)|(null)\ngpu|64|1000000|gpu:h200:8(S:0-1)|h200,ib\ngpu|32|500000|gpu:h100:4,shard:8|h100\n"
    )
    parts = parse_sinfo(text)
    assert parts["cpu"] == Partition("cpu", 2, 23081, 0, set())
    assert (parts["gpu"].cpus, parts["gpu"].memory_mb, parts["gpu"].gpus) == (32, 500000, 4)
    assert parts["gpu"].features == {"h200", "ib", "h100"}
    assert parse_gpus("gpu:2") == 2 and parse_gpus("gpu") == 1 and parse_gpus("(null)") == 0


def test_scontrol_config_and_times():
    conf = parse_config(
        "Configuration data as of ...\nAccountingStorageType   = accounting_storage/slurmdbd\nMinJobAge               = 300 sec\n"
    )
    assert conf["AccountingStorageType"] == "accounting_storage/slurmdbd"
    assert parse_seconds(conf["MinJobAge"]) == 300 and parse_seconds("1h") == 3600 and parse_seconds(None) is None


def test_associations_give_accounts_and_qos():
    assert parse_associations("dflash|normal,long\nroot|normal\n") == ({"dflash", "root"}, {"normal", "long"})


def test_a_fitting_config_passes_in_one_line_with_the_default_account_and_the_caps():
    plan = check_cluster(SETTINGS, cluster(), {"cpu": 0, "gpu": 1})
    assert plan.problems == []
    assert plan.account == "dflash"
    assert plan.cpu_caps == {"cpu": 2, "gpu": 16} and plan.memory_caps == {"cpu": 23000, "gpu": 500000}
    assert "\n" not in plan.line
    assert plan.line.startswith(
        "SLURM cluster lab: accounting on (slurmdbd: job states from sacct); account dflash (alice's default"
    )
    assert (
        "cpu (2 CPUs, 23000 MB a node), gpu (16 CPUs, 8 GPU(s), 500000 MB a node; "
        "GPU jobs 2 CPUs a GPU, the node's share)" in plan.line
    )
    limited = check_cluster({**SETTINGS, "max_cpus_per_job": 4}, cluster(), {"cpu": 0, "gpu": 1})
    assert limited.cpu_caps == {"cpu": 2, "gpu": 4} and "slurm.max_cpus_per_job" in limited.line


def test_accounting_off_stops_a_sacct_run_and_says_what_to_do():
    off = cluster(accounting="accounting_storage/none", accounts=None, default_account=None, qos=None)
    plan = check_cluster(SETTINGS, off, {"cpu": 0})
    assert len(plan.problems) == 1 and "accounting is off" in plan.problems[0]
    assert "--slurm-status-command squeue" in plan.problems[0] and "wait for ever" in plan.problems[0]
    # squeue works while ended jobs stay listed (MinJobAge >= 120 s) ...
    assert check_cluster(SETTINGS, off, {"cpu": 0}, status_command="squeue").problems == []
    # ... and not below: the plugin would fall back to sacct.
    off.min_job_age_s = 30
    assert "MinJobAge is 30 s" in check_cluster(SETTINGS, off, {"cpu": 0}, status_command="squeue").problems[0]
    assert "no account" in check_cluster(SETTINGS, off, {"cpu": 0}, status_command="squeue").line


@pytest.mark.parametrize(
    "settings, used, problem",
    [
        ({"account": "nope"}, {"cpu": 0}, "slurm.account 'nope' is not one of alice's accounts (dflash, other"),
        ({"qos": "high"}, {"cpu": 0}, "slurm.qos 'high' is not one alice may use (long, normal)"),
        ({"cpu_partition": "small"}, {"small": 0}, "partition 'small' does not exist on cluster lab (it has: cpu, gpu"),
        ({}, {"cpu": 0, "gpu": 16}, "jobs ask for 16 GPU(s) in partition 'gpu', whose nodes have 8"),
        (
            {"gpu_constraint": "a100"},
            {"cpu": 0, "gpu": 1},
            "slurm.gpu_constraint 'a100' matches no node feature of partition 'gpu' (h200, ib)",
        ),
    ],
)
def test_what_the_cluster_lacks_stops_the_run_before_any_submission(settings, used, problem):
    plan = check_cluster({**SETTINGS, **settings}, cluster(), used)
    assert any(problem in p for p in plan.problems), plan.problems


def test_a_named_account_qos_and_constraint_are_used_and_said():
    plan = check_cluster(
        {**SETTINGS, "account": "other", "qos": "long", "gpu_constraint": "h200&ib"}, cluster(), {"cpu": 0, "gpu": 8}
    )
    assert plan.problems == [] and plan.account == "other"
    assert "account other; QoS long; constraint h200&ib" in plan.line


def test_read_cluster_asks_scontrol_sinfo_and_sacctmgr():
    answers = {
        "scontrol": "ClusterName = lab\nAccountingStorageType = accounting_storage/slurmdbd\nMinJobAge = 300 sec\n",
        "sinfo": "cpu*|2|23081|(null)|(null)\ngpu|2|23081|gpu:2|(null)\n",
        "sacctmgr show associations": "dflash|normal\n",
        "sacctmgr show user": "dflash\n",
    }
    asked = []

    def run(args):
        asked.append(args)
        key = args[0] if args[0] != "sacctmgr" else f"sacctmgr show {args[4]}"
        return answers[key]

    found = read_cluster(user="alice", run=run)
    assert found.name == "lab" and found.partitions["gpu"].gpus == 2
    assert found.accounts == {"dflash"} and found.default_account == "dflash" and found.qos == {"normal"}
    assert [
        "sacctmgr",
        "--noheader",
        "--parsable2",
        "show",
        "associations",
        "user=alice",
        "format=account,qos",
    ] in asked


def test_without_slurm_commands_the_reason_is_named(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(SlurmClusterError, match="`scontrol` not found"):
        read_cluster(user="alice")


def test_caps_inside_a_job_follow_the_allocation(monkeypatch):
    monkeypatch.delenv("SLURM_CPUS_PER_TASK", raising=False)
    monkeypatch.delenv("SLURM_CPUS_ON_NODE", raising=False)
    assert cpus_in_this_job() is None and cap(4, None) == 4
    monkeypatch.setenv("SLURM_CPUS_ON_NODE", "2")
    assert cpus_in_this_job() == 2 and cap(4, 2) == 2 and cap(1, 2) == 1


def test_a_state_loses_its_qualifier():
    """sacct says `CANCELLED by 0` for a scancelled job; the executor plugin knows `CANCELLED`
    (the patch that passes it on: tests/test_slurm_states.py)."""
    assert job_state("CANCELLED by 0") == "CANCELLED" and job_state("COMPLETED") == "COMPLETED"
    assert job_state("") == ""
