"""The status page's HTTP server: one HTML page, its assets, and the run's snapshot as JSON.

Routes (GET only): ``/`` the page, ``/assets/<name>`` its script and style (shipped in the
package: the machines have no internet), ``/api/status`` the snapshot. Anything else is a 404;
asset names are looked up in a fixed table, so no request path ever reaches the file system.
Bound beyond loopback, every request but the static assets must carry the access token
(``?token=`` or ``Authorization: Bearer``). Secrets from the environment (S3 keys, the token)
are blanked out of every response and log line.

Only requests that name this server in their ``Host`` header are answered (loopback names, the
bound address, and names given with ``allowed_hosts``); any other gets a 421 without data, so a
web page whose DNS name is rebound to 127.0.0.1 cannot read the run through a visitor's browser.

Connections: ``status.http.StatusHTTPServer``.
"""

from __future__ import annotations

import hmac
import io
import ipaddress
import json
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass, field
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler
from importlib import resources
from urllib.parse import parse_qs, urlsplit

from dflash_pipeline.core.credentials import SECRET_ENV_VARS
from dflash_pipeline.status.http import REQUEST_TIMEOUT_S, WORKERS, StatusHTTPServer
from dflash_pipeline.status.snapshot import SnapshotBuilder

log = logging.getLogger(__name__)

ASSETS = {
    "app.js": "application/javascript; charset=utf-8",
    "style.css": "text/css; charset=utf-8",
}
REDACTED = "[redacted]"
TOKEN_ENV = "DFLASH_STATUS_TOKEN"

# Loopback names a browser on this machine uses for the page (with any port: an SSH tunnel
# maps the page to another local port).
LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
WILDCARD_HOSTS = frozenset({"", "0.0.0.0", "::"})


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def read_asset(name: str) -> bytes:
    return resources.files("dflash_pipeline.status").joinpath("assets", name).read_bytes()


class Redactor:
    """Blanks known secret values out of text."""

    def __init__(self, secrets):
        # Longest first, so a secret containing another is blanked whole.
        self.secrets = sorted({s for s in secrets if s and len(s) >= 4}, key=len, reverse=True)

    @classmethod
    def from_env(cls, extra=(), env=None) -> Redactor:
        env = os.environ if env is None else env
        return cls([env.get(name, "") for name in SECRET_ENV_VARS] + list(extra))

    def __call__(self, text: str) -> str:
        for secret in self.secrets:
            text = text.replace(secret, REDACTED)
        return text


class RedactingFilter(logging.Filter):
    """Blanks secrets in every record a handler writes (storage errors quote URLs and more)."""

    def __init__(self, redact: Redactor):
        super().__init__()
        self.redact = redact

    def filter(self, record: logging.LogRecord) -> bool:
        record.msg = self.redact(record.getMessage())
        record.args = None
        return True


class StatusState:
    """The shared snapshot, rebuilt only while someone is looking.

    The first request starts the first build; later requests get the last one at once and, when
    it is older than the refresh interval, start one rebuild in the background. The interval
    stretches to twice the last build's duration, so a slow listing (10,000 shards in S3 took
    ~3.5 s) never keeps the server listing back to back. Requests wait for the first build at
    most ``first_wait_s`` (the first read of a large S3 run takes minutes): then they get a
    placeholder that says so, and the worker is free for the next request.

    After an idle spell nobody looked, so the last snapshot can be minutes old: a request that
    finds it older than ``stale_after_s`` waits for the rebuild it starts (at most
    ``first_wait_s``, then it gets the old one) instead of showing the old state as current.
    """

    def __init__(
        self,
        builder: SnapshotBuilder,
        refresh_s: float = 2.0,
        first_wait_s: float = 10.0,
        stale_after_s: float = 30.0,
    ):
        self.builder = builder
        self.refresh_s = refresh_s
        self.first_wait_s = first_wait_s
        self.stale_after_s = stale_after_s
        self._rebuilt = threading.Event()  # set when the build in progress ends
        self._lock = threading.Lock()
        self._first_done = threading.Event()
        self._built_at = 0.0
        self._build_s = 0.0
        self._body: bytes | None = None
        self._rebuilding = False
        self._started_at: float | None = None

    def _build(self, redact: Redactor) -> None:
        started = time.monotonic()
        try:
            snapshot = self.builder.build()
        except Exception as err:  # storage down: say so on the page, keep serving
            log.warning("could not read the run: %s", redact(str(err)))
            snapshot = {"error": f"could not read the run: {err}", "generated_at": time.time()}
        body = redact(json.dumps(snapshot)).encode("utf-8")
        with self._lock:
            self._body, self._built_at = body, time.monotonic()
            self._build_s = self._built_at - started
            self._rebuilding = False
            rebuilt = self._rebuilt
        rebuilt.set()
        self._first_done.set()

    def _start_build(self, redact: Redactor) -> None:
        threading.Thread(target=self._build, args=(redact,), name="snapshot", daemon=True).start()

    def body(self, redact: Redactor) -> bytes:
        with self._lock:
            first = self._body is None and not self._rebuilding
            if first:
                self._rebuilding, self._started_at = True, time.monotonic()
        if first:
            self._start_build(redact)
        if not self._first_done.wait(self.first_wait_s):
            waited = time.monotonic() - (self._started_at or time.monotonic())
            return json.dumps(
                {
                    "error": f"reading the run for the first time ({waited:.0f} s so far; a large S3 run "
                    "takes minutes): the page fills in when it is done",
                    "generated_at": time.time(),
                }
            ).encode("utf-8")
        with self._lock:
            age = time.monotonic() - self._built_at
            due = age >= max(self.refresh_s, 2 * self._build_s)
            start = due and not self._rebuilding
            if start:
                self._rebuilding = True
                self._rebuilt = threading.Event()
            body, rebuilt = self._body, self._rebuilt
        if start:
            self._start_build(redact)
        if age >= self.stale_after_s and rebuilt.wait(self.first_wait_s):
            with self._lock:
                body = self._body
        return body


def split_host_header(value: str) -> tuple[str, str | None] | None:
    """``(name, port)`` of a Host header (port None when absent), or None if it is malformed."""
    value = value.strip().lower()
    if value.startswith("["):  # [v6]:port
        name, sep, rest = value[1:].partition("]")
        if not sep or (rest and not rest.startswith(":")):
            return None
        port = rest[1:] if rest else None
    elif value.count(":") == 1:
        name, port = value.split(":")
    elif ":" not in value:
        name, port = value, None
    else:  # a bare IPv6 address: not a valid Host
        return None
    if not name or (port is not None and not (port.isdigit() and len(port) <= 5)):
        return None
    return name.rstrip("."), port


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
        return True
    except ValueError:
        return False


@dataclass(frozen=True)
class HostPolicy:
    """Which ``Host`` headers the server answers.

    Loopback names with any port; the bound address (or, bound to every address, any IP literal
    and this machine's host name) and the names of ``extra`` with the bound port or none. DNS
    rebinding needs a DNS name that the server does not know; an IP literal is always the
    address the browser really connected to. A request without a Host header (HTTP/1.0 tools;
    browsers always send one) is answered.
    """

    bound_host: str
    bound_port: int
    extra: frozenset[str] = field(default_factory=frozenset)

    def names(self) -> frozenset[str]:
        names = {n.lower().rstrip(".") for n in self.extra}
        if self.bound_host not in WILDCARD_HOSTS:
            names.add(self.bound_host.strip("[]").lower())
        else:
            names.add(socket.gethostname().lower())
        return frozenset(names)

    def allows(self, header: str | None, names: frozenset[str] | None = None) -> bool:
        if header is None:
            return True
        parsed = split_host_header(header)
        if parsed is None:
            return False
        name, port = parsed
        if name in LOOPBACK_NAMES:
            return True
        if port is not None and int(port) != self.bound_port:
            return False
        if name in (self.names() if names is None else names):
            return True
        return self.bound_host in WILDCARD_HOSTS and _is_ip(name)


def make_handler(state: StatusState, token: str | None, redact: Redactor, hosts: HostPolicy):
    host_names = hosts.names()

    class Handler(BaseHTTPRequestHandler):
        server_version = "dflash-status"
        sys_version = ""

        def setup(self) -> None:
            # The server read the request head already (StatusHTTPServer): parse it from memory,
            # answer on the socket (whose timeout bounds a client that stops reading).
            self.connection, head = self.request
            self.rfile = io.BytesIO(head)
            self.wfile = self.connection.makefile("wb", buffering=0)

        def log_message(self, format, *args):  # noqa: A002 (the stdlib's signature)
            # The query may carry the token: log the path only, and blank secrets anyway.
            # A malformed request line is answered before it has a path.
            log.info("%s %s", self.command, redact(urlsplit(getattr(self, "path", "") or "").path))

        def log_error(self, format, *args):  # noqa: A002
            log.info("bad request: %s", redact(format % args))

        def _send(self, status: int, body: bytes, content_type: str) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")
            self.send_header("X-Content-Type-Options", "nosniff")
            self.send_header("Content-Security-Policy", "default-src 'self'; style-src 'self'")
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def _not_found(self) -> None:
            self._send(HTTPStatus.NOT_FOUND, b"not found\n", "text/plain; charset=utf-8")

        def _host_allowed(self) -> bool:
            given = self.headers.get_all("Host") or []
            if len(given) > 1:
                return False
            return hosts.allows(given[0] if given else None, host_names)

        def _misdirected(self) -> None:
            self._send(HTTPStatus.MISDIRECTED_REQUEST, b"misdirected request\n", "text/plain; charset=utf-8")

        def _authorized(self, query: dict) -> bool:
            if token is None:
                return True
            given = (query.get("token") or [""])[0]
            header = self.headers.get("Authorization", "")
            if header.startswith("Bearer "):
                given = header[len("Bearer ") :]
            return hmac.compare_digest(given.encode(), token.encode())

        def do_GET(self) -> None:  # noqa: N802 (the stdlib's name)
            if not self._host_allowed():
                return self._misdirected()
            url = urlsplit(self.path)
            path, query = url.path, parse_qs(url.query)
            if path.startswith("/assets/"):
                name = path[len("/assets/") :]
                if name in ASSETS:
                    return self._send(HTTPStatus.OK, read_asset(name), ASSETS[name])
                return self._not_found()
            if path not in ("/", "/index.html", "/api/status"):
                return self._not_found()
            if not self._authorized(query):
                return self._send(HTTPStatus.UNAUTHORIZED, b"token required\n", "text/plain; charset=utf-8")
            if path == "/api/status":
                return self._send(HTTPStatus.OK, state.body(redact), "application/json")
            return self._send(HTTPStatus.OK, read_asset("index.html"), "text/html; charset=utf-8")

        do_HEAD = do_GET  # noqa: N815

        def _read_only(self) -> None:
            if not self._host_allowed():
                return self._misdirected()
            self._send(HTTPStatus.METHOD_NOT_ALLOWED, b"the status page is read-only\n", "text/plain")

        do_POST = do_PUT = do_DELETE = do_PATCH = _read_only  # noqa: N815

    return Handler


class StatusServer:
    """The status page's server for one run; ``port=0`` picks a free port."""

    def __init__(
        self,
        builder: SnapshotBuilder,
        host: str = "127.0.0.1",
        port: int = 8080,
        token: str | None = None,
        refresh_s: float = 2.0,
        allowed_hosts=(),
        workers: int = WORKERS,
        request_timeout_s: float = REQUEST_TIMEOUT_S,
    ):
        if not is_loopback(host) and not token:
            raise ValueError(
                f"the status page is bound to {host}, beyond loopback: give it an access token "
                f"(${TOKEN_ENV} or --token-file), or bind it to 127.0.0.1"
            )
        self.token = token
        self.redact = Redactor.from_env(extra=[token] if token else [])
        self.state = StatusState(builder, refresh_s)
        self.host = host
        self._handler = None  # made once bound: the Host policy names the bound port
        self.httpd = StatusHTTPServer(
            (host, port),
            lambda *args: self._handler(*args),
            workers=workers,
            request_timeout_s=request_timeout_s,
        )
        self.hosts = HostPolicy(host, self.httpd.server_address[1], frozenset(allowed_hosts))
        self._handler = make_handler(self.state, token, self.redact, self.hosts)
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        return self.httpd.server_address[1]

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/"

    def serve_forever(self) -> None:
        self.httpd.serve_forever(poll_interval=0.5)

    def start(self) -> StatusServer:
        """Serve from a background thread (tests, embedding)."""
        self._thread = threading.Thread(target=self.serve_forever, name="status-server", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)
