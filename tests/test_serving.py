"""Acceptance inside a serving engine: server commands, vLLM's /metrics counters, the request loop
against stand-in servers, the lossless comparison and the engine parity gate. CPU only: neither
vLLM nor SGLang runs here; the stand-ins play the parts of their HTTP APIs the measurement uses."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from dflash_pipeline.engines.environments import EngineInstall
from dflash_pipeline.engines.launch import ServerSpec, server_command
from dflash_pipeline.evaluation import serving
from dflash_pipeline.evaluation.lossless import failure_message
from dflash_pipeline.evaluation.metrics import aggregate, metrics_document
from dflash_pipeline.evaluation.engine_counters import (
    EngineResponseError,
    acceptance_from_counters,
    acceptance_histogram_from_counters,
    parse_vllm_metrics,
)
from dflash_pipeline.evaluation.parity import (
    DEFAULT_ENGINE_PARITY_TOLERANCE,
    EngineParityError,
    check_engine_parity,
    engine_parity_report,
    same_output_taus,
    known_engine_limitations,
)
from dflash_pipeline.evaluation.engine_requests import prompt_result
from dflash_pipeline.evaluation.serving import (
    drafter_block_size,
    drafter_fields,
    measure_in_engine,
    serving_server_spec,
    sglang_mamba_flag,
)
from tests.support.vllm_stand_in import StandInServer
from tests.support.seaweed import free_port

FIXTURES = Path(__file__).parent / "fixtures" / "serving"
MEASUREMENT = ["--seed", "0", "--no-enable-prefix-caching", "--generation-config", "vllm"]


# --- server commands ------------------------------------------------------------------------------


def test_vllm_speculative_and_plain_servers_differ_only_by_the_dflash_config():
    spec = serving_server_spec("vllm", "/m/target", "/m/drafter", 16, 8000, hybrid=True, python="/v/bin/python")
    assert server_command(spec) == [
        *["/v/bin/python", "-m", "vllm.entrypoints.openai.api_server", "--model", "/m/target"],
        *["--host", "127.0.0.1", "--port", "8000"],
        *["--tensor-parallel-size", "1", "--data-parallel-size", "1"],
        "--speculative-config",
        '{"method": "dflash", "model": "/m/drafter", "num_speculative_tokens": 15}',
        *MEASUREMENT,
    ]
    plain = serving_server_spec(
        "vllm", "/m/target", "/m/drafter", 16, 8000, hybrid=True, speculative=False, tp=2,
        mem_fraction=0.8, extra_args=["--max-model-len", "8192"], python="/v/bin/python",
    )  # fmt: skip
    assert server_command(plain) == [
        *["/v/bin/python", "-m", "vllm.entrypoints.openai.api_server", "--model", "/m/target"],
        *["--host", "127.0.0.1", "--port", "8000"],
        *["--tensor-parallel-size", "2", "--data-parallel-size", "1", "--gpu-memory-utilization", "0.8"],
        *MEASUREMENT,
        *["--max-model-len", "8192"],
    ]


def test_a_sampled_dflash2_evaluation_asks_vllm_to_sample_the_selectors_candidates(tmp_path):
    """vLLM's DFlash2 selector walks its candidates by argmax unless its speculative config says
    draft_sample_method probabilistic (vllm 0.28-0.34 config/speculative.py, default greedy);
    the loop and SGLang sample from the selector's softmax at temperature > 0. Greedy runs and
    DFlash drafters keep vLLM's default."""
    import json as _json

    drafter = tmp_path / "drafter"
    drafter.mkdir()
    (drafter / "config.json").write_text(_json.dumps({"architectures": ["DFlash2DraftModel"]}))

    def vllm_config(temperature, engine="vllm"):
        spec = serving_server_spec(
            engine, "/t", str(drafter), 8, 1, hybrid=False, temperature=temperature, python="/e/bin/python"
        )
        command = server_command(spec)
        if engine != "vllm":
            return command
        return _json.loads(command[command.index("--speculative-config") + 1])

    assert vllm_config(0.7)["draft_sample_method"] == "probabilistic"
    assert "draft_sample_method" not in vllm_config(0.0)
    assert "draft_sample_method" not in " ".join(vllm_config(0.7, "sglang"))
    (drafter / "config.json").write_text(_json.dumps({"architectures": ["DFlashDraftModel"]}))
    assert "draft_sample_method" not in vllm_config(0.7)


def test_sglang_speculative_and_plain_servers():
    launch = ["/s/bin/python", "-m", "sglang.launch_server", "--model-path", "/m/target"]
    spec = serving_server_spec(
        "sglang", "/m/target", "/m/drafter", 16, 30000, hybrid=True, tp=2, python="/s/bin/python"
    )
    assert server_command(spec) == [
        *launch,
        *["--host", "127.0.0.1", "--port", "30000", "--tp-size", "2", "--dp-size", "1"],
        *["--speculative-algorithm", "DFLASH", "--speculative-num-draft-tokens", "16"],
        *["--speculative-draft-model-path", "/m/drafter", "--speculative-dflash-block-size", "16"],
        *["--mamba-radix-cache-strategy", "extra_buffer"],
    ]
    plain = serving_server_spec(
        "sglang", "/m/target", "/m/drafter", 16, 30000, hybrid=True, speculative=False,
        python="/s/bin/python",
    )  # fmt: skip
    assert server_command(plain) == [
        *launch,
        *["--host", "127.0.0.1", "--port", "30000", "--tp-size", "1", "--dp-size", "1"],
    ]
    with pytest.raises(ValueError, match="unknown serving engine 'trt'"):
        serving_server_spec("trt", "/t", "/d", 16, 1, hybrid=False)


def test_generation_with_a_dflash_drafter_in_vllm_drafts_block_size_minus_one_tokens():
    dflash = {"algorithm": "DFLASH", "draft_model": "/d", "num_draft_tokens": 8}
    cmd = server_command(ServerSpec(engine="vllm", model="/m", port=1, speculative=dflash, python="python3"))
    assert json.loads(cmd[cmd.index("--speculative-config") + 1]) == {
        "method": "dflash",
        "model": "/d",
        "num_speculative_tokens": 7,
    }
    eagle = {"algorithm": "EAGLE3", "num_steps": 3, "num_draft_tokens": 4, "draft_model": "/e"}
    cmd = server_command(ServerSpec(engine="vllm", model="/m", port=1, speculative=eagle, python="python3"))
    spec_json = json.loads(cmd[cmd.index("--speculative-config") + 1])
    assert spec_json["num_speculative_tokens"] == 3  # chain drafters: num_steps, as before


# --- vLLM's counters ------------------------------------------------------------------------------


def fixture_counters():
    before = parse_vllm_metrics((FIXTURES / "vllm-metrics-before.txt").read_text())
    after = parse_vllm_metrics((FIXTURES / "vllm-metrics-after.txt").read_text())
    return before, after


def test_vllm_metrics_fixture_gives_the_requests_counters():
    """A real capture: vLLM 0.20.1 on an H200 serving the demo target with its exported drafter
    (block 8), /metrics read before and after the first held-out prompt (see the README here)."""
    before, after = fixture_counters()
    assert (before.drafts, before.draft_tokens, before.accepted) == (0, 0, 0)
    assert sorted(after.accepted_per_pos) == list(range(7))
    steps, accepted, draft_tokens, hist = acceptance_histogram_from_counters(before, after, 8)
    assert (steps, accepted, draft_tokens) == (13, 31, 91)
    # accepted per position 10, 7, 6, 3, 2, 2, 1 -> steps with A = 0..7
    assert hist == [3, 3, 1, 3, 1, 0, 1, 1]
    reply = {"choices": [{"text": "", "token_ids": list(range(45)), "finish_reason": "stop"}]}
    record = prompt_result("demo-0000", "heldout", 40, acceptance_from_counters(reply, before, after, 8), 8)
    # the loop measured 3.3846 on the same prompt (bench/results/serving_parity-full-h200.json)
    assert record.verify_steps == 13 and record.committed_tokens == 44 and round(record.tau, 4) == 3.3846
    assert record.generated_tokens == 45 and record.finish_reason == "stop"
    assert record.as_dict()["draft_tokens"] == 91
    assert aggregate([record])["per_position"][:3] == [round(10 / 13, 4), round(7 / 13, 4), round(6 / 13, 4)]


def test_vllm_counters_are_summed_over_engines():
    per_pos = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
    text = "\n".join(
        [
            "# TYPE vllm:spec_decode_num_drafts_total counter",
            'vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 3.0',
            'vllm:spec_decode_num_drafts_total{engine="1",model_name="m"} 4.0',
            "# TYPE vllm:spec_decode_num_draft_tokens_total counter",
            'vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 9.0',
            'vllm:spec_decode_num_draft_tokens_total{engine="1",model_name="m"} 12.0',
            "# TYPE vllm:spec_decode_num_accepted_tokens_total counter",
            'vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 2.0',
            'vllm:spec_decode_num_accepted_tokens_total{engine="1",model_name="m"} 5.0',
            "# TYPE vllm:spec_decode_num_accepted_tokens_per_pos_total counter",
            f'{per_pos}{{engine="0",model_name="m",position="0"}} 2.0',
            f'{per_pos}{{engine="1",model_name="m",position="0"}} 3.0',
            f'{per_pos}{{engine="1",model_name="m",position="1"}} 2.0',
            "",
        ]
    )
    counters = parse_vllm_metrics(text)
    assert (counters.drafts, counters.draft_tokens, counters.accepted) == (7, 21, 7)
    assert counters.accepted_per_pos == {0: 5.0, 1: 2.0}


def test_vllm_pages_without_usable_counters_are_refused():
    plain_page = "".join(
        line + "\n"
        for line in (FIXTURES / "vllm-metrics-before.txt").read_text().splitlines()
        if "spec_decode" not in line
    )
    with pytest.raises(EngineResponseError, match="without speculative decoding"):
        parse_vllm_metrics(plain_page, "plain /metrics")
    before, after = fixture_counters()
    with pytest.raises(EngineResponseError, match="prompt q: drafts changed by -13.0, not a count"):
        acceptance_histogram_from_counters(after, before, 8, "prompt q")
    with pytest.raises(EngineResponseError, match=r"positions \[0, .*6\], expected at most 0..2"):
        acceptance_histogram_from_counters(before, after, 4, "prompt q")
    with pytest.raises(EngineResponseError, match="no choices\\[0\\].token_ids"):
        acceptance_from_counters({"choices": [{"text": "x"}]}, before, after, 8, "prompt q")


# --- the request loop against stand-in servers ----------------------------------------------------


def steps_for(prompt_ids):
    """The stand-ins' verify steps for a prompt: A derived from the prompt ids (block size 4)."""
    return [p % 4 for p in prompt_ids]


# Where the plain server decodes differently from the speculative one, by a prompt's first id:
# (generated token index, the target's logit margin there). Prompt p2 diverges at a near tie
# (rounding in bf16, a lost token in fp32); a prompt starting with 11 at a clear choice.
DIVERGENCES = {9: (5, 0.1), 11: (3, 2.0)}
MARGIN = 3.0  # the target's margin everywhere else


def tokens_for(prompt_ids, plain: bool):
    tokens = [(sum(prompt_ids) + i) % 1000 for i in range(1 + sum(a + 1 for a in steps_for(prompt_ids)))]
    if plain and prompt_ids[0] in DIVERGENCES:
        tokens[DIVERGENCES[prompt_ids[0]][0]] += 1
    return tokens


def margins_for(prompt_ids, count: int) -> list[float]:
    margins = [MARGIN] * count
    if prompt_ids[0] in DIVERGENCES:
        index, margin = DIVERGENCES[prompt_ids[0]]
        margins[index] = margin
    return margins


def top_logprobs(engine: str, tokens: list[int], margins: list[float]):
    """The plain server's top-2 logprobs per generated token, in each engine's reply shape: vLLM
    {"token_id:<id>": logprob} (return_tokens_as_token_ids), SGLang [logprob, id, text]."""
    pairs = [((t, -0.01), (t + 1, -0.01 - m)) for t, m in zip(tokens, margins)]
    if engine == "vllm":
        return [{f"token_id:{t}": lp for t, lp in pair} for pair in pairs]
    return [[[lp, t, None] for t, lp in pair] for pair in pairs]


# Versions that serve the stand-ins' mixed sliding/full drafter (dflash_pipeline.engines.limits).
STAND_IN_VERSIONS = {"vllm": "0.26.0", "sglang": "0.5.17"}


class StandInEngine(BaseHTTPRequestHandler):
    """vLLM's /v1/completions, /metrics and /version, or SGLang's /generate and
    /get_server_info, speculative or plain, as far as the measurement uses them."""

    engine = "vllm"
    speculative = True
    metrics: StandInServer
    requests: list[dict] = []

    def reply(self, status, body, content_type="application/json"):
        data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        if self.path == "/metrics" and self.engine == "vllm":
            self.reply(200, self.metrics.text(), "text/plain; version=0.0.4")
        elif self.path == "/version" and self.engine == "vllm":
            self.reply(200, {"version": STAND_IN_VERSIONS["vllm"]})
        elif self.path == "/get_server_info" and self.engine == "sglang":
            self.reply(200, {"version": STAND_IN_VERSIONS["sglang"], "tp_size": 1})
        else:
            self.reply(404, {"error": self.path})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        StandInEngine.requests.append({"path": self.path, "speculative": self.speculative, **body})
        ids = body["prompt"] if self.engine == "vllm" else body["input_ids"]
        tokens = tokens_for(ids, plain=not self.speculative)
        steps = steps_for(ids)
        if self.engine == "vllm":
            if self.speculative:
                self.metrics.observe_request(len(ids), steps)
            choice = {"index": 0, "text": "", "finish_reason": "length", "token_ids": tokens}
            if body.get("logprobs"):
                top = top_logprobs("vllm", tokens, margins_for(ids, len(tokens)))
                choice["logprobs"] = {"top_logprobs": top, "token_logprobs": [-0.01] * len(tokens)}
            self.reply(200, {"choices": [choice], "usage": {"completion_tokens": len(tokens)}})
            return
        meta = {"completion_tokens": len(tokens), "finish_reason": {"type": "length"}}
        if body.get("return_logprob"):
            meta["output_top_logprobs"] = top_logprobs("sglang", tokens, margins_for(ids, len(tokens)))
        if self.speculative:
            meta["spec_verify_ct"] = len(steps)
            meta["spec_correct_drafts_histogram"] = [steps.count(a) for a in range(4)]
        self.reply(200, {"text": "", "output_ids": tokens, "meta_info": meta})

    def log_message(self, *args):
        pass


class StandInManagedServer:
    """ManagedServer's interface, serving a stand-in engine in a thread instead of a process."""

    launched: list[list[str]] = []

    def __init__(self, spec, log_path, run_dir, startup_timeout=1800):
        self.spec = spec

    def __enter__(self):
        StandInManagedServer.launched.append(server_command(self.spec))
        handler = type(
            "Handler",
            (StandInEngine,),
            {
                "engine": self.spec.engine,
                "speculative": bool(self.spec.speculative_settings()),
                "metrics": StandInServer(num_speculative_tokens=3),  # block size 4
            },
        )
        self.http = ThreadingHTTPServer((self.spec.host, self.spec.port), handler)
        threading.Thread(target=self.http.serve_forever, daemon=True).start()
        return self

    def alive(self):
        return True

    def __exit__(self, *exc):
        self.http.shutdown()
        self.http.server_close()


@pytest.fixture
def stand_in_servers(monkeypatch):
    monkeypatch.setattr(serving, "ManagedServer", StandInManagedServer)
    StandInManagedServer.launched = []
    StandInEngine.requests = []
    return StandInManagedServer


def exported_drafter(folder: Path) -> Path:
    folder.mkdir()
    config = {
        "architectures": ["DFlashDraftModel"],
        "block_size": 4,
        "num_hidden_layers": 2,
        "head_dim": 16,
        "rope_theta": 1000000.0,
        "layer_types": ["sliding_attention", "full_attention"],
        "sliding_window": 2048,
        "dflash_config": {"mask_token_id": 151669, "target_layer_ids": [1, 9], "block_size": 4},
    }
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def stand_in_install(engine: str) -> EngineInstall:
    """The environment a stand-in server is said to run from (its command line names it)."""
    return EngineInstall(engine, f"/envs/{engine}/bin/python", engine, STAND_IN_VERSIONS[engine])


PROMPTS = [("p1", "math", [5, 6, 7, 8]), ("p2", "chat", [9, 10]), ("p3", "chat", [3, 3, 1])]


def measure_greedy(engine: str, folder: Path, prompts=PROMPTS, **options):
    """A greedy measurement of the stand-ins' drafter (exported once into ``folder``) in ``engine``."""
    drafter = folder / "drafter"
    if not drafter.exists():
        exported_drafter(drafter)
    runs = len(list(folder.glob("run*")))
    return measure_in_engine(
        engine, "/m/target", drafter, prompts, 4, max_new_tokens=64, temperature=0.0,
        log_dir=folder / f"run{runs}", port=free_port(), hybrid=False, install=stand_in_install(engine),
        **options,
    )  # fmt: skip


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_measurement_in_an_engine_end_to_end(tmp_path, stand_in_servers, engine):
    measurement = measure_greedy(engine, tmp_path, seed=7)
    speculative, plain = stand_in_servers.launched
    assert "dflash" in " ".join(speculative).lower() and "speculative" not in " ".join(plain)
    assert measurement.engine == engine
    assert measurement.engine_version == {"vllm": "0.26.0", "sglang": "0.5.17"}[engine]
    assert measurement.drafter_fields["dflash_config.mask_token_id"] == 151669
    assert measurement.drafter_fields["layer_types"] == ["sliding_attention", "full_attention"]
    assert measurement.drafter_fields["dflash_config.use_swa"] is None

    by_id = {r.id: r for r in measurement.results}
    # p1: A = 1, 2, 3, 0 -> 4 verify steps committing 2 + 3 + 4 + 1 = 10 tokens, 11 generated
    assert by_id["p1"].verify_steps == 4 and by_id["p1"].accept_hist == [1, 1, 1, 1]
    assert by_id["p1"].generated_tokens == 11 and by_id["p1"].prompt_set == "math"
    # Both counted as the loop counts: A + 1 per verify step (not SGLang's completion_tokens, 11)
    assert by_id["p1"].committed_tokens == 10
    assert measurement.outputs["p1"] == tokens_for([5, 6, 7, 8], plain=False)
    assert measurement.plain_outputs["p2"] == tokens_for([9, 10], plain=True)

    lossless = measurement.lossless
    assert lossless["checked"] and not lossless["passed"] and lossless["exact"] == 2
    assert set(lossless["failures"]) == {"p2"}
    message = failure_message(lossless)
    assert "prompt p2: first divergence at generated token 5" in message and "target margin 0.1" in message
    # No dtype given: the engine's own default is not known, so no tolerance (as in fp32).
    assert by_id["p2"].as_dict()["lossless"]["verdict"] == "lost"
    assert by_id["p1"].as_dict()["lossless"]["verdict"] == "exact"

    sent = StandInEngine.requests
    assert [r["speculative"] for r in sent] == [True] * 3 + [False] * 3
    # Only the plain reference is asked for its top-2 logprobs (the target's margins).
    margin_keys = {"vllm": "logprobs", "sglang": "top_logprobs_num"}[engine]
    assert [r.get(margin_keys) for r in sent] == [None] * 3 + [2] * 3
    if engine == "vllm":
        assert [r["prompt"] for r in sent[:3]] == [p[2] for p in PROMPTS]  # ids, in order
        assert all(r["path"] == "/v1/completions" and r["return_token_ids"] for r in sent)
        assert sent[0]["model"] == "/m/target" and sent[0]["temperature"] == 0.0
        assert [r["seed"] for r in sent[:3]] == [7, 8, 9]  # one seed per prompt, as the loop
    else:
        assert [r["input_ids"] for r in sent[:3]] == [p[2] for p in PROMPTS]
    document = metrics_document(measurement.results, measurement.settings(), lossless=measurement.lossless)
    assert document["overall"]["speedup_estimate"] is not None
    json.dumps(document)


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_engine_lossless_tells_a_near_tie_from_a_lost_token_by_the_targets_margin(tmp_path, stand_in_servers, engine):
    """In bf16 a divergence where the plain server's top-2 logprobs are within the dtype's
    tolerance (0.25) is a near tie and passes; one at a clear choice (margin 2.0) is lost and
    fails the check, named with its margin."""
    measurement = measure_greedy(engine, tmp_path, [*PROMPTS, ("p4", "chat", [11, 2])], dtype="bfloat16")
    lossless = measurement.lossless
    assert (lossless["exact"], lossless["near_tie"], lossless["lost"]) == (2, 1, 1)
    assert lossless["margin_tolerance"] == 0.25 and not lossless["passed"]
    assert lossless["near_ties"]["p2"]["margin"] == pytest.approx(0.1)
    assert set(lossless["failures"]) == {"p4"}
    assert lossless["failures"]["p4"]["margin"] == pytest.approx(2.0)
    assert "prompt p4: first divergence at generated token 3" in failure_message(lossless)
    verdicts = {r.id: r.as_dict()["lossless"]["verdict"] for r in measurement.results}
    assert verdicts == {"p1": "exact", "p2": "near_tie", "p3": "exact", "p4": "lost"}
    # Without the clear divergence the check passes in bf16; a set tolerance of 0 fails the tie.
    kept = measure_greedy(engine, tmp_path, dtype="bfloat16")
    assert kept.lossless["passed"] and kept.lossless["near_tie"] == 1
    strict = measure_greedy(engine, tmp_path, dtype="bfloat16", margin_tolerance=0.0)
    assert not strict.lossless["passed"] and set(strict.lossless["failures"]) == {"p2"}


def test_margins_from_a_real_vllm_reply():
    """A reply of vLLM's CPU build 0.32.0 to the plain reference's request (``logprobs: 2``,
    ``return_tokens_as_token_ids``), captured with the demo target: one {"token_id:<id>": logprob}
    dict per generated token, the greedy token first."""
    from dflash_pipeline.evaluation.engine_requests import top2_margins

    reply = json.loads((FIXTURES / "vllm-0.32.0-cpu-completion-top2-logprobs.json").read_text())
    margins = top2_margins("vllm", reply, "captured reply")
    assert len(margins) == len(reply["choices"][0]["token_ids"]) == 4
    assert margins[0] == pytest.approx(-1.627656102180481 + 1.9205514192581177)
    assert margins[2] == pytest.approx(0.0287485, abs=1e-6)  # a near tie of the demo target


def test_a_reply_without_top_logprobs_gives_unknown_margins_or_a_named_error():
    from dflash_pipeline.evaluation.engine_counters import EngineResponseError
    from dflash_pipeline.evaluation.engine_requests import top2_margins

    sglang = {"output_ids": [1, 2], "meta_info": {"output_top_logprobs": [[[-0.1, 1, None]], None]}}
    assert top2_margins("sglang", sglang) == [None, None]  # one value, or none: no margin
    vllm = {"choices": [{"token_ids": [1], "logprobs": {"top_logprobs": [{"a": -0.5, "b": float("-inf")}]}}]}
    assert top2_margins("vllm", vllm) == [None]
    with pytest.raises(EngineResponseError, match="prompt p9: the sglang reply has no top logprobs"):
        top2_margins("sglang", {"output_ids": [1], "meta_info": {}}, "prompt p9")


def test_sampled_measurement_launches_no_plain_server(tmp_path, stand_in_servers):
    drafter = exported_drafter(tmp_path / "drafter")
    measurement = measure_in_engine(
        "vllm",
        "/m/target",
        drafter,
        PROMPTS[:1],
        4,
        max_new_tokens=8,
        temperature=0.7,
        install=stand_in_install("vllm"),
        log_dir=tmp_path / "run",
        port=free_port(),
        hybrid=False,
    )
    assert len(stand_in_servers.launched) == 1 and measurement.plain_outputs == {}
    assert not measurement.lossless["checked"] and "temperature" in measurement.lossless["reason"]
    assert measurement.results[0].tau == pytest.approx(10 / 4)


def test_drafter_fields_name_what_is_missing(tmp_path):
    drafter = exported_drafter(tmp_path / "drafter")
    fields = drafter_fields(drafter)
    assert fields["dflash_config.target_layer_ids"] == [1, 9]
    assert fields["rope_theta"] == 1e6 and fields["rope_parameters"] is None
    assert drafter_block_size(drafter) == 4
    with pytest.raises(FileNotFoundError, match="no config.json"):
        drafter_fields(tmp_path)


# --- the engine parity gate -----------------------------------------------------------------------

FIELDS = {
    "dflash_config.mask_token_id": 151669,
    "dflash_config.target_layer_ids": [1, 9, 17, 25, 33],
    "layer_types": None,
    "rope_theta": 1000000.0,
}


def report(loop_tau, engine_tau, tolerance=DEFAULT_ENGINE_PARITY_TOLERANCE):
    return engine_parity_report(
        loop_tau,
        engine_tau,
        tolerance,
        engine="vllm",
        engine_version="0.20.1",
        drafter_fields=FIELDS,
    )


def test_engine_parity_passes_within_tolerance():
    passed = check_engine_parity(report(4.0, 3.9))
    assert passed["passed"] and passed["gap"] == -0.025 and passed["tolerance"] == 0.05
    assert passed["engine"] == "vllm" and passed["engine_version"] == "0.20.1"
    assert passed["drafter_fields"] == FIELDS
    json.dumps(passed)


def test_a_mis_exported_drafter_fails_engine_parity_naming_numbers_engine_and_fields():
    failed = report(3.60, 3.09)  # recorded: the loop at 3.60, the engine at 3.09
    assert not failed["passed"] and failed["gap"] == pytest.approx(-0.1417)
    with pytest.raises(EngineParityError) as error:
        check_engine_parity(failed)
    text = str(error.value)
    assert "vllm 0.20.1 measured tau 3.090, 14.2% below the project loop's tau 3.600" in text
    assert "gap -0.1417, tolerance 5%" in text
    assert "dflash_config.mask_token_id: 151669" in text
    assert "dflash_config.target_layer_ids: [1, 9, 17, 25, 33]" in text
    assert "layer_types: null" in text
    for cause in ("target layer ids", "sliding-window", "mask token id", "RoPE", "dtype"):
        assert cause in text


def test_engine_parity_boundary_is_inclusive():
    assert report(4.0, 3.8)["passed"] and report(4.0, 4.2)["passed"]  # gaps of exactly 5%
    assert not report(4.0, 3.79)["passed"] and not report(4.0, 4.21)["passed"]
    with pytest.raises(EngineParityError, match="above the project loop's tau"):
        check_engine_parity(report(4.0, 4.21))
    with pytest.raises(ValueError, match="loop tau must be positive"):
        report(0.0, 3.0)


RESULTS = Path(__file__).resolve().parent.parent / "bench" / "results"


@pytest.mark.parametrize(
    "record, passes",
    [
        ("serving_parity-full-h200.json", True),
        ("serving_parity-misexported-h200.json", False),
        ("serving_parity-swa-h200.json", False),
    ],
)
def test_the_gate_decides_the_recorded_h200_runs(record, passes):
    """The numbers vLLM 0.20.1 and the loop gave on the same 16 held-out demo prompts: the
    export with capture indices is within 5%; the same drafter without them (vLLM then taps one
    layer early) fails, naming both taus, the engine and the fields it read; a drafter with two
    sliding-window layers fails too (vLLM 0.20.1 runs them as full attention), and the message
    names that limitation first."""
    run = json.loads((RESULTS / record).read_text())
    parity = engine_parity_report(
        run["loop_tau"],
        run["engine_tau"],
        DEFAULT_ENGINE_PARITY_TOLERANCE,
        engine=run["engine"],
        engine_version=run["engine_version"],
        drafter_fields=run["drafter_fields"],
    )
    recorded = {key: value for key, value in parity.items() if key != "known_limitations"}
    assert recorded == run["engine_parity"]  # what the evaluate rule wrote there
    assert parity["passed"] is passes and run["engine_lossless"]["passed"]
    if passes:
        check_engine_parity(parity)
        return
    with pytest.raises(EngineParityError) as error:
        check_engine_parity(parity)
    text = str(error.value)
    if record == "serving_parity-swa-h200.json":
        assert "vllm 0.20.1 measured tau 1.629, 64.9% below the project loop's tau 4.640" in text
        # [sliding, sliding, full]: both the sliding layers and the mix are beyond vLLM 0.20.1.
        assert len([line for line in parity["known_limitations"] if "cannot serve" in line]) == 1
        assert text.index("Known limitation") < text.index("Usual causes")
        assert "vllm 0.20.1 cannot serve this dflash drafter with layers [sliding, sliding, full]" in text
        assert "It is served by vllm >= 0.26 (GPU build)" in text
        return
    assert "vllm 0.20.1 measured tau 3.661, 8.7% below the project loop's tau 4.010" in text
    assert "dflash_config.target_layer_ids: [1, 5]" in text
    assert parity["known_limitations"] == []


SLIDING_FIELDS = {"layer_types": ["sliding_attention", "sliding_attention"], "sliding_window": 64}
MIXED_FIELDS = {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 64}


@pytest.mark.parametrize(
    "engine, version, fields, build, expected",
    [
        ("vllm", "0.20.1", SLIDING_FIELDS, "gpu", ["sliding-window drafter layers"]),
        ("vllm", "0.25.1", SLIDING_FIELDS, "gpu", []),
        ("vllm", "0.25.1", MIXED_FIELDS, "gpu", ["mixing sliding-window and full-attention"]),
        ("vllm", "0.26.0", MIXED_FIELDS, "gpu", []),
        ("vllm", "0.32.0", MIXED_FIELDS, "cpu", ["mixing sliding-window and full-attention"]),
        ("vllm", None, SLIDING_FIELDS, "gpu", []),  # unknown: the server's version decides
        ("vllm", "not-a-version", SLIDING_FIELDS, "gpu", []),
        ("sglang", "0.5.13", SLIDING_FIELDS, "gpu", ["sliding-window drafter layers"]),
        ("sglang", "0.5.17", MIXED_FIELDS, "gpu", []),
        ("vllm", "0.20.1", {"layer_types": ["full_attention"] * 2, "sliding_window": None}, "gpu", []),
        ("vllm", "0.20.1", {"layer_types": None}, "gpu", []),
    ],
)
def test_known_engine_limitations_come_from_the_engine_limits_table(engine, version, fields, build, expected):
    found = [line for line in known_engine_limitations(engine, version, fields, build) if "cannot serve" in line]
    assert len(found) == len(expected)
    for line, words in zip(found, expected):
        assert words in line and "[source: " in line


def test_sglang_gets_the_mamba_flag_its_version_knows():
    # Renamed in 0.5.14; the old name removed in 0.5.20 (tests/test_sglang_args.py parses both).
    assert sglang_mamba_flag("0.5.11") == "--mamba-scheduler-strategy"
    assert sglang_mamba_flag("0.5.17") == sglang_mamba_flag("0.5.23") == "--mamba-radix-cache-strategy"
    assert sglang_mamba_flag(None) == "--mamba-radix-cache-strategy"
    old = serving_server_spec("sglang", "/t", "/d", 8, 1, hybrid=True, python="p", engine_version="0.5.12")
    assert "--mamba-scheduler-strategy" in old.extra_args


def rows(*prompts: tuple[str, str, int, int]) -> list[dict]:
    """Per-prompt rows as the metrics JSON has them: (id, trajectory, committed, steps)."""
    return [{"id": i, "trajectory": t, "committed_tokens": c, "verify_steps": s} for i, t, c, s in prompts]


def test_trajectory_digest_ends_at_the_first_stop_token_whether_or_not_it_is_returned():
    from dflash_pipeline.evaluation.metrics import trajectory_digest

    stop = {2, 7}
    assert trajectory_digest([5, 6, 2], stop) == trajectory_digest([5, 6], stop)  # stop returned or not
    assert trajectory_digest([5, 6, 7, 9, 9], stop) == trajectory_digest([5, 6], stop)
    assert trajectory_digest([5, 6], stop) != trajectory_digest([5, 8], stop)
    assert trajectory_digest([5, 6], stop) != trajectory_digest([5, 6, 8], stop)
    assert trajectory_digest([56], stop) != trajectory_digest([5, 6], stop)


def test_same_output_taus_count_only_prompts_whose_engine_text_is_the_loops():
    loop = rows(("a", "x1", 40, 10), ("b", "x2", 30, 10), ("c", "x3", 50, 10), ("d", None, 10, 5))
    engine = rows(("a", "x1", 38, 10), ("b", "y2", 20, 10), ("c", "x3", 45, 10), ("d", None, 10, 5))
    same = same_output_taus(loop, engine)
    # d: a run without digests never counts as the same output
    assert same == {"prompts": 2, "of": 4, "loop_tau": 4.5, "engine_tau": 4.15, "differing_ids": ["b", "d"]}
    assert same_output_taus(loop, [])["prompts"] == 0 and same_output_taus(loop, [])["loop_tau"] is None


def test_a_gap_from_a_text_that_went_another_way_is_judged_on_the_prompts_with_the_same_output():
    """Seven prompts decode the same in both; on the eighth the engine's text left the loop's at a
    near tie and its drafts were accepted less: over all prompts the engine is 6.3% below, on the
    same texts 1% below. The gate judges the same texts and reports both."""
    loop = rows(*[(f"p{i}", f"t{i}", 50, 10) for i in range(7)], ("p7", "t7", 70, 10))
    engine = rows(*[(f"p{i}", f"t{i}", 49.5, 10) for i in range(7)], ("p7", "other", 47, 10))
    loop_tau = sum(r["committed_tokens"] for r in loop) / 80
    engine_tau = sum(r["committed_tokens"] for r in engine) / 80
    parity = engine_parity_report(
        loop_tau, engine_tau, engine="sglang", engine_version="0.5.17", drafter_fields=FIELDS,
        same_output=same_output_taus(loop, engine),
    )  # fmt: skip
    assert parity["gap"] == pytest.approx(-0.063, abs=1e-3) and not parity["gap"] >= -0.05
    assert parity["same_output"]["gap"] == pytest.approx(-0.01) and parity["same_output"]["differing_ids"] == ["p7"]
    assert parity["passed"] and parity["judged_on"] == "the 7 of 8 prompts with the same output"
    check_engine_parity(parity)


def test_a_broken_export_fails_on_the_same_texts_and_the_message_gives_both_gaps():
    """A drafter the engine reads wrongly changes no text (the engine verifies every draft), so
    its gap shows on the prompts with the same output; fewer than half the same: all prompts."""
    loop = rows(*[(f"p{i}", f"t{i}", 45, 10) for i in range(8)])
    engine = rows(*[(f"p{i}", f"t{i}", 30, 10) for i in range(8)])
    parity = engine_parity_report(
        4.5, 3.0, engine="sglang", engine_version="0.5.17", drafter_fields=FIELDS,
        same_output=same_output_taus(loop, engine),
    )  # fmt: skip
    assert not parity["passed"] and parity["judged_on"] == "the 8 of 8 prompts with the same output"
    with pytest.raises(EngineParityError) as error:
        check_engine_parity(parity)
    text = str(error.value)
    assert "sglang 0.5.17 measured tau 3.000, 33.3% below the project loop's tau 4.500" in text
    assert "on the 8 of 8 prompts with the same output (all prompts: 3.000 against 4.500" in text

    mostly_other = rows(*[(f"p{i}", f"t{i}" if i < 3 else "other", 45, 10) for i in range(8)])
    parity = engine_parity_report(
        4.5, 4.1, engine="sglang", engine_version="0.5.17", drafter_fields=FIELDS,
        same_output=same_output_taus(loop, mostly_other),
    )  # fmt: skip
    assert parity["judged_on"] == "all prompts" and not parity["passed"] and "gap" not in parity["same_output"]
    with pytest.raises(EngineParityError, match=r"4\.100, 8\.9% below .* on all prompts\.\n"):
        check_engine_parity(parity)
