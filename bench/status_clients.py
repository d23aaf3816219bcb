"""The status page under a crowd: concurrent clients polling /api/status, and half-sent requests.

Serves a mid-flight run (tests/support/status_run.py, plus finished prepare shards) with
``python -m dflash_pipeline.status serve`` in a process of its own, then, from this process
(asyncio, one connection per request, as the page's HTTP/1.0 answers close them):

* ``load``: ``--clients`` clients, each requesting /api/status back to back for ``--seconds``;
  latency (connect to the answer's last byte) p50/p95/p99/max, requests, errors, the server's
  threads (most seen), and the kernel's listen-queue overflows meanwhile (TcpExt ListenOverflows,
  machine-wide: other programs' count too);
* ``half_open``: ``--half-open`` connections that send part of a request head and then nothing;
  how many the server had closed within ``--half-open-wait`` seconds, when the last was closed,
  its threads (most seen), and the latency of whole requests made meanwhile.

``--compare head`` runs the same against the server of the checkout's HEAD commit
(``git show HEAD:dflash_pipeline/status/server.py``), to set the figures side by side.

    python bench/status_clients.py --out bench/results/status_clients.json [--compare head]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

from benchlib import cpu_model, emit, provenance

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from dflash_pipeline.core import layout  # noqa: E402
from dflash_pipeline.core.storage import LocalStorage  # noqa: E402
from tests.support.status_run import write_run  # noqa: E402

# The HEAD commit's server, run with the same run as this checkout's (--compare head).
HEAD_RUNNER = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    sys.path.insert(0, sys.argv[1])
    from legacy_status_server import StatusServer
    from dflash_pipeline.core.storage import ReadOnlyStorage
    from dflash_pipeline.status.snapshot import RunSource, SnapshotBuilder
    root, shards, events, workdir, port = sys.argv[2:7]
    source = RunSource(ReadOnlyStorage.open(root), num_shards=int(shards), events_file=Path(events),
                       workdir=Path(workdir))
    server = StatusServer(SnapshotBuilder(source), port=int(port))
    print("serving", flush=True)
    server.serve_forever()
    """
)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def listen_overflows() -> int:
    lines = Path("/proc/net/netstat").read_text().splitlines()
    for names, values in zip(lines[::2], lines[1::2]):
        if names.startswith("TcpExt:"):
            return int(dict(zip(names.split()[1:], values.split()[1:]))["ListenOverflows"])
    return 0


def threads_of(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("Threads:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


def summary(latencies: list[float]) -> dict:
    return {
        "p50_s": percentile(latencies, 50),
        "p95_s": percentile(latencies, 95),
        "p99_s": percentile(latencies, 99),
        "max_s": max(latencies) if latencies else None,
        "mean_s": statistics.fmean(latencies) if latencies else None,
    }


async def request(port: int, timeout_s: float) -> float:
    """One GET /api/status; its latency, or an exception."""
    started = time.perf_counter()

    async def exchange():
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            writer.write(f"GET /api/status HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nConnection: close\r\n\r\n".encode())
            data = await reader.read()  # to EOF: each answer closes its connection
        finally:
            writer.close()
        if not data.startswith(b"HTTP/1.") or data.split(b" ", 2)[1] != b"200":
            raise RuntimeError(f"answer {data[:40]!r}")

    await asyncio.wait_for(exchange(), timeout_s)
    return time.perf_counter() - started


async def sample_threads(pid: int, stop: asyncio.Event, seen: list[int]) -> None:
    while not stop.is_set():
        seen.append(threads_of(pid))
        await asyncio.sleep(0.2)


async def load(port: int, pid: int, clients: int, seconds: float) -> dict:
    latencies: list[float] = []
    errors: dict[str, int] = {}
    end = time.monotonic() + seconds

    async def client():
        while time.monotonic() < end:
            try:
                latencies.append(await request(port, 120))
            except Exception as err:  # noqa: BLE001 (every failure is a figure)
                name = type(err).__name__
                errors[name] = errors.get(name, 0) + 1

    stop, threads = asyncio.Event(), []
    sampler = asyncio.create_task(sample_threads(pid, stop, threads))
    before = listen_overflows()
    started = time.monotonic()
    await asyncio.gather(*(client() for _ in range(clients)))
    elapsed = time.monotonic() - started
    stop.set()
    await sampler
    return {
        "clients": clients,
        "seconds": round(elapsed, 2),
        "requests": len(latencies),
        "requests_per_s": round(len(latencies) / elapsed, 1),
        "errors": sum(errors.values()),
        "errors_by_kind": errors,
        "latency": {k: (round(v, 4) if v is not None else None) for k, v in summary(latencies).items()},
        "listen_overflows": listen_overflows() - before,
        "server_threads_max": max(threads, default=0),
    }


async def half_open(port: int, pid: int, count: int, wait_s: float) -> dict:
    """``count`` connections that send half a request head, then wait for the server to close them."""
    closed_at: list[float] = []
    started = time.monotonic()

    async def slow_client():
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), wait_s)
        except Exception:  # noqa: BLE001 (not even accepted within the wait)
            return
        try:
            writer.write(b"GET /api/status HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Half: ")
            await writer.drain()
            remaining = wait_s - (time.monotonic() - started)
            await asyncio.wait_for(reader.read(), max(0.1, remaining))  # EOF: the server closed it
            closed_at.append(time.monotonic() - started)
        except Exception:  # noqa: BLE001 (still open at the end of the wait, or reset)
            pass
        finally:
            writer.close()

    stop, threads = asyncio.Event(), []
    sampler = asyncio.create_task(sample_threads(pid, stop, threads))
    slow = [asyncio.create_task(slow_client()) for _ in range(count)]
    await asyncio.sleep(0.5)  # the half-sent ones connect first
    during, during_errors = [], 0
    for _ in range(10):
        try:
            during.append(await request(port, wait_s))
        except Exception:  # noqa: BLE001
            during_errors += 1
        await asyncio.sleep(0.2)
    await asyncio.gather(*slow)
    stop.set()
    await sampler
    return {
        "connections": count,
        "wait_s": wait_s,
        "closed_by_server": len(closed_at),
        "last_closed_after_s": round(max(closed_at), 2) if closed_at else None,
        "server_threads_max": max(threads, default=0),
        "requests_meanwhile": {
            "count": len(during),
            "errors": during_errors,
            **{k: (round(v, 4) if v is not None else None) for k, v in summary(during).items()},
        },
    }


def make_run(tmp: Path, shards: int) -> tuple[Path, Path]:
    root = tmp / "results/demo"
    run = LocalStorage(root)
    events = write_run(run, tmp)
    for shard in range(2, shards):
        run.write_bytes(layout.shard_key("prepare", shard), b"p")
    return root, events


def start_server(kind: str, tmp: Path, root: Path, events: Path, shards: int, port: int) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}
    env.pop("DFLASH_STATUS_TOKEN", None)
    if kind == "checkout":
        cmd = [
            sys.executable,
            "-m",
            "dflash_pipeline.status",
            "serve",
            "--run-url",
            str(root),
            "--num-shards",
            str(shards),
            "--workdir",
            str(tmp),
            "--events-file",
            str(events),
            "--port",
            str(port),
        ]
    else:
        legacy = tmp / "legacy"
        legacy.mkdir(exist_ok=True)
        source = subprocess.run(
            ["git", "show", "HEAD:dflash_pipeline/status/server.py"],
            cwd=REPO,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        (legacy / "legacy_status_server.py").write_text(source)
        cmd = [sys.executable, "-c", HEAD_RUNNER, str(legacy), str(root), str(shards), str(events), str(tmp), str(port)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                break
        except OSError:
            if proc.poll() is not None:
                raise SystemExit(f"the {kind} server exited ({proc.returncode})") from None
            time.sleep(0.2)
    # The first request builds the snapshot: not part of the figures.
    asyncio.run(request(port, 120))
    return proc


def measure(kind: str, args, tmp: Path, root: Path, events: Path) -> dict:
    port = free_port()
    proc = start_server(kind, tmp, root, events, args.shards, port)
    try:
        result = {"load": asyncio.run(load(port, proc.pid, args.clients, args.seconds))}
        if args.half_open:
            result["half_open"] = asyncio.run(half_open(port, proc.pid, args.half_open, args.half_open_wait))
        return result
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=50)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--shards", type=int, default=200, help="shards of the served run")
    parser.add_argument("--half-open", type=int, default=1000, help="half-sent requests (0: skip that phase)")
    parser.add_argument(
        "--half-open-wait",
        type=float,
        default=60.0,
        help="how long the half-sent connections wait for the server to close them",
    )
    parser.add_argument("--compare", choices=["head"], help="also measure the HEAD commit's server")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    record = {
        "benchmark": "status_clients",
        **provenance(f"CPU: {cpu_model()} ({os.cpu_count()} cores), loopback"),
        # The figures of "checkout" are those of the working tree, changes not yet committed included.
        "status_server_uncommitted": bool(
            subprocess.run(
                ["git", "status", "--porcelain", "--", "dflash_pipeline/status"],
                cwd=REPO,
                capture_output=True,
                text=True,
            ).stdout.strip()
        ),
        "load_average_before": os.getloadavg(),
        "settings": {k: getattr(args, k) for k in ("clients", "seconds", "shards", "half_open", "half_open_wait")},
    }
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        root, events = make_run(tmp, args.shards)
        record["checkout"] = measure("checkout", args, tmp, root, events)
        if args.compare == "head":
            record["head"] = measure("head", args, tmp, root, events)
    record["load_average_after"] = os.getloadavg()
    emit(record, args.out)


if __name__ == "__main__":
    main()
