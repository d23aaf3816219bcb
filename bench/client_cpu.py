"""Generation clients' CPU per request, without a GPU: both clients of ``generation_client.py``
(the pipeline's generate path and the bare load generator) against a canned server.

The server is a separate process that answers every request, after ``--delay-s`` (the time a
request spends decoding), with one fixed response body in the format the engine's adapter
parses: SGLang's ``/generate`` (text, ``output_ids``, ``meta_info``) or vLLM's
``/v1/completions`` with ``token_ids``; ``--max-new-tokens`` random ids of the demo tokenizer
and their text. The server's speed does not enter the clients' CPU figures (``process_time`` of
this process), so this measures the clients' own work per request on any machine; tokens/s here
is the clients' ceiling with a server that costs nothing, not an engine's speed.

    python bench/client_cpu.py --engine sglang --concurrency 1 8 64 256 --out bench/results/x.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import random
import subprocess
import sys
import tempfile
from pathlib import Path

from benchlib import emit, provenance

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from generation_client import load_generator, measure_pair, pipeline, prompts  # noqa: E402

from dflash_pipeline.demo.build_model import build_demo_model  # noqa: E402
from dflash_pipeline.engines.client import make_adapter  # noqa: E402

MODEL_NAME = "demo"


def response_body(engine: str, tokenizer, new_tokens: int) -> bytes:
    """One response of ``new_tokens`` random ids, as the engine sends it."""
    rng = random.Random(0)
    ids = [rng.randrange(0, tokenizer.vocab_size) for _ in range(new_tokens)]
    text = tokenizer.decode(ids, skip_special_tokens=False)
    if engine == "sglang":
        meta = {
            "id": "9f0c1a2b3c4d4e5f8a9b0c1d2e3f4a5b",
            "finish_reason": {"type": "length", "length": new_tokens},
            "prompt_tokens": 120,
            "weight_version": "default",
            "total_retractions": 0,
            "completion_tokens": new_tokens,
            "cached_tokens": 64,
            "e2e_latency": 0.57,
        }
        return json.dumps({"text": text, "output_ids": ids, "meta_info": meta}).encode()
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": "length", "stop_reason": None}
    choice |= {"token_ids": ids, "prompt_logprobs": None, "prompt_token_ids": None}
    usage = {"prompt_tokens": 120, "total_tokens": 120 + new_tokens, "completion_tokens": new_tokens}
    return json.dumps(
        {"id": "cmpl-0", "object": "text_completion", "model": MODEL_NAME, "choices": [choice], "usage": usage}
    ).encode()


async def serve(body: bytes, port: int, delay_s: float) -> None:
    """HTTP/1.1 with keep-alive: every request gets ``body`` after ``delay_s``."""
    head = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(body)

    async def handle(reader, writer):
        try:
            while True:
                header = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in header.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                await reader.readexactly(length)
                await asyncio.sleep(delay_s)
                writer.write(head + body)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", port, backlog=4096)
    print("ready", flush=True)
    async with server:
        await server.serve_forever()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engine", choices=("sglang", "vllm"), default="sglang")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 64, 256])
    p.add_argument("--prompts-per-slot", type=int, default=4, help="each run sends max(this x concurrency, 16)")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--delay-s", type=float, default=0.3, help="the server's time per request")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--port", type=int, default=18932)
    p.add_argument("--device", default=None, help="the machine, in words (default: the processor's name)")
    p.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    from transformers import AutoTokenizer

    from dflash_pipeline.data.chat import render_prompt

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model = build_demo_model(tmp / "demo")
        tokenizer = AutoTokenizer.from_pretrained(model)
        if args.serve:
            body = response_body(args.engine, tokenizer, args.max_new_tokens)
            asyncio.run(serve(body, args.port, args.delay_s))
            return
        server = subprocess.Popen(
            [sys.executable, __file__, "--serve", *sys.argv[1:]], stdout=subprocess.PIPE, text=True
        )
        try:
            if server.stdout.readline().strip() != "ready":
                raise SystemExit("the canned server did not start")
            url = f"http://127.0.0.1:{args.port}"
            rows = prompts(max(max(args.prompts_per_slot * c, 16) for c in args.concurrency))
            texts = [render_prompt(tokenizer, r["messages"], True) for r in rows]
            requests = [(text, tokenizer(text, add_special_tokens=False)["input_ids"]) for text in texts]
            adapter = make_adapter(args.engine, MODEL_NAME)
            # Warm-up of both paths: one-time costs of the process (imports, first part) stay out.
            asyncio.run(load_generator(url, adapter, requests[:16], 16, args.max_new_tokens))
            asyncio.run(
                pipeline(url, args.engine, MODEL_NAME, tokenizer, rows[:16], 16, args.max_new_tokens, str(tmp / "run"))
            )
            runs = []
            for concurrency in args.concurrency:
                count = max(args.prompts_per_slot * concurrency, 16)
                for _ in range(args.repeats):
                    runs.append(
                        measure_pair(url, args.engine, MODEL_NAME, adapter, tokenizer, requests[:count],
                                     rows[:count], concurrency, args.max_new_tokens, str(tmp / "run"))
                    )  # fmt: skip
                    print(json.dumps(runs[-1]), flush=True)
        finally:
            server.terminate()
            server.wait()

    def mean(client: str, c: int) -> float:
        values = [r[client]["client_cpu_ms_per_request"] for r in runs if r["concurrency"] == c]
        return round(sum(values) / len(values), 2)

    result = {
        "benchmark": "client_cpu",
        "engine_format": args.engine,
        "server": f"canned response after {args.delay_s} s (no engine)",
        "max_new_tokens": args.max_new_tokens,
        "concurrency": args.concurrency,
        "runs": runs,
        "cpu_ms_per_request": {
            str(c): {"load_generator": mean("load_generator", c), "pipeline": mean("pipeline", c)}
            for c in args.concurrency
        },
        **provenance(args.device or platform.processor() or platform.machine() or "cpu"),
    }
    emit(result, args.out)


if __name__ == "__main__":
    main()
