"""The workflow starts the status page itself when `status.serve` is set, and it outlives the run."""

from __future__ import annotations

import http.client
import json
import subprocess
import sys

import pytest

from tests.support.seaweed import free_port

pytestmark = pytest.mark.workflow


def test_status_serve_starts_the_page_which_keeps_serving_after_the_run(workflow, demo_model):
    port = free_port()
    workflow.write_config(status={"serve": True, "port": port}, target={"model": str(demo_model), "build_demo": False})
    stop = [sys.executable, "-m", "dflash_pipeline.status", "stop", "--workdir", str(workflow.root)]
    try:
        proc = workflow.snakemake("results/demo/outputs/ingest-summary.json")
        assert f"http://127.0.0.1:{port}/" in proc.stdout + proc.stderr
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        conn.request("GET", "/api/status")
        status = json.loads(conn.getresponse().read())
        assert status["run"].endswith("results/demo") and status["num_shards"] == 2
        assert status["storage"]["by_category"]["ingest"]["objects"] == 3
        # A second run finds it serving and leaves it alone.
        again = workflow.snakemake("results/demo/outputs/ingest-summary.json", "--forcerun", "ingest")
        assert "already running" in again.stdout + again.stderr
    finally:
        stopped = subprocess.run(stop, capture_output=True, text=True, timeout=60)
    assert "Stopped the status page" in stopped.stdout
