"""Tune's logic as plain Python: the stream accounting of both APIs, the choice within bounds,
which settings are measured (MTP only where the target has a head and the engine serves it), how
generate takes the choice and when a result is refused as measured for other settings."""

from __future__ import annotations

import json
import sys

import pytest

from dflash_pipeline.core import layout
from dflash_pipeline.core.config import validate_config
from dflash_pipeline.core.storage import open_storage
from dflash_pipeline.engines.client import CompletionsAdapter, EngineError, SglangAdapter
from dflash_pipeline.engines.replay import Timing, percentiles, read_chunk
from dflash_pipeline.engines.tuning import (
    RESULT_SCHEMA,
    TuneError,
    apply_choice,
    choose,
    has_mtp_head,
    mtp_speculative,
    read_tune_result,
    tune_defining,
    tune_key,
    tuned_choice,
    variants,
)
from dflash_pipeline.stages.tune import first_turn

TUNE = validate_config({})["tune"]


def setting(concurrency, tps, tpot_p90=10.0, ttft_p90=0.5, mtp=False, gpu=None):
    return {
        "concurrency": concurrency, "output_tokens_per_s": tps, "tokens_per_s_per_gpu": tps,
        "output_tokens": 1000, "tpot_ms": {"p50": tpot_p90 / 2, "p90": tpot_p90, "p99": tpot_p90},
        "ttft_s": {"p50": ttft_p90 / 2, "p90": ttft_p90, "p99": ttft_p90},
        "engine_memory_mb": {"rss": 1000.0, "gpu": gpu}, "mtp": mtp,
        "speculative": mtp_speculative(3) if mtp else {},
    }  # fmt: skip


def test_vllm_chunks_count_their_token_ids_and_the_usage_chunk_corrects_the_total():
    adapter, timing = CompletionsAdapter("m", strict=False, token_ids=True), Timing(sent=0.0)
    read_chunk(adapter, {"choices": [{"text": "a", "token_ids": [5]}]}, timing, 1.0)
    read_chunk(adapter, {"choices": [{"text": "bc", "token_ids": [6, 7]}]}, timing, 1.5)
    read_chunk(adapter, {"choices": [{"text": "", "token_ids": [], "finish_reason": "length"}]}, timing, 1.6)
    read_chunk(adapter, {"choices": [], "usage": {"completion_tokens": 4}}, timing, 1.7)
    assert timing.tokens == 4 and timing.finish_reason == "length"
    assert timing.ttft() == 1.0 and timing.tpot() == pytest.approx(0.7 / 3)


def test_text_chunks_count_one_token_each_until_the_usage_says_otherwise():
    adapter, timing = CompletionsAdapter("m"), Timing(sent=10.0)
    for t in (10.5, 10.6, 10.7):
        read_chunk(adapter, {"choices": [{"text": "x", "finish_reason": None}]}, timing, t)
    read_chunk(adapter, {"choices": [{"text": "", "finish_reason": "stop"}], "usage": {"completion_tokens": 3}},
               timing, 10.8)  # fmt: skip
    assert (timing.tokens, timing.finish_reason, timing.ttft()) == (3, "stop", 0.5)


def test_sglang_chunks_carry_cumulative_counts():
    adapter, timing = SglangAdapter(), Timing(sent=0.0)
    read_chunk(adapter, {"text": "a", "meta_info": {"completion_tokens": 1}}, timing, 0.2)
    read_chunk(adapter, {"text": "abc", "meta_info": {"completion_tokens": 3}}, timing, 0.4)
    read_chunk(adapter, {"text": "abcd", "meta_info": {"completion_tokens": 4, "finish_reason": {"type": "stop"}}},
               timing, 0.5)  # fmt: skip
    assert (timing.tokens, timing.finish_reason) == (4, "stop")
    assert timing.tpot() == pytest.approx(0.1)


def test_percentiles_are_nearest_rank():
    assert percentiles(list(range(1, 101))) == {"p50": 50, "p90": 90, "p99": 99}
    assert percentiles([0.002], 1000.0) == {"p50": 2.0, "p90": 2.0, "p99": 2.0}
    assert percentiles([]) is None


def test_the_choice_is_the_best_throughput_within_the_bounds():
    settings = [setting(16, 900.0, tpot_p90=20), setting(64, 2000.0, tpot_p90=45), setting(256, 2600.0, tpot_p90=90)]
    assert choose(settings, {})["concurrency"] == 256
    chosen = choose(settings, {"max_tpot_ms": 50})
    assert chosen["concurrency"] == 64 and chosen["why"] == "the best throughput within the bounds"
    assert settings[2]["out_of_bounds"] == ["p90 per-token latency 90 ms > tune.max_tpot_ms 50"]


def test_memory_bounds_read_gpu_memory_where_measured():
    settings = [setting(16, 900.0, gpu=60000.0), setting(64, 2000.0, gpu=79000.0)]
    assert choose(settings, {"max_memory_mb": 70000})["concurrency"] == 16


def test_no_setting_within_the_bounds_takes_the_lowest_latency_and_says_so():
    settings = [setting(16, 900.0, tpot_p90=60), setting(64, 2000.0, tpot_p90=80)]
    chosen = choose(settings, {"max_tpot_ms": 10})
    assert chosen["concurrency"] == 16 and chosen["why"].startswith("no setting met the bounds")


def test_mtp_wins_only_by_throughput():
    settings = [setting(64, 2000.0), setting(64, 2900.0, mtp=True)]
    chosen = choose(settings, {})
    assert chosen["mtp"] and chosen["speculative"]["algorithm"] == "NEXTN"


def write_model(tmp_path, config: dict):
    (tmp_path / "config.json").write_text(json.dumps(config))
    return str(tmp_path)


def test_mtp_is_measured_where_the_target_has_a_head_and_the_engine_serves_it(tmp_path):
    qwen36 = write_model(tmp_path, {"text_config": {"mtp_num_hidden_layers": 1}})
    assert has_mtp_head(qwen36)
    measured, line = variants("vllm", qwen36, TUNE, {})
    assert [v.mtp for v in measured] == [False, True] and line == "measured with and without MTP"
    assert measured[1].speculative == {"algorithm": "NEXTN", "num_steps": 3, "eagle_topk": 1, "num_draft_tokens": 4}
    measured, line = variants("transformers", qwen36, TUNE, {})
    assert [v.mtp for v in measured] == [False] and "transformers does not serve" in line
    measured, line = variants("sglang", qwen36, {**TUNE, "mtp": False}, {})
    assert len(measured) == 1 and "tune.mtp: false" in line
    pinned = {"algorithm": "EAGLE3", "draft_model": "d"}
    measured, line = variants("sglang", qwen36, TUNE, pinned)
    assert measured[0].speculative == pinned and "pinned" in line


def test_a_target_without_mtp_layers_is_measured_plain(tmp_path):
    model = write_model(tmp_path, {"num_hidden_layers": 4, "mtp_num_hidden_layers": 0})
    assert not has_mtp_head(model)
    assert "no MTP head" in variants("sglang", model, TUNE, {})[1]


def result_for(config: dict, concurrency=32, mtp=False) -> dict:
    return {
        "schema": RESULT_SCHEMA, "key": tune_key(tune_defining(config)), "engine": "vllm",
        "engine_version": "0.20.1", "device": "1 x NVIDIA H200", "created_utc": "2026-12-05T10:00:00Z",
        "choice": {"concurrency": concurrency, "mtp": mtp, "speculative": mtp_speculative(3) if mtp else {},
                   "tokens_per_s_per_gpu": 2345.6, "why": "the best throughput within the bounds"},
    }  # fmt: skip


def test_generate_takes_the_tuned_concurrency_per_data_parallel_rank_unless_pinned():
    config = validate_config({"generation": {"engine": "vllm", "server": {"dp": 2}}})
    tuned = tuned_choice(result_for(config), tune_key(tune_defining(config)))
    gen, line = apply_choice(config["generation"], tuned, 64)
    assert gen["concurrency"] == 64 and "measured by tune: vllm 0.20.1 at concurrency 32 on 1 x NVIDIA H200" in line
    assert "x 2 data-parallel ranks" in line
    gen, line = apply_choice({**config["generation"], "concurrency": 8}, tuned, 64)
    assert gen["concurrency"] == 8 and "pinned" in line
    gen, line = apply_choice(config["generation"], None, 48)
    assert gen["concurrency"] == 48 and "tune.untuned_concurrency" in line


def test_the_tuned_mtp_choice_sets_the_servers_speculative_settings_unless_pinned():
    config = validate_config({"generation": {"engine": "sglang"}})
    tuned = tuned_choice(result_for(config, mtp=True))
    gen, line = apply_choice(config["generation"], tuned, 64)
    assert gen["server"]["speculative"]["algorithm"] == "NEXTN" and "MTP on" in line
    assert config["generation"]["server"]["speculative"] == {}  # the caller's config is left alone
    pinned = {
        **config["generation"],
        "server": {**config["generation"]["server"], "speculative": {"algorithm": "EAGLE3"}},
    }
    assert apply_choice(pinned, tuned, 64)[0]["server"]["speculative"] == {"algorithm": "EAGLE3"}


def test_a_result_measured_for_other_settings_is_not_used(tmp_path, caplog):
    config = validate_config({"generation": {"engine": "vllm"}})
    storage = open_storage(tmp_path)
    storage.write_text(layout.TUNE_RESULT, json.dumps(result_for(config)))
    assert read_tune_result(storage, tune_key(tune_defining(config))).concurrency == 32
    changed = validate_config({"generation": {"engine": "vllm", "sampling": {"temperature": 0.6}}})
    assert read_tune_result(storage, tune_key(tune_defining(changed))) is None
    assert "measured for other settings" in caplog.text
    with pytest.raises(TuneError, match="schema"):
        tuned_choice({"choice": {}})
    assert read_tune_result(open_storage(tmp_path / "empty"), "k") is None


def test_what_defines_a_result():
    base = validate_config({})
    key = tune_key(tune_defining(base))
    for change in (
        {"generation": {"engine": "vllm"}},
        {"generation": {"max_new_tokens": 100}},
        {"generation": {"server": {"tp": 2}}},
        {"tune": {"concurrencies": [8]}},
        {"target": {"model": "elsewhere"}},
    ):
        assert tune_key(tune_defining(validate_config(change))) != key, change
    for same in ({"generation": {"part_every_samples": 7}}, {"tune": {"enabled": False, "untuned_concurrency": 3}},
                 {"generation": {"server": {"dp": 4}}}):  # fmt: skip
        assert tune_key(tune_defining(validate_config(same))) == key, same


def test_the_replayed_request_is_the_first_turn_of_a_conversation():
    messages = [
        {"role": "system", "content": "s"}, {"role": "user", "content": "q1"},
        {"role": "assistant", "content": "a1"}, {"role": "user", "content": "q2"},
    ]  # fmt: skip
    assert first_turn(messages) == [{"role": "system", "content": "s"}, {"role": "user", "content": "q1"}]


# A stand-in engine server for ManagedServer: healthy at once, then it dies, saying why in its
# log, right after answering its first health check (so the job has seen it healthy first).
DYING_ENGINE = """
import http.server, sys

class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, *args):
        pass

server = http.server.HTTPServer(("127.0.0.1", int(sys.argv[sys.argv.index("--port") + 1])), Health)
server.handle_request()
print("engine core died: CUDA error: an illegal memory access", flush=True)
sys.exit(1)
"""


def test_a_failed_replay_or_a_dead_server_names_the_setting_and_the_engine_log(tmp_path):
    """Against a real ManagedServer whose process answers its health check and then exits: the
    messages name the setting and the log label, with the server's last lines."""
    from dflash_pipeline.engines.launch import ManagedServer, ServerSpec, free_port
    from dflash_pipeline.engines.replay import ReplayError
    from dflash_pipeline.stages.tune import engine_failures_named

    engine = tmp_path / "engine"
    engine.write_text(f"#!{sys.executable}\n{DYING_ENGINE}")
    engine.chmod(0o755)
    spec = ServerSpec("vllm", "/models/target", free_port(), python=str(engine))
    label = "logs/tune/engine.log (this attempt: logs/tune/engine.attempt-1.log)"
    server = ManagedServer(spec, tmp_path / "engine.log", tmp_path / "run", startup_timeout=120, log_label=label)
    with server:
        with pytest.raises(EngineError) as failed, engine_failures_named(server, "MTP, concurrency 64"):
            raise ReplayError("every request at concurrency 64 failed")
        server.process.wait(timeout=120)  # it exits after its health check
        with pytest.raises(EngineError) as died, engine_failures_named(server, "plain, concurrency 8"):
            pass
    assert str(failed.value).startswith(
        f"vllm server failed the replay at MTP, concurrency 64 (ReplayError: every request at concurrency 64 "
        f"failed); see its log {label}. Last lines:"
    )
    assert str(died.value).startswith(f"vllm server died while measuring plain, concurrency 8; see its log {label}.")
    assert "engine core died: CUDA error" in str(died.value)
    assert "died before the job stopped it: exit code 1" in (tmp_path / "engine.log").read_text()


def test_a_server_that_exits_while_starting_fails_tune_naming_the_engine_log(demo_model, tmp_path):
    """tune's own launch of an engine whose server cannot start (an environment with vLLM's
    metadata but not vLLM: ``python -m vllm...`` exits at once): ManagedServer's startup failure,
    naming the log label with the engine's last words."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from dflash_pipeline.engines.tuning import tune_defining
    from dflash_pipeline.stages.tune import run_job
    from tests.support.engine_envs import metadata_only_env

    python = metadata_only_env(tmp_path / "vllm", "vllm", "0.24.0")
    config = validate_config({"generation": {"engine": "vllm"}, "target": {"model": str(demo_model)}})
    prompts = tmp_path / "prepare-00000.parquet"
    messages = [{"role": "user", "content": "What is 2 + 2?"}]
    pq.write_table(pa.Table.from_pylist([{"id": "p0", "messages": messages}]), prompts)
    label = "logs/tune/engine.log (this attempt: logs/tune/engine.attempt-1.log)"
    log = tmp_path / "engine.log"
    with pytest.raises(EngineError) as failed:
        run_job(
            [str(prompts)], str(tmp_path / "tune-result.json"), str(demo_model), config["generation"],
            config["tune"], tune_defining(config), str(log), str(tmp_path / "run"),
            {"vllm": {"python": str(python)}}, engine_log_label=label,
        )  # fmt: skip
    message = str(failed.value)
    assert message.startswith(f"vllm server exited with code 1 while starting; see its log {label}. Last lines:")
    assert "No module named 'vllm'" in message and "No module named 'vllm'" in log.read_text()
    assert not (tmp_path / "tune-result.json").exists()


def test_the_mtp_setting_reaches_both_engines_command_lines():
    from dflash_pipeline.engines.launch import ServerSpec, server_command

    vllm = server_command(ServerSpec("vllm", "/m", 30000, python="/v/bin/python", speculative=mtp_speculative(3)))
    config = vllm[vllm.index("--speculative-config") + 1]
    assert json.loads(config) == {"method": "mtp", "num_speculative_tokens": 3}
    sglang = server_command(ServerSpec("sglang", "/m", 30000, python="/s/bin/python", speculative=mtp_speculative(2)))
    flags = dict(zip(sglang, sglang[1:]))
    assert flags["--speculative-algorithm"] == "NEXTN" and flags["--speculative-num-steps"] == "2"
    assert flags["--speculative-num-draft-tokens"] == "3" and flags["--speculative-eagle-topk"] == "1"


def test_generate_waits_for_tune_unless_its_shards_were_generated_before_a_result(tmp_path):
    from dflash_pipeline.engines.tuning import generate_waits_for_tune

    storage = open_storage(tmp_path)
    assert generate_waits_for_tune(storage)  # a new run: tune first
    storage.write_text(layout.shard_key("generate", 0), "x")
    assert not generate_waits_for_tune(storage)  # shards from before: kept, tune runs beside
    storage.write_text(layout.TUNE_RESULT, "{}")
    assert generate_waits_for_tune(storage)


def test_tune_runs_where_the_run_launches_a_server_and_generates():
    from dflash_pipeline.core.layout import stages_built
    from dflash_pipeline.engines.tuning import tune_gpus

    def tunes(**config):
        return "tune" in stages_built(validate_config(config))

    assert tunes(tune={"enabled": True})
    assert not tunes(tune={"enabled": False})
    assert not tunes(tune={"enabled": True}, until="prepare")
    assert not tunes(tune={"enabled": True}, generation={"engine": "endpoint"})
    # One server's devices: its tensor parallelism on a GPU run, none on a CPU run.
    assert tune_gpus(validate_config({"generation": {"gpus_per_job": 4, "server": {"tp": 2}}})) == 2
    assert tune_gpus(validate_config({"generation": {"gpus_per_job": 0}})) == 0
