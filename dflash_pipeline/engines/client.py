"""One async HTTP client for every engine.

Two small adapters speak the two APIs the engines offer for a prompt the pipeline rendered:
OpenAI-compatible ``/v1/completions`` (transformers serve, vLLM, external endpoints) and SGLang's
native ``/generate`` (token ids in, token ids out). Everything else is shared: bounded concurrency
(the caller's), timeouts, retries with backoff on transient errors, and spreading requests over
several servers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import Awaitable, Iterator
from dataclasses import dataclass
from typing import NoReturn, TypeVar

import httpx

log = logging.getLogger(__name__)

TRANSIENT_STATUS = {408, 425, 429, 500, 502, 503, 504}

# Connections per httpx client of ``HttpPools``. httpcore's pool (1.0.9,
# ``AsyncConnectionPool._assign_requests_to_connections``, run each time a request starts or ends)
# walks all its connections, and for every idle one builds a list of them all again
# (``len([connection.is_idle() for connection in self._connections])``): with 256 connections in
# one pool that was ~15 ms of CPU per request on the event loop, which capped a client near 40
# requests/s. Pools of 4 keep that walk short at any concurrency (16 per pool cost twice the CPU
# per request of 4 at concurrency 256; 1 to 4 the same).
CONNECTIONS_PER_POOL = 4


class RequestFailed(RuntimeError):
    """A request failed for good (after retries, or with a non-transient error)."""


class EngineError(RuntimeError):
    """The engine itself is broken (did not start, died, keeps failing); names its log."""


@dataclass(frozen=True)
class Sampling:
    max_new_tokens: int
    temperature: float
    top_p: float = 1.0
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None

    def as_dict(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if v is not None}


@dataclass(frozen=True)
class Completion:
    text: str
    finish_reason: str  # stop | length | ...
    prompt_tokens: int | None
    completion_tokens: int | None
    output_ids: list[int] | None


class CompletionsAdapter:
    """OpenAI ``/v1/completions``. ``strict`` sends only standard fields: transformers serve
    rejects unknown ones; vLLM understands ``top_k``/``min_p``/``return_token_ids``.
    ``token_ids`` sends the rendered prompt's ids instead of its text (vLLM takes a list of ids
    as the prompt): the engine decodes exactly the prompt the pipeline rendered and tokenized,
    with no second tokenization of its own."""

    def __init__(self, model: str, strict: bool = True, token_ids: bool = False):
        self.model = model
        self.strict = strict
        self.token_ids = token_ids

    def request(self, prompt_text: str, prompt_ids: list[int], sampling: Sampling) -> tuple[str, dict]:
        body = {
            "model": self.model,
            "prompt": list(prompt_ids) if self.token_ids else prompt_text,
            "max_tokens": sampling.max_new_tokens,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
        }
        if sampling.seed is not None:
            body["seed"] = sampling.seed
        if not self.strict:
            body["skip_special_tokens"] = False
            body["return_token_ids"] = True
            if sampling.top_k is not None:
                body["top_k"] = sampling.top_k
            if sampling.min_p is not None:
                body["min_p"] = sampling.min_p
        return "/v1/completions", body

    def parse(self, data: dict) -> Completion:
        choice = data["choices"][0]
        usage = data.get("usage") or {}
        return Completion(
            text=choice.get("text") or "",
            finish_reason=choice.get("finish_reason") or "unknown",
            prompt_tokens=usage.get("prompt_tokens"),
            completion_tokens=usage.get("completion_tokens"),
            output_ids=choice.get("token_ids"),
        )


class SglangAdapter:
    """SGLang's native ``/generate``: the rendered prompt's ids in, generated ids out."""

    def request(self, prompt_text: str, prompt_ids: list[int], sampling: Sampling) -> tuple[str, dict]:
        params = {
            "max_new_tokens": sampling.max_new_tokens,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "skip_special_tokens": False,
        }
        for key in ("top_k", "min_p"):
            if getattr(sampling, key) is not None:
                params[key] = getattr(sampling, key)
        if sampling.seed is not None:
            params["sampling_seed"] = sampling.seed
        return "/generate", {"input_ids": prompt_ids, "sampling_params": params}

    def parse(self, data: dict) -> Completion:
        meta = data.get("meta_info") or {}
        reason = meta.get("finish_reason") or {}
        return Completion(
            text=data.get("text") or "",
            finish_reason=reason.get("type", "unknown") if isinstance(reason, dict) else str(reason),
            prompt_tokens=meta.get("prompt_tokens"),
            completion_tokens=meta.get("completion_tokens"),
            output_ids=data.get("output_ids"),
        )


def make_adapter(engine: str, model: str):
    if engine == "sglang":
        return SglangAdapter()
    if engine == "vllm":
        return CompletionsAdapter(model, strict=False, token_ids=True)
    return CompletionsAdapter(model, strict=engine in ("transformers", "endpoint"))


class HttpPools:
    """Several ``httpx.AsyncClient`` of at most ``per_pool`` requests in flight each, for many
    concurrent requests (see ``CONNECTIONS_PER_POOL``): ``lease()`` lends the least busy client,
    and opens another when every one is full. The clients share one TLS context (making one
    reads the CA bundle: ~40 ms each)."""

    def __init__(self, timeout: httpx.Timeout | float, per_pool: int = CONNECTIONS_PER_POOL):
        self.timeout = timeout
        self.per_pool = per_pool
        self.clients: list[httpx.AsyncClient] = []
        self.in_flight: list[int] = []
        self._tls = httpx.create_ssl_context()

    def _open(self) -> int:
        self.clients.append(
            httpx.AsyncClient(
                timeout=self.timeout,
                verify=self._tls,
                # No cap on connections: a burst never waits for a pool's slot.
                limits=httpx.Limits(max_connections=None, max_keepalive_connections=self.per_pool),
            )
        )
        self.in_flight.append(0)
        return len(self.clients) - 1

    @contextlib.contextmanager
    def lease(self) -> Iterator[httpx.AsyncClient]:
        """The least busy client, counted busy until the ``with`` ends (read the response inside)."""
        index = min(range(len(self.clients)), key=self.in_flight.__getitem__, default=None)
        if index is None or self.in_flight[index] >= self.per_pool:
            index = self._open()
        self.in_flight[index] += 1
        try:
            yield self.clients[index]
        finally:
            self.in_flight[index] -= 1

    async def aclose(self) -> None:
        for client in self.clients:
            await client.aclose()


class EngineClient:
    """Sends completion requests to one or more servers of the same engine."""

    def __init__(
        self,
        urls: list[str],
        adapter,
        timeout: float = 600,
        max_retries: int = 5,
        backoff: float = 1.0,
        alive=None,
    ):
        if not urls:
            raise ValueError("no server URL given")
        self.urls = [u.rstrip("/") for u in urls]
        self.adapter = adapter
        self.max_retries = max_retries
        self.backoff = backoff
        # A launched server can die; retrying against a dead process only delays the error.
        self.alive = alive or (lambda: True)
        self.in_flight = {u: 0 for u in self.urls}
        self.http = HttpPools(httpx.Timeout(timeout, connect=30))

    async def __aenter__(self) -> EngineClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.http.aclose()

    def _pick_url(self) -> str:
        # Least in-flight first: a slow server gets fewer new requests.
        return min(self.urls, key=lambda u: (self.in_flight[u], random.random()))

    async def complete(self, prompt_text: str, prompt_ids: list[int], sampling: Sampling) -> Completion:
        path, body = self.adapter.request(prompt_text, prompt_ids, sampling)
        last_error = "no attempt"
        for attempt in range(self.max_retries + 1):
            url = self._pick_url()
            self.in_flight[url] += 1
            try:
                with self.http.lease() as http:
                    resp = await http.post(url + path, json=body)
                if resp.status_code == 200:
                    return self.adapter.parse(resp.json())
                last_error = f"HTTP {resp.status_code} from {url}: {resp.text[:300]}"
                if resp.status_code not in TRANSIENT_STATUS:
                    raise RequestFailed(last_error)
            except httpx.TransportError as err:
                last_error = f"{type(err).__name__} talking to {url}: {err}"
                if not self.alive():
                    raise EngineError(f"the engine process died ({last_error})") from None
            finally:
                self.in_flight[url] -= 1
            if attempt < self.max_retries:
                delay = min(30.0, self.backoff * 2**attempt) * (0.5 + random.random())
                log.warning("request failed (%s); retry %d in %.1f s", last_error, attempt + 1, delay)
                await asyncio.sleep(delay)
        raise RequestFailed(f"gave up after {self.max_retries + 1} attempts: {last_error}")


T = TypeVar("T")

HEALTH_PATH = "/health"  # vLLM's, SGLang's and transformers serve's

# How long one health probe may take. SGLang 0.5.23's /health generates a token and waits up to
# 20 s (SGLANG_HEALTH_CHECK_TIMEOUT) for its scheduler to answer anything, then says 503
# (sglang/srt/entrypoints/http_server.py, health_generate); vLLM 0.34.0's says 503 on
# EngineDeadError (vllm/entrypoints/serve/instrumentator/health.py), transformers serve's when its
# batching worker is dead. tests/test_engine_limits.py holds these to the installed engines' code.
PROBE_TIMEOUT_S = 30.0


async def watch_for_hang(urls: list[str], hung_after_s: float, setting: str = "generation.hung_after_s") -> NoReturn:
    """Probes each server's health until one has given no healthy answer for ``hung_after_s``,
    then raises ``EngineError`` naming it; runs until cancelled. A hung server (process alive,
    stopped or deadlocked; a stalled gateway) accepts connections and never answers: without this
    every request would wait its whole timeout, times its retries, before a sample counted as
    failed (hours at the defaults). Any answer below 500 counts as healthy (a 404: a server
    without that path is there); a 5xx (the engine says it is unhealthy: SGLang's stuck
    scheduler, vLLM's dead engine core), a timeout or a refused connection does not."""
    interval = max(0.5, min(30.0, hung_after_s / 4))
    loop = asyncio.get_running_loop()

    async def watch(url: str, http: httpx.AsyncClient) -> NoReturn:
        # One loop per server: a probe waiting out its timeout on one never delays another's.
        last_healthy, problem = loop.time(), ""
        while True:
            started = loop.time()
            try:
                resp = await http.get(url.rstrip("/") + HEALTH_PATH)
            except httpx.HTTPError as err:
                problem = f"{type(err).__name__}: {err}" if str(err) else type(err).__name__
            else:
                if resp.status_code < 500:
                    last_healthy = loop.time()
                else:
                    problem = f"HTTP {resp.status_code}"
            silent = loop.time() - last_healthy
            if silent >= hung_after_s:
                raise EngineError(
                    f"the engine server at {url} has given no healthy answer for {silent:.0f} s ({setting}): "
                    f"hung, gone or unhealthy; its health check {HEALTH_PATH} last got {problem}"
                )
            await asyncio.sleep(max(0.0, interval - (loop.time() - started)))

    # Its own connections: a probe never queues behind the requests of the pools.
    async with httpx.AsyncClient(timeout=httpx.Timeout(min(PROBE_TIMEOUT_S, hung_after_s))) as http:
        watches = [asyncio.create_task(watch(url, http)) for url in urls]
        try:
            done, _ = await asyncio.wait(watches, return_when=asyncio.FIRST_EXCEPTION)
            raise next(iter(done)).exception()  # a watch ends only by raising
        finally:
            for task in watches:
                task.cancel()
            await asyncio.gather(*watches, return_exceptions=True)


async def unless_hung(work: Awaitable[T], urls: list[str], hung_after_s: float, setting: str) -> T:
    """``work``'s result, or ``watch_for_hang``'s error as soon as a server of ``urls`` has
    given no healthy answer for ``hung_after_s`` (``work`` is then cancelled: only requests, nothing
    that writes, may be in it)."""
    task = asyncio.ensure_future(work)
    watch = asyncio.create_task(watch_for_hang(urls, hung_after_s, setting))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
        if watch.done():
            watch.result()  # raises: the watch ends only so
        return task.result()
    finally:
        watch.cancel()
        task.cancel()
        await asyncio.gather(task, watch, return_exceptions=True)
