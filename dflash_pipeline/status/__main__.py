"""Serve the status page of a run, or start / stop one in the background.

    python -m dflash_pipeline.status                 # serve in the foreground (config.yaml's run)
    python -m dflash_pipeline.status start           # serve in the background, print the URL
    python -m dflash_pipeline.status stop            # stop this tree's background server
    python -m dflash_pipeline.status --default-storage-prefix s3://bucket/prefix   # an S3 run

The run is found the way Snakemake finds it: ``results_dir``/``run`` of the config file, below
``--default-storage-prefix`` for S3 runs (credentials from ``SNAKEMAKE_STORAGE_S3_*``, else
boto's chain, as for the run), or given directly with ``--run-url``. The server only lists and reads the run.

The access token (required beyond loopback) comes from $DFLASH_STATUS_TOKEN or --token-file,
never from the command line, where every user of the machine sees it (``ps``). ``start`` hands it
to the background server through that server's environment.

``start`` records the server in a pid file (the tree's absolute working directory, host, port,
pid); ``stop`` stops only a server of this tree: a pid file copied with the tree, or a pid that
is no longer this tree's status server, is left alone.
"""

from __future__ import annotations

import argparse
import errno
import json
import logging
import os
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path


from dflash_pipeline.core import layout
from dflash_pipeline.core.credentials import protect_storage_credentials
from dflash_pipeline.core.run_cli import RunArgumentError, add_run_arguments, open_run
from dflash_pipeline.report import headline
from dflash_pipeline.status.events import DEFAULT_EVENTS_FILE
from dflash_pipeline.core.storage import ReadOnlyStorage
from dflash_pipeline.status.server import TOKEN_ENV, RedactingFilter, StatusServer
from dflash_pipeline.status.snapshot import RunSource, SnapshotBuilder

DEFAULT_PIDFILE = "logs/status-server.pid"
DEFAULT_LOGFILE = "logs/status-server.log"
MODULE = "dflash_pipeline.status"


class CliError(Exception):
    """A one-line message for the user; the command exits 1."""


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m dflash_pipeline.status",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("action", nargs="?", choices=["serve", "start", "stop"], default="serve")
    add_run_arguments(p, run_url=True)
    p.add_argument("--num-shards", type=int, help="shards per stage; overrides the config")
    p.add_argument("--num-segments", type=int, help="training segments; overrides the config")
    p.add_argument("--until", choices=layout.STAGES, help="the last stage the run builds; overrides the config")
    p.add_argument("--workdir", default=".", help="Snakemake's working directory (default: %(default)s)")
    p.add_argument(
        "--events-file",
        default=DEFAULT_EVENTS_FILE,
        help="the dflash logger plugin's events, relative to --workdir (default: %(default)s)",
    )
    p.add_argument("--host", default="127.0.0.1", help="bind address (default: %(default)s)")
    # A string, checked by hand: a bad port is one line and exit 1 (argparse prints its usage).
    p.add_argument("--port", default="8080", help="port (default: %(default)s; 0: any free one)")
    p.add_argument(
        "--allow-host",
        action="append",
        default=[],
        metavar="NAME",
        help="another name the page is reached by (a reverse proxy's); loopback names and "
        "the bound address are always allowed, any other Host header gets a 421",
    )
    p.add_argument("--token-file", help=f"a file holding the access token (mode 0600); default: ${TOKEN_ENV}")
    # Refused (see main): a token on the command line is visible to every user in `ps`.
    p.add_argument("--token", help=argparse.SUPPRESS)
    p.add_argument("--refresh", type=float, default=2.0, help="seconds between reads of the run")
    p.add_argument("--pidfile", default=DEFAULT_PIDFILE, help="start/stop: pid file, relative to --workdir")
    p.add_argument("--logfile", default=DEFAULT_LOGFILE, help="start: server log, relative to --workdir")
    return p


def parse_port(value: str) -> int:
    try:
        port = int(value)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise CliError(f"invalid port {value!r}: give a number from 0 to 65535 (0: any free port)")
    return port


def read_token(args) -> str | None:
    """The access token: from --token-file (readable by its owner only), else $DFLASH_STATUS_TOKEN."""
    if args.token_file:
        path = Path(args.token_file)
        try:
            mode = path.stat().st_mode
            token = path.read_text().strip()
        except OSError as err:
            raise CliError(f"cannot read the token file {path}: {err.strerror or err}") from None
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise CliError(f"the token file {path} is readable by other users: chmod 600 {path}")
        if not token:
            raise CliError(f"the token file {path} is empty")
        return token
    return os.environ.get(TOKEN_ENV) or None


def resolve_source(args) -> RunSource:
    workdir = Path(args.workdir)
    try:
        # Without --num-shards the page needs the config's, wherever the run is.
        run = open_run(args, workdir=workdir, config_needed=args.num_shards is None)
    except RunArgumentError as err:
        raise CliError(str(err)) from None
    config, run_url = run.config, run.url
    num_shards = args.num_shards if args.num_shards is not None else config["num_shards"]
    num_segments = args.num_segments
    if num_segments is None:
        num_segments = config.get("train", {}).get("segments", 0)
    # The stages the run builds: without a config file (--run-url and --num-shards given), those
    # of a default run up to --until.
    stages = layout.stages_built({**config, "until": args.until or config["until"]})
    events = Path(args.events_file)
    return RunSource(
        storage=ReadOnlyStorage.open(run_url),
        num_shards=num_shards,
        num_segments=num_segments,
        stages=stages,
        # The plugin writes one file per working directory, whatever run Snakemake drives there:
        # the snapshot shows only the Snakemake runs whose jobs write into this run root.
        events_file=events if events.is_absolute() else workdir / events,
        workdir=workdir,
        # As the report reads them: GPU-hours from the job benchmarks, the engine's τ configured.
        gpus_per_rule=headline.gpus_per_rule(config),
        evaluate_engine=config["evaluate"]["engine"],
    )


def page_url(host: str, port: int, token: str | None) -> str:
    shown = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
    shown = f"[{shown}]" if ":" in shown else shown
    return f"http://{shown}:{port}/" + ("?token=<token>" if token else "")


def _port_open(host: str, port: int) -> bool:
    target = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
    try:
        with socket.create_connection((target, port), timeout=0.5):
            return True
    except OSError:
        return False


# -- the pid file -------------------------------------------------------------------------------


def _tree(workdir) -> str:
    return os.path.realpath(workdir)


def read_pidfile(pidfile: Path) -> dict | None:
    """The record of a pid file: ``{"pid", "workdir", "host", "port"}``; a pid file of an older
    version (the pid alone) gives only the pid. None when there is none or it is unreadable."""
    try:
        text = pidfile.read_text().strip()
    except OSError:
        return None
    try:
        record = json.loads(text)
    except ValueError:
        return None
    if isinstance(record, int):  # the pid alone (older versions)
        return {"pid": record}
    if isinstance(record, dict) and isinstance(record.get("pid"), int):
        return record
    return None


def server_tree(pid: int, proc: str = "/proc") -> str | None:
    """The tree (absolute working directory) of the status server with this pid, or None when
    the process is gone or is no status server (pids get reused)."""
    try:
        argv = Path(f"{proc}/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return None
    args = [a.decode(errors="replace") for a in argv if a]
    if "-m" not in args or MODULE not in args or "serve" not in args:
        return None
    workdir = "."
    for i, arg in enumerate(args):
        if arg == "--workdir" and i + 1 < len(args):
            workdir = args[i + 1]
        elif arg.startswith("--workdir="):
            workdir = arg.split("=", 1)[1]
    if os.path.isabs(workdir):
        # What `start` passes. A server holding a storage credential is non-dumpable, and then
        # its /proc cwd is unreadable to its own user (its command line stays readable).
        return _tree(workdir)
    try:
        cwd = os.readlink(f"{proc}/{pid}/cwd")
    except OSError:
        return None
    return _tree(os.path.join(cwd, workdir))


def our_server(args) -> tuple[dict | None, str | None]:
    """(the record of this tree's running status server, or None; a one-line reason when a pid
    file exists but names no server of this tree)."""
    pidfile = Path(args.workdir) / args.pidfile
    record = read_pidfile(pidfile)
    if record is None:
        return None, None
    tree = _tree(args.workdir)
    recorded = record.get("workdir")
    if recorded is not None and recorded != tree:
        return None, (
            f"the pid file {pidfile} belongs to the status page of {recorded} "
            "(a copied tree?), not this one: left alone"
        )
    running = server_tree(record["pid"])
    if running != tree:
        return None, f"pid {record['pid']} of {pidfile} is no longer this tree's status page"
    return record, None


def write_pidfile(pidfile: Path, record: dict) -> None:
    pidfile.parent.mkdir(parents=True, exist_ok=True)
    tmp = pidfile.with_name(pidfile.name + ".tmp")
    tmp.write_text(json.dumps(record) + "\n")
    tmp.replace(pidfile)  # a reader never sees half a record


def start_background(args, port: int, token: str | None) -> int:
    workdir = Path(args.workdir)
    pidfile, logfile = workdir / args.pidfile, workdir / args.logfile
    record, _ = our_server(args)
    if record is not None:
        shown = record.get("port", port)
        print(f"Status page already running: {page_url(record.get('host', args.host), shown, token)}")
        return 0
    if port and _port_open(args.host, port):
        raise CliError(f"port {port} is taken by another program: status page not started (choose one with --port)")
    resolve_source(args)  # fail here, in the foreground, on a bad config
    tree = _tree(workdir)
    serve = [
        "serve",
        "--workdir",
        tree,
        *(["--configfile", *args.configfile] if args.configfile else []),
        "--events-file",
        args.events_file,
        "--host",
        args.host,
        "--port",
        str(port),
        "--refresh",
        str(args.refresh),
    ]
    for flag, value in (
        ("--run-url", args.run_url),
        ("--default-storage-prefix", args.default_storage_prefix),
        ("--num-shards", args.num_shards),
        ("--num-segments", args.num_segments),
        ("--until", args.until),
    ):
        if value is not None:
            serve += [flag, str(value)]
    for name in args.allow_host:
        serve += ["--allow-host", name]
    # The token travels in the server's environment (readable by this user alone), never in its
    # command line; a token file is read here, so the server needs no path to it.
    env = {k: v for k, v in os.environ.items() if k != TOKEN_ENV}
    if token:
        env[TOKEN_ENV] = token
    logfile.parent.mkdir(parents=True, exist_ok=True)
    with open(logfile, "ab") as log_fh:
        proc = subprocess.Popen(
            [sys.executable, "-m", MODULE, *serve],
            stdin=subprocess.DEVNULL,
            stdout=log_fh,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,  # outlives the caller (make, Snakemake's onstart)
        )
    # Recorded at once: a server slow to answer is still this tree's, and `stop` finds it.
    write_pidfile(pidfile, {"pid": proc.pid, "workdir": tree, "host": args.host, "port": port})
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pidfile.unlink(missing_ok=True)
            lines = [line for line in logfile.read_text(errors="replace").splitlines() if line.strip()]
            raise CliError(f"status page failed to start: {lines[-1] if lines else 'no output'} (log: {logfile})")
        if _port_open(args.host, port):
            break
        time.sleep(0.2)
    else:
        raise CliError(f"status page did not answer within 20 s; see {logfile}")
    print(f"Status page: {page_url(args.host, port, token)}  (stop it with: python -m {MODULE} stop)")
    return 0


def stop_background(args) -> int:
    pidfile = Path(args.workdir) / args.pidfile
    record, reason = our_server(args)
    if record is None:
        if reason is None:
            print("No status page running.")
        elif "belongs to" in reason:
            print(f"No status page of this tree running; {reason}.")
        else:
            print(f"No status page running ({reason}).")
            pidfile.unlink(missing_ok=True)  # this tree's own stale pid file
        return 0
    pid = record["pid"]
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and server_tree(pid) is not None:
        time.sleep(0.1)
    pidfile.unlink(missing_ok=True)
    print(f"Stopped the status page (pid {pid}).")
    return 0


def _stop_on_sigterm(signum, frame):
    raise KeyboardInterrupt  # leaves serve_forever in the main thread, closing the socket


def serve(args, port: int, token: str | None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    # The page reads the run's storage: with its credential in this process's environment, an
    # engine of the same user could read it from /proc (core.credentials).
    protect_storage_credentials()
    source = resolve_source(args)
    try:
        server = StatusServer(
            SnapshotBuilder(source), args.host, port, token, args.refresh, allowed_hosts=args.allow_host
        )
    except ValueError as err:  # beyond loopback without a token
        raise CliError(str(err)) from None
    except OverflowError as err:
        raise CliError(f"invalid port {port}: {err}") from None
    except OSError as err:
        if err.errno == errno.EADDRINUSE:
            raise CliError(f"port {port} on {args.host} is already in use (choose another with --port)") from None
        if err.errno == errno.EACCES:
            raise CliError(
                f"no permission to serve on port {port} (ports below 1024 need root; choose another with --port)"
            ) from None
        raise CliError(f"cannot serve on {args.host}:{port}: {err.strerror or err}") from None
    for handler in logging.getLogger().handlers:
        handler.addFilter(RedactingFilter(server.redact))
    signal.signal(signal.SIGTERM, _stop_on_sigterm)
    print(f"Status page of {source.storage.url}: {page_url(args.host, server.port, token)}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.httpd.server_close()
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser().parse_args(argv)
    try:
        if args.token is not None:
            raise CliError(
                f"--token puts the token on the command line, where `ps` shows it to every "
                f"user: set ${TOKEN_ENV} or use --token-file FILE (mode 0600) instead"
            )
        if args.action == "stop":
            return stop_background(args)
        port = parse_port(args.port)
        token = read_token(args)
        if args.action == "start":
            if port == 0:
                raise CliError("start needs a fixed port (--port 0 is for serve)")
            return start_background(args, port, token)
        return serve(args, port, token)
    except CliError as err:
        print(f"status page: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
