"""Dry-run cost of the workflow against S3 at scale (design target: 10,000 shards x every per-shard
stage in <= 30 s against a local SeaweedFS; <= 60 s with 25% of the shards' chains missing).

Fills a bucket on a local SeaweedFS with every output of a finished run of N shards up to
``--until`` (the list comes from ``snakemake --summary`` of the same config; tiny objects,
uploaded stage by stage so mtimes are consistent), then times `snakemake -n` with the s3 profile
(must report nothing to do), deletes the generate and tokenize outputs of ``--missing-fraction``
of the shards and times it again (must plan exactly those chains), and once more with Snakemake
and the S3 plugin as they ship, for comparison (``DFLASH_S3_FOLDER_INVENTORY=0``: the plugin's
own per-object checks; ``DFLASH_PLANNING_PATCHES=0``: Snakemake's own per-job checks and garbage
collection). The S3 requests of each dry run are counted by operation (``DFLASH_S3_REQUEST_LOG``).

    python bench/dryrun_s3.py --shards 10000 --out bench/results/dryrun_s3-10k.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import resource
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from benchlib import copy_workflow, emit, provenance, require_success

import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from dflash_pipeline.core import layout  # noqa: E402
from dflash_pipeline.core.s3 import S3Storage  # noqa: E402
from tests.conftest import parse_job_table  # noqa: E402
from tests.support.seaweed import start_seaweed  # noqa: E402

# Upload order of a finished run (a rule's outputs are newer than its inputs').
RULE_ORDER = (
    "ingest",
    "prepare",
    "generate",
    "tokenize",
    "extract",
    "train",
    "export",
    "evaluate",
    "report_prompts",
    "report_generation",
    "report_tokenization",
    "report_training",
    "report_evaluation",
    "report_headline",  # report_storage reads the headline page
    "report_storage",
)


def summary_outputs(wf: Path, env: dict) -> dict[str, list[str]]:
    """Every output of the planned run, by rule (``snakemake --summary`` on local files)."""
    proc = subprocess.run(
        [sys.executable, "-m", "snakemake", "--summary", "--cores", "1"],
        cwd=wf,
        capture_output=True,
        text=True,
        env=env,
        check=True,
    )
    by_rule: dict[str, list[str]] = defaultdict(list)
    for line in proc.stdout.splitlines()[1:]:
        fields = line.split("\t")
        if len(fields) >= 3 and fields[0] != "output_file":
            by_rule[fields[2]].append(fields[0])
    # Benchmark files are not in the summary, but a missing one reruns its job once a job
    # downstream of it is planned: a finished run has every one of them.
    root = layout.run_root("results", "demo")
    for rule, keys in list(by_rule.items()):
        if rule in layout.SHARD_STAGES:
            shards = sorted({shard_of(k) for k in keys})
            by_rule[rule] += [f"{root}/{layout.benchmark_key(rule, s)}" for s in shards]
        else:
            by_rule[rule].append(f"{root}/{layout.benchmark_key(rule)}")
    return by_rule


def shard_of(key: str) -> str:
    """``.../tokenize-00012.stats.json`` -> ``00012``."""
    return Path(key).name.split("-")[1].split(".")[0]


def dry_run(wf: Path, bucket: str, env: dict, **extra) -> dict:
    log = wf / f"requests-{time.time_ns()}.json"
    cmd = [
        sys.executable,
        "-m",
        "snakemake",
        "-n",
        "--cores",
        "1",
        "--profile",
        "profiles/s3",
        "--default-storage-prefix",
        f"s3://{bucket}/bench",
    ]
    t0, cpu0 = time.time(), resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.run(
        cmd, cwd=wf, capture_output=True, text=True, env={**env, "DFLASH_S3_REQUEST_LOG": str(log), **extra}
    )
    seconds = time.time() - t0
    cpu1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    if os.environ.get("BENCH_VERBOSE"):
        print(proc.stdout, proc.stderr, file=sys.stderr)
    require_success({"snakemake -n exits 0": proc.returncode == 0}, (proc.stdout + proc.stderr)[-3000:])
    return {
        "seconds": round(seconds, 2),
        # The snakemake process's own CPU time: on a shared machine the steadier figure, and
        # close to the wall time of the same plan on an idle one (planning is one thread).
        "cpu_seconds": round(cpu1.ru_utime - cpu0.ru_utime + cpu1.ru_stime - cpu0.ru_stime, 2),
        "jobs": parse_job_table(proc.stdout + proc.stderr),
        "nothing_to_do": "Nothing to be done" in proc.stdout + proc.stderr,
        "requests": json.loads(log.read_text()) if log.exists() else None,
        "exit_code": proc.returncode,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards", type=int, default=10000)
    parser.add_argument("--until", default="tokenize", help="config key `until` of the run")
    parser.add_argument(
        "--mode",
        choices=["online", "offline"],
        default="online",
        help="config key `train.mode` (offline adds the extract stage per shard)",
    )
    parser.add_argument("--missing-fraction", type=float, default=0.25, help="0: time the complete run only")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        server = start_seaweed(tmp / "weed")
        env.update(server.env)
        os.environ.update(server.env)
        try:
            wf = tmp / "wf"
            wf.mkdir()
            copy_workflow(wf)
            config = yaml.safe_load((wf / "config.yaml").read_text())
            config["num_shards"] = args.shards
            config["until"] = args.until
            config["train"]["mode"] = args.mode
            config["target"]["build_demo"] = False
            # A dry-run reads no weights, but the preflight wants a model folder: a stand-in.
            target = wf / "target-stand-in"
            target.mkdir()
            for name in ("config.json", "tokenizer_config.json"):
                (target / name).write_text("{}\n")
            (target / "model.safetensors").write_bytes(b"")
            config["target"]["model"] = str(target)
            config["status"] = {**config.get("status", {}), "serve": False}
            (wf / "config.yaml").write_text(yaml.safe_dump(config))
            t0 = time.time()
            by_rule = summary_outputs(wf, env)
            local_s = time.time() - t0  # planning on local files, all missing: the floor
            store = S3Storage(f"s3://{server.bucket}/bench")
            rules = sorted(by_rule, key=lambda r: (RULE_ORDER.index(r) if r in RULE_ORDER else 99, r))
            t0 = time.time()
            for rule in rules:
                with ThreadPoolExecutor(16) as pool:
                    list(pool.map(lambda k: store.write_bytes(k, b"x"), by_rule[rule]))
                time.sleep(1.1)  # S3 mtimes have 1 s resolution: keep stages apart
            fill_s = time.time() - t0
            objects = sum(len(v) for v in by_rule.values())
            complete = dry_run(wf, server.bucket, env)
            shards = sorted({shard_of(k) for k in by_rule.get("tokenize", [])})
            gone = set(random.Random(0).sample(shards, int(len(shards) * args.missing_fraction)))
            doomed = [
                k
                for rule in ("generate", "tokenize")
                for k in by_rule.get(rule, [])
                if shard_of(k) in gone and "/benchmark." not in k
            ]
            missing = plain = None
            if gone:
                with ThreadPoolExecutor(16) as pool:
                    list(pool.map(store.delete, doomed))
                missing = dry_run(wf, server.bucket, env)
                # Snakemake and the S3 plugin as they ship: none of the pipeline's planning patches.
                plain = dry_run(wf, server.bucket, env, DFLASH_S3_FOLDER_INVENTORY="0", DFLASH_PLANNING_PATCHES="0")
        finally:
            server.stop()
    expected = {"generate": len(gone), "tokenize": len(gone)}
    require_success(
        {
            "the complete run has nothing to do": complete["nothing_to_do"],
            "the missing chains are planned exactly": not gone
            or all(missing["jobs"].get(rule) == n for rule, n in expected.items()),
        }
    )
    result = {
        "benchmark": "dryrun_s3",
        "shards": args.shards,
        "until": args.until,
        "train_mode": args.mode,
        "objects": objects,
        "outputs_by_rule": {r: len(v) for r, v in by_rule.items()},
        "complete": complete,
        "missing_shards": len(gone),
        "missing_objects": len(doomed),
        "with_missing": missing,
        "with_missing_plans_exactly_their_chains": missing
        and all(missing["jobs"].get(rule) == n for rule, n in expected.items()),
        "with_missing_as_shipped": plain,
        "planning_local_all_missing_seconds": round(local_s, 2),
        "fill_seconds": round(fill_s, 1),
        **provenance(f"cpu {os.cpu_count()} cores, {platform.machine()}"),
    }
    emit(result, args.out)


if __name__ == "__main__":
    main()
