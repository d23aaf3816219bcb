"""On-policy regeneration of a shard's conversations through an engine client.

Each conversation is replayed turn by turn on its regenerated history: every assistant turn of
the source is replaced by the target's own response, and a conversation that ends with a user or
tool turn gets one more assistant turn. Finished conversations go into progress parts as they
come, so an interrupted shard resumes from them. After every part the run's halt is checked: a
halted run stops the shard there.

A saved row (a part, or the reuse copy of an earlier build of the shard) is reused only when its
sample id, its generation fingerprint (model, template, sampling, engine) and its prompt hash
(``prompt_hash``: the ingest's hash of the prompt's non-assistant turns) all match the prompt's,
and its turns sit where the prompt's do: a prompt edited under the same source id is
regenerated. Rows saved before rows carried a prompt hash (the column is null) are regenerated.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import pyarrow as pa
import pyarrow.compute as pc

from dflash_pipeline.core.jobstate import ShardProgress, raise_if_halted
from dflash_pipeline.core.config import schema_defaults
from dflash_pipeline.core.lease import raise_if_driverless
from dflash_pipeline.data.chat import assistant_message, render_prompt, split_reasoning
from dflash_pipeline.data.prompts import messages_prompt_hash
from dflash_pipeline.engines.client import Completion, EngineClient, EngineError, RequestFailed, Sampling

log = logging.getLogger(__name__)

MESSAGE = pa.struct([("role", pa.string()), ("content", pa.string()), ("reasoning_content", pa.string())])
TURN = pa.struct(
    [
        ("message_index", pa.int32()),
        ("finish_reason", pa.string()),
        ("think_closed", pa.bool_()),
        ("prompt_tokens", pa.int32()),
        ("completion_tokens", pa.int32()),
        ("output_ids", pa.list_(pa.int32())),
    ]
)
GENERATED_SCHEMA = pa.schema(
    [
        ("id", pa.string()),
        ("shard", pa.int32()),
        ("split", pa.string()),
        ("messages", pa.list_(MESSAGE)),
        ("turns", pa.list_(TURN)),
        ("prompt_tokens", pa.int64()),
        ("completion_tokens", pa.int64()),
        ("error", pa.string()),
        ("fingerprint", pa.string()),
        # The prompt's hash (``messages_prompt_hash`` of the prompt row): a saved row is reused
        # only for the same prompt text. Last and nullable: parts and reuse objects written
        # before it read back with nulls, and such rows are regenerated.
        ("prompt_hash", pa.string()),
    ]
)


_DEFAULTS = schema_defaults("generation")


@dataclass
class GenerationSettings:
    thinking: bool
    sampling: Sampling
    # The `generation` section's defaults (dflash_pipeline/config/schema.yaml).
    # generation.concurrency null: tune's choice (generate resolves it), else this.
    concurrency: int = schema_defaults("tune")["untuned_concurrency"]
    part_every_samples: int = _DEFAULTS["part_every_samples"]
    part_every_seconds: float = _DEFAULTS["part_every_seconds"]
    telemetry_every_seconds: float = _DEFAULTS["telemetry_every_seconds"]
    max_consecutive_failures: int = _DEFAULTS["max_consecutive_failures"]
    max_error_fraction: float = _DEFAULTS["max_error_fraction"]

    @classmethod
    def from_config(cls, gen: dict, model_dir: str) -> GenerationSettings:
        """From the `generation` config section; sampling falls back to the model's defaults."""
        return cls(
            thinking=gen["thinking"],
            sampling=sampling_from_config(model_dir, gen["sampling"], gen["max_new_tokens"], gen["seed"]),
            **{
                k: gen[k]
                for k in (
                    "concurrency",
                    "part_every_samples",
                    "part_every_seconds",
                    "telemetry_every_seconds",
                    "max_consecutive_failures",
                    "max_error_fraction",
                )
            },
        )


def sampling_from_config(model_dir: str, overrides: dict, max_new_tokens: int, seed: int | None) -> Sampling:
    """The model's own generation config, with the config's non-null values on top."""
    defaults: dict = {}
    path = Path(model_dir) / "generation_config.json"
    if path.is_file():
        gen = json.loads(path.read_text())
        if gen.get("do_sample") is False:
            defaults["temperature"] = 0.0
        for key in ("temperature", "top_p", "top_k", "min_p"):
            if gen.get(key) is not None and key not in defaults:
                defaults[key] = gen[key]
    merged = {**defaults, **{k: v for k, v in (overrides or {}).items() if v is not None}}
    return Sampling(
        max_new_tokens=max_new_tokens,
        temperature=float(merged.get("temperature", 1.0)),
        top_p=float(merged.get("top_p", 1.0)),
        top_k=merged.get("top_k"),
        min_p=merged.get("min_p"),
        seed=seed,
    )


def fingerprint(
    model_dir: str, chat_template: str, settings: GenerationSettings, engine: str, engine_version: str
) -> str:
    """Identifies what produced a row: reused rows must match it exactly."""
    config_path = Path(model_dir) / "config.json"
    model_config = config_path.read_bytes() if config_path.is_file() else model_dir.encode()
    payload = {
        "model": hashlib.sha256(model_config).hexdigest()[:16],
        "model_name": Path(model_dir).name,
        "chat_template": hashlib.sha256((chat_template or "").encode()).hexdigest()[:16],
        "sampling": settings.sampling.as_dict(),
        "thinking": settings.thinking,
        "engine": engine,
        "engine_version": engine_version,
    }
    digest = hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]
    return f"{digest}:{json.dumps(payload, sort_keys=True)}"


class ShardGenerator:
    """Regenerates one shard's conversations through an engine client."""

    def __init__(self, tokenizer, client: EngineClient, settings: GenerationSettings, fingerprint: str):
        self.tokenizer = tokenizer
        self.client = client
        self.settings = settings
        self.fingerprint = fingerprint
        self.end_of_turn = tokenizer.eos_token

    async def _turn(self, history: list[dict]) -> tuple[dict, dict]:
        prompt = render_prompt(self.tokenizer, history, self.settings.thinking)
        prompt_ids = self.tokenizer(prompt, add_special_tokens=False)["input_ids"]
        done: Completion = await self.client.complete(prompt, prompt_ids, self.settings.sampling)
        split = split_reasoning(prompt, done.text, self.end_of_turn)
        completion_tokens = done.completion_tokens
        if completion_tokens is None:
            completion_tokens = len(self.tokenizer(done.text, add_special_tokens=False)["input_ids"])
        turn = {
            "message_index": len(history),
            "finish_reason": done.finish_reason,
            "think_closed": split.think_closed,
            "prompt_tokens": done.prompt_tokens if done.prompt_tokens is not None else len(prompt_ids),
            "completion_tokens": completion_tokens,
            "output_ids": done.output_ids,
        }
        return assistant_message(split), turn

    async def conversation(self, row: dict) -> dict:
        """The row regenerated; it carries the prompt's hash (``row["prompt_hash"]`` when
        ``generate_shard`` set it, else computed from the prompt's messages)."""
        history: list[dict] = []
        turns: list[dict] = []
        error = None
        try:
            for message in row["messages"]:
                if message["role"] == "assistant":
                    reply, turn = await self._turn(history)
                    history.append(reply)
                    turns.append(turn)
                else:
                    history.append({"role": message["role"], "content": message["content"]})
            if history[-1]["role"] != "assistant":
                reply, turn = await self._turn(history)
                history.append(reply)
                turns.append(turn)
        except RequestFailed as err:
            error = str(err)
        return {
            "id": row["id"],
            "shard": row["shard"],
            "split": row["split"],
            "messages": [
                {
                    "role": m["role"],
                    "content": m["content"],
                    "reasoning_content": m.get("reasoning_content"),
                }
                for m in (history if error is None else row["messages"])
            ],
            "turns": turns,
            "prompt_tokens": sum(t["prompt_tokens"] for t in turns),
            "completion_tokens": sum(t["completion_tokens"] for t in turns),
            "error": error,
            "fingerprint": self.fingerprint,
            "prompt_hash": row.get("prompt_hash") or messages_prompt_hash(row["messages"]),
        }


def generated_roles(messages: list[dict]) -> list[str]:
    """The roles of the row generated from a prompt's messages: the prompt's, plus the assistant
    turn a conversation that does not end with one gets."""
    roles = [m["role"] for m in messages]
    return roles if roles and roles[-1] == "assistant" else [*roles, "assistant"]


@dataclass(frozen=True)
class Wanted:
    """What a saved row must match to stand for a prompt."""

    prompt_hash: str
    roles: tuple[str, ...]  # of the generated row (``generated_roles``)

    @classmethod
    def of(cls, row: dict) -> Wanted:
        return cls(
            row.get("prompt_hash") or messages_prompt_hash(row["messages"]), tuple(generated_roles(row["messages"]))
        )


def reusable_rows(
    saved: pa.Table, fingerprint_value: str, wanted: dict[str, Wanted], what: str = "saved"
) -> dict[str, dict]:
    """Rows from earlier attempts that need no new request: a wanted sample id, the same
    fingerprint and prompt hash, no error, and assistant turns where the prompt has them (the
    prompt hash, like the ingest's dedupe, leaves assistant turns out). A row without a prompt hash
    (saved before rows carried one) is not reused. For a repeated id the later row wins.

    Only the small key columns are converted to Python to choose; only the chosen rows whole.
    """
    if saved.num_rows == 0:
        return {}
    same_fingerprint = pc.equal(saved.column("fingerprint"), pa.scalar(fingerprint_value, pa.string()))
    same_run = pc.and_(pc.is_null(saved.column("error")), pc.fill_null(same_fingerprint, False)).to_pylist()
    ids = saved.column("id").to_pylist()
    hashes = saved.column("prompt_hash").to_pylist()
    chosen, stale = [], 0
    for index, (sample_id, digest, ok) in enumerate(zip(ids, hashes, same_run, strict=True)):
        want = wanted.get(sample_id)
        if want is None or not ok:
            continue
        if digest is not None and digest == want.prompt_hash:
            chosen.append(index)
        else:
            stale += 1
    found: dict[str, dict] = {}
    taken = saved if len(chosen) == saved.num_rows else saved.take(pa.array(chosen, pa.int64()))
    for row in taken.to_pylist():
        if tuple(m["role"] for m in row["messages"]) == wanted[row["id"]].roles:
            found[row["id"]] = row
        else:
            found.pop(row["id"], None)  # a later row for another shape of the prompt
            stale += 1
    if stale:
        log.info(
            "%d %s rows not reused: their prompt changed since (or they predate prompt "
            "hashes); those prompts are generated again",
            stale,
            what,
        )
    return found


async def generate_shard(
    prompts: pa.Table,
    generator: ShardGenerator,
    progress: ShardProgress,
    engine_info,
    health_check=lambda: True,
    hang_watch: Callable[[], Coroutine[Any, Any, NoReturn]] | None = None,
) -> pa.Table:
    """Generate every prompt not already in a saved part; returns the shard in prompt order.
    ``hang_watch()`` (``client.watch_for_hang`` with its servers) runs beside the requests: its
    error stops the job like any engine error, the finished samples saved."""
    settings = generator.settings
    rows = prompts.to_pylist()
    wanted: dict[str, Wanted] = {}
    for row in rows:
        wanted[row["id"]] = Wanted.of(row)
        row["prompt_hash"] = wanted[row["id"]].prompt_hash  # computed once, carried by the result
    # Rows of an earlier finished build of this shard (the shard was re-planned, e.g. after data
    # was added or edited), then rows saved in parts by an interrupted attempt.
    done = reusable_rows(progress.load_reusable(GENERATED_SCHEMA), generator.fingerprint, wanted, "earlier build's")
    done.update(reusable_rows(progress.load_parts(GENERATED_SCHEMA), generator.fingerprint, wanted, "progress part"))
    todo = [r for r in rows if r["id"] not in done]
    telemetry = progress.telemetry(
        len(rows), settings.telemetry_every_seconds, resumed=len(rows) - len(todo), token_field="tokens_generated"
    )
    log.info(
        "shard %05d: %d prompts, %d resumed from earlier work, %d to generate",
        progress.shard,
        len(rows),
        telemetry.resumed,
        len(todo),
    )
    pending: list[dict] = []
    last_flush = time.monotonic()
    consecutive_failures = 0

    async def flush() -> None:
        nonlocal pending, last_flush
        if pending:
            batch, pending = pending, []
            # Built in the thread too: converting the rows is CPU work of its own (~1 ms per 64
            # short rows) that would hold the event loop, and every request with it.
            await asyncio.to_thread(lambda: progress.write_part(pa.Table.from_pylist(batch, schema=GENERATED_SCHEMA)))
            log.info("saved a part of %d samples", len(batch))
        last_flush = time.monotonic()

    async def save_part_or_stop() -> None:
        await flush()
        # A tokenize shard failed the quality gate meanwhile: this shard is being generated with
        # the same settings, so stop here; the parts keep what is finished. The same when the
        # driver that started the job is gone: nobody would collect the shard.
        job = f"generate shard {progress.shard:05d}"
        await asyncio.to_thread(raise_if_halted, progress.run, job)
        await asyncio.to_thread(raise_if_driverless, progress.run, job)

    async def report_forever() -> None:
        while True:
            await asyncio.to_thread(lambda: telemetry.write(engine=engine_info()))
            await asyncio.sleep(settings.telemetry_every_seconds)

    semaphore = asyncio.Semaphore(settings.concurrency)

    async def one(row: dict) -> dict:
        async with semaphore:
            return await generator.conversation(row)

    # Starting a server can take minutes: the run may have been halted meanwhile.
    raise_if_halted(progress.run, f"generate shard {progress.shard:05d}")
    reporter = asyncio.create_task(report_forever())
    tasks = [asyncio.create_task(one(r)) for r in todo]
    watch = asyncio.create_task(hang_watch() if hang_watch else asyncio.Event().wait())  # ends only by raising
    try:
        # The watch among the awaited: a hung server stops the loop at once, not after the
        # requests' timeouts. It never returns, so the tasks' results are the first len(tasks).
        completions = asyncio.as_completed([*tasks, watch])
        for _ in tasks:
            result = await next(completions)
            telemetry.done += 1
            telemetry.tokens += result["completion_tokens"]
            if result["error"] is None:
                consecutive_failures = 0
            else:
                telemetry.errors += 1
                consecutive_failures += 1
                log.warning("sample %s failed: %s", result["id"], result["error"])
            done[result["id"]] = result
            pending.append(result)
            if consecutive_failures >= settings.max_consecutive_failures or not health_check():
                raise EngineError(
                    f"engine unhealthy: {consecutive_failures} requests in a row failed (last: {result['error']})"
                )
            if (
                len(pending) >= settings.part_every_samples
                or time.monotonic() - last_flush >= settings.part_every_seconds
            ):
                await save_part_or_stop()
        await flush()  # the last part: every sample is done, so the shard is written
    except BaseException:
        telemetry.state = "failed"
        for task in tasks:
            if task.done() and not task.cancelled() and task.exception() is None:
                result = task.result()  # finished, not yet counted: saved with the rest
                if result["id"] not in done:
                    done[result["id"]] = result
                    pending.append(result)
            else:
                task.cancel()
        await flush()  # finished samples are never lost, whatever stopped the job
        raise
    finally:
        reporter.cancel()
        watch.cancel()
        if telemetry.state == "failed":
            await asyncio.to_thread(lambda: telemetry.write(engine=engine_info()))
    errors = [r for r in done.values() if r["error"] is not None]
    failed = bool(rows) and len(errors) / len(rows) > settings.max_error_fraction
    telemetry.state = "failed" if failed else "done"
    await asyncio.to_thread(lambda: telemetry.write(engine=engine_info()))
    if failed:
        raise EngineError(
            f"{len(errors)} of {len(rows)} samples failed (above generation.max_error_fraction="
            f"{settings.max_error_fraction}); first: {errors[0]['id']}: {errors[0]['error']}"
        )
    return pa.Table.from_pylist([done[r["id"]] for r in rows], schema=GENERATED_SCHEMA)
