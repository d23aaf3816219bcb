"""Tune stage: measure the generation engine on the run's own prompts before the long generation.

One server of the configured engine on one device's share (the config's tensor parallelism, no
data parallelism) replays a sample of the run's prompts (the first assistant turn of
conversations from the first prepared shards) at each of ``tune.concurrencies``, with and without
MTP where the target has an MTP head and the engine serves it (``dflash_pipeline.engines.tuning``).
The result goes to ``outputs/tune-result.json`` in the run root: every setting's figures and the
choice, which ``generate`` takes unless the config pins ``generation.concurrency`` (or the
server's speculative settings) and ``plan`` takes as the measured generation rate.

Run by hand: ``python -m dflash_pipeline.stages.tune --help``; in the workflow: ``make tune``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import logging
import random
import sys
import time

from collections.abc import Iterator

import httpx
import pyarrow.parquet as pq

from dflash_pipeline.core.storage import write_atomically
from dflash_pipeline.data.chat import render_prompt
from dflash_pipeline.engines.client import EngineError, make_adapter
from dflash_pipeline.engines.environments import EngineSetupError, engine_version
from dflash_pipeline.engines.launch import ManagedServer, ServerSpec, server_port
from dflash_pipeline.engines.regenerate import GenerationSettings
from dflash_pipeline.engines.replay import ReplayError, describe_device, measure_setting, warm_up
from dflash_pipeline.engines.tuning import RESULT_SCHEMA, TuneError, choose, tune_key, variants

log = logging.getLogger(__name__)

# The sample's seed: the same prompts for every measurement of a run.
SAMPLE_SEED = 0


def first_turn(messages: list[dict]) -> list[dict]:
    """The conversation up to its first assistant turn: what the first request of it sends."""
    history = []
    for message in messages:
        if message["role"] == "assistant":
            break
        history.append({"role": message["role"], "content": message["content"]})
    return history


def sample_prompts(paths: list[str], count: int, tokenizer, thinking: bool) -> list[tuple[str, list[int]]]:
    """``count`` prompts drawn (seeded) from the prepared shards, rendered and tokenized as
    generate renders them."""
    rows = []
    for path in paths:
        rows += pq.read_table(path, columns=["id", "messages"]).to_pylist()
    if not rows:
        raise TuneError(f"the prepared shards hold no prompts: {', '.join(paths)}")
    rows.sort(key=lambda r: r["id"])
    chosen = random.Random(SAMPLE_SEED).sample(rows, min(count, len(rows)))
    prompts = []
    for row in chosen:
        history = first_turn(row["messages"])
        if not history:
            continue
        text = render_prompt(tokenizer, history, thinking)
        prompts.append((text, tokenizer(text, add_special_tokens=False)["input_ids"]))
    return prompts


@contextlib.contextmanager
def engine_failures_named(server: ManagedServer, setting: str) -> Iterator[None]:
    """A failed replay or a server that died during it: one EngineError naming the setting and
    the engine's log (with its last lines)."""
    try:
        yield
    except (ReplayError, httpx.HTTPError) as err:
        raise server.fail(f"failed the replay at {setting} ({type(err).__name__}: {err})") from None
    if not server.alive():
        raise server.fail(f"died while measuring {setting}")


def run_job(
    prompt_paths: list[str],
    out_path: str,
    model: str,
    gen: dict,
    tune: dict,
    defining: dict,
    engine_log: str,
    runtime_dir: str,
    engines: dict | None = None,
    engine_log_label: str | None = None,
) -> dict:
    """Measure every setting, choose, and write the result to ``out_path``; returns it."""
    engine = gen["engine"]
    if engine == "endpoint":
        raise TuneError("tune measures a server the run launches; generation.engine is 'endpoint'")
    from transformers import AutoTokenizer

    # One line per request (thousands per setting) would bury the measurements in the log.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    tokenizer = AutoTokenizer.from_pretrained(model)
    sampling = GenerationSettings.from_config(gen, model).sampling
    if tune["max_new_tokens"] is not None:
        sampling = dataclasses.replace(sampling, max_new_tokens=tune["max_new_tokens"])
    prompts = sample_prompts(prompt_paths, tune["prompts"], tokenizer, gen["thinking"])
    srv = gen["server"]
    tp = srv["tp"]
    gpus = tp if gen["gpus_per_job"] else 0
    configs, mtp_line = variants(engine, model, tune, srv["speculative"])
    version = engine_version(engine, engines)
    log.info("tune: %d prompts, %s, concurrencies %s; %s", len(prompts), version, tune["concurrencies"], mtp_line)
    adapter = make_adapter(engine, model)
    settings = []
    for variant in configs:
        # One device's share: the config's TP, one data-parallel rank.
        server_cfg = {**srv, "dp": 1, "speculative": variant.speculative}
        spec = ServerSpec.from_config(engine, model, server_port(srv["port_base"]), server_cfg, engines)
        server = ManagedServer(
            spec, engine_log, runtime_dir, startup_timeout=srv["startup_timeout_s"], log_label=engine_log_label
        )
        with server:
            with engine_failures_named(server, f"{variant.name} warm-up"):
                asyncio.run(warm_up(spec.url, adapter, prompts, sampling))
            for concurrency in tune["concurrencies"]:
                with engine_failures_named(server, f"{variant.name}, concurrency {concurrency}"):
                    figures = asyncio.run(
                        measure_setting(
                            spec.url,
                            adapter,
                            prompts,
                            sampling,
                            concurrency,
                            tune["seconds_per_setting"],
                            server.process.pid,
                            gen["request_timeout_s"],
                        )
                    )
                figures.update(
                    mtp=variant.mtp,
                    speculative=variant.speculative,
                    tokens_per_s_per_gpu=round(figures["output_tokens_per_s"] / max(1, tp), 2),
                )
                settings.append(figures)
                log.info(
                    "%s, concurrency %d: %.1f output tokens/s, p50 TTFT %s s, p50 TPOT %s ms, %d cut at the budget",
                    variant.name,
                    concurrency,
                    figures["output_tokens_per_s"],
                    (figures["ttft_s"] or {}).get("p50"),
                    (figures["tpot_ms"] or {}).get("p50"),
                    figures["cut_at_budget"],
                )
    bounds = {k: tune[k] for k in ("max_tpot_ms", "max_ttft_s", "max_memory_mb")}
    choice = choose(settings, bounds)
    result = {
        "schema": RESULT_SCHEMA,
        "key": tune_key(defining),
        "defining": defining,
        "engine": engine,
        "engine_version": version,
        "device": describe_device(gpus),
        "gpus": gpus,
        "created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "prompts": len(prompts),
        "max_new_tokens": sampling.max_new_tokens,
        "mtp": mtp_line,
        "bounds": bounds,
        "settings": settings,
        "choice": choice,
    }
    with write_atomically(out_path) as tmp:
        tmp.write_text(json.dumps(result, indent=1) + "\n")
    mtp = " with MTP" if choice["mtp"] else ""
    log.info(
        "tune chose concurrency %d%s: %.1f tokens/s per GPU (%s)",
        choice["concurrency"],
        mtp,
        choice["tokens_per_s_per_gpu"],
        choice["why"],
    )
    return result


def main(argv: list[str] | None = None) -> int:
    from dflash_pipeline.core.run_cli import add_configfile_argument, read_configfiles
    from dflash_pipeline.stages.cli import existing_file, json_object, model_dir

    parser = argparse.ArgumentParser(prog="python -m dflash_pipeline.stages.tune", description=__doc__)
    parser.add_argument("--prompts", type=existing_file, nargs="+", required=True, help="prepared shard parquets")
    parser.add_argument("--out", required=True, help="the result's JSON file")
    parser.add_argument("--model", type=model_dir, required=True, help="target model folder")
    given = parser.add_mutually_exclusive_group(required=True)
    add_configfile_argument(given, "read for its generation, tune and engines sections")
    given.add_argument(
        "--config-json", type=json_object, help="the run's config as JSON (its generation, tune and engines sections)"
    )
    parser.add_argument("--engine-log", default="tune-engine.log")
    parser.add_argument("--runtime-dir", default=".")
    args = parser.parse_args(argv)
    cfg = read_configfiles(args.configfile, parser) if args.configfile else args.config_json
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    from dflash_pipeline.core.config import ConfigError, validate_config
    from dflash_pipeline.engines.tuning import tune_defining

    try:
        config = validate_config({**cfg, "target": {**cfg.get("target", {}), "model": args.model}})
        run_job(
            args.prompts,
            args.out,
            args.model,
            config["generation"],
            config["tune"],
            tune_defining(config),
            args.engine_log,
            args.runtime_dir,
            config["engines"],
        )
    except (ConfigError, EngineError, EngineSetupError, TuneError, ReplayError) as err:
        log.error("%s", err)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
