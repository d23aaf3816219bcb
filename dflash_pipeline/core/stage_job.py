"""What every rule's script does around its stage function: ``with stage_job(snakemake, "train")
as job:`` opens the job's log, and ``job`` checks its inputs, records its outputs, leases its GPUs
and names its engine log. The scripts under ``scripts/`` are then only the wiring of Snakemake's
inputs, outputs and params to one function of ``dflash_pipeline.stages``.

A rule that declares the ``attempt`` resource (one that Snakemake retries) keeps each attempt's
logs apart below the run root (``core.joblog.JobAttempt``): Snakemake empties the declared logs
when it starts a job again, so a retry would erase the failure it retries. A rule that declares an
``engine`` log gets it written when the job ends, however it ends: this attempt's engine log after
the last lines of the earlier attempts'.

``smk`` is the ``snakemake`` object Snakemake gives a script (``snakemake.script.Snakemake``); a
plain object with the same attributes does for a job run by hand.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path

from dflash_pipeline.core.checksums import record_outputs, verify_inputs, verify_stored_size
from dflash_pipeline.core.config import job_settings
from dflash_pipeline.core.gpu_slots import GpuLease, job_devices, pool_from_config
from dflash_pipeline.core.joblog import JobAttempt, bundle_logs, job_logging

# What the declared engine log says when the attempt started no engine server.
NO_ENGINE = "no engine server was started in this attempt (see the job log)"


def _names(container) -> set[str]:
    """The names of a Snakemake container (input, log, resources...); none for a plain list."""
    keys = getattr(container, "keys", None)
    return set(keys()) if callable(keys) else set()


def _flat(paths: Iterable) -> list[str]:
    """Paths given one by one or as lists (``snakemake.input.heldout``), in order."""
    flat: list[str] = []
    for path in paths:
        if isinstance(path, (str, Path)):
            flat.append(str(path))
        else:
            flat.extend(str(p) for p in path)
    return flat


class StageJob:
    """One running job of rule ``smk.rule`` (its stage ``name``): see the module's docstring."""

    def __init__(self, smk, name: str, engine_absent: str = NO_ENGINE):
        self.smk, self.name, self.engine_absent = smk, name, engine_absent
        self.log = logging.getLogger("dflash_pipeline.job")
        logs = _names(smk.log)
        self.log_file = smk.log.job if "job" in logs else smk.log[0]
        self.engine_declared = smk.log.engine if "engine" in logs else None
        wildcards = self.wildcards = dict(getattr(smk, "wildcards", None) or {})
        # The shard or segment the job works on ("-": a job of the whole run), as its records name it.
        self.part = wildcards.get("shard") or wildcards.get("segment") or "-"
        keeps_attempts = "attempt" in _names(getattr(smk, "resources", None)) or self.engine_declared is not None
        job = name if self.part == "-" else f"{name}-{self.part}"
        self.attempt = JobAttempt.of(smk, job, self.log_file) if keeps_attempts else None

    @property
    def run_url(self) -> str:
        """The run root, local or S3: the rule's ``run_url`` param, as the plan resolved it (a
        job never works it out from where Snakemake put its files)."""
        try:
            return self.smk.params.run_url
        except AttributeError:
            raise ValueError(f"rule {self.smk.rule} declares no run_url param (params: run_url=RUN_URL)") from None

    @property
    def engine_log(self) -> str:
        """Where this attempt's engine server writes its log (kept in the run root with the job log)."""
        return str(self._attempt().local("engine"))

    @property
    def engine_log_label(self) -> str:
        """How error messages name the engine log: the declared one and this attempt's own."""
        return self._attempt().label(self.engine_declared)

    def engine_args(self) -> dict:
        """The keyword arguments of a stage function that launches an engine server: where its
        log goes, how messages name that log, the GPU slots' lock folder, the ``engines`` config."""
        return {
            "engine_log": self.engine_log,
            "engine_log_label": self.engine_log_label,
            "runtime_dir": pool_from_config(self.smk.config)[1],
            "engines": self.smk.config["engines"],
        }

    def beside_log(self, suffix: str) -> Path:
        """A file next to the job's log, named after it: what a failed job keeps there outlives
        its outputs, which Snakemake deletes."""
        return Path(self.log_file).with_suffix(suffix)

    def _attempt(self) -> JobAttempt:
        if self.attempt is None:
            raise ValueError(f"rule {self.smk.rule} declares no engine log and no attempt resource")
        return self.attempt

    def verify(self, *paths) -> None:
        """Check tracked inputs against their producers' checksum records before reading them
        (``core.checksums.verify_inputs``); call it before a GPU is taken."""
        verify_inputs(self.run_url, self.smk.rule, self.wildcards, dict(self.smk.config), _flat(paths))

    def verify_stored(self, url: str) -> None:
        """Check a tracked input the job reads by byte range from the run root, never whole:
        its record and its stored size (``core.checksums.verify_stored_size``)."""
        verify_stored_size(self.run_url, url, f"rule {self.smk.rule}")

    def record(self, *paths) -> None:
        """Record the checksums of the outputs the stage function wrote, for every job that reads them."""
        record_outputs(self.run_url, self.smk.rule, _flat(paths), self.part)

    def settings(self, defining: dict | None = None) -> dict:
        """The stage's config section: ``defining`` (the rule's param, by default ``settings``:
        Snakemake reruns a job when it changes) and the operational keys read from the config."""
        return job_settings(
            self.smk.config, self.name, dict(self.smk.params.settings if defining is None else defining)
        )

    @contextlib.contextmanager
    def devices(self) -> Iterator[GpuLease]:
        """Lease the job's ``gpu`` resource of this machine's pool for the block and make those
        devices the only ones it sees (``core.gpu_slots``); none for a CPU job."""
        with job_devices(self.smk.resources.gpu, *pool_from_config(self.smk.config)) as lease:
            yield lease

    def torch_threads(self, count: int) -> None:
        """torch's compute threads (as many as Snakemake granted, unless a stage knows better)."""
        import torch

        torch.set_num_threads(count)

    @contextlib.contextmanager
    def engine_folder(self) -> Iterator[Path]:
        """A folder for an engine that writes several files (server logs, raw counters), bundled
        into this attempt's engine log when the block ends. It holds this attempt's files only:
        an earlier attempt's were bundled into its own engine log, kept in the run root."""
        folder = Path(self.log_file).parent / f"{self.name}-engine"
        shutil.rmtree(folder, ignore_errors=True)
        try:
            yield folder
        finally:
            # Before the attempt's logs are kept (when the job's logging ends).
            bundle_logs(folder, self.engine_log, self.engine_absent)

    @contextlib.contextmanager
    def _logging(self) -> Iterator[logging.Logger]:
        if self.attempt is None:
            with job_logging(self.log_file) as log:
                yield log
        else:
            with self.attempt.logging(self.log_file) as log:
                yield log


@contextlib.contextmanager
def stage_job(
    smk, name: str, *, engine_absent: str = NO_ENGINE, refusals: tuple[type[BaseException], ...] = ()
) -> Iterator[StageJob]:
    """Run the block as the job ``smk`` of stage ``name``: every record of the package goes to
    the job's log and stderr, an error is written to the log before it leaves the block, and the
    logs are kept as the module's docstring says. ``engine_absent`` is what the engine log says
    when no engine ran. An error of ``refusals`` (a refused input, which the log already
    explains in full) ends the job with exit status 1 and no traceback."""
    job = StageJob(smk, name, engine_absent)
    try:
        with job._logging() as log:
            job.log = log
            yield job
    except refusals:
        sys.exit(1)
    finally:
        if job.engine_declared is not None:
            # This attempt's bundle, after the last lines of any earlier attempt's logs.
            job._attempt().bundle(job.engine_declared, "engine", job.engine_absent)
