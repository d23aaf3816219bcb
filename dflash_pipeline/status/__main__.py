"""Serve the status page of a run, or start / stop one in the background.

    python -m dflash_pipeline.status                 # serve in the foreground (config.yaml's run)
    python -m dflash_pipeline.status start           # serve in the background, print the URL
    python -m dflash_pipeline.status stop            # stop the background server
    python -m dflash_pipeline.status --default-storage-prefix s3://bucket/prefix   # an S3 run

The run is found the way Snakemake finds it: ``results_dir``/``run`` of the config file, below
``--default-storage-prefix`` for S3 runs (credentials from ``SNAKEMAKE_STORAGE_S3_*``), or given
directly with ``--run-url``. The server only lists and reads the run.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import yaml

from dflash_pipeline.core import layout
from dflash_pipeline.core.config import validate_config
from dflash_pipeline.status.events import DEFAULT_EVENTS_FILE
from dflash_pipeline.core.storage import ReadOnlyStorage
from dflash_pipeline.status.server import RedactingFilter, StatusServer
from dflash_pipeline.status.snapshot import RunSource, SnapshotBuilder
from dflash_pipeline.core.storage import is_s3_url

DEFAULT_PIDFILE = "logs/status-server.pid"
DEFAULT_LOGFILE = "logs/status-server.log"
TOKEN_ENV = "DFLASH_STATUS_TOKEN"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m dflash_pipeline.status", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("action", nargs="?", choices=["serve", "start", "stop"], default="serve")
    p.add_argument("--configfile", default="config.yaml", help="the workflow config (default: %(default)s)")
    p.add_argument("--run-url", help="the run root (local folder or s3:// URL); overrides the config")
    p.add_argument("--default-storage-prefix", help="the S3 prefix of an S3 run (as given to Snakemake)")
    p.add_argument("--num-shards", type=int, help="shards per stage; overrides the config")
    p.add_argument("--num-segments", type=int, help="training segments; overrides the config")
    p.add_argument("--until", choices=["prepare", "generate", "tokenize", "train", "evaluate"],
                   help="the last stage the run builds; overrides the config")
    p.add_argument("--workdir", default=".", help="Snakemake's working directory (default: %(default)s)")
    p.add_argument("--events-file", default=DEFAULT_EVENTS_FILE,
                   help="the dflash logger plugin's events, relative to --workdir (default: %(default)s)")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default: %(default)s)")
    p.add_argument("--port", type=int, default=8080, help="port (default: %(default)s; 0: any free one)")
    p.add_argument("--token", default=os.environ.get(TOKEN_ENV),
                   help=f"access token, required beyond loopback (default: ${TOKEN_ENV})")
    p.add_argument("--refresh", type=float, default=2.0, help="seconds between reads of the run")
    p.add_argument("--pidfile", default=DEFAULT_PIDFILE, help="start/stop: pid file, relative to --workdir")
    p.add_argument("--logfile", default=DEFAULT_LOGFILE, help="start: server log, relative to --workdir")
    return p


def resolve_source(args) -> RunSource:
    workdir = Path(args.workdir)
    config = {}
    if args.run_url is None or args.num_shards is None:
        config_path = workdir / args.configfile if not Path(args.configfile).is_absolute() else Path(args.configfile)
        if not config_path.is_file():
            raise SystemExit(f"config file {config_path} not found: give --configfile, or --run-url and --num-shards")
        config = validate_config(yaml.safe_load(config_path.read_text()) or {})
    run_url = args.run_url
    if run_url is None:
        root = layout.run_root(config["results_dir"], config["run"])
        provider = "s3" if args.default_storage_prefix else None
        run_url = layout.run_url(root, provider, args.default_storage_prefix)
    if not is_s3_url(run_url) and not Path(run_url).is_absolute():
        run_url = str(workdir / run_url)
    num_shards = args.num_shards if args.num_shards is not None else config["num_shards"]
    num_segments = args.num_segments
    if num_segments is None:
        num_segments = config.get("train", {}).get("segments", 0)
    until = args.until or config.get("until", "evaluate")
    events = Path(args.events_file)
    return RunSource(
        storage=ReadOnlyStorage.open(run_url),
        num_shards=num_shards,
        num_segments=num_segments,
        until=until,
        events_file=events if events.is_absolute() else workdir / events,
        workdir=workdir,
    )


def page_url(host: str, port: int, token: str | None) -> str:
    shown = "127.0.0.1" if host in ("0.0.0.0", "::") else host
    shown = f"[{shown}]" if ":" in shown else shown
    return f"http://{shown}:{port}/" + ("?token=<token>" if token else "")


def _port_open(host: str, port: int) -> bool:
    target = "127.0.0.1" if host in ("0.0.0.0", "::") else host
    try:
        with socket.create_connection((target, port), timeout=0.5):
            return True
    except OSError:
        return False


def _our_server_pid(pidfile: Path) -> int | None:
    """The pid in ``pidfile`` if that process is still a status server (pids get reused)."""
    try:
        pid = int(pidfile.read_text().strip())
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except (OSError, ValueError):
        return None
    return pid if b"dflash_pipeline.status" in cmdline else None


def start_background(args, argv: list[str]) -> int:
    workdir = Path(args.workdir)
    pidfile, logfile = workdir / args.pidfile, workdir / args.logfile
    url = page_url(args.host, args.port, args.token)
    if _our_server_pid(pidfile) and _port_open(args.host, args.port):
        print(f"Status page already running: {url}")
        return 0
    if _port_open(args.host, args.port):
        print(f"Port {args.port} is taken by another program: status page not started "
              "(choose one with --port)", file=sys.stderr)
        return 1
    resolve_source(args)  # fail here, in the foreground, on a bad config
    logfile.parent.mkdir(parents=True, exist_ok=True)
    serve_argv = ["serve" if a == "start" else a for a in argv]
    with open(logfile, "ab") as log_fh:
        proc = subprocess.Popen(
            [sys.executable, "-m", "dflash_pipeline.status", *serve_argv],
            stdin=subprocess.DEVNULL, stdout=log_fh, stderr=subprocess.STDOUT,
            start_new_session=True,  # outlives the caller (make, Snakemake's onstart)
        )
    pidfile.parent.mkdir(parents=True, exist_ok=True)
    pidfile.write_text(f"{proc.pid}\n")
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = logfile.read_text(errors="replace").splitlines()[-5:]
            print("Status page failed to start:\n  " + "\n  ".join(tail), file=sys.stderr)
            return 1
        if _port_open(args.host, args.port):
            print(f"Status page: {url}  (stop it with: python -m dflash_pipeline.status stop)")
            return 0
        time.sleep(0.2)
    print(f"Status page did not answer within 20 s; see {logfile}", file=sys.stderr)
    return 1


def stop_background(args) -> int:
    pidfile = Path(args.workdir) / args.pidfile
    pid = _our_server_pid(pidfile)
    if pid is None:
        print("No status page running.")
        pidfile.unlink(missing_ok=True)
        return 0
    os.kill(pid, signal.SIGTERM)
    pidfile.unlink(missing_ok=True)
    print(f"Stopped the status page (pid {pid}).")
    return 0


def _stop_on_sigterm(signum, frame):
    raise KeyboardInterrupt  # leaves serve_forever in the main thread, closing the socket


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser().parse_args(argv)
    if args.action == "start":
        return start_background(args, argv)
    if args.action == "stop":
        return stop_background(args)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    source = resolve_source(args)
    server = StatusServer(SnapshotBuilder(source), args.host, args.port, args.token, args.refresh)
    for handler in logging.getLogger().handlers:
        handler.addFilter(RedactingFilter(server.redact))
    signal.signal(signal.SIGTERM, _stop_on_sigterm)
    print(f"Status page of {source.storage.url}: {page_url(args.host, server.port, args.token)}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.httpd.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
