"""Generate stage: regenerate every assistant turn of a prompt shard with the target.

Each conversation is replayed turn by turn on its regenerated history (on-policy): every
assistant turn of the source is replaced by the target's own response, and a conversation that
ends with a user or tool turn gets one more assistant turn. Finished conversations are saved in
parts under ``_progress/generate/shard-NNNNN/`` every K samples or T seconds, so a killed job
resumes where it stopped; telemetry for the status page is written every
``generation.telemetry_every_seconds``. The regeneration itself is
``dflash_pipeline.engines.regenerate``; this module starts or reaches the engine and writes the shard, whose
parquet metadata names the target's weights (``target_weights``). While the run is halted (``_progress/HALT.json``: a tokenize shard
failed the data-quality gate) a job refuses to start, and a running one stops after its next part.

Run by hand: ``python -m dflash_pipeline.stages.generate --help``.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from functools import partial

import pyarrow as pa
import pyarrow.parquet as pq

from dflash_pipeline.core.jobstate import RunHalted, ShardProgress, raise_if_halted
from dflash_pipeline.core.config import schema_defaults
from dflash_pipeline.core.lease import DriverGone
from dflash_pipeline.core.storage import open_storage, write_atomically
from dflash_pipeline.data.shard_kinds import ShardKindError, require_file_kind
from dflash_pipeline.engines.client import EngineClient, EngineError, make_adapter, watch_for_hang
from dflash_pipeline.engines.environments import EngineSetupError, engine_version
from dflash_pipeline.engines.launch import ManagedServer, ServerSpec, server_port
from dflash_pipeline.engines.tuning import TunedChoice, apply_choice, read_tune_result, tune_defining, tune_key
from dflash_pipeline.engines.regenerate import (
    GenerationSettings,
    ShardGenerator,
    fingerprint,
    generate_shard,
)
from dflash_pipeline.model import target_identity

log = logging.getLogger(__name__)


def tuned_choice(run_url: str, config: dict) -> TunedChoice | None:
    """The run's tune result for this config's defining settings (None: not measured, or
    measured for other settings)."""
    return read_tune_result(open_storage(run_url), tune_key(tune_defining(config)))


def run_job(
    prompts_path: str,
    out_path: str,
    run_url: str,
    shard: int,
    model: str,
    gen: dict,
    engine_log: str,
    runtime_dir: str,
    engines: dict | None = None,
    engine_log_label: str | None = None,
    tuned: TunedChoice | None = None,
    untuned_concurrency: int = schema_defaults("tune")["untuned_concurrency"],
) -> None:
    """Everything one generate job does: start or reach the engine, generate, write the shard.
    A halted run (a tokenize shard failed the data-quality gate) is refused before anything
    starts, and stops the job after its next part (``RunHalted``). The engine server writes
    ``engine_log``; error messages name it as ``engine_log_label`` where one is given (the
    workflow's: the job's declared log and this attempt's own file)."""
    progress = ShardProgress(open_storage(run_url), "generate", shard)
    raise_if_halted(progress.run, f"generate shard {shard:05d}")
    # Before any engine starts: another stage's shard would fail on its first row.
    require_file_kind(prompts_path, "prepare", "generate")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    # Concurrency and MTP measured by tune, unless the config pins them.
    gen, concurrency_line = apply_choice(gen, tuned, untuned_concurrency)
    log.info("shard %05d: %s", shard, concurrency_line)
    settings = GenerationSettings.from_config(gen, model)
    engine = gen["engine"]
    prompts = pq.read_table(prompts_path)
    server = None
    if engine == "endpoint":
        urls = gen["endpoints"]
        if not urls:
            raise EngineError("generation.engine is 'endpoint' but generation.endpoints is empty")
    else:
        srv = gen["server"]
        spec = ServerSpec.from_config(engine, model, server_port(srv["port_base"]), srv, engines)
        server = ManagedServer(
            spec, engine_log, runtime_dir, startup_timeout=srv["startup_timeout_s"], log_label=engine_log_label
        )
        urls = [spec.url]
    fp = fingerprint(model, tokenizer.chat_template, settings, engine, engine_version(engine, engines))

    def engine_info() -> dict:
        return {
            "kind": engine,
            "urls": urls,
            "healthy": server.alive() if server else True,
            "log": str(engine_log) if server else None,
        }

    async def main() -> pa.Table:
        adapter = make_adapter(engine, model)
        health = server.alive if server else (lambda: True)
        async with EngineClient(urls, adapter, gen["request_timeout_s"], gen["max_retries"], alive=health) as client:
            generator = ShardGenerator(tokenizer, client, settings, fp)
            watch = partial(watch_for_hang, urls, gen["hung_after_s"])
            return await generate_shard(prompts, generator, progress, engine_info, health, watch)

    try:
        if server:
            server.start()
        try:
            table = asyncio.run(main())
        except EngineError as err:
            raise EngineError(
                f"{err}. Engine log: {(engine_log_label or engine_log) if server else 'external endpoint'}. "
                "Finished samples are saved and a rerun resumes from them."
            ) from None
    finally:
        if server:
            server.stop()
    with write_atomically(out_path) as tmp:
        pq.write_table(with_target_weights(table, model), tmp)
    progress.save_reusable(table)
    removed = progress.clear_parts()
    log.info("shard %05d written (%d rows); %d parts removed", shard, table.num_rows, removed)


def with_target_weights(table: pa.Table, model: str) -> pa.Table:
    """The shard with the target's weights digest in its parquet metadata (``target_weights``,
    ``model.target_identity``): the fingerprint names the model by its config.json, which a
    re-released or quantized copy keeps."""
    digest = target_identity.weights_digest(model)
    if digest is None:  # an endpoint's model folder may hold no weights here
        return table
    return table.replace_schema_metadata(
        {**(table.schema.metadata or {}), target_identity.KEY.encode(): digest.encode()}
    )


def main(argv: list[str] | None = None) -> int:
    from dflash_pipeline.core.run_cli import add_configfile_argument, read_configfiles
    from dflash_pipeline.stages.cli import json_object, model_dir, non_negative_int, or_s3, shard_of

    parser = argparse.ArgumentParser(prog="python -m dflash_pipeline.stages.generate", description=__doc__)
    parser.add_argument(
        "--prompts", type=or_s3(shard_of("prepare", "generate")), required=True, help="prompt shard parquet"
    )
    parser.add_argument("--out", required=True, help="generated shard parquet")
    parser.add_argument("--run-url", required=True, help="run root (local folder or s3://)")
    parser.add_argument("--shard", type=non_negative_int, required=True)
    parser.add_argument("--model", type=model_dir, required=True, help="target model folder")
    settings = parser.add_mutually_exclusive_group(required=True)
    add_configfile_argument(settings, "read for its generation and engines sections")
    settings.add_argument("--generation-json", type=json_object, help="the `generation` config as JSON")
    parser.add_argument("--engine-log", default="engine.log")
    parser.add_argument("--runtime-dir", default=".")
    parser.add_argument(
        "--engines-json", type=json_object, help="the `engines` config as JSON (default: --configfile's, else none)"
    )
    args = parser.parse_args(argv)
    config = read_configfiles(args.configfile, parser) if args.configfile else None
    if config:
        args.generation_json = config["generation"]
    if args.engines_json is None:
        args.engines_json = config["engines"] if config else {}
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    try:
        run_job(
            args.prompts,
            args.out,
            args.run_url,
            args.shard,
            args.model,
            args.generation_json,
            args.engine_log,
            args.runtime_dir,
            args.engines_json,
        )
    except (EngineError, EngineSetupError, RunHalted, DriverGone, ShardKindError) as err:
        log.error("%s", err)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
