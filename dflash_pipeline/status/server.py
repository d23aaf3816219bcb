"""The status page's HTTP server: one HTML page, its assets, and the run's snapshot as JSON.

Routes (GET only): ``/`` the page, ``/assets/<name>`` its script and style (shipped in the
package: the machines have no internet), ``/api/status`` the snapshot. Anything else is a 404;
asset names are looked up in a fixed table, so no request path ever reaches the file system.
Bound beyond loopback, every request but the static assets must carry the access token
(``?token=`` or ``Authorization: Bearer``). Secrets from the environment (S3 keys, the token)
are blanked out of every response and log line.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import logging
import os
import threading
import time
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from urllib.parse import parse_qs, urlsplit

from dflash_pipeline.status.snapshot import SnapshotBuilder

log = logging.getLogger(__name__)

ASSETS = {
    "app.js": "application/javascript; charset=utf-8",
    "style.css": "text/css; charset=utf-8",
}
# Environment variables whose values must never leave the server.
SECRET_ENV_VARS = (
    "SNAKEMAKE_STORAGE_S3_ACCESS_KEY",
    "SNAKEMAKE_STORAGE_S3_SECRET_KEY",
    "SNAKEMAKE_STORAGE_S3_TOKEN",
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
)
REDACTED = "[redacted]"


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

    The first request builds it; later requests get the last one at once and, when it is older
    than the refresh interval, start one rebuild in the background. The interval stretches to
    twice the last build's duration, so a slow listing (10,000 shards in S3 took ~3.5 s) never
    keeps the server listing back to back.
    """

    def __init__(self, builder: SnapshotBuilder, refresh_s: float = 2.0):
        self.builder = builder
        self.refresh_s = refresh_s
        self._lock = threading.Lock()
        self._first_build = threading.Lock()
        self._built_at = 0.0
        self._build_s = 0.0
        self._body: bytes | None = None
        self._rebuilding = False

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

    def body(self, redact: Redactor) -> bytes:
        if self._body is None:
            with self._first_build:  # concurrent first requests wait for one build
                if self._body is None:
                    self._build(redact)
        with self._lock:
            due = time.monotonic() - self._built_at >= max(self.refresh_s, 2 * self._build_s)
            start = due and not self._rebuilding
            if start:
                self._rebuilding = True
            body = self._body
        if start:
            threading.Thread(target=self._build, args=(redact,), name="snapshot", daemon=True).start()
        return body


def make_handler(state: StatusState, token: str | None, redact: Redactor):
    class Handler(BaseHTTPRequestHandler):
        server_version = "dflash-status"
        sys_version = ""

        def log_message(self, format, *args):  # noqa: A002 (the stdlib's signature)
            # The query may carry the token: log the path only, and blank secrets anyway.
            log.info("%s %s", self.command, redact(urlsplit(self.path).path))

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

        def _authorized(self, query: dict) -> bool:
            if token is None:
                return True
            given = (query.get("token") or [""])[0]
            header = self.headers.get("Authorization", "")
            if header.startswith("Bearer "):
                given = header[len("Bearer ") :]
            return hmac.compare_digest(given.encode(), token.encode())

        def do_GET(self) -> None:  # noqa: N802 (the stdlib's name)
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
            self._send(HTTPStatus.METHOD_NOT_ALLOWED, b"the status page is read-only\n", "text/plain")

        do_POST = do_PUT = do_DELETE = do_PATCH = _read_only  # noqa: N815

    return Handler


class StatusServer:
    """A threaded HTTP server for one run; ``port=0`` picks a free port."""

    def __init__(
        self,
        builder: SnapshotBuilder,
        host: str = "127.0.0.1",
        port: int = 8080,
        token: str | None = None,
        refresh_s: float = 2.0,
    ):
        if not is_loopback(host) and not token:
            raise ValueError(
                f"the status page is bound to {host}, beyond loopback: give it an access token "
                "(--token or DFLASH_STATUS_TOKEN), or bind it to 127.0.0.1"
            )
        self.token = token
        self.redact = Redactor.from_env(extra=[token] if token else [])
        self.state = StatusState(builder, refresh_s)
        self.httpd = ThreadingHTTPServer((host, port), make_handler(self.state, token, self.redact))
        self.httpd.daemon_threads = True
        self.host = host
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
