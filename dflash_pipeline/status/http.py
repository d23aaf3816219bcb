"""The status page's connection layer (``StatusHTTPServer``).

One thread accepts connections and reads each request head without
blocking (a client that has not sent its whole head within ``request_timeout_s`` of connecting
is dropped, so idle or half-sent connections tie up nothing); a fixed pool of ``workers``
threads answers complete requests. At most ``max_connections`` connections are held at once;
beyond that, new ones wait in the kernel's listen backlog (``backlog``). Every answer closes its
connection (HTTP/1.0): the page polls every two seconds, and no idle keep-alive connection can
hold a worker.
"""

from __future__ import annotations

import logging
import re
import selectors
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from http import HTTPStatus

log = logging.getLogger(__name__)

# Connection handling (see the module's docstring). The page's clients are a few browsers and
# scripts; the figures leave room for a crowd of them (bench/status_clients.py: 50 clients).
WORKERS = 8
MAX_CONNECTIONS = 1024  # and never more than the process's file descriptors allow
BACKLOG = 128
REQUEST_TIMEOUT_S = 5.0
WRITE_TIMEOUT_S = 10.0
# A request head longer than this (the stdlib's own limits are 64 KiB a line, 100 headers) is
# refused; GET requests carry nothing else.
MAX_HEAD_BYTES = 65536
HEAD_END = re.compile(rb"\r?\n\r?\n")


@dataclass
class _Pending:
    """A connection whose request head is still arriving."""

    address: tuple
    deadline: float
    head: bytearray = field(default_factory=bytearray)


def _close(conn: socket.socket) -> None:
    try:
        conn.shutdown(socket.SHUT_WR)  # the client reads the whole answer, then EOF
    except OSError:
        pass
    conn.close()


def _say_and_close(conn: socket.socket, status: HTTPStatus) -> None:
    """A last word to a client the server drops (best effort: never blocks)."""
    try:
        conn.send(f"HTTP/1.0 {status.value} {status.phrase}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n".encode())
    except OSError:
        pass
    _close(conn)


def _fd_room() -> int:
    """Connections the process can hold besides the files it needs for itself."""
    try:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    except (ImportError, OSError, ValueError):
        return MAX_CONNECTIONS
    return MAX_CONNECTIONS if soft == resource.RLIM_INFINITY else max(16, soft - 64)


class StatusHTTPServer:
    """Accepts connections and reads request heads on one thread; a fixed pool answers.

    The interface is socketserver's as the status server uses it: ``serve_forever``,
    ``shutdown``, ``server_close``, ``server_address``.
    """

    def __init__(
        self,
        address: tuple[str, int],
        handler_class,
        workers: int = WORKERS,
        max_connections: int = MAX_CONNECTIONS,
        backlog: int = BACKLOG,
        request_timeout_s: float = REQUEST_TIMEOUT_S,
        write_timeout_s: float = WRITE_TIMEOUT_S,
    ):
        host, port = address
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.socket = socket.socket(family, socket.SOCK_STREAM)
        try:
            self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self.socket.bind((host, port))
            self.socket.listen(backlog)
            self.socket.setblocking(False)
        except BaseException:
            self.socket.close()
            raise
        self.server_address = self.socket.getsockname()[:2]
        self.RequestHandlerClass = handler_class
        self.max_connections = min(max_connections, _fd_room())
        self.request_timeout_s = request_timeout_s
        self.write_timeout_s = write_timeout_s
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="status-worker")
        self._pending: dict[socket.socket, _Pending] = {}
        self._answering = 0  # connections handed to the pool: queued or being answered
        self._lock = threading.Lock()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._stop = threading.Event()
        self._stopped = threading.Event()
        self._stopped.set()

    # -- the accepting thread ------------------------------------------------------------------

    def serve_forever(self, poll_interval: float = 0.5) -> None:
        with self._lock:
            if self._stop.is_set():  # shut down before it began
                return
            self._stopped.clear()
        sel = selectors.DefaultSelector()
        sel.register(self._wake_r, selectors.EVENT_READ)
        listening = False
        try:
            while not self._stop.is_set():
                with self._lock:
                    room = len(self._pending) + self._answering < self.max_connections
                if room != listening:  # full: new connections wait in the listen backlog
                    if room:
                        sel.register(self.socket, selectors.EVENT_READ)
                    else:
                        sel.unregister(self.socket)
                    listening = room
                timeout = poll_interval
                if self._pending:
                    first = min(p.deadline for p in self._pending.values())
                    timeout = max(0.0, min(timeout, first - time.monotonic()))
                for key, _ in sel.select(timeout):
                    if key.fileobj is self.socket:
                        self._accept(sel)
                    elif key.fileobj is self._wake_r:
                        try:
                            self._wake_r.recv(4096)
                        except OSError:
                            pass
                    else:
                        self._read(sel, key.fileobj)
                self._expire(sel)
        finally:
            for conn in list(self._pending):
                sel.unregister(conn)
                conn.close()
            self._pending.clear()
            sel.close()
            self._stopped.set()

    def _accept(self, sel) -> None:
        for _ in range(64):  # a burst at most; the loop comes back while more wait
            with self._lock:
                if len(self._pending) + self._answering >= self.max_connections:
                    return
            try:
                conn, address = self.socket.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as err:  # out of file descriptors: let answers finish first
                log.warning("accept failed: %s", err)
                time.sleep(0.05)
                return
            conn.setblocking(False)
            self._pending[conn] = _Pending(address, time.monotonic() + self.request_timeout_s)
            sel.register(conn, selectors.EVENT_READ)

    def _read(self, sel, conn: socket.socket) -> None:
        pending = self._pending[conn]
        try:
            data = conn.recv(16384)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:  # the client gave up
            self._drop(sel, conn)
            return
        pending.head += data
        if HEAD_END.search(pending.head):
            self._drop(sel, conn, close=False)
            self._dispatch(conn, pending.address, bytes(pending.head))
        elif len(pending.head) > MAX_HEAD_BYTES:
            self._drop(sel, conn, say=HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE)

    def _expire(self, sel) -> None:
        now = time.monotonic()
        for conn in [c for c, p in self._pending.items() if p.deadline <= now]:
            self._drop(sel, conn, say=HTTPStatus.REQUEST_TIMEOUT)

    def _drop(self, sel, conn: socket.socket, close: bool = True, say: HTTPStatus | None = None) -> None:
        sel.unregister(conn)
        del self._pending[conn]
        if say is not None:
            _say_and_close(conn, say)
        elif close:
            conn.close()

    def _dispatch(self, conn: socket.socket, address, head: bytes) -> None:
        with self._lock:
            self._answering += 1
        try:
            self._pool.submit(self._answer, conn, address, head)
        except RuntimeError:  # the pool is shut down: the server is closing
            self._done(conn)

    # -- the workers ---------------------------------------------------------------------------

    def _answer(self, conn: socket.socket, address, head: bytes) -> None:
        try:
            conn.setblocking(True)
            conn.settimeout(self.write_timeout_s)
            self.RequestHandlerClass((conn, head), address, self)
        except Exception as err:  # the client went away mid-answer, or stopped reading
            log.debug("answer to %s failed: %s", address, err)
        finally:
            self._done(conn)

    def _done(self, conn: socket.socket) -> None:
        _close(conn)
        with self._lock:
            self._answering -= 1
        try:
            self._wake_w.send(b"x")  # a slot is free: the accepting thread may listen again
        except OSError:
            pass

    # -- control ---------------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Stop serve_forever (from another thread) and wait until it has returned; a
        serve_forever that starts later returns at once."""
        with self._lock:
            self._stop.set()
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
        self._stopped.wait()

    def server_close(self) -> None:
        self.socket.close()
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._wake_r.close()
        self._wake_w.close()
