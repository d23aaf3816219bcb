"""Taps from a vLLM server: token ids in, the target's taps out, checked before use.

The server runs vLLM's ``extract_hidden_states`` speculative method with the project's connector
(``engines/vllm_connector/dflash_taps_connector.py``, loaded by the server from a folder put on
its ``PYTHONPATH``).
Each request is a one-token completion of the sample's token ids; the connector writes the rows of
the prompt's tokens to a file the response names. The client checks that the file holds the ids
it sent, one row per id and the layers it asked for, puts the layers in the asked tap order
(``model.taps.vllm_slot_order``), and deletes the file.

The files wait in a node-local folder (``node_local_root``: shared memory where it has room) until
their reader takes them; ``CacheBound`` holds new requests back while that folder holds more than
``train.taps_server.max_cache_bytes``, so a trainer slower than the engine does not fill it, and a
fixed number of requests in flight per client (``concurrency``) keeps the engine from racing ahead.

Layer ids: project tap k = vLLM aux layer id k + 1 (``model.taps.vllm_aux_layer_ids``), both the
decoder layer's output before the final norm.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import httpx
import torch
from safetensors.torch import load_file

from dflash_pipeline.engines.client import EngineError
from dflash_pipeline.engines.launch import ServerSpec
from dflash_pipeline.model.taps import vllm_aux_layer_ids, vllm_slot_order

log = logging.getLogger(__name__)

# The name the server imports the connector by: a copy of the module in a folder of the run's own,
# so the engine's environment never sees the pipeline's package. Its folder is not a package (the
# pipeline never imports it: it imports vLLM).
CONNECTOR_MODULE = "dflash_taps_connector"
CONNECTOR_SOURCE = Path(__file__).parent / "vllm_connector" / f"{CONNECTOR_MODULE}.py"
CONNECTOR_CLASS = "DFlashTapsConnector"
# The connector and the module it imports beside it (its copies to the host and writes).
CONNECTOR_MODULES = (f"{CONNECTOR_MODULE}.py", "taps_host_copies.py")
# The connector's marker beside a taps file it could not write (its FAILED_SUFFIX: the connector
# runs in the engine's environment and imports nothing of the pipeline's).
FAILED_SUFFIX = ".failed"


def failure_marker(path: Path) -> Path:
    return path.with_name(path.name + FAILED_SUFFIX)


class TapsMismatch(EngineError):
    """The engine's file does not hold the taps of the sample that was sent."""


def install_connector(folder: str | Path) -> Path:
    """Copy the connector's modules into ``folder``; returns the folder (for ``PYTHONPATH``)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    for module in CONNECTOR_MODULES:
        shutil.copyfile(CONNECTOR_SOURCE.parent / module, folder / module)
    return folder


def taps_server_spec(
    model: str | Path,
    tap_ids: Sequence[int],
    port: int,
    run_dir: str | Path,
    *,
    python: str | None,
    env: dict[str, str],
    tp: int = 1,
    mem_fraction: float | None = None,
    dtype: str | None = None,
    max_model_len: int | None = None,
    max_num_seqs: int | None = None,
    extra_args: Sequence[str] = (),
    quantization: str | None = None,
) -> ServerSpec:
    """A vLLM server that computes the taps ``tap_ids`` of ``model``; its files go to
    ``<run_dir>/taps`` and its connector module to ``<run_dir>/connector``. ``max_num_seqs``:
    the most sequences its clients can have in flight (``extra_args`` come last, so a
    ``--max-num-seqs`` there wins). ``quantization`` (``train.target_quantization``): vLLM's
    ``--quantization`` of the same name."""
    run_dir = Path(run_dir)
    connector_dir = install_connector(run_dir / "connector")
    storage = run_dir / "taps"
    storage.mkdir(parents=True, exist_ok=True)
    speculative = {
        "method": "extract_hidden_states",
        "num_speculative_tokens": 1,
        "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": vllm_aux_layer_ids(tap_ids)}},
    }
    transfer = {
        "kv_connector": CONNECTOR_CLASS,
        "kv_connector_module_path": CONNECTOR_MODULE,
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {"shared_storage_path": str(storage)},
    }
    args = ["--speculative-config", json.dumps(speculative), "--kv-transfer-config", json.dumps(transfer)]
    # Same sampling on every run (the one generated token is thrown away anyway).
    args += ["--seed", "0", "--generation-config", "vllm"]
    if dtype:
        args += ["--dtype", dtype]
    if max_model_len:
        args += ["--max-model-len", str(max_model_len)]
    if quantization:
        args += ["--quantization", quantization]
    if max_num_seqs:
        # vLLM sizes its start-up for --max-num-seqs sequences at once (1024 by default on a
        # large GPU): a sampler warm-up over that many rows of the vocabulary, CUDA graphs for
        # each batch size, a recurrent-state slot per sequence on hybrid models. Beside other
        # processes on an H100, a 27B-shaped hybrid target's server ran out of memory in that
        # warm-up (970 MiB for 1024 rows of a 248K vocabulary); a taps server never has more
        # sequences than its clients keep in flight.
        args += ["--max-num-seqs", str(max_num_seqs)]
    # Only the connector's folder: the engine's environment must not import the pipeline's packages.
    server_env = {**env, "PYTHONPATH": str(connector_dir)}
    return ServerSpec(
        engine="vllm",
        model=str(model),
        port=port,
        tp=tp,
        mem_fraction=mem_fraction,
        extra_args=args + list(extra_args),
        python=python,
        env=server_env,
    )


def taps_storage(spec: ServerSpec) -> Path:
    """Where the server of ``spec`` writes its tap files."""
    transfer = json.loads(spec.extra_args[spec.extra_args.index("--kv-transfer-config") + 1])
    return Path(transfer["kv_connector_extra_config"]["shared_storage_path"])


# RAM-backed on Linux: the engine's files reach the reader without a disk write.
SHARED_MEMORY = Path("/dev/shm")


def node_local_root(max_cache_bytes: int, candidates: Sequence[Path] = (SHARED_MEMORY,)) -> str:
    """Where a node's tap files go: the first of ``candidates`` that is a writable folder with
    twice ``max_cache_bytes`` free (the bound is checked before a request, so requests in flight
    may pass it), else the temporary folder."""
    for folder in map(Path, candidates):
        try:
            if (
                folder.is_dir()
                and os.access(folder, os.W_OK | os.X_OK)
                and shutil.disk_usage(folder).free >= 2 * max_cache_bytes
            ):
                return str(folder)
        except OSError:
            continue
    return tempfile.gettempdir()


@contextmanager
def node_local_dir(max_cache_bytes: int, prefix: str = "dflash-taps-") -> Iterator[Path]:
    """A folder of this job's own under ``node_local_root``, removed at the end."""
    with tempfile.TemporaryDirectory(prefix=prefix, dir=node_local_root(max_cache_bytes)) as folder:
        yield Path(folder)


class CacheBound:
    """The byte bound of the node-local tap cache: the bytes of every file in ``folder`` (written
    by the engine and not yet consumed, for any reader on the node, partial files included)
    against ``max_bytes`` (None: no bound)."""

    def __init__(self, folder: str | Path, max_bytes: int | None):
        self.folder = Path(folder)
        self.max_bytes = max_bytes

    def held_bytes(self) -> int:
        total = 0
        try:
            entries = list(os.scandir(self.folder))
        except FileNotFoundError:
            return 0
        for entry in entries:
            try:
                total += entry.stat().st_size
            except FileNotFoundError:  # consumed by another reader meanwhile
                pass
        return total

    def has_room(self) -> bool:
        """Whether a new request may go out: the cache holds at most the bound. An empty cache
        always has room, so one sequence larger than the bound still gets its taps."""
        return self.max_bytes is None or self.held_bytes() <= self.max_bytes


class _QuietHttpLogs:
    """httpx logs every request at INFO (and httpcore its connection steps at DEBUG): one line a
    sequence would flood a training job's log. While a taps client is open, both log from
    WARNING up; their earlier levels come back when the last one closes."""

    LOGGERS = ("httpx", "httpcore")

    def __init__(self):
        self.lock = threading.Lock()
        self.users = 0
        self.levels: dict[str, int] = {}

    def acquire(self) -> None:
        with self.lock:
            if self.users == 0:
                for name in self.LOGGERS:
                    logger = logging.getLogger(name)
                    self.levels[name] = logger.level
                    logger.setLevel(max(logger.level, logging.WARNING))
            self.users += 1

    def release(self) -> None:
        with self.lock:
            self.users -= 1
            if self.users == 0:
                for name, level in self.levels.items():
                    logging.getLogger(name).setLevel(level)


QUIET_HTTP_LOGS = _QuietHttpLogs()


def arrange_taps(found: dict[str, torch.Tensor], token_ids: Sequence[int], tap_ids: Sequence[int]) -> torch.Tensor:
    """The checked taps [T, K*H] in ``tap_ids`` order from a connector file's tensors (the server
    may capture more layers than asked); raises ``TapsMismatch`` when they are not the rows of
    ``token_ids`` or do not hold those layers in vLLM's ascending order."""
    hidden, ids, layers = found.get("hidden_states"), found.get("token_ids"), found.get("layer_ids")
    if hidden is None or ids is None or layers is None:
        raise TapsMismatch("the engine's taps file lacks hidden_states, token_ids or layer_ids")
    if ids.tolist() != list(token_ids):
        raise TapsMismatch(f"the engine's taps are of other token ids ({len(ids)} ids, {len(token_ids)} sent)")
    if hidden.ndim != 3 or hidden.shape[0] != len(token_ids):
        raise TapsMismatch(f"the engine returned taps of shape {tuple(hidden.shape)} for {len(token_ids)} tokens")
    captured = layers.tolist()
    wanted = vllm_aux_layer_ids(tap_ids)
    if captured != sorted(set(captured)) or hidden.shape[1] != len(captured) or not set(wanted) <= set(captured):
        raise TapsMismatch(
            f"the engine captured vLLM layers {captured} in {hidden.shape[1]} slots; taps "
            f"{list(tap_ids)} need layers {wanted} (vLLM id = tap + 1, slots in ascending id order)"
        )
    slots = [captured.index(layer_id) for layer_id in vllm_aux_layer_ids(tap_ids)]
    order = [slots[i] for i in vllm_slot_order(tap_ids)]
    if order == list(range(hidden.shape[1])):
        # Every captured layer, in the order asked (ascending taps, the usual case): a view of the
        # file's rows. The gather below copies them (210 MB a 4,096-token 27B sequence: 70 ms).
        return hidden.reshape(len(token_ids), -1)
    return hidden[:, order].reshape(len(token_ids), -1)


class EngineTaps:
    """Taps of token-id sequences from a running taps server at ``url`` serving ``model`` and
    writing its files into ``storage``.

    ``alive`` says whether the server still runs (a dead one fails the wait at once instead of
    after ``timeout``); by default its health endpoint answers, asked at most once a second.
    ``max_cache_bytes`` bounds the files waiting in ``storage`` (``CacheBound``): no request goes
    out while they hold more."""

    def __init__(
        self,
        url: str,
        model: str,
        storage: str | Path,
        tap_ids: Sequence[int],
        *,
        alive: Callable[[], bool] | None = None,
        timeout: float = 600,
        concurrency: int = 4,
        max_cache_bytes: int | None = None,
    ):
        self.url = url
        self.model = model
        self.storage = Path(storage)
        self.tap_ids = list(tap_ids)
        self.alive = alive or self._healthy
        self.timeout = timeout
        self.concurrency = concurrency
        self.bound = CacheBound(self.storage, max_cache_bytes)
        self.sleep = time.sleep  # how a wait passes (a test's stand-in shows what it waited for)
        self.http = httpx.Client(timeout=timeout)
        QUIET_HTTP_LOGS.acquire()
        self._open = True

    @classmethod
    def of_server(cls, spec: ServerSpec, tap_ids: Sequence[int], **kwargs) -> EngineTaps:
        return cls(spec.url, spec.model, taps_storage(spec), tap_ids, **kwargs)

    def address(self) -> dict:
        """What another process needs to reach the same server (``EngineTaps(**address)``)."""
        return {"url": self.url, "model": self.model, "storage": str(self.storage)}

    def _healthy(self) -> bool:
        try:
            return self.http.get(f"{self.url}/health", timeout=30).status_code == 200
        except httpx.HTTPError:
            return False

    def close(self) -> None:
        if self._open:
            self._open = False
            self.http.close()
            QUIET_HTTP_LOGS.release()

    def __enter__(self) -> EngineTaps:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def taps(self, token_ids: Sequence[int]) -> torch.Tensor:
        """The taps [T, K*H] of one sequence (the engine's dtype, on the CPU)."""
        token_ids = [int(t) for t in token_ids]
        # Backpressure: the engine gets no more work while the node's unread taps fill the cache.
        self._wait_until(
            self.bound.has_room, lambda: f"room in the taps cache {self.storage} (at most {self.bound.max_bytes} bytes)"
        )
        path = self._request(token_ids)
        try:
            found = self._wait_and_load(path)
        finally:
            path.unlink(missing_ok=True)
            failure_marker(path).unlink(missing_ok=True)
        return arrange_taps(found, token_ids, self.tap_ids)

    def taps_of(self, sequences: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        """The taps of several sequences, ``concurrency`` requests in flight (the engine batches
        them), in the order given."""
        if len(sequences) <= 1:
            return [self.taps(s) for s in sequences]
        with ThreadPoolExecutor(max_workers=min(self.concurrency, len(sequences))) as pool:
            return list(pool.map(self.taps, sequences))

    def _request(self, token_ids: list[int]) -> Path:
        body = {"model": self.model, "prompt": token_ids, "max_tokens": 1, "temperature": 0.0}
        try:
            resp = self.http.post(f"{self.url}/v1/completions", json=body)
        except httpx.HTTPError as exc:
            raise EngineError(f"taps request to {self.url} failed: {exc!r}") from exc
        if resp.status_code != 200:
            raise EngineError(f"taps request to {self.url} failed: HTTP {resp.status_code}: {resp.text[:500]}")
        params = resp.json().get("kv_transfer_params") or {}
        if "hidden_states_path" not in params:
            raise EngineError(
                f"the server at {self.url} returned no hidden_states_path: is it a taps server "
                "(extract_hidden_states with the project's connector)?"
            )
        path = Path(params["hidden_states_path"])
        if path.parent.resolve() != self.storage.resolve():
            raise EngineError(f"the engine wrote taps to {path}, outside its taps folder {self.storage}")
        return path

    def _wait_and_load(self, path: Path) -> dict[str, torch.Tensor]:
        # The response comes before the worker has written the file (it writes when the request's
        # blocks are released); the file appears whole (renamed into place), or its failure marker
        # does (the connector could not write it).
        failed = failure_marker(path)
        self._wait_until(lambda: path.exists() or failed.exists(), lambda: f"the taps file {path.name}")
        if not path.exists():
            why = failed.read_text(errors="replace").strip()
            raise EngineError(f"the taps server at {self.url} could not write the taps file {path}: {why}")
        return load_file(str(path))

    def _wait_until(self, ready: Callable[[], bool], what: Callable[[], str]) -> None:
        """Until ``ready()``; a dead server or ``timeout`` seconds end the wait with an EngineError."""
        deadline = time.monotonic() + self.timeout
        delay, asked_at = 0.002, time.monotonic()
        while not ready():
            if time.monotonic() - asked_at >= 1:
                asked_at = time.monotonic()
                if not self.alive():
                    raise EngineError(f"the taps server at {self.url} died while this client waited for {what()}")
            if time.monotonic() > deadline:
                raise EngineError(f"the taps client waited {self.timeout:.0f} s for {what()} (server {self.url})")
            self.sleep(delay)
            # At most 10 ms late: a 0.1 s cap left a finished file unread for up to 0.1 s, the
            # request's slot idle meanwhile (one 8B sequence's taps take ~0.25 s on an H100).
            delay = min(delay * 2, 0.01)


class EngineTapSource:
    """Training batches' taps from a taps server, a tap source of training
    (``training.tap_sources.TapSource``): right-padded [b, length, K*H] on ``device``.

    ``prefetch(sequences)`` asks for a later batch's taps in the background, so the engine
    computes batches i+1 .. i+``prefetch_depth`` while the trainer's GPU steps on batch i (the
    loop asks for each batch once, as soon as it is that far ahead); ``taps`` of those same
    sequences then takes the prefetched rows, and an engine error of the prefetch surfaces there.
    At most ``prefetch_depth`` batches wait ahead (a further prefetch is ignored until one is
    taken); the node-local cache's bound (``CacheBound``) still holds the engine back. One batch
    ahead left the engine idle while the trainer read the batch it had (SpecForge measured a
    remote target at 2.37x its colocated mode with two batches ahead over two servers)."""

    def __init__(self, client: EngineTaps, prefetch_depth: int = 1):
        self.client = client
        self.prefetch_depth = max(1, int(prefetch_depth))
        self._pool = ThreadPoolExecutor(max_workers=self.prefetch_depth, thread_name_prefix="taps-prefetch")
        self._ahead: dict[tuple[int, ...], Future] = {}

    def __enter__(self) -> EngineTapSource:
        return self

    def __exit__(self, *exc) -> None:
        # A prefetch still in flight is dropped (its batch is not trained on); closing the
        # client ends its wait.
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.client.close()

    @staticmethod
    def _key(sequences) -> tuple[int, ...]:
        return tuple(id(seq) for seq in sequences)  # the loop hands over its own sequence objects

    def _rows(self, sequences) -> list[torch.Tensor]:
        return self.client.taps_of([seq.input_ids.tolist() for seq in sequences])

    def prefetch(self, sequences) -> None:
        key = self._key(sequences)
        if key not in self._ahead and len(self._ahead) < self.prefetch_depth:
            self._ahead[key] = self._pool.submit(self._rows, sequences)

    def taps(self, sequences, input_ids: torch.Tensor, device, dtype) -> torch.Tensor:
        length = input_ids.shape[1]
        ahead = self._ahead.pop(self._key(sequences), None)
        if ahead is None:
            # Not asked for ahead: what waits ahead is of batches before this one (a loop that
            # went another way), never to be taken.
            for stale in self._ahead.values():
                stale.cancel()
            self._ahead.clear()
            rows = self._rows(sequences)
        else:
            rows = ahead.result()
        padded = [torch.nn.functional.pad(row, (0, 0, 0, length - row.shape[0])) for row in rows]
        return torch.stack(padded).to(device=device, dtype=dtype)


def taps_difference(engine: torch.Tensor, reference: torch.Tensor, num_taps: int) -> float:
    """The largest of the taps' max-abs differences, each relative to its tap's largest absolute
    reference value (a relative measure, so one tolerance serves every model scale)."""
    worst = 0.0
    for got, want in zip(engine.float().chunk(num_taps, dim=-1), reference.float().chunk(num_taps, dim=-1)):
        scale = want.abs().max().clamp_min(1e-12)
        worst = max(worst, float((got - want).abs().max() / scale))
    return worst


def target_taps(target, tap_ids: Sequence[int], token_ids: Sequence[int]) -> torch.Tensor:
    """One sequence's taps from the in-process target (``model.taps``), on the CPU."""
    from dflash_pipeline.model.taps import TargetTaps

    device = next(target.parameters()).device
    return TargetTaps(target, tap_ids)(torch.tensor([list(token_ids)], device=device))[0].cpu()


# Beyond the target's weights, what its reference forward needs on a GPU (one sample's activations,
# the allocator's slack): a target that leaves less free on the job's GPU computes on the CPU.
REFERENCE_HEADROOM_BYTES = 2 * 2**30


def reference_device(device: torch.device, target_bytes: int | None, free_bytes: int | None) -> torch.device:
    """Where the per-run check's reference is computed: the job's device when the target's weights
    fit its free memory with ``REFERENCE_HEADROOM_BYTES`` to spare (or either size is unknown),
    else the CPU. A target larger than one GPU is what the engine shards over the job's GPUs;
    its reference is one sample's forward (up to 256 tokens), seconds to minutes on a host."""
    if device.type != "cuda" or target_bytes is None or free_bytes is None:
        return device
    return device if target_bytes + REFERENCE_HEADROOM_BYTES <= free_bytes else torch.device("cpu")


def check_engine_taps(client: EngineTaps, reference: torch.Tensor, token_ids: Sequence[int], tolerance: float) -> float:
    """One sample's taps from the engine against ``reference``, the in-process target's
    (``target_taps``): raises ``TapsMismatch`` above ``tolerance`` (``taps_difference``); returns
    the difference. Catches what the engine may do differently from the target's forward (hybrid
    layers, prefix caching, chunked prefill, a wrong layer)."""
    difference = taps_difference(client.taps(token_ids), reference, len(client.tap_ids))
    if not difference <= tolerance:
        raise TapsMismatch(
            f"the engine's taps differ from the target's by {difference:.3g} (largest absolute "
            f"difference relative to the tap's largest value) over {len(token_ids)} tokens, above "
            f"train.taps_server.parity_tolerance {tolerance}: the engine computes other taps"
        )
    return difference


def taps_client(address: dict, tap_ids: Sequence[int], server: dict, **kwargs) -> EngineTaps:
    """A client of the taps server at ``address`` (``EngineTaps.address``) with the config's
    ``train.taps_server`` settings."""
    return EngineTaps(
        address["url"], address["model"], address["storage"], tap_ids,
        timeout=server["request_timeout_s"], concurrency=server["concurrency"],
        max_cache_bytes=server["max_cache_bytes"], **kwargs,
    )  # fmt: skip


def server_dtype(server: dict, device) -> str:
    """The dtype the taps server computes in: ``train.taps_server.dtype``, else the dtype the
    in-process target computes in on ``device`` (``model.target.target_compute_dtype``)."""
    from dflash_pipeline.model.target import target_compute_dtype

    return server["dtype"] or target_compute_dtype(device)


@contextmanager
def checked_taps_server(
    target_dir: str,
    tap_ids: Sequence[int],
    server: dict,
    engines: dict | None,
    run_dir: Path,
    log_path: Path,
    sample: Sequence[int],
    device,
    purpose: str,
    clients: int = 1,
    quantization: str | None = None,
) -> Iterator[EngineTaps]:
    """A vLLM taps server of ``target_dir`` on this node (``server``: the config's
    ``train.taps_server``; ``engines``: where vLLM is installed) with its files in ``run_dir``,
    and its taps of ``sample`` checked against the in-process target's before anything else asks
    it (the per-run check); yields a client. ``purpose`` (the config key that asked for it) names
    the job in a refusal; ``clients``: the processes that will ask it, each with
    ``server["concurrency"]`` requests in flight at most."""
    from dflash_pipeline.core.resources import checkpoint_bytes
    from dflash_pipeline.engines.environments import configured_engine, engine_env, engine_python
    from dflash_pipeline.engines.launch import ManagedServer, free_port
    from dflash_pipeline.engines.limits import taps_refusal
    from dflash_pipeline.model.target import load_target, target_compute_dtype

    installed = configured_engine("vllm", engines)
    refused = taps_refusal("vllm", installed.version, installed.build)
    if refused:
        raise SystemExit(f"{purpose} engine: {refused}")
    device = torch.device(device)
    dtype = server_dtype(server, device)
    # The reference first, computed by the target as online training's in-process one computes
    # (what the engine replaces), and the target freed before the server starts: on a GPU the
    # server takes its share of the memory, and a target beside it would not fit (a 27B target
    # alone is 54 GB), where the engine is there for targets that do not fit beside a trainer.
    # A target that does not fit the job's GPU (the engine shards it) computes it on the CPU, in
    # the dtype it would have on the GPU.
    free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else None
    weights = checkpoint_bytes(target_dir)
    where = reference_device(device, weights, free)
    if where != device:
        log.info(
            "the target's weights (%s bytes) do not fit the %s bytes free on %s: the per-run check's "
            "reference is computed on the CPU", weights, free, device,
        )  # fmt: skip
    target = load_target(target_dir, where, getattr(torch, target_compute_dtype(device)), quantization)
    reference = target_taps(target, tap_ids, sample)
    del target
    if device.type == "cuda":
        torch.cuda.empty_cache()
    spec = taps_server_spec(
        target_dir, tap_ids, free_port(), run_dir, python=engine_python("vllm", engines),
        env=engine_env("vllm", engines), tp=max(1, torch.cuda.device_count()) if device.type == "cuda" else 1,
        mem_fraction=server["mem_fraction"], dtype=dtype,
        max_model_len=server["max_model_len"], max_num_seqs=server["concurrency"] * clients,
        extra_args=server["extra_args"], quantization=quantization,
    )  # fmt: skip
    address = {"url": spec.url, "model": spec.model, "storage": str(taps_storage(spec))}
    with ManagedServer(spec, log_path, run_dir, startup_timeout=server["startup_timeout_s"]) as managed:
        with taps_client(address, tap_ids, server, alive=managed.alive) as client:
            difference = check_engine_taps(client, reference, sample, server["parity_tolerance"])
            log.info(
                "taps server %s: one sample's taps (%d tokens) within %.3g of the target's (tolerance %g)",
                spec.url, len(sample), difference, server["parity_tolerance"],
            )  # fmt: skip
            yield client
