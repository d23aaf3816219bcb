"""A real single-node Slurm cluster for tests, from Debian's packages (slurm-wlm, slurmdbd, munge,
mariadb-server): munged, MariaDB, slurmdbd, slurmctld and slurmd as children of the test, every
file (configs, keys, state, spool, database, logs) in one folder, every port chosen free on
127.0.0.1. Accounting is on (slurmdbd on MariaDB), as the SLURM executor plugin needs: it learns
that a job ended from `sacct`.

The one node is this machine (its CPUs and memory) under two partitions, ``cpu`` (the default) and
``gpu``. With ``gpus`` > 0 the node declares that many placeholder GPUs (gres ``gpu``, backed by
empty files: nothing checks them without a cgroup device constraint), so a job that asks
``--gpus=N`` is scheduled, accounted (``gres/gpu`` in its TRES) and gets Slurm's
``CUDA_VISIBLE_DEVICES``.

Clients (sbatch, sacct, ...) find the cluster through ``SLURM_CONF`` (``cluster.env``); jobs run
as the submitting user (root in CI) with its environment (``sbatch --export=ALL``).

    python -m tests.support.slurm_cluster DIR    # start one by hand; Ctrl-C stops it
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import stat
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from tests.support.seaweed import free_port

# The programs the cluster runs (Debian: slurm-wlm slurmdbd munge mariadb-server).
DAEMONS = ("munged", "mariadbd", "mariadb-install-db", "slurmdbd", "slurmctld", "slurmd", "sbatch", "sacct", "sacctmgr")
PACKAGES = "slurm-wlm slurmdbd munge mariadb-server"
CLUSTER = "dflashtest"
ACCOUNT = "dflash"
QOS = "normal"


class SlurmUnavailable(RuntimeError):
    """The packages are missing or this machine cannot run the daemons (not root)."""


def missing() -> str | None:
    """Why a cluster cannot start here, or None."""
    absent = [name for name in DAEMONS if not _which(name)]
    if absent:
        return f"{', '.join(absent)} not found (apt-get install {PACKAGES}; .ci/run installs them)"
    if os.geteuid() != 0:
        return "the Slurm daemons of the test cluster run as root, and the tests do not"
    return None


def _which(name: str) -> str | None:
    return shutil.which(name) or shutil.which(name, path="/usr/sbin:/usr/bin:/sbin:/bin")


def node_memory_mb() -> int:
    """The node's RealMemory: this machine's memory less 1 GiB for the daemons and the driver."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return max(1024, int(line.split()[1]) // 1024 - 1024)
    raise SlurmUnavailable("no MemTotal in /proc/meminfo")


@dataclass
class SlurmCluster:
    root: Path
    node: str
    cpus: int
    memory_mb: int
    gpus: int
    conf: Path
    munge_socket: Path | None = None
    mysql_port: int | None = None
    no_gpus_reason: str | None = None
    processes: dict[str, subprocess.Popen] = field(default_factory=dict)

    @property
    def bin(self) -> Path:
        return self.root / "bin"

    @property
    def env(self) -> dict[str, str]:
        """What a client (sbatch, sacct, snakemake's SLURM plugin) needs to reach this cluster:
        SLURM_CONF, and on PATH first the client commands that set it themselves. The job-step
        plugin drops every SLURM_* variable (SLURM_CONF too) before its `srun` inside the job; a
        real cluster's clients read /etc/slurm/slurm.conf, this one's have the wrappers."""
        return {"SLURM_CONF": str(self.conf), "PATH": f"{self.bin}{os.pathsep}{os.environ.get('PATH', '')}"}

    def log(self, name: str) -> Path:
        return self.root / "log" / f"{name}.log"

    def command(self, *args: str, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess:
        """A Slurm client command against this cluster."""
        proc = subprocess.run(
            [str(self.bin / args[0]) if (self.bin / args[0]).exists() else args[0], *args[1:]],
            env={**os.environ, **self.env},
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if check and proc.returncode != 0:
            raise SlurmUnavailable(f"{' '.join(args)} failed ({proc.returncode}): {proc.stderr.strip()}")
        return proc

    def sacct(self, *fields: str, extra: tuple[str, ...] = ()) -> list[dict[str, str]]:
        """Every job's allocation record (sacct -X), one dict per job with the named fields."""
        proc = self.command(
            "sacct",
            "-X",
            "--allusers",
            "--parsable2",
            "--noheader",
            "--starttime",
            "now-1days",
            f"--format={','.join(fields)}",
            *extra,
        )
        return [dict(zip(fields, line.split("|"))) for line in proc.stdout.splitlines() if line]

    def running_jobs(self, name: str | None = None) -> list[str]:
        args = ["squeue", "--noheader", "--states=RUNNING", "--format=%i"]
        if name:
            args += ["--name", name]
        return self.command(*args).stdout.split()

    def cancel_all(self, timeout: float = 60) -> None:
        """Cancel every job of the cluster and wait until none is left."""
        self.command("scancel", "--full", "--user", str(os.getuid()), check=False)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            proc = self.command("squeue", "--noheader", "--format=%i", check=False)
            if proc.returncode != 0 or not proc.stdout.strip():
                return
            time.sleep(1)

    def stop(self) -> None:
        if "slurmctld" in self.processes and self.processes["slurmctld"].poll() is None:
            try:
                self.cancel_all(timeout=30)
            except (SlurmUnavailable, subprocess.TimeoutExpired):
                pass
        for name in ("slurmd", "slurmctld", "slurmdbd", "mariadbd", "munged"):
            process = self.processes.pop(name, None)
            if process is None or process.poll() is not None:
                continue
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def start_slurm_cluster(root: Path, gpus: int = 2, timeout: float = 180) -> SlurmCluster:
    """Start the cluster in ``root`` (a new folder); raises SlurmUnavailable with the reason."""
    reason = missing()
    if reason:
        raise SlurmUnavailable(reason)
    root = Path(root).resolve()
    for sub in ("etc", "log", "run", "state", "spool", "db", "munge", "dev"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    node = socket.gethostname().split(".")[0]
    cpus = os.cpu_count() or 1
    cluster = SlurmCluster(root, node, cpus, node_memory_mb(), gpus, root / "etc/slurm.conf")
    ports = {name: free_port() for name in ("mysql", "dbd", "ctld", "slurmd")}
    try:
        _start_munge(cluster)
        _start_mariadb(cluster, ports["mysql"], timeout)
        _write_configs(cluster, ports)
        _write_client_wrappers(cluster)
        _start(cluster, "slurmdbd", ["slurmdbd", "-D"])
        _wait(lambda: _port_open(ports["dbd"]), timeout, "slurmdbd to listen", cluster, "slurmdbd")
        # The cluster, an account for the jobs and this user in it, before slurmctld registers.
        _sacctmgr(cluster, "add", "cluster", CLUSTER)
        _sacctmgr(cluster, "add", "account", ACCOUNT, "Description=tests", "Organization=tests")
        _sacctmgr(cluster, "add", "user", _user(), f"Account={ACCOUNT}", f"DefaultAccount={ACCOUNT}")
        _start(cluster, "slurmctld", ["slurmctld", "-D", "-i"])
        _wait(lambda: _port_open(ports["ctld"]), timeout, "slurmctld to listen", cluster, "slurmctld")
        _start(cluster, "slurmd", ["slurmd", "-D", "-N", node])
        _wait(lambda: _node_ready(cluster), timeout, "the node to be idle", cluster, "slurmd")
    except BaseException:
        cluster.stop()
        raise
    return cluster


def _user() -> str:
    import pwd

    return pwd.getpwuid(os.getuid()).pw_name


CLIENTS = ("sbatch", "srun", "salloc", "sacct", "sacctmgr", "squeue", "scancel", "scontrol", "sinfo", "sshare")


def _write_client_wrappers(cluster: SlurmCluster) -> None:
    cluster.bin.mkdir(exist_ok=True)
    for name in CLIENTS:
        real = _which(name)
        if real is None:
            continue
        wrapper = cluster.bin / name
        wrapper.write_text(f'#!/bin/sh\nSLURM_CONF={cluster.conf} exec {real} "$@"\n')
        wrapper.chmod(0o755)


def _start(cluster: SlurmCluster, name: str, args: list[str]) -> subprocess.Popen:
    log = open(cluster.log(name + "-console"), "ab")
    process = subprocess.Popen(
        [_which(args[0]), *args[1:]],
        env={**os.environ, **cluster.env},
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    log.close()
    cluster.processes[name] = process
    return process


def _port_open(port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(1)
        return sock.connect_ex(("127.0.0.1", port)) == 0


def _node_ready(cluster: SlurmCluster) -> bool:
    proc = cluster.command("sinfo", "--noheader", "--Node", "--format=%t", check=False)
    return (
        proc.returncode == 0
        and bool(proc.stdout.split())
        and all(state.rstrip("*") == "idle" for state in proc.stdout.split())
    )


def _wait(predicate, timeout: float, what: str, cluster: SlurmCluster, daemon: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        process = cluster.processes.get(daemon)
        if process is not None and process.poll() is not None:
            raise SlurmUnavailable(f"{daemon} exited ({process.returncode}):\n{_tail(cluster, daemon)}")
        if predicate():
            return
        time.sleep(0.5)
    raise SlurmUnavailable(f"timed out after {timeout:.0f} s waiting for {what}:\n{_tail(cluster, daemon)}")


def _tail(cluster: SlurmCluster, daemon: str) -> str:
    text = ""
    for path in (cluster.log(daemon), cluster.log(daemon + "-console")):
        if path.exists():
            text += "".join(path.read_text(errors="replace").splitlines(keepends=True)[-20:])
    return text


def _sacctmgr(cluster: SlurmCluster, *args: str) -> None:
    cluster.command("sacctmgr", "--immediate", *args)


def _start_munge(cluster: SlurmCluster) -> None:
    key = cluster.root / "munge/munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o600)
    cluster.munge_socket = cluster.root / "munge/munge.socket"
    _start(
        cluster,
        "munged",
        [
            "munged",
            "--foreground",
            "--force",
            f"--socket={cluster.munge_socket}",
            f"--key-file={key}",
            f"--pid-file={cluster.root / 'munge/munged.pid'}",
            f"--seed-file={cluster.root / 'munge/munged.seed'}",
            f"--log-file={cluster.log('munged')}",
        ],
    )
    _wait(lambda: cluster.munge_socket.exists(), 30, "munged's socket", cluster, "munged")


def _start_mariadb(cluster: SlurmCluster, port: int, timeout: float) -> None:
    datadir = cluster.root / "db"
    subprocess.run(
        [
            _which("mariadb-install-db"),
            "--no-defaults",
            "--user=root",
            f"--datadir={datadir}",
            "--auth-root-authentication-method=normal",
            "--skip-test-db",
        ],
        check=True,
        capture_output=True,
    )
    cluster.mysql_port = port
    _start(
        cluster,
        "mariadbd",
        [
            "mariadbd",
            "--no-defaults",
            "--user=root",
            f"--datadir={datadir}",
            f"--socket={cluster.root / 'run/mysqld.sock'}",
            f"--port={port}",
            "--bind-address=127.0.0.1",
            f"--pid-file={cluster.root / 'run/mysqld.pid'}",
            f"--log-error={cluster.log('mariadbd')}",
            # Only slurmdbd connects, from loopback; small buffers for a small machine.
            "--skip-grant-tables",
            "--skip-name-resolve",
            "--innodb-buffer-pool-size=64M",
            "--innodb-log-file-size=32M",
            "--innodb-lock-wait-timeout=900",
        ],
    )
    _wait(lambda: _port_open(port), timeout, "MariaDB to listen", cluster, "mariadbd")


def _write_configs(cluster: SlurmCluster, ports: dict[str, int]) -> None:
    root = cluster.root
    auth = f"AuthType=auth/munge\nAuthInfo=socket={cluster.munge_socket}\n"
    dbd = root / "etc/slurmdbd.conf"
    dbd.write_text(
        f"{auth}"
        f"DbdAddr=127.0.0.1\nDbdHost=localhost\nDbdPort={ports['dbd']}\n"
        "SlurmUser=root\n"
        f"PidFile={root / 'run/slurmdbd.pid'}\nLogFile={cluster.log('slurmdbd')}\nDebugLevel=info\n"
        "StorageType=accounting_storage/mysql\n"
        f"StorageHost=127.0.0.1\nStoragePort={ports['mysql']}\nStorageUser=root\nStorageLoc=slurm_acct_db\n"
    )
    dbd.chmod(0o600)
    gres = ""
    if cluster.gpus:
        devices = []
        for index in range(cluster.gpus):
            # Slurm takes only character or block devices as GPU files; these are /dev/null's.
            device = root / f"dev/nvidia{index}"
            try:
                os.mknod(device, 0o600 | stat.S_IFCHR, os.makedev(1, 3))
            except OSError as err:
                cluster.gpus = 0
                cluster.no_gpus_reason = f"no placeholder GPU devices ({err}): the node has no gres"
                break
            devices.append(device)
    if cluster.gpus:
        (root / "etc/gres.conf").write_text(
            "AutoDetect=off\n" + "".join(f"NodeName={cluster.node} Name=gpu File={device}\n" for device in devices)
        )
        gres = f" Gres=gpu:{cluster.gpus}"
    cluster.conf.write_text(
        f"ClusterName={CLUSTER}\n"
        f"SlurmctldHost={cluster.node}(127.0.0.1)\n"
        f"SlurmctldPort={ports['ctld']}\nSlurmdPort={ports['slurmd']}\n"
        "SlurmUser=root\nSlurmdUser=root\n"
        f"{auth}CredType=cred/munge\n"
        f"StateSaveLocation={root / 'state'}\nSlurmdSpoolDir={root / 'spool'}\n"
        f"SlurmctldPidFile={root / 'run/slurmctld.pid'}\nSlurmdPidFile={root / 'run/slurmd.pid'}\n"
        f"SlurmctldLogFile={cluster.log('slurmctld')}\nSlurmdLogFile={cluster.log('slurmd')}\n"
        "SlurmctldDebug=info\nSlurmdDebug=info\n"
        # No cgroups in a container: processes tracked by their parent ids, no CPU binding.
        "ProctrackType=proctrack/linuxproc\nTaskPlugin=task/none\nJobAcctGatherType=jobacct_gather/none\n"
        "MpiDefault=none\nReturnToService=2\nDefMemPerCPU=1000\n"
        "SchedulerType=sched/backfill\nSelectType=select/cons_tres\nSelectTypeParameters=CR_CPU_Memory\n"
        "AccountingStorageType=accounting_storage/slurmdbd\n"
        f"AccountingStorageHost=127.0.0.1\nAccountingStoragePort={ports['dbd']}\n"
        # The munge socket of the connection to slurmdbd (AuthInfo's is not used for it).
        f"AccountingStoragePass={cluster.munge_socket}\n"
        "AccountingStorageEnforce=associations\n"
        "AccountingStorageTRES=gres/gpu\n"
        # sacct's Comment: the plugin writes the rule and wildcards there.
        "AccountingStoreFlags=job_comment\n"
        + ("GresTypes=gpu\n" if cluster.gpus else "")
        # A scancel or a time limit sends SIGTERM, then SIGKILL this many seconds later.
        + "KillWait=10\nOverTimeLimit=0\nInactiveLimit=0\nMinJobAge=300\n"
        f"NodeName={cluster.node} NodeAddr=127.0.0.1 CPUs={cluster.cpus} RealMemory={cluster.memory_mb}"
        f"{gres} State=UNKNOWN\n"
        f"PartitionName=cpu Nodes={cluster.node} Default=YES MaxTime=INFINITE State=UP\n"
        f"PartitionName=gpu Nodes={cluster.node} MaxTime=INFINITE State=UP\n"
    )


if __name__ == "__main__":
    import sys

    folder = Path(sys.argv[1] if len(sys.argv) > 1 else "slurm-cluster")
    # Ctrl-C or SIGTERM stops it (a background shell job ignores SIGINT).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    started = start_slurm_cluster(folder)
    print(f"export SLURM_CONF={started.conf} PATH={started.bin}:$PATH   # Ctrl-C stops the cluster", flush=True)
    try:
        signal.pause()
    except KeyboardInterrupt:
        pass
    finally:
        started.stop()
