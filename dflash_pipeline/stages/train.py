"""Train stage: one checkpoint segment of the drafter (``python -m dflash_pipeline.stages.train --help``).

On CPU or one GPU the segment runs in this process; over several GPUs this module starts itself
under torchrun (DDP), each rank running ``main``. SIGTERM reaches the workers either way, so a
preempted job checkpoints (``dflash_pipeline.training.trainer``).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path

from dflash_pipeline.core import layout
from dflash_pipeline.core.config import trains_from_engine_taps
from dflash_pipeline.core.jobstate import RunHalted, raise_if_halted, read_halt
from dflash_pipeline.core.joblog import job_logging
from dflash_pipeline.core.lease import raise_if_driverless
from dflash_pipeline.core.storage import open_storage
from dflash_pipeline.training.trainer import SegmentJob, TrainingDiverged

log = logging.getLogger(__name__)


def shard_paths(paths: list[str]) -> dict[str, str]:
    """``outputs/<stage>-NNNNN.<ext>`` paths keyed by their shard ``NNNNN``."""
    found = {}
    for path in paths:
        match = layout.SHARD_OBJECT.match(f"{layout.OUTPUTS_DIR}/{os.path.basename(path)}")
        if match is None:
            raise ValueError(f"{path}: not a shard output (outputs/<stage>-NNNNN.<ext>)")
        found[match["shard"]] = path
    return found


def torchrun_command(nproc: int, args: list[str]) -> list[str]:
    return [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc_per_node={nproc}", "-m", "dflash_pipeline.stages.train", *args,
    ]  # fmt: skip


def segment_args(
    job: SegmentJob, settings_file: str, logs: list[str] = (), taps_server: dict | None = None
) -> list[str]:
    """The per-rank command line of a torchrun segment. The shard lists go into a file beside
    ``settings_file``: at 10,000 offline shards they are megabytes, past Linux's argv limit."""
    shards_file = Path(settings_file).with_name("shards.json")
    shards_file.write_text(json.dumps({"tokenized": job.tokenized, "hidden": job.hidden}))
    args = [
        "--run-url", job.run_url, "--segment", str(job.segment), "--settings", settings_file,
        "--target", job.target_dir, "--manifest", job.manifest_path, "--shards", str(shards_file),
    ]  # fmt: skip
    if logs:
        args += ["--log", *map(str, logs)]
    if taps_server:
        args += ["--taps-server", json.dumps(taps_server)]
    return args


def run_train_job(job: SegmentJob, gpus: int, logs: list[str] = (), taps_server: dict | None = None) -> int:
    """Run the segment here (gpus <= 1) or under torchrun over ``gpus`` devices (each rank
    reaching the taps server at ``taps_server``, when there is one)."""
    if gpus <= 1:
        job.run()
        return 0
    with tempfile.TemporaryDirectory(prefix="dflash-train-") as tmp:
        settings_file = Path(tmp) / "settings.json"
        settings_file.write_text(json.dumps(job.settings))
        proc = subprocess.Popen(torchrun_command(gpus, segment_args(job, str(settings_file), logs, taps_server)))
        previous = signal.signal(signal.SIGTERM, lambda *_: proc.send_signal(signal.SIGTERM))
        try:
            code = proc.wait()
        finally:
            signal.signal(signal.SIGTERM, previous)
    if code != 0:
        # A diverged segment halted the run with its one-line message: that, not the exit code.
        halt = read_halt(open_storage(job.run_url)) or {}
        if halt.get("stage") == "train" and halt.get("shard") == layout.segment_name(job.segment):
            raise TrainingDiverged(halt.get("message") or halt.get("cause"))
        raise SystemExit(f"torchrun over {gpus} GPUs failed with exit code {code}")
    return 0


def train_job(
    run_url: str,
    segment: int,
    settings: dict,
    target_dir: str,
    tokenized: list[str],
    hidden: list[str],
    manifest: str,
    gpus: int,
    logs: list[str] = (),
    engines: dict | None = None,
) -> int:
    """What the `train` rule runs: the segment over the job's shards on ``gpus`` devices; refused
    while the run is halted (a tokenize shard failed the data-quality gate). Under torchrun the
    ranks log into ``logs`` (the job's log files) too. With ``train.taps_from: engine`` (online)
    the job first starts its node's taps server (the ``engines`` config section says where vLLM
    is installed) and checks one sample's taps against the target's."""
    run, name = open_storage(run_url), f"train segment {segment:04d}"
    raise_if_halted(run, name)
    raise_if_driverless(run, name)  # a job queued by a driver that is gone since does not start
    job = SegmentJob(
        run_url=run_url,
        segment=segment,
        settings=settings,
        target_dir=target_dir,
        tokenized=shard_paths(tokenized),
        hidden=shard_paths(hidden),
        manifest_path=manifest,
        device=None if gpus else "cpu",
    )
    if trains_from_engine_taps(settings):
        from dflash_pipeline.engines.engine_taps import node_local_dir

        # Node-local (shared memory where it has room): the server writes each request's taps
        # there and the trainer reads them.
        with node_local_dir(settings["taps_server"]["max_cache_bytes"]) as run_dir:
            # One training process per GPU (or the job's own on CPU) asks the server.
            with taps_server(job, engines, run_dir, logs, clients=max(1, gpus)) as address:
                with engine_tap_source(address, job.settings) as job.tap_source:
                    return run_train_job(job, gpus, logs, address)
    return run_train_job(job, gpus, logs)


def engine_tap_source(address: dict, settings: dict, tap_ids: list[int] | None = None):
    """Batches' taps from the taps server at ``address`` (``EngineTaps.address``)."""
    from dflash_pipeline.engines.engine_taps import EngineTapSource, taps_client

    server = settings["taps_server"]
    return EngineTapSource(
        taps_client(address, tap_ids or list(address["tap_ids"]), server), server.get("prefetch_depth", 1)
    )


@contextmanager
def taps_server(
    job: SegmentJob, engines: dict | None, run_dir: Path, logs: list[str] = (), clients: int = 1
) -> Iterator[dict]:
    """The job's vLLM taps server, running and checked against the target on one sample, for
    ``clients`` training processes; yields its address (``EngineTaps.address``). Its log goes
    beside the job's first log."""
    import torch

    from dflash_pipeline.engines.engine_taps import checked_taps_server
    from dflash_pipeline.model.config import build_drafter_config
    from dflash_pipeline.training.data import read_training_sequences

    device = job.device or ("cuda" if torch.cuda.is_available() else "cpu")
    tap_ids = build_drafter_config(job.settings, job.target_dir).target_layer_ids
    # One sample, the first of the training set, up to 256 tokens: cheap, and enough for several
    # prefill chunks of a small chunk size.
    sample = read_training_sequences(job.tokenized)[0].input_ids[:256].tolist()
    log_path = Path(logs[0]).with_name(f"{Path(logs[0]).stem}-vllm-taps.log") if logs else run_dir / "vllm-taps.log"
    with checked_taps_server(
        job.target_dir, tap_ids, job.settings["taps_server"], engines, run_dir, log_path, sample, device,
        purpose="train.taps_from", clients=clients, quantization=job.settings.get("target_quantization"),
    ) as client:  # fmt: skip
        yield {**client.address(), "tap_ids": list(tap_ids)}


def main(argv: list[str] | None = None) -> int:
    from dflash_pipeline.core.run_cli import add_configfile_argument, read_configfiles
    from dflash_pipeline.stages.cli import existing_file, json_file, model_dir, non_negative_int, shard_lists, shard_of

    parser = argparse.ArgumentParser(prog="python -m dflash_pipeline.stages.train", description=__doc__)
    parser.add_argument("--run-url", required=True, help="run root (local folder or s3://bucket/prefix)")
    parser.add_argument("--segment", type=non_negative_int, required=True)
    given = parser.add_mutually_exclusive_group(required=True)
    add_configfile_argument(given, "read for its train section")
    given.add_argument("--settings", type=json_file, help="JSON file with the config's `train` section")
    parser.add_argument("--target", type=model_dir, required=True, help="target model folder")
    parser.add_argument(
        "--shards",
        type=shard_lists("tokenized", {"tokenized": shard_of("tokenize", "train"), "hidden": existing_file}),
        required=True,
        help='JSON file {"tokenized": {SHARD: PATH}, "hidden": {SHARD: MANIFEST}} (hidden: offline mode only)',
    )
    parser.add_argument("--manifest", required=True, help="where to write the segment manifest")
    parser.add_argument("--device", default=None)
    parser.add_argument("--log", nargs="*", default=[], help="log files to append this process's records to")
    parser.add_argument(
        "--taps-server", type=json.loads, default=None, help="JSON address of a running taps server (taps_from engine)"
    )
    args = parser.parse_args(argv)
    if args.configfile:
        settings = read_configfiles(args.configfile, parser)["train"]
    else:
        with open(args.settings) as fh:
            settings = json.load(fh)
    with job_logging(None, copies=args.log):
        try:
            run_segment(args, settings)
        except (TrainingDiverged, RunHalted) as err:
            if int(os.environ.get("RANK", "0")) == 0:  # the one line that says it all, once
                log.error("%s", err)
            return 1
    return 0


def run_segment(args: argparse.Namespace, settings: dict) -> None:
    with open(args.shards) as fh:
        listed = json.load(fh)
    with engine_tap_source(args.taps_server, settings) if args.taps_server else nullcontext() as tap_source:
        SegmentJob(
            run_url=args.run_url,
            segment=args.segment,
            settings=settings,
            target_dir=args.target,
            tokenized=listed["tokenized"],
            hidden=listed.get("hidden", {}),
            manifest_path=args.manifest,
            device=args.device,
            tap_source=tap_source,
        ).run()


if __name__ == "__main__":
    sys.exit(main())
