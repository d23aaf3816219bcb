"""Check every stored object a later job reads (shard objects, ingest outputs, segment manifests
with their checkpoint index, the exported drafter) against its checksum; with --repair, rebuild
what is missing or damaged, and exactly that.

    python -m dflash_pipeline.stages.verify [--configfile FILE ...] [--default-storage-prefix s3://...]
                                            [--repair [--dry-run] | --adopt] [--sizes-only] [-- SNAKEMAKE ARGS]
    make verify [CONFIG=...] [PREFIX=s3://bucket/prefix] [REPAIR=1] [SNAKEMAKE_ARGS="..."]

The config is read as Snakemake reads it (``core.run_cli.open_run``); the objects the run should
hold are the rules' outputs for it (``report.targets.run_outputs``: its ``num_shards``, ``until``,
training mode and drafter shape). One line per problem:

* ``missing``: expected, absent (Snakemake does not rebuild a deleted intermediate of a finished
  run: it says "Nothing to be done", and only this check notices);
* ``damaged``: its size or sha256 differs from what the producing job recorded
  (dflash_pipeline.core.checksums); for a segment manifest, also: its checkpoint's index no longer
  lists the files the manifest recorded;
* ``unrecorded``: present without its checksum record (a deleted record must not switch the
  check off; readers refuse it too);
* ``orphaned``: a checksum record without its object (and not of an expected one), or an object of
  a shard beyond ``num_shards``.

The refusals jobs wrote when they met a damaged input (``_progress/checksums/refused/``) are
listed as notes: each stays until its job runs with a sound input, so neither a finding nor
deleted by --repair.

An unrecorded object is rebuilt by --repair. Only a run made before checksums were recorded (no
record at all) is pointed at ``--adopt``, which hashes each unrecorded object as stored and writes
its record, once and explicitly (it says how many; a second --adopt finds none); it refuses an
object whose content does not parse as its kind (parquet, JSON, JSON lines, safetensors), which
only a repair can mend.
Exit code 1 when anything is wrong (after --repair: when anything is still wrong).

--repair deletes each damaged object with its record (and stale or orphaned records; an object
beyond num_shards is left alone), then RUNS Snakemake itself in the current directory:

    python -m snakemake --forcerun <run root>/outputs/<each missing or damaged object> \\
        [--configfile ...] [--default-storage-provider s3 --default-storage-prefix ...] \\
        --cores all [SNAKEMAKE ARGS]

``--forcerun FILE`` reruns the job that makes FILE and every job downstream of it, nothing
upstream and no other shard. The command is printed first; ``--dry-run`` prints it (and what
would be deleted) and changes nothing. Give the run's own Snakemake options after ``--`` (e.g.
``-- --profile profiles/slurm-s3``; a ``--cores`` there replaces ``--cores all``). Afterwards the
run is checked again.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from dflash_pipeline.core import layout
from dflash_pipeline.core.checksums import (
    CHECKSUMS_DIR,
    REFUSALS_DIR,
    ChecksumError,
    is_checked_key,
    object_key_of_sidecar,
    producer_of,
    read_record,
    rule_and_shard_of,
    sidecar_key,
    write_record,
)
from dflash_pipeline.core.digest import digest_file
from dflash_pipeline.core.run_cli import add_run_arguments, open_run
from dflash_pipeline.core.storage import Storage, StorageError, open_storage
from dflash_pipeline.report.targets import run_outputs

PARALLEL = 8  # concurrent record reads and hashes (S3 round trips dominate)


@dataclass
class Finding:
    kind: str  # missing, damaged, unrecorded, orphaned
    key: str
    detail: str


@dataclass
class Report:
    run_url: str
    checked: int = 0  # objects compared with their record
    unchecked: list[str] = field(default_factory=list)  # objects without a record (also findings)
    findings: list[Finding] = field(default_factory=list)
    stale_records: list[str] = field(default_factory=list)  # records of missing/orphaned objects
    refusals: list[str] = field(default_factory=list)  # notes: jobs that refused a damaged input

    def of(self, kind: str) -> list[Finding]:
        return [f for f in self.findings if f.kind == kind]

    @property
    def ok(self) -> bool:
        return not self.findings

    def lines(self, storage: Storage) -> list[str]:
        out = [f"{f.kind:<9} {storage.join(f.key)}  {f.detail}" for f in self.findings]
        out += [f"note      {storage.join(key)}  {detail}" for key, detail in refusal_notes(storage, self.refusals)]
        summary = (
            f"verify {self.run_url}: {self.checked} object(s) match their checksums, "
            f"{len(self.of('missing'))} missing, {len(self.of('damaged'))} damaged, "
            f"{len(self.of('unrecorded'))} without a checksum record, {len(self.of('orphaned'))} orphaned"
        )
        return [*out, summary]


def expected_keys(config: dict) -> list[str]:
    """Every object a finished run of ``config`` holds that carries a checksum record: of the
    rules' declared outputs (``report.targets.run_outputs``, the one table of what a run
    produces), those a later job reads."""
    return [key for keys in run_outputs(config).values() for key in keys if is_checked_key(key)]


def index_mismatch(storage: Storage, key: str) -> str | None:
    """For a segment manifest: why its checkpoint's index differs from the files it recorded."""
    from dflash_pipeline.training.checkpoint import INDEX

    manifest = json.loads(storage.read_bytes(key))
    if "files" not in manifest or "checkpoint_prefix" not in manifest:
        return None
    index_key = manifest["checkpoint_prefix"] + INDEX
    try:
        index = json.loads(storage.read_bytes(index_key))
    except Exception as err:  # noqa: BLE001 (absent or unreadable: either is the finding)
        return f"(its checkpoint index {storage.join(index_key)} is unreadable: {type(err).__name__})"
    if index.get("files") != manifest["files"]:
        return f"(its checkpoint index {storage.join(index_key)} no longer lists the files it recorded)"
    return None


def refusal_notes(storage: Storage, keys: list[str]) -> list[tuple[str, str]]:
    """Each refusal with what it says: the job, the damaged input, and that it stays until then."""
    notes = []
    for key in keys:
        try:
            doc = json.loads(storage.read_bytes(key))
            job = f"rule {doc['rule']} " + ",".join(f"{k}={v}" for k, v in sorted(doc["wildcards"].items()))
            detail = f"({job.strip()} refused its damaged input {doc['input']}; removed when that job runs again)"
        except (StorageError, ValueError, KeyError, TypeError, AttributeError):
            detail = "(a job's refusal of a damaged input; removed when that job runs again)"
        notes.append((key, detail))
    return notes


def check_run(storage: Storage, config: dict, sizes_only: bool = False) -> Report:
    report = Report(storage.url)
    expected = expected_keys(config)
    listed = [*storage.list(f"{layout.OUTPUTS_DIR}/"), *storage.list(f"{layout.DRAFTER_DIR}/")]
    objects = {o.key: o for o in listed if is_checked_key(o.key)}
    records = storage.list(f"{CHECKSUMS_DIR}/")
    # Refusals live among the records but are no record of an object: never orphaned.
    report.refusals = [o.key for o in records if o.key.startswith(f"{REFUSALS_DIR}/")]
    sidecars = [o.key for o in records if not o.key.startswith(f"{REFUSALS_DIR}/")]
    recorded = {k for k in map(object_key_of_sidecar, sidecars) if k}
    for key in expected:
        if key not in objects:
            stale = key in recorded
            if stale:
                report.stale_records.append(key)
            report.findings.append(
                Finding(
                    "missing",
                    key,
                    f"(made by {producer_of(key)}" + ("; its checksum record remains)" if stale else ")"),
                )
            )
    for key in sorted(recorded - set(objects) - set(expected)):
        report.stale_records.append(key)
        report.findings.append(
            Finding("orphaned", sidecar_key(key), f"(a checksum record of {key}, which does not exist)")
        )
    beyond = {
        k
        for k in objects
        if layout.SHARD_OBJECT.match(k) and int(layout.SHARD_OBJECT.match(k)["shard"]) >= config["num_shards"]
    }
    for key in sorted(beyond):
        report.findings.append(
            Finding("orphaned", key, f"(shard beyond num_shards={config['num_shards']}; left alone by --repair)")
        )

    def check(key: str) -> Finding | str | None:
        record = read_record(storage, key) if key in recorded else None
        if record is None:
            return key
        size = objects[key].size
        if size != record.size:
            return Finding("damaged", key, f"({size} bytes, but {record.producer()} wrote {record.size})")
        if not sizes_only:
            stored = storage.sha256(key)
            if stored != record.digest:
                return Finding(
                    "damaged",
                    key,
                    f"(sha256 {stored.sha256[:16]}..., but {record.producer()} wrote {record.sha256[:16]}...)",
                )
            if layout.OUTPUTS_DIR + "/train-segment-" in key:
                mismatch = index_mismatch(storage, key)
                if mismatch:
                    return Finding("damaged", key, mismatch)
        return None

    # --adopt is the advice only for a run made before checksums were recorded (none at all):
    # in a run that records them, an object without one is suspect, and a repair rebuilds it.
    legacy = not recorded
    with ThreadPoolExecutor(PARALLEL) as pool:
        for result in pool.map(check, sorted(set(objects) - beyond)):
            if isinstance(result, Finding):
                report.findings.append(result)
            elif isinstance(result, str):
                report.unchecked.append(result)
                advice = (
                    "a run made before checksums were recorded: verify --adopt records its objects as "
                    "stored, once; else verify --repair rebuilds it"
                    if legacy
                    else "verify --repair rebuilds it"
                )
                report.findings.append(
                    Finding(
                        "unrecorded",
                        result,
                        f"(no checksum record {sidecar_key(result)}: made by {producer_of(result)}; {advice})",
                    )
                )
            else:
                report.checked += 1
    order = {"missing": 0, "damaged": 1, "unrecorded": 2, "orphaned": 3}
    report.findings.sort(key=lambda f: (order[f.kind], f.key))
    return report


def rebuild_command(
    report: Report, root: str, configfiles: list[str] | None, prefix: str | None, snakemake_args: list[str]
) -> list[str] | None:
    """The Snakemake command that rebuilds the missing and damaged objects and what follows."""
    targets = [f"{root}/{f.key}" for f in report.findings if f.kind in ("missing", "damaged", "unrecorded")]
    if not targets:
        return None
    cmd = [sys.executable, "-m", "snakemake", "--forcerun", *targets]
    if configfiles:
        cmd += ["--configfile", *configfiles]
    if prefix:
        if not any(a.startswith(("--default-storage-provider", "--profile")) for a in snakemake_args):
            cmd += ["--default-storage-provider", "s3"]
        cmd += ["--default-storage-prefix", prefix]
    if not any(
        a == "--cores" or a.startswith("--cores=") or a in ("-c", "-j") or a.startswith("--jobs")
        for a in snakemake_args
    ):
        cmd += ["--cores", "all"]
    return cmd + list(snakemake_args)


def delete_damaged(storage: Storage, report: Report) -> list[str]:
    """Delete each damaged object with its record, and the stale records; the keys deleted."""
    deleted = []
    for finding in report.of("unrecorded"):
        storage.delete(finding.key)
        deleted.append(finding.key)
    for finding in report.of("damaged"):
        for key in (finding.key, sidecar_key(finding.key)):
            storage.delete(key)
            deleted.append(key)
    for key in report.stale_records:
        storage.delete(sidecar_key(key))
        deleted.append(sidecar_key(key))
    return deleted


def content_problem(path: Path, key: str) -> str | None:
    """Why the file ``path`` (a copy of ``key``) does not parse as its kind, by its name:
    parquet, JSON, JSON lines or safetensors; None when it parses (or is of another kind)."""
    name = key.rsplit("/", 1)[-1]
    try:
        if name.endswith(".parquet"):
            import pyarrow.parquet as pq

            pq.read_table(path)  # footer and every page: a damaged page fails here too
        elif name.endswith(".jsonl"):
            for line in path.read_text(encoding="utf-8").splitlines():
                if line.strip():
                    json.loads(line)
        elif name.endswith(".json"):
            json.loads(path.read_text(encoding="utf-8"))
        elif name.endswith(".safetensors"):
            return safetensors_problem(path)
    except Exception as err:  # noqa: BLE001 (whatever the parser raises is the finding)
        kind = name.rsplit(".", 1)[-1]
        return f"it does not parse as {kind} ({type(err).__name__}: {' '.join(str(err).split())[:200]})"
    return None


def safetensors_problem(path: Path) -> str | None:
    """A safetensors file is an 8-byte header length, a JSON header, and the tensors' bytes,
    which must end exactly where the header's last offset says."""
    size = path.stat().st_size
    with open(path, "rb") as fh:
        head = fh.read(8)
        length = int.from_bytes(head, "little") if len(head) == 8 else -1
        if length < 0 or 8 + length > size:
            return "it does not parse as safetensors (its header length runs past the file)"
        header = json.loads(fh.read(length))
    ends = [int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"]
    if 8 + length + max(ends, default=0) != size:
        return "it does not parse as safetensors (its tensors do not end where the file does)"
    return None


def adopt(storage: Storage, report: Report) -> tuple[int, list[tuple[str, str]]]:
    """Write the record of each unrecorded object whose content parses as its kind, hashed as
    stored; how many were written, and each refused object with why."""

    def one(key: str) -> str | None:
        with storage.local_copy(key) as path:
            problem = content_problem(path, key)
            if problem is None:
                rule, shard = rule_and_shard_of(key)
                write_record(storage, key, digest_file(path), rule, shard, adopted=True)
        return problem

    keys = [f.key for f in report.of("unrecorded")]
    with ThreadPoolExecutor(PARALLEL) as pool:
        problems = list(pool.map(one, keys))
    refused = [(key, problem) for key, problem in zip(keys, problems) if problem is not None]
    return len(keys) - len(refused), refused


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    snakemake_args: list[str] = []
    if "--" in argv:
        at = argv.index("--")
        argv, snakemake_args = argv[:at], argv[at + 1 :]
    parser = argparse.ArgumentParser(
        prog="python -m dflash_pipeline.stages.verify",
        # The docstring's first paragraph: its first line alone stops mid-sentence.
        description=" ".join(__doc__.split("\n\n")[0].split()),
        epilog="Arguments after -- go to snakemake (with --repair).",
    )
    add_run_arguments(parser)
    parser.add_argument(
        "--repair",
        action="store_true",
        help="delete the damaged objects, then run snakemake --forcerun on every missing "
        "or damaged one (exactly those and what follows are rebuilt)",
    )
    parser.add_argument("--dry-run", action="store_true", help="with --repair: print, change nothing")
    parser.add_argument(
        "--adopt",
        action="store_true",
        help="a run made before checksums were recorded: hash each object without a record as "
        "stored and write its record (once; the objects are taken as they are)",
    )
    parser.add_argument(
        "--sizes-only",
        action="store_true",
        help="compare sizes only (one listing, no object read; misses a flipped byte)",
    )
    parser.add_argument("--json", action="store_true", help="print the findings as JSON")
    args = parser.parse_args(argv)
    if args.adopt and args.repair:
        parser.error("--adopt and --repair: give one")
    if snakemake_args and not args.repair:
        parser.error("arguments after -- are for snakemake, which only --repair runs")
    run = open_run(args, parser, must_exist=True)
    config, root, run_url = run.config, run.root, run.url
    storage = open_storage(run_url)
    try:
        report = check_run(storage, config, args.sizes_only)
    except (StorageError, ChecksumError) as err:
        print(f"verify: {err}", file=sys.stderr)
        return 2
    if args.json:
        print(
            json.dumps(
                {
                    "run_url": run_url,
                    "checked": report.checked,
                    "unchecked": report.unchecked,
                    "findings": [f.__dict__ for f in report.findings],
                },
                indent=1,
            )
        )
    else:
        print("\n".join(report.lines(storage)))
    if args.adopt:
        count, refused = adopt(storage, report)
        print(f"adopted {count} object(s) without a checksum record: their records are written")
        for key, problem in refused:
            print(f"not adopted {storage.join(key)}: {problem}; verify --repair rebuilds it")
        refused_keys = {key for key, _ in refused}
        remaining = [f for f in report.findings if f.kind != "unrecorded" or f.key in refused_keys]
        if remaining:
            print(
                "repair: "
                + shlex.join(
                    ["python", "-m", "dflash_pipeline.stages.verify", *[a for a in argv if a != "--adopt"], "--repair"]
                )
            )
        return 1 if remaining else 0
    if not args.repair:
        if not report.ok:
            print("repair: " + shlex.join(["python", "-m", "dflash_pipeline.stages.verify", *argv, "--repair"]))
        return 0 if report.ok else 1
    if report.ok:
        print("nothing to repair")
        return 0
    cmd = rebuild_command(report, root, args.configfile, args.default_storage_prefix, snakemake_args)
    if args.dry_run:
        for key in [f.key for f in report.of("damaged")] + [sidecar_key(k) for k in report.stale_records]:
            print(f"would delete {storage.join(key)}")
        print("would run: " + (shlex.join(cmd) if cmd else "nothing (no object to rebuild)"))
        return 1
    for key in delete_damaged(storage, report):
        print(f"deleted {storage.join(key)}")
    if cmd:
        print("running: " + shlex.join(cmd), flush=True)
        rc = subprocess.run(cmd).returncode
        if rc != 0:
            print(f"verify: snakemake failed ({rc}); the run is not repaired", file=sys.stderr)
            return rc
    after = check_run(storage, config, args.sizes_only)
    print("after the repair:")
    print("\n".join(after.lines(storage)))
    return 0 if after.ok else 1


if __name__ == "__main__":
    sys.exit(main())
