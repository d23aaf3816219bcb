"""Storage credentials stay out of the engine's reach (dflash_pipeline.core.credentials).

An engine runs as the same user as the job that starts it. Its own environment is clean
(tests/test_engine_limits.py), but Linux shows any process of a user the environment another
process of that user was started with, in ``/proc/<pid>/environ``. The first test runs a job and
its engine as an ordinary user (as ``nobody`` when the tests run as root: root reads every
process's files) with the system's Python and this module alone; the others show that the real
code paths (the engine launch, a job's logging, the driver reading the Snakefile) protect the
process they run in, and only when it holds a credential.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from dflash_pipeline.core import credentials
from dflash_pipeline.core.credentials import SECRET_ENV_VARS, secrets_in_environment
from tests.conftest import REPO
from tests.support.ci import skip_unless_ci

NOBODY = 65534

# The engine's stand-in: reads the environment its parent was started with.
ENGINE = """
import json, os, sys
secret = sys.argv[1]
try:
    with open(f"/proc/{os.getppid()}/environ", "rb") as src:
        text = src.read().decode(errors="replace")
    print(json.dumps({"read": "ok", "seen": secret in text, "own": secret in str(os.environ), "uid": os.getuid()}))
except OSError as err:
    print(json.dumps({"read": type(err).__name__, "seen": False, "own": secret in str(os.environ), "uid": os.getuid()}))
"""

# The job's stand-in: holds the secret in the environment it was started with, drops it from the
# environment it passes on (as engine_env does), protects itself or not, starts the engine.
JOB = """
import os, subprocess, sys
import credentials  # the copy beside this script
mode, secret = sys.argv[1], sys.argv[2]
for name in credentials.SECRET_ENV_VARS:
    os.environ.pop(name, None)
if mode == "protected":
    assert credentials.protect_storage_credentials(), "not protected"
engine = os.path.join(os.path.dirname(os.path.abspath(__file__)), "engine.py")
sys.stdout.write(subprocess.run([sys.executable, engine, secret], capture_output=True, text=True, check=True).stdout)
"""


def ordinary_user() -> tuple[dict, list[str]]:
    """How to start a process as an ordinary user: subprocess arguments and the Python it runs.
    As root that is ``nobody`` with a Python it can run; otherwise this user and this Python."""
    if os.geteuid() != 0:
        return {}, [sys.executable]

    def become_nobody() -> None:
        os.setgroups([])
        os.setgid(NOBODY)
        os.setuid(NOBODY)

    # The checkout and its virtualenv may be closed to nobody; the system's Python is not.
    for python in dict.fromkeys(p for p in ("/usr/bin/python3", shutil.which("python3"), sys.executable) if p):
        try:
            probe = subprocess.run(
                [python, "-c", "import os; print(os.getuid())"],
                preexec_fn=become_nobody,
                capture_output=True,
                text=True,
                cwd="/",
            )
        except OSError:
            continue
        if probe.returncode == 0 and probe.stdout.strip() == str(NOBODY):
            return {"preexec_fn": become_nobody}, [python]
    skip_unless_ci("cannot run a Python as nobody (uid 65534) here: no ordinary user to test as")
    raise AssertionError("unreachable")


@pytest.fixture
def open_dir():
    """A folder an ordinary user can read (tmp_path lies below a folder only its owner enters)."""
    folder = Path(tempfile.mkdtemp(prefix="dflash-credentials-"))
    folder.chmod(0o755)
    yield folder
    shutil.rmtree(folder)


def run_job_and_engine(folder: Path, mode: str, secret: str) -> dict:
    (folder / "credentials.py").write_text(Path(credentials.__file__).read_text())
    (folder / "job.py").write_text(JOB)
    (folder / "engine.py").write_text(ENGINE)
    for name in ("credentials.py", "job.py", "engine.py"):
        (folder / name).chmod(0o644)
    how, python = ordinary_user()
    env = {"PATH": "/usr/bin:/bin", "SNAKEMAKE_STORAGE_S3_SECRET_KEY": secret, "AWS_SECRET_ACCESS_KEY": secret}
    proc = subprocess.run(
        [*python, "-S", str(folder / "job.py"), mode, secret],
        env=env,
        cwd="/",
        capture_output=True,
        text=True,
        **how,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_an_engine_of_the_same_user_cannot_read_the_storage_secret_of_the_job_that_started_it(open_dir):
    secret = secrets.token_hex(16)
    # Without the protection the engine reads it, although neither its own environment nor the
    # job's os.environ holds it any more: the hole this closes.
    exposed = run_job_and_engine(open_dir, "plain", secret)
    assert exposed["uid"] != 0 and not exposed["own"]
    assert exposed == {**exposed, "read": "ok", "seen": True}
    protected = run_job_and_engine(open_dir, "protected", secret)
    assert protected == {"read": "PermissionError", "seen": False, "own": False, "uid": exposed["uid"]}


def test_the_credentials_are_found_in_the_environment_given_or_the_one_the_process_started_with():
    assert secrets_in_environment({"AWS_SESSION_TOKEN": "t", "HOME": "/h"}) == ["AWS_SESSION_TOKEN"]
    assert secrets_in_environment({"AWS_ACCESS_KEY_ID": "", "AWS_PROFILE": "p"}) == []
    assert set(SECRET_ENV_VARS) >= {"SNAKEMAKE_STORAGE_S3_SECRET_KEY", "AWS_SECRET_ACCESS_KEY"}
    # Dropped from os.environ, still in /proc/self/environ: still found.
    script = (
        "import os\n"
        "os.environ.pop('SNAKEMAKE_STORAGE_S3_SECRET_KEY')\n"
        "from dflash_pipeline.core.credentials import secrets_in_environment\n"
        "print(secrets_in_environment())\n"
    )
    env = clean_env() | {"SNAKEMAKE_STORAGE_S3_SECRET_KEY": "s3cr3t"}
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True)
    assert proc.stdout.strip() == "['SNAKEMAKE_STORAGE_S3_SECRET_KEY']"


def clean_env() -> dict[str, str]:
    """This process's environment without any credential, the checkout's package first."""
    env = {k: v for k, v in os.environ.items() if k not in SECRET_ENV_VARS}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    return env


# Each real path the protection is called from, run in a process of its own; prints whether that
# process is still dumpable afterwards.
LAUNCH = """
import sys
from pathlib import Path
from dflash_pipeline.core.credentials import is_dumpable
from dflash_pipeline.engines.client import EngineError
from dflash_pipeline.engines.launch import ManagedServer, ServerSpec, free_port
folder = Path(sys.argv[1])
spec = ServerSpec(engine="vllm", model="/m/target", port=free_port(), python=str(folder / "python"))
try:
    ManagedServer(spec, folder / "vllm.log", folder).start()
except EngineError as err:
    assert "exited with code 3" in str(err), err
print(is_dumpable())
"""
JOB_LOGGING = """
import sys
from dflash_pipeline.core.credentials import is_dumpable
from dflash_pipeline.core.joblog import job_logging
with job_logging(sys.argv[1] + "/job.log"):
    pass
print(is_dumpable())
"""
SNAKEFILE_READ = """
import sys
from snakemake.cli import main
from dflash_pipeline.core.credentials import is_dumpable
try:
    main(["-n", "--cores", "1", "--directory", sys.argv[1], "--snakefile", sys.argv[2], "--quiet", "all"])
except SystemExit as done:
    assert done.code in (0, None), done.code
print(is_dumpable(), file=sys.stderr)
"""


@pytest.mark.parametrize("credential", [None, "SNAKEMAKE_STORAGE_S3_SECRET_KEY", "AWS_SESSION_TOKEN"])
def test_a_job_that_launches_an_engine_holding_a_credential_is_non_dumpable(tmp_path, credential):
    """The engine launch (ManagedServer.start) protects the job that calls it, whatever entry
    point that job came through; without a credential the job stays as it was."""
    engine = tmp_path / "python"
    # The engine stand-in records its own environment, then fails its start.
    engine.write_text(f"#!/bin/sh\nenv > {tmp_path / 'engine-env'}\nexit 3\n")
    engine.chmod(0o755)
    env = clean_env() | ({credential: "s3cr3t-value"} if credential else {})
    proc = subprocess.run(
        [sys.executable, "-c", LAUNCH, str(tmp_path)], env=env, capture_output=True, text=True, cwd=REPO
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == ("True" if credential is None else "False")
    assert "s3cr3t-value" not in (tmp_path / "engine-env").read_text()


@pytest.mark.parametrize("credential", [None, "AWS_SECRET_ACCESS_KEY"])
def test_every_job_script_holding_a_credential_is_non_dumpable(tmp_path, credential):
    """A job that starts no engine of its own is still readable by another job's engine: every
    job script protects itself when it opens its log (core.joblog.job_logging)."""
    env = clean_env() | ({credential: "s3cr3t-value"} if credential else {})
    proc = subprocess.run([sys.executable, "-c", JOB_LOGGING, str(tmp_path)], env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == ("True" if credential is None else "False")


@pytest.mark.parametrize("credential", [None, "SNAKEMAKE_STORAGE_S3_SECRET_KEY"])
def test_the_driver_holding_a_credential_is_non_dumpable_once_it_reads_the_snakefile(workflow, credential):
    """The driver runs the local jobs' scripts as its children and, on Slurm, each job's
    Snakemake process stands above its script: both read the Snakefile (rules/common.smk)."""
    env = clean_env() | ({credential: "s3cr3t-value"} if credential else {})
    proc = subprocess.run(
        [sys.executable, "-c", SNAKEFILE_READ, str(workflow.root), str(workflow.root / "Snakefile")],
        env=env,
        capture_output=True,
        text=True,
        cwd=workflow.root,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == ("True" if credential is None else "False"), proc.stderr


STATUS_SERVE = """
from types import SimpleNamespace
from dflash_pipeline.core.credentials import is_dumpable
from dflash_pipeline.status import __main__ as status

class Refused:  # stops serve() once it would listen
    def __init__(self, *args, **kwargs):
        raise ValueError("stopped before listening")

status.resolve_source, status.SnapshotBuilder, status.StatusServer = (lambda args: None), (lambda source: None), Refused
try:
    status.serve(SimpleNamespace(host="127.0.0.1", refresh=1.0, allow_host=[]), 0, None)
except status.CliError:
    pass
print(is_dumpable())
"""


@pytest.mark.parametrize("credential", [None, "AWS_SECRET_ACCESS_KEY"])
def test_the_status_page_holding_a_credential_is_non_dumpable(credential):
    """The status page reads the run's storage, so it may hold the credential too; it runs beside
    the jobs as the same user."""
    env = clean_env() | ({credential: "s3cr3t-value"} if credential else {})
    proc = subprocess.run([sys.executable, "-c", STATUS_SERVE], env=env, capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == ("True" if credential is None else "False")


def test_stop_finds_a_non_dumpable_status_page_by_its_command_line(tmp_path):
    """`stop` tells this tree's status page from a reused pid by the server's command line: a
    non-dumpable server's /proc cwd is unreadable to its own user, its command line is not, and
    `start` gives it an absolute --workdir. A stand-in /proc: entries with a command line, and a
    cwd link only where it is readable."""
    from dflash_pipeline.status import __main__ as status

    proc = tmp_path / "proc"

    def process(pid: int, argv: list[str], cwd: Path | None) -> int:
        (proc / str(pid)).mkdir(parents=True)
        (proc / str(pid) / "cmdline").write_bytes(b"\0".join(a.encode() for a in argv) + b"\0")
        if cwd is not None:
            (proc / str(pid) / "cwd").symlink_to(cwd)
        return pid

    tree, here = tmp_path / "tree", tmp_path / "here"
    serve = ["python3", "-m", status.MODULE, "serve", "--port", "0"]
    protected = process(11, [*serve, "--workdir", str(tree)], cwd=None)
    relative_protected = process(12, [*serve, "--workdir", "run"], cwd=None)
    relative = process(13, [*serve, "--workdir=run"], cwd=here)
    other = process(14, ["python3", "-m", "http.server"], cwd=here)
    assert status.server_tree(protected, str(proc)) == os.path.realpath(tree)
    assert status.server_tree(relative_protected, str(proc)) is None  # a relative --workdir needs the cwd
    assert status.server_tree(relative, str(proc)) == os.path.realpath(here / "run")
    assert status.server_tree(other, str(proc)) is None  # no status server
    assert status.server_tree(99, str(proc)) is None  # gone


# The engine's stand-in as root: reads every /proc/<pid>/environ it can, and says which hold the
# secret.
SCAN = """
import json, os, sys
secret = sys.argv[1].encode()
readable, holding, refused = [], [], []
for name in os.listdir("/proc"):
    if name.isdigit():
        try:
            with open(f"/proc/{name}/environ", "rb") as src:
                data = src.read()
        except OSError:
            refused.append(int(name))
            continue
        readable.append(int(name))
        if secret in data:
            holding.append(int(name))
print(json.dumps({"pid": os.getpid(), "readable": readable, "holding": holding, "refused": refused}))
"""

# The job: started (through a shell, which keeps the secret in its environment) with the secret,
# it starts the stand-in as the pipeline starts an engine, or as a plain child (the hole).
ROOT_JOB = """
import os, subprocess, sys
from dflash_pipeline.engines.environments import engine_env
from dflash_pipeline.engines.launch import start_engine_process
mode, secret, scan, out_path = sys.argv[1:5]
cmd = [sys.executable, "-c", scan, secret]
with open(out_path, "wb") as out:
    if mode == "engine":
        engine = start_engine_process(cmd, engine_env("vllm", None), out)
    else:
        engine = subprocess.Popen(cmd, stdout=out, env=engine_env("vllm", None))
    engine.wait()
print(os.getpid(), os.getppid())
"""


def scan_from_engine(tmp_path: Path, mode: str, secret: str) -> tuple[dict, list[int]]:
    """What the engine stand-in read, and the pids of the shell and the job above it."""
    out = tmp_path / f"scan-{mode}.json"
    env = clean_env() | {
        "SNAKEMAKE_STORAGE_S3_SECRET_KEY": secret,
        "AWS_SECRET_ACCESS_KEY": secret,
        "MY_COPY_OF_THE_KEY": secret,  # a copy under another name
        "PYTHONPATH": str(REPO),
    }
    shell = f'{sys.executable} -c "$JOB" {mode} {secret} "$SCAN" {out}; exit $?'  # no exec: the shell stays
    proc = subprocess.run(
        ["bash", "-c", shell], env=env | {"JOB": ROOT_JOB, "SCAN": SCAN}, capture_output=True, text=True, cwd=REPO
    )
    assert proc.returncode == 0, proc.stderr
    job, shell_pid = map(int, proc.stdout.split()[-2:])
    return json.loads(out.read_text()), [shell_pid, job]


def test_an_engine_started_as_root_finds_the_secret_in_no_environment_it_can_read(tmp_path):
    """Run as root, the engine reads every /proc/*/environ it can: none holds the storage
    secret, neither the non-dumpable job that started it nor the (dumpable) shell above it,
    nor any other root process; its own environment has none of its copies either."""
    if os.geteuid() != 0:
        skip_unless_ci("the root case: these tests run as an ordinary user here")
    if not any(credentials._effective_capabilities() & (1 << cap) for cap in credentials.PROCESS_READING_CAPS):
        skip_unless_ci("root without CAP_SYS_PTRACE and the like here: no process reads another's environment anyway")
    secret = secrets.token_hex(16)
    # Without the confinement the engine reads it from the job and the shell: the hole.
    exposed, above = scan_from_engine(tmp_path, "plain", secret)
    assert set(above) <= set(exposed["holding"])
    confined, above = scan_from_engine(tmp_path, "engine", secret)
    assert confined["holding"] == []
    assert confined["pid"] in confined["readable"]  # the scan works: its own environment
    assert set(above) <= set(confined["refused"])
