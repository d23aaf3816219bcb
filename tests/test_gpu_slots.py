"""GPU slots: concurrent jobs never share a device (fake device ids on a CPU machine)."""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dflash_pipeline.core.gpu_slots import GpuLease, device_pool

HERE = Path(__file__).resolve().parent


def test_pool_is_the_inherited_visible_devices_when_set():
    assert device_pool(4, None) == ["0", "1", "2", "3"]
    assert device_pool(4, "") == ["0", "1", "2", "3"]
    assert device_pool(8, "2,5") == ["2", "5"]


def test_leases_in_one_pool_are_disjoint_and_released(tmp_path):
    pool = device_pool(4)
    a = GpuLease(2, pool, tmp_path)
    b = GpuLease(2, pool, tmp_path)
    c = GpuLease(1, pool, tmp_path)
    a.acquire(timeout=5)
    b.acquire(timeout=5)
    assert set(a.devices).isdisjoint(b.devices)
    assert len(set(a.devices) | set(b.devices)) == 4
    with pytest.raises(TimeoutError):
        c.acquire(timeout=0.5, poll=0.1)
    assert c.devices == []  # all or nothing: a failed try holds no lock
    a.release()
    assert len(c.acquire(timeout=5)) == 1
    b.release()
    c.release()


def test_asking_for_more_than_the_pool_is_refused(tmp_path):
    with pytest.raises(ValueError, match="asks for 3 GPUs but the pool has 2"):
        GpuLease(3, device_pool(2), tmp_path)


def test_zero_gpus_takes_no_lock(tmp_path):
    lease = GpuLease(0, [], tmp_path)
    assert lease.acquire() == [] and lease.visible_devices == ""


def _hold(lock_dir, held, release):
    lease = GpuLease(1, device_pool(1), lock_dir)
    lease.acquire(timeout=60)
    held.set()
    release.wait()
    os._exit(0)  # no release: the kernel must free the lock when the process dies


def test_lock_is_freed_when_the_holder_dies(tmp_path):
    fork = multiprocessing.get_context("fork")
    held, release = fork.Event(), fork.Event()
    proc = fork.Process(target=_hold, args=(tmp_path, held, release))
    proc.start()
    assert held.wait(timeout=60), "the holder never took the lock"
    waiter = GpuLease(1, device_pool(1), tmp_path)
    with pytest.raises(TimeoutError):  # held until the test lets the holder die
        waiter.acquire(timeout=0.3, poll=0.1)
    release.set()
    proc.join(timeout=60)
    assert proc.exitcode == 0
    assert waiter.acquire(timeout=0) == ["0"]  # free at once: no wait for anything
    waiter.release()


def test_wrapper_sets_visible_devices_and_keeps_the_lock_while_the_command_runs(tmp_path):
    env = dict(os.environ)
    env.pop("CUDA_VISIBLE_DEVICES", None)
    cmd = [sys.executable, "-m", "dflash_pipeline.core.gpu_slots", "--gpus", "2", "--pool", "2"]
    cmd += ["--lock-dir", str(tmp_path), "--", sys.executable, "-c"]
    script = (
        f"import os, sys; sys.path.insert(0, {str(HERE.parent)!r});"
        "from dflash_pipeline.core.gpu_slots import GpuLease;"
        f"other = GpuLease(1, ['0', '1'], {str(tmp_path)!r});"
        "taken = other._try_take();"
        "print(os.environ['CUDA_VISIBLE_DEVICES'], taken)"
    )
    out = subprocess.run(cmd + [script], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["0,1", "False"]


@pytest.mark.workflow
def test_concurrent_snakemake_gpu_jobs_never_share_a_device(tmp_path):
    wf = tmp_path / "wf"
    shutil.copytree(HERE / "workflows" / "gpu_slots", wf)
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    env.pop("CUDA_VISIBLE_DEVICES", None)
    subprocess.run(
        [sys.executable, "-m", "snakemake", "--cores", "8", "--resources", "gpu=4", "--quiet"],
        cwd=wf,
        env=env,
        check=True,
        capture_output=True,
        timeout=300,
    )
    jobs = {p.stem: json.loads(p.read_text()) for p in sorted((wf / "out").glob("job*.json"))}
    assert len(jobs) == 8
    for job in jobs.values():
        assert len(job["devices"]) == job["asked"]
        assert set(job["devices"]) <= {"0", "1", "2", "3"}
    # Pairs of jobs seen holding their devices at the same moment (record_job.py).
    side_by_side = [(name, other) for name, job in jobs.items() for other in job["alongside"]]
    assert side_by_side, "no job ran beside another; the test proved nothing"
    for name, other in side_by_side:
        assert set(jobs[name]["devices"]).isdisjoint(jobs[other]["devices"]), (name, other, jobs)
