"""The taps connector's way from the engine's cache to a file, off the engine's step.

Imported by the connector (``dflash_taps_connector``) from the same folder, in the engine's own
environment: this module imports only torch, never vLLM nor the pipeline, so its logic runs and is
tested on a CPU without an engine.

A finished request's rows are gathered on the device (a tensor of their own: the cache's blocks
may be given to other requests at once), then copied to a reused host buffer with
``non_blocking=True`` on a side CUDA stream, and the copy's event recorded. A writer thread waits
for that event, writes the file and hands the buffer back. So the engine's step neither waits for
the device-to-host copy (~20-40 ms for a 27B target's sequence, synchronous before) nor for the
file; a file is never written before its copy finished, and a buffer is never refilled while a copy
or a write still uses it. On the CPU (vLLM's CPU build) the copy is a plain one and its "event" is
done at once.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Protocol

import torch

# Files being copied or written at once at most: each holds its rows in a host buffer of its own
# until written (an 8B target's 3,072-token sequence with 5 taps: 126 MB).
MAX_PENDING_WRITES = 4


class BackgroundWrites:
    """Files written on a thread of their own, so that the engine's step loop does not wait for
    them: a 126 MB taps file took ~56 ms to /dev/shm on a Xeon (1.3 s to a disk's /tmp), and the
    loop went on meanwhile (the write releases the GIL). At most ``limit`` in flight: a new one
    waits for the oldest. A failed write raises at the next ``submit`` or ``settle`` (the engine's
    next step): the engine then stops and its clients see a dead server. The client of the file
    itself learns it at once, from the marker the connector's ``write_taps_file`` leaves, also
    when the write failed after the engine's last step."""

    def __init__(self, limit: int = MAX_PENDING_WRITES):
        self.limit = limit
        self._pool: ThreadPoolExecutor | None = None
        self._pending: deque[Future] = deque()

    def settle(self, below: int | None = None) -> None:
        """Collect the finished writes (raising a failed one's error); with ``below``, wait until
        fewer than that many are in flight."""
        while self._pending and (self._pending[0].done() or (below is not None and len(self._pending) >= below)):
            self._pending.popleft().result()

    def submit(self, write: Callable[..., None], *args: Any) -> None:
        self.settle(below=self.limit)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dflash-taps-write")
        self._pending.append(self._pool.submit(write, *args))


class CopyDone(Protocol):
    """What a copy returns: ``torch.cuda.Event``'s ``synchronize`` (returns once the copy is done)."""

    def synchronize(self) -> None: ...


class _Done:
    def synchronize(self) -> None:
        pass


class HostCopy:
    """A plain copy to host memory, done when it returns (the CPU: the engine's cache is there)."""

    pin_memory = False

    def copy(self, host: torch.Tensor, rows: torch.Tensor) -> CopyDone:
        host.copy_(rows)
        return _Done()


class CudaHostCopy:
    """An asynchronous device-to-host copy into pinned memory on a side stream of its own; the
    returned event is done when the copy is."""

    pin_memory = True

    def __init__(self, device: torch.device):
        self.stream = torch.cuda.Stream(device=device)

    def copy(self, host: torch.Tensor, rows: torch.Tensor) -> CopyDone:
        # The rows were gathered on the engine's stream: the copy starts after that gather.
        self.stream.wait_stream(torch.cuda.current_stream(rows.device))
        with torch.cuda.stream(self.stream):
            host.copy_(rows, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.stream)
        # The gathered rows' memory is not handed to another tensor before the side stream's copy.
        rows.record_stream(self.stream)
        return done


def host_copy_for(device: torch.device) -> HostCopy | CudaHostCopy:
    return CudaHostCopy(device) if device.type == "cuda" else HostCopy()


class RowsToHost:
    """Rows copied into ``limit`` reused host buffers and written out by ``write(host_rows, *args)``
    on a writer thread once their copy is done.

    A buffer grows only for rows larger than any it held, so a server's buffers reach the size of
    its longest sequences and stay there (pinned memory is slow to allocate). When every buffer is
    in flight, ``submit`` waits for the oldest copy-and-write (the back-pressure the engine's step
    feels only then). A failed write raises at a later ``submit`` or ``settle``, as
    ``BackgroundWrites`` says."""

    def __init__(self, copier: HostCopy | CudaHostCopy, limit: int = MAX_PENDING_WRITES):
        self.copier = copier
        self.writes = BackgroundWrites(limit)
        self.allocations = 0  # host buffers allocated so far (growth included)
        self._lock = threading.Lock()
        self._free: list[torch.Tensor] = [torch.empty(0, dtype=torch.uint8) for _ in range(limit)]

    def settle(self) -> None:
        self.writes.settle()

    def submit(self, rows: torch.Tensor, write: Callable[..., None], *args: Any) -> None:
        # Fewer than ``limit`` copy-and-writes in flight, each holding one buffer: one is free.
        self.writes.settle(below=self.writes.limit)
        nbytes = rows.numel() * rows.element_size()
        buffer = self._take(nbytes)
        try:
            host = buffer[:nbytes].view(rows.dtype).view(rows.shape)
            done = self.copier.copy(host, rows)
        except BaseException:
            self._give(buffer)
            raise

        def copy_then_write() -> None:
            try:
                done.synchronize()
                write(host, *args)
            finally:
                self._give(buffer)

        self.writes.submit(copy_then_write)

    def _take(self, nbytes: int) -> torch.Tensor:
        with self._lock:
            # The smallest free buffer that holds the rows, else the largest one (to be grown).
            sizes = [b.numel() for b in self._free]
            fits = [i for i, size in enumerate(sizes) if size >= nbytes]
            index = min(fits, key=sizes.__getitem__) if fits else max(range(len(sizes)), key=sizes.__getitem__)
            chosen = self._free.pop(index)
        if chosen.numel() >= nbytes:
            return chosen
        del chosen  # grown: the smaller buffer goes
        self.allocations += 1
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.copier.pin_memory)

    def _give(self, buffer: torch.Tensor) -> None:
        with self._lock:
            self._free.append(buffer)
