"""Generation client overhead: the pipeline's generate path against a minimal load generator.

Both send the same requests to the same server (`transformers serve`, or vLLM / SGLang with
``--engine vllm|sglang``, each from its environment with ``--engine-python``) at the same
concurrency: the load generator posts the body the pipeline's adapter builds for that engine
(same endpoint, same fields), prompts rendered and tokenized before its clock starts; the pipeline
adds chat rendering, tokenization, reasoning splitting, progress parts and telemetry. Design
target: pipeline tokens/s >= 0.97 x the load generator's. Several ``--concurrency`` values are
measured one after another against one server (``--prompts-per-slot`` sizes each run).

The model has a realistic layer shape (random weights; hidden/layers/heads configurable) with
the demo tokenizer, so every request runs to `--max-new-tokens` (random weights never stop).

    python bench/generation_client.py --out bench/results/generation_client.json
    python bench/generation_client.py --engine vllm --hidden 4096 --layers 36 --heads 32 \
        --intermediate 12288 --prompts 1024 --concurrency 256 --max-new-tokens 512
    python bench/generation_client.py --engine sglang --engine-python ENV/bin/python --hidden 4096 \
        --layers 36 --heads 32 --intermediate 12288 --prompts 1024 --concurrency 64   (and 256)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchlib import emit, provenance

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from dflash_pipeline.demo.build_model import build_demo_model  # noqa: E402
from dflash_pipeline.demo.task import prompt_messages, sample_problem  # noqa: E402
from dflash_pipeline.engines.client import EngineClient, HttpPools, Sampling, make_adapter  # noqa: E402
from dflash_pipeline.engines.environments import installed_engine  # noqa: E402
from dflash_pipeline.engines.launch import ManagedServer, ServerSpec  # noqa: E402
from dflash_pipeline.engines.regenerate import GenerationSettings, ShardGenerator, generate_shard  # noqa: E402
from dflash_pipeline.core.jobstate import ShardProgress  # noqa: E402
from dflash_pipeline.core.storage import open_storage  # noqa: E402


def make_model(out: Path, demo: Path | None, hidden: int, layers: int, heads: int, kv_heads: int, inter: int) -> Path:
    import torch
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    demo = demo or build_demo_model(out / "demo")
    tokenizer = AutoTokenizer.from_pretrained(demo)
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=128,
        intermediate_size=inter,
        max_position_embeddings=4096,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        torch_dtype="bfloat16",
    )
    torch.manual_seed(0)
    # An 8B-shaped model initialises in seconds on a GPU and in minutes on CPU.
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):
        model = Qwen3ForCausalLM(config).to(torch.bfloat16)
    # Make end-of-turn unlikely so every request generates its full length.
    with torch.no_grad():
        model.lm_head.weight[tokenizer.eos_token_id].zero_()
    path = out / "model"
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    del model
    if device == "cuda":
        torch.cuda.empty_cache()  # the server needs the memory
    return path


def prompts(n: int) -> list[dict]:
    rng = random.Random(0)
    return [
        {
            "id": f"b{i}",
            "shard": 0,
            "split": "train",
            "messages": [dict(m) for m in prompt_messages(sample_problem(rng))],
        }
        for i in range(n)
    ]


class LoopLag:
    """How late the client's event loop runs a timer due every 20 ms, measured beside the
    requests: a blocking step in the client (a part written, a tokenizer call, telemetry) delays
    every request's next send and read by as much, which at high concurrency costs throughput
    where the client's total CPU time would not show it. The timer is a plain callback and fires
    50 times a second: each firing costs the process CPU time (a loop turn), and a 5 ms task
    timer used to add ~12 ms to every request's CPU figure at concurrency 1 (~0.6 s a request)."""

    TICK_S = 0.020

    def __init__(self):
        self.lags: list[float] = []
        self._handle = None

    def _tick(self, due: float) -> None:
        loop = asyncio.get_running_loop()
        now = loop.time()
        self.lags.append(max(0.0, now - due))
        self._handle = loop.call_at(now + self.TICK_S, self._tick, now + self.TICK_S)

    def __enter__(self):
        loop = asyncio.get_running_loop()
        due = loop.time() + self.TICK_S
        self._handle = loop.call_at(due, self._tick, due)
        self.cpu0 = time.process_time()
        return self

    def __exit__(self, *exc):
        self._handle.cancel()
        self.cpu = time.process_time() - self.cpu0

    def figures(self, requests: int) -> dict:
        lags = sorted(self.lags) or [0.0]
        return {
            "client_cpu_ms_per_request": round(1000 * self.cpu / max(requests, 1), 2),
            "loop_lag_p99_ms": round(1000 * lags[int(0.99 * (len(lags) - 1))], 1),
            "loop_lag_max_ms": round(1000 * lags[-1], 1),
        }


async def load_generator(
    url: str, adapter, prompts: list[tuple[str, list[int]]], concurrency: int, max_new: int
) -> dict:
    """The minimal client: POST the very requests the pipeline's adapter for this engine builds
    (same endpoint, same body: SGLang's ``/generate`` with ids, vLLM's ``/v1/completions`` with
    ids and ``return_token_ids``), prompts rendered and tokenized before the clock starts, and
    count completion tokens. What the pipeline adds is then only its own work per request."""
    sem = asyncio.Semaphore(concurrency)
    tokens = 0
    sampling = Sampling(max_new, 0.0)
    # The pipeline's connection pools (one connection per in-flight request, in pools of 16): one
    # httpx pool of hundreds of connections costs more CPU per request than the engine's
    # decoding at high concurrency, and would measure the pool instead of the server.
    pools = HttpPools(600)
    try:

        async def one(text, ids):
            nonlocal tokens
            path, body = adapter.request(text, ids, sampling)
            async with sem:
                for attempt in range(3):  # a dropped keep-alive connection is retried, as ours does
                    try:
                        with pools.lease() as http:
                            r = await http.post(url + path, json=body)
                        break
                    except httpx.TransportError:
                        if attempt == 2:
                            raise
                r.raise_for_status()
                tokens += adapter.parse(r.json()).completion_tokens or 0

        t0 = time.perf_counter()
        with LoopLag() as lag:
            await asyncio.gather(*(one(text, ids) for text, ids in prompts))
        wall = time.perf_counter() - t0
    finally:
        await pools.aclose()
    return {
        "tokens": tokens,
        "seconds": round(wall, 2),
        "tokens_per_s": round(tokens / wall, 1),
        **lag.figures(len(prompts)),
    }


def measure_pair(url, engine, model, adapter, tokenizer, requests, rows, concurrency, max_new, run_dir) -> dict:
    """One run of each client against the server, the load generator first, and their ratio."""
    base = asyncio.run(load_generator(url, adapter, requests, concurrency, max_new))
    ours = asyncio.run(pipeline(url, engine, model, tokenizer, rows, concurrency, max_new, run_dir))
    return {
        "concurrency": concurrency,
        "prompts": len(rows),
        "load_generator": base,
        "pipeline": ours,
        "ratio": round(ours["tokens_per_s"] / base["tokens_per_s"], 3),
    }


async def pipeline(url, engine, model, tokenizer, rows, concurrency, max_new, run_dir) -> dict:
    import pyarrow as pa

    settings = GenerationSettings(
        thinking=True,
        sampling=Sampling(max_new, 0.0),
        concurrency=concurrency,
        part_every_samples=64,
        part_every_seconds=30,
        telemetry_every_seconds=2,
    )
    progress = ShardProgress(open_storage(run_dir), "generate", 0)
    progress.clear_parts()
    # Built before the clock, as the stage has its shard before it sends: the first Arrow table
    # of a process imports pandas (~0.6 s of CPU), which counted in the first run's figures.
    prompt_table = pa.Table.from_pylist(rows)
    async with EngineClient([url], make_adapter(engine, model)) as client:
        gen = ShardGenerator(tokenizer, client, settings, "bench")
        t0 = time.perf_counter()
        with LoopLag() as lag:
            table = await generate_shard(prompt_table, gen, progress, lambda: {})
        wall = time.perf_counter() - t0
    tokens = sum(table.column("completion_tokens").to_pylist())
    return {
        "tokens": tokens,
        "seconds": round(wall, 2),
        "tokens_per_s": round(tokens / wall, 1),
        **lag.figures(len(rows)),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engine", choices=("transformers", "vllm", "sglang"), default="transformers")
    p.add_argument("--engine-python", help="the Python of the engine's own environment (default: this one)")
    p.add_argument("--prompts", type=int, default=256)
    p.add_argument(
        "--concurrency",
        type=int,
        nargs="+",
        default=[64],
        help="requests in flight; several are measured one after another against one server",
    )
    p.add_argument(
        "--prompts-per-slot",
        type=int,
        default=0,
        help="with several concurrencies, each sends max(--prompts-per-slot x concurrency, 16) prompts "
        "(rounds of equal length at every concurrency) instead of --prompts",
    )
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--layers", type=int, default=28)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--intermediate", type=int, default=6144)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument(
        "--demo-model",
        type=Path,
        default=None,
        help="a folder with the tokenizer to use (a built demo target, or Qwen3's)",
    )
    p.add_argument("--engine-arg", action="append", default=[], help="extra server argument")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    from transformers import AutoTokenizer

    from dflash_pipeline.data.chat import render_prompt

    # The engine as its own environment has it (the pipeline's has no vLLM or SGLang), read before
    # the long run: a bench that reads it after its runs and fails loses them.
    install = installed_engine(args.engine, args.engine_python or sys.executable)
    engine = f"{install.distribution} {install.version}" + (
        " serve --continuous-batching" if args.engine == "transformers" else ""
    )
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model = make_model(tmp, args.demo_model, args.hidden, args.layers, args.heads, args.kv_heads, args.intermediate)
        tokenizer = AutoTokenizer.from_pretrained(model)
        most = max(max(args.prompts_per_slot * c, 16) for c in args.concurrency) if args.prompts_per_slot else 0
        rows = prompts(max(args.prompts, most))
        texts = [render_prompt(tokenizer, r["messages"], True) for r in rows]
        requests = [(text, tokenizer(text, add_special_tokens=False)["input_ids"]) for text in texts]
        adapter = make_adapter(args.engine, str(model))
        spec = ServerSpec(
            engine=args.engine, model=str(model), port=18931, extra_args=args.engine_arg, python=args.engine_python
        )
        runs = []
        with ManagedServer(spec, tmp / "engine.log", tmp, startup_timeout=600) as server:
            # Warm-up, then alternate the two clients so drift hits both alike.
            asyncio.run(load_generator(spec.url, adapter, requests[:16], 16, 16))
            for concurrency in args.concurrency:
                count = max(args.prompts_per_slot * concurrency, 16) if args.prompts_per_slot else len(rows)
                for _ in range(args.repeats):
                    runs.append(
                        measure_pair(spec.url, args.engine, str(model), adapter, tokenizer, requests[:count],
                                     rows[:count], concurrency, args.max_new_tokens, str(tmp / "run"))
                    )  # fmt: skip
                    print(json.dumps(runs[-1]), flush=True)
            log_tail = server.log_tail(5)
    gpu = (
        subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True
        ).stdout.strip()
        if os.path.exists("/usr/bin/nvidia-smi")
        else ""
    )
    result = {
        "benchmark": "generation_client",
        "engine": engine,
        "model_shape": {
            "hidden": args.hidden,
            "layers": args.layers,
            "heads": args.heads,
            "kv_heads": args.kv_heads,
            "intermediate": args.intermediate,
            "vocab": len(tokenizer),
            "weights": "random, bf16",
        },
        "tokenizer": str(args.demo_model or "demo target"),
        "engine_args": args.engine_arg,
        "prompts": args.prompts,
        "concurrency": args.concurrency,
        "max_new_tokens": args.max_new_tokens,
        "runs": runs,
        "ratio_mean": round(sum(r["ratio"] for r in runs) / len(runs), 3),
        "ratio_by_concurrency": {
            str(c): round(sum(r["ratio"] for r in runs if r["concurrency"] == c) / args.repeats, 3)
            for c in args.concurrency
        },
        **provenance(gpu or platform.processor() or "cpu"),
        "server_log_tail": log_tail,
    }
    emit(result, args.out)


if __name__ == "__main__":
    main()
