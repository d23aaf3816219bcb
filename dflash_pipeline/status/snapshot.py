"""One picture of a run, built from the run root (local or S3) and the Snakemake job events.

Sources, cheapest first:

* a listing of the run root: which shard outputs exist (done), and bytes per stage. The whole
  root is listed on the first refresh and every ``full_listing_every_s``; in between, a refresh
  lists only what can still change: per shard stage the key ranges of shard blocks that were not
  all done (``SETTLED_BLOCK`` shards each), and the few run-level prefixes (``LIVE_PREFIXES``).
  A finished run of 10,000 shards x 3 stages leaves ~50k objects (outputs and every finished
  shard's telemetry); listing them took minutes of S3 pages per refresh on a loaded machine,
  while the incremental refresh costs a handful of requests (bench/status_scale.py);
* the ``_progress/`` telemetry of jobs (read again only when its size or mtime changed, so a
  finished shard's telemetry is read once per server, concurrently on the first refresh);
* training metrics (``_progress/train/segment-KKKK/metrics.jsonl``), each segment's τ in the loop
  (``outputs/segment_tau-KKKK.json``) and evaluation metrics;
* the events file of the ``dflash`` logger plugin: which jobs run, finished or failed. The
  plugin writes one file per working directory, whatever run Snakemake drives from there (a
  local run, an S3 run, another prefix): only the Snakemake runs whose jobs write into this run
  root are shown (``RunJobBoard``).

No Snakemake dry-run is ever started (against S3 it costs requests per object); everything here
only lists and reads. The result is plain JSON for the page and the ``/api/status`` route.

Its length (over 500 lines): the builder is one pass over the run root's listing that sees every
kind of object together (shard outputs, telemetry, stage totals, training segments, halt, lease);
the job boards (``status.events``) and the summaries (``status.summaries``) are apart.
"""

from __future__ import annotations

import bisect
import json
import re
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from dflash_pipeline.core import layout
from dflash_pipeline.core.jobstate import parse_totals, read_train_metrics
from dflash_pipeline.core.storage import ObjectInfo, ReadOnlyStorage, StorageError
from dflash_pipeline.report import headline as headline_figures
from dflash_pipeline.status.events import RunEvents, RunJobBoard, local_log_path
from dflash_pipeline.status.summaries import (
    evaluation_is_old,
    evaluation_summary,
    failed_row,
    halt_summary,
    headline_summary,
    lease_summary,
    log_progress,
    running_row,
    stage_rate,
    training_summary,
    tune_summary,
)

# Shard stages in pipeline order; each is named like the rule that builds its objects.
SHARD_STAGES = tuple(layout.SHARD_STAGES)

TELEMETRY_KEY = layout.SHARD_TELEMETRY
TOTALS_KEY = re.compile(r"^_progress/(?P<stage>[a-z_]+)/totals\.json$")
SEGMENT_KEY = re.compile(r"^_progress/train/segment-(?P<segment>\d{4})/(?P<name>metrics\.jsonl|telemetry\.json)$")
SEGMENT_MANIFEST = re.compile(r"^outputs/train-segment-(?P<segment>\d{4})\.json$")
BENCHMARK_KEY = re.compile(rf"^{layout.OUTPUTS_DIR}/benchmark\.[^/]+\.tsv$")
# Stages of one job each after training, in the stage table and the overall bar beside the shard
# stages and training: the object that says the job is done. (tune, before generate, shows as a
# running job: a run skips it when its result is up to date.)
SINGLE_JOB_STAGES = {"export": layout.DRAFTER_CONFIG, "evaluate": layout.EVAL_METRICS}

# Shards per block: a block whose shards were all done at the last listing is settled (not
# listed again until the next full listing, or until a job of it runs or fails again).
SETTLED_BLOCK = 100
# Run-level objects that change while a run goes on, listed on every refresh (all small).
LIVE_PREFIXES = (
    f"{layout.PROGRESS_DIR}/train/",
    layout.HALT,
    layout.RUN_LEASE,
    f"{layout.OUTPUTS_DIR}/train-segment-",
    f"{layout.OUTPUTS_DIR}/segment_tau-",
    f"{layout.OUTPUTS_DIR}/evaluate-",
    f"{layout.OUTPUTS_DIR}/ingest-",
    layout.TUNE_RESULT,
    f"{layout.OUTPUTS_DIR}/report-",
    f"{layout.DRAFTER_DIR}/",
)
# Concurrent reads of telemetry not seen before (the first refresh of a finished run: one GET
# per finished shard and stage).
READ_THREADS = 8

LOG_TAIL_LINES = 20
LOG_TAIL_BYTES = 16384


@dataclass
class RunSource:
    """Where a run lives, as the status server sees it."""

    storage: ReadOnlyStorage  # the run root
    num_shards: int
    num_segments: int = 0  # training segments (config train.segments); 0: as many as seen
    # The stages the run builds (layout.stages_built): shown, and counted, before their first
    # object exists; a stage it does not build appears once it has one, and is not missing.
    stages: tuple[str, ...] = layout.STAGES
    events_file: Path | None = None
    workdir: Path = Path(".")  # Snakemake's working directory: local log paths are relative to it
    # Telemetry not refreshed for this long belongs to a job that died without saying so.
    stale_after_s: float = 300.0
    # The whole run root is listed again this often (bytes of logs, checkpoints, settled
    # shards); in between only what can still change is (see the module's docstring).
    full_listing_every_s: float = 300.0
    # GPUs per GPU rule (report.headline.gpus_per_rule of the config): GPU-hours from the job
    # benchmarks in the run root, as the report counts them; None: not known, not shown.
    gpus_per_rule: dict[str, int] | None = None
    # The config's evaluate.engine: "transformers" measures no serving engine's τ.
    evaluate_engine: str | None = None


class SnapshotBuilder:
    """Builds snapshots of one run, caching what did not change since the last one."""

    def __init__(self, source: RunSource):
        self.source = source
        self.board = RunJobBoard(source.events_file, source.storage.url, source.workdir) if source.events_file else None
        self._cache: dict[str, tuple[tuple[int, float], object]] = {}
        # The run root's objects as last listed, sorted by key (keys in a parallel list).
        self._objects: list[ObjectInfo] | None = None
        self._keys: list[str] = []
        self._full_at = 0.0
        self._settled: dict[str, set[int]] = {}
        self.last_listing = "none"  # "full" or "incremental": what the last build listed

    def _list_objects(self, now: float, events: RunEvents) -> list[ObjectInfo]:
        storage = self.source.storage
        if self._objects is None or now - self._full_at >= self.source.full_listing_every_s:
            self._objects = storage.list("")
            self._keys = [o.key for o in self._objects]
            self._full_at, self.last_listing = now, "full"
            return self._objects
        for prefix, start, stop in self._live_ranges(events):
            fresh = storage.list_range(prefix, start, stop)
            lo = bisect.bisect_left(self._keys, max(prefix, start))
            upper = prefix + "\U0010ffff"  # above every key that starts with prefix
            hi = bisect.bisect_left(self._keys, upper if stop is None else min(upper, stop))
            self._objects[lo:hi] = fresh
            self._keys[lo:hi] = [o.key for o in fresh]
        self.last_listing = "incremental"
        return self._objects

    def _live_ranges(self, events: RunEvents) -> list[tuple[str, str, str | None]]:
        """(prefix, start, stop) of every key range a refresh lists between full listings."""
        ranges = [(prefix, "", None) for prefix in LIVE_PREFIXES]
        n = self.source.num_shards
        blocks = (n + SETTLED_BLOCK - 1) // SETTLED_BLOCK
        active: dict[str, set[int]] = {}  # a job ran or failed since: its block may change
        for job in events.jobs.values():
            shard = job.wildcards.get("shard", "")
            if job.rule in SHARD_STAGES and shard.isdigit() and job.state in ("running", "failed"):
                active.setdefault(job.rule, set()).add(int(shard) // SETTLED_BLOCK)
        for stage in SHARD_STAGES:
            settled = self._settled.get(stage, set()) - active.get(stage, set())
            block = 0
            while block < blocks:
                if block in settled:
                    block += 1
                    continue
                first = block
                while block < blocks and block not in settled:
                    block += 1
                lo, hi = first * SETTLED_BLOCK, block * SETTLED_BLOCK
                for prefix in (f"{layout.OUTPUTS_DIR}/{stage}-", f"{layout.PROGRESS_DIR}/{stage}/shard-"):
                    stop = f"{prefix}{layout.shard_name(hi)}" if hi < n else None
                    ranges.append((prefix, f"{prefix}{layout.shard_name(lo)}" if lo else "", stop))
        return ranges

    def _settle(self, done: dict[str, set[int]]) -> None:
        n = self.source.num_shards
        for stage, shards in done.items():
            self._settled[stage] = {
                b
                for b in range((n + SETTLED_BLOCK - 1) // SETTLED_BLOCK)
                if all(s in shards for s in range(b * SETTLED_BLOCK, min((b + 1) * SETTLED_BLOCK, n)))
            }

    def _prefetch(self, objects: list[ObjectInfo], skip=lambda key: False) -> None:
        """Read, concurrently, every parsed object that is new or changed since its last read
        (but those ``skip`` names)."""
        todo = []
        for obj in objects:
            if skip(obj.key):
                continue
            parse = _parser_for(obj.key)
            hit = self._cache.get(obj.key)
            if parse is not None and (hit is None or hit[0] != (obj.size, obj.mtime)):
                todo.append((obj, parse))
        if len(todo) < 2:
            return
        with ThreadPoolExecutor(READ_THREADS) as pool:
            list(pool.map(lambda item: self._read_cached(item[0].key, item[0].size, item[0].mtime, item[1]), todo))

    def _read_cached(self, key: str, size: int, mtime: float, parse):
        hit = self._cache.get(key)
        if hit is not None and hit[0] == (size, mtime):
            return hit[1]
        try:
            value = parse(self.source.storage.read_text(key))
        except (StorageError, ValueError):
            return hit[1] if hit else None  # mid-replacement: keep the last good copy
        self._cache[key] = ((size, mtime), value)
        return value

    def _log_tail(self, job_logs: list[str], fallback_key: str | None) -> list[str]:
        """Last lines of a job's log: the local file Snakemake writes while the job runs, or
        the copy in the run root (S3 runs upload it when the job ends)."""
        workdir = self.source.workdir.resolve()
        for name in job_logs:
            path = (workdir / local_log_path(name)).resolve()
            # Only .log files inside the working directory, whatever an events file says.
            if workdir in path.parents and path.suffix == ".log" and path.is_file():
                with open(path, "rb") as fh:
                    fh.seek(max(0, path.stat().st_size - LOG_TAIL_BYTES))
                    return _last_lines(fh.read())
        if fallback_key:
            try:
                return _last_lines(self.source.storage.read_bytes(fallback_key)[-LOG_TAIL_BYTES:])
            except StorageError:
                pass
        return []

    def build(self) -> dict:
        now = time.time()
        events = self.board.refresh() if self.board else RunEvents()
        objects = self._list_objects(now, events)
        n = self.source.num_shards

        done: dict[str, set[int]] = {stage: set() for stage in SHARD_STAGES}
        totals: dict[str, dict[int, dict]] = {}
        for obj in objects:
            if (m := layout.SHARD_OBJECT.match(obj.key)) and m["stage"] in done:
                if m["ext"] == layout.SHARD_STAGES.get(m["stage"]):
                    done[m["stage"]].add(int(m["shard"]))
            elif m := TOTALS_KEY.match(obj.key):
                totals[m["stage"]] = self._read_cached(obj.key, obj.size, obj.mtime, _totals) or {}

        def summed(key: str) -> bool:
            """A finished shard's telemetry whose counts its stage's totals object holds: not
            read (a cold refresh of 10,000 finished shards reads a few objects, not 20,000)."""
            m = TELEMETRY_KEY.match(key)
            return (
                bool(m)
                and int(m["shard"]) in done.get(m["stage"], ())
                and int(m["shard"]) in totals.get(m["stage"], {})
            )

        def unread(key: str) -> bool:
            if BENCHMARK_KEY.match(key):
                gpus = self.source.gpus_per_rule or {}
                return not gpus.get(headline_figures.benchmark_rule(key))
            return summed(key)

        self._prefetch(objects, skip=unread)
        storage_use: dict[str, dict] = {}
        telemetry: dict[tuple[str, int], dict] = {}
        segments: dict[int, dict] = {}
        segment_taus: dict[int, tuple[object, float]] = {}
        eval_metrics = tune_result = None
        halt = lease = None
        written: dict[str, float] = {}  # single-job stages' objects and segment manifests: mtime
        gpu_seconds, benchmarked = 0.0, False
        for obj in objects:
            use = storage_use.setdefault(layout.storage_category(obj.key), {"bytes": 0, "objects": 0})
            use["bytes"] += obj.size
            use["objects"] += 1
            if layout.SHARD_OBJECT.match(obj.key) or summed(obj.key):
                continue
            if obj.key in SINGLE_JOB_STAGES.values() or SEGMENT_MANIFEST.match(obj.key):
                written[obj.key] = obj.mtime
            if BENCHMARK_KEY.match(obj.key) and self.source.gpus_per_rule is not None:
                gpus = self.source.gpus_per_rule.get(headline_figures.benchmark_rule(obj.key))
                if gpus is not None:
                    benchmarked = True
                    if gpus:  # a CPU job's file is not read: it adds nothing
                        seconds = self._read_cached(obj.key, obj.size, obj.mtime, headline_figures.benchmark_seconds)
                        gpu_seconds += (seconds or 0.0) * gpus
                continue
            if m := TELEMETRY_KEY.match(obj.key):
                stage = m["stage"] if m["stage"] in SHARD_STAGES else None
                record = self._read_cached(obj.key, obj.size, obj.mtime, json.loads)
                if stage and isinstance(record, dict):
                    telemetry[(stage, int(m["shard"]))] = record
            elif m := SEGMENT_KEY.match(obj.key):
                seg = segments.setdefault(int(m["segment"]), {})
                parse = read_train_metrics if m["name"] == layout.TRAIN_METRICS else json.loads
                seg[m["name"]] = self._read_cached(obj.key, obj.size, obj.mtime, parse)
            elif m := SEGMENT_MANIFEST.match(obj.key):
                segments.setdefault(int(m["segment"]), {}).update(done=True, manifest_at=obj.mtime)
            elif m := layout.SEGMENT_TAU.match(obj.key):
                # The segment's τ in the loop (rule segment_tau); only a manifest makes a segment.
                record = self._read_cached(obj.key, obj.size, obj.mtime, json.loads)
                segment_taus[int(m["segment"])] = (record, obj.mtime)
            elif obj.key == layout.EVAL_METRICS:
                eval_metrics = self._read_cached(obj.key, obj.size, obj.mtime, json.loads)
            elif obj.key == layout.TUNE_RESULT:
                tune_result = self._read_cached(obj.key, obj.size, obj.mtime, json.loads)
            elif obj.key == layout.HALT:
                halt = self._read_cached(obj.key, obj.size, obj.mtime, json.loads) or {
                    "cause": "unreadable halt object"
                }
            elif obj.key == layout.RUN_LEASE:
                lease = self._read_cached(obj.key, obj.size, obj.mtime, json.loads)

        self._settle(done)
        jobs_by_stage_shard: dict[tuple[str, int], object] = {}
        for job in sorted(events.jobs.values(), key=lambda j: j.jobid):
            stage = job.rule if job.rule in SHARD_STAGES else None
            if stage and "shard" in job.wildcards and job.wildcards["shard"].isdigit():
                jobs_by_stage_shard[(stage, int(job.wildcards["shard"]))] = job

        stages, running, failed = [], [], []
        for stage in SHARD_STAGES:
            planned = stage in self.source.stages
            present = planned or done[stage] or any(s == stage for s, _ in jobs_by_stage_shard)
            if not present:
                continue
            counts = {"done": 0, "running": 0, "failed": 0, "missing": 0}
            fraction_sum = 0.0
            for shard in range(n):
                job = jobs_by_stage_shard.get((stage, shard))
                tele = telemetry.get((stage, shard))
                if tele is not None and job is not None and job.started_at is not None:
                    # A rerun's first seconds still see the telemetry of the job before it.
                    if float(tele.get("updated_at", 0)) < job.started_at:
                        tele = None
                tele_live = (
                    tele is not None
                    and tele.get("state") == "running"
                    and now - float(tele.get("updated_at", 0)) < self.source.stale_after_s
                )
                if shard in done[stage]:
                    counts["done"] += 1
                    fraction_sum += 1.0
                    continue
                if (job is not None and job.state == "running") or (job is None and tele_live):
                    counts["running"] += 1
                    row = self._running_row(
                        stage, stage, shard, job, tele, now
                    )  # shard stages are named as their rules
                    fraction_sum += (row["percent"] or 0.0) / 100.0
                    running.append(row)
                elif (job is not None and job.state == "failed") or (
                    job is None and tele is not None and tele.get("state") == "failed"
                ):
                    counts["failed"] += 1
                    failed.append(self._failed_row(stage, stage, shard, job, tele))
                else:
                    counts["missing"] += 1
            stages.append(
                {
                    "stage": stage,
                    "rule": stage,
                    "total": n,
                    **counts,
                    "percent": round(100.0 * fraction_sum / n, 2) if n else 100.0,
                    "bytes": storage_use.get(stage, {}).get("bytes", 0),
                }
            )
        train_row = self._train_stage(segments, events, now, running, failed)
        if train_row is not None:
            stages.append(train_row)
        train_complete = train_row is None or train_row["done"] == train_row["total"]
        manifests = [t for key, t in written.items() if SEGMENT_MANIFEST.match(key)]
        # What each single-job stage's object must be newer than to be this run's, not one from
        # before a forced rerun of what it follows.
        upstream = {
            "export": manifests if train_complete else [float("inf")],
            "evaluate": manifests + [written.get(layout.DRAFTER_CONFIG, float("inf"))]
            if train_complete
            else [float("inf")],
        }
        for stage, key in SINGLE_JOB_STAGES.items():
            # export makes the drafter evaluate reads: built where evaluate is.
            planned = stage in self.source.stages or (stage == "export" and "evaluate" in self.source.stages)
            job = max((j for j in events.jobs.values() if j.rule == stage), key=lambda j: j.jobid, default=None)
            if not planned and key not in written and job is None:
                continue
            row = {"stage": stage, "rule": stage, "total": 1, "done": 0, "running": 0, "failed": 0, "missing": 0}
            fraction = 0.0
            if job is not None and job.state == "running":
                row["running"] = 1
                fraction = (log_progress(self._log_tail(job.log, _log_key(stage, None))).get("percent") or 0) / 100
            elif job is not None and job.state == "failed":
                row["failed"] = 1
            elif (job is not None and job.state == "done") or (
                key in written and all(t <= written[key] for t in upstream[stage])
            ):
                row["done"], fraction = 1, 1.0
            else:
                row["missing"] = 1
            row["percent"] = round(100.0 * fraction, 2)
            row["bytes"] = 0
            stages.append(row)
        eval_old = evaluation_is_old(
            written.get(layout.EVAL_METRICS), train_complete, upstream["evaluate"] if train_complete else []
        )
        # Jobs of rules without shards or segments (ingest, tune, export, evaluate, report): the
        # failed ones, and the running ones with their log tails (tune measures for up to an
        # hour on a GPU before the first generate job; evaluate takes minutes).
        for job in events.jobs.values():
            if job.rule in ("train", "all") or (job.rule in SHARD_STAGES and "shard" in job.wildcards):
                continue
            # A segment_tau job names its segment (its log: logs/segment_tau/segment-KKKK.log).
            segment = job.wildcards.get("segment")
            part = f"segment-{segment}" if segment else None
            if job.state == "failed":
                failed.append(self._failed_row(None, job.rule, part, job, None))
            elif job.state == "running":
                running.append(self._running_row(job.rule, job.rule, part, job, None, now))

        # Each stage weighs the same: a stage of one job (evaluate) counts as much as one of
        # 10,000 shards, and the bar stays below 100% until every stage is done.
        overall = sum(s["percent"] for s in stages) / len(stages) if stages else 0.0
        if any(s["done"] < s["total"] for s in stages):
            overall = min(overall, 99.9)
        # Training's bytes: its manifests, checkpoints and progress area.
        for row in stages:
            if row["stage"] == "train":
                row["bytes"] = sum(storage_use.get(c, {}).get("bytes", 0) for c in ("train", "checkpoints"))
        return {
            "run": self.source.storage.url,
            "generated_at": now,
            "num_shards": n,
            "progress_percent": round(overall, 2),
            "workflow": {
                "state": events.state,
                "started_at": events.started_at,
                "ended_at": events.ended_at,
                "steps_done": events.steps_done,
                "steps_total": events.steps_total,
                "errors": events.errors[-5:],
                "events_file": str(self.source.events_file) if self.source.events_file else None,
                # Whose Snakemake run the job events above are (RunJobBoard.source).
                "events_source": self.board.source if self.board else "none",
            },
            # A tokenize shard failed the quality gate: generation is stopped until it is cleared.
            "halt": halt_summary(halt),
            # Which driver runs this run root (core/lease.py): where to look, whom to stop.
            "lease": lease_summary(lease, now),
            "stages": stages,
            "running": running,
            "failed": failed,
            "throughput": {
                # Generation's rate from generate rows alone; training's (tokens it trains on)
                # on its own: None when no such job runs.
                "tokens_per_s": stage_rate(running, "generate"),
                "training_tokens_per_s": stage_rate(running, "train"),
                "tokens_generated": sum(int(t.get("tokens_generated", 0)) for t in telemetry.values())
                + sum(
                    int(entry.get("tokens_generated", 0))
                    for stage, entries in totals.items()
                    for shard, entry in entries.items()
                    if shard in done.get(stage, ())
                ),
            },
            "training": training_summary(segments, segment_taus),
            "evaluation": evaluation_summary(eval_metrics, old=eval_old),
            # The run's headline figures, as on the report's first page (report/headline.py).
            "headline": headline_summary(
                eval_metrics,
                [t for (stage, _), t in telemetry.items() if stage == "generate"]
                + [e for shard, e in totals.get("generate", {}).items() if shard in done.get("generate", ())],
                round(gpu_seconds / 3600, 4) if benchmarked else None,
                self.source.evaluate_engine,
                old=eval_old,
            ),
            # The engine settings measured before generation (stages/tune.py), if any.
            "tune": tune_summary(tune_result),
            "storage": {
                # Bytes outside the ranges listed between full listings are as of this time.
                "full_listing_at": self._full_at,
                "total_bytes": sum(u["bytes"] for u in storage_use.values()),
                "by_category": dict(sorted(storage_use.items())),
            },
        }

    def _train_stage(self, segments, events, now, running, failed) -> dict | None:
        """Training as a stage whose units are checkpoint segments (progress: steps)."""
        trains = "train" in self.source.stages
        total = (self.source.num_segments if trains else 0) or (max(segments) + 1 if segments else 0)
        if not total:
            return None
        jobs = {
            int(job.wildcards["segment"]): job
            for job in sorted(events.jobs.values(), key=lambda j: j.jobid)
            if job.rule == "train" and job.wildcards.get("segment", "").isdigit()
        }
        counts = {"done": 0, "running": 0, "failed": 0, "missing": 0}
        fraction_sum = 0.0
        redoing = False  # a segment before this one is not done: this one's manifest is old
        for segment in range(total):
            seg, job = segments.get(segment, {}), jobs.get(segment)
            tele = seg.get("telemetry.json") or {}
            fresh = now - float(tele.get("updated_at", 0)) < self.source.stale_after_s
            log_key = f"{layout.LOGS_DIR}/train/segment-{layout.segment_name(segment)}.log"
            done, redoing = seg.get("done") and not redoing, redoing or not seg.get("done")
            if done:
                counts["done"] += 1
                fraction_sum += 1.0
            elif (job is not None and job.state == "running") or (
                job is None and tele.get("state") == "running" and fresh
            ):
                counts["running"] += 1
                steps_done, steps_total = tele.get("steps_done"), tele.get("steps_total")
                percent = round(100.0 * steps_done / steps_total, 2) if steps_total and steps_done is not None else None
                fraction_sum += (percent or 0.0) / 100.0
                running.append(
                    {
                        "stage": "train",
                        "rule": "train",
                        "shard": f"segment-{layout.segment_name(segment)}",
                        "jobid": job.jobid if job is not None else None,
                        "samples_done": steps_done,
                        "samples_total": steps_total,
                        "percent": percent,
                        "tokens_per_s": tele.get("tokens_per_s"),
                        "eta_s": tele.get("eta_s"),
                        "errors": None,
                        "elapsed_s": round(now - job.started_at, 1) if job is not None and job.started_at else None,
                        "updated_at": tele.get("updated_at"),
                        "log_tail": self._log_tail(job.log if job else [], log_key),
                    }
                )
            elif (job is not None and job.state == "failed") or (job is None and tele.get("state") == "failed"):
                counts["failed"] += 1
                row = self._failed_row(None, "train", None, job, tele)
                row["shard"] = f"segment-{layout.segment_name(segment)}"
                row["log_tail"] = self._log_tail(job.log if job else [], log_key)
                failed.append(row)
            else:
                counts["missing"] += 1
        return {
            "stage": "train",
            "rule": "train",
            "total": total,
            **counts,
            "percent": round(100.0 * fraction_sum / total, 2),
            "bytes": 0,
        }

    def _running_row(self, stage, rule, shard, job, tele, now) -> dict:
        return running_row(
            stage, rule, shard, job, tele, now, self._log_tail(job.log if job else [], _log_key(rule, shard))
        )

    def _failed_row(self, stage, rule, shard, job, tele) -> dict:
        return failed_row(stage, rule, shard, job, tele, self._log_tail(job.log if job else [], _log_key(rule, shard)))


def _log_key(rule: str | None, shard: int | None) -> str | None:
    """The run-root key of a job's log (rules/common.smk log_path)."""
    if not rule:
        return None
    name = f"{rule}/{layout.shard_name(shard)}.log" if shard is not None else f"{rule}.log"
    return f"{layout.LOGS_DIR}/{name}"


def _last_lines(data: bytes, lines: int = LOG_TAIL_LINES) -> list[str]:
    text = data.decode("utf-8", errors="replace")
    return text.splitlines()[-lines:]


def _totals(text: str) -> dict[int, dict]:
    return parse_totals(json.loads(text))


def _parser_for(key: str):
    """How build() parses an object it reads (None: it is only listed)."""
    if TELEMETRY_KEY.match(key):
        return json.loads
    if m := SEGMENT_KEY.match(key):
        return read_train_metrics if m["name"] == layout.TRAIN_METRICS else json.loads
    if key in (layout.EVAL_METRICS, layout.HALT, layout.RUN_LEASE, layout.TUNE_RESULT):
        return json.loads
    if BENCHMARK_KEY.match(key):
        return headline_figures.benchmark_seconds
    return None
