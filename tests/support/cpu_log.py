"""CPU seconds per test, for deciding where the suite's time goes (opt-in: DFLASH_TEST_CPU_LOG=path).

On a saturated CI machine the suite's wall time is about its CPU work divided by the cores, and a
test's wall time says more about what ran beside it than about the test. This plugin records, per
test (setup + call + teardown, so a module fixture's start lands on its first test and its stop
on its last), the CPU seconds of the pytest process and of every process it started, directly or
not: Snakemake, its jobs, engine servers and their workers.

How the descendants are counted:
- reaped children: ``RUSAGE_CHILDREN`` (each includes the children it reaped itself);
- live descendants: their own CPU plus their reaped children's (``/proc`` through psutil), at the
  test's start and end, so a module's server alive through the test counts only what it did then;
- descendants that escape the tree (their parent died first, so they were handed to init and
  nobody here reaps them: a server killed by its process group) are followed by a sampler thread
  (every ``SAMPLE_S``) and counted up to their last sample. Only a process seen outside the tree
  counts so: one that ends inside it is in its parent's reaped times, and one that its parent
  reaps just before dying itself (a shell and its command) is in the parent's, then in
  ``RUSAGE_CHILDREN``. A descendant orphaned and ended between two samples is missed.

Each test appends one tab-separated line to ``<path>`` (one write, O_APPEND, so xdist workers can
share the file): node id, wall seconds, the pytest process's CPU, its descendants' CPU, the sum.
``python -m tests.support.cpu_log <path>`` prints the table, largest first, with totals per file.
"""

from __future__ import annotations

import os
import resource
import sys
import threading
import time
from collections import defaultdict

import psutil
import pytest

SAMPLE_S = 0.5


def _own_and_reaped(proc: psutil.Process) -> float:
    times = proc.cpu_times()
    return times.user + times.system + times.children_user + times.children_system


def _rusage(who) -> float:
    usage = resource.getrusage(who)
    return usage.ru_utime + usage.ru_stime


class DescendantSampler:
    """Every descendant seen since the test began, with its last CPU reading and parent."""

    def __init__(self, root: psutil.Process):
        self.root = root
        self.lock = threading.Lock()
        # pid -> (proc, CPU, whether it was outside the tree: handed to init, nobody here reaps it)
        self.seen: dict[int, tuple[psutil.Process, float, bool]] = {}
        self.at_start: dict[int, float] = {}
        self.escaped_cpu = 0.0  # CPU of tracked processes that vanished outside our accounting
        self.stop_event = threading.Event()

    def sample(self) -> None:
        try:
            current = self.root.children(recursive=True)
        except psutil.Error:
            current = []
        with self.lock:
            in_tree = {p.pid: p for p in current}
            procs = dict(in_tree)
            for pid, (proc, _, _) in self.seen.items():
                procs.setdefault(pid, proc)  # keep following those that left the tree
            live_pids = set()
            for pid, proc in procs.items():
                try:
                    cpu = _own_and_reaped(proc)
                    if not proc.is_running():
                        raise psutil.NoSuchProcess(pid)
                except psutil.Error:
                    continue
                live_pids.add(pid)
                self.seen[pid] = (proc, cpu, pid not in in_tree)
            for pid in list(self.seen):
                if pid not in live_pids:
                    _, cpu, escaped = self.seen.pop(pid)
                    if escaped:  # nobody here reaped it: its CPU is nowhere else
                        self.escaped_cpu += cpu - self.at_start.get(pid, 0.0)

    def begin(self) -> None:
        self.sample()
        with self.lock:
            self.at_start = {pid: cpu for pid, (_, cpu, _) in self.seen.items()}
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop_event.wait(SAMPLE_S):
            self.sample()

    def end(self) -> float:
        """The descendants' CPU seconds since begin(), less what RUSAGE_CHILDREN holds."""
        self.stop_event.set()
        self.thread.join()
        self.sample()
        with self.lock:
            live = sum(cpu - self.at_start.get(pid, 0.0) for pid, (_, cpu, _) in self.seen.items())
            return live + self.escaped_cpu


class CpuLog:
    def __init__(self, path: str):
        self.path = path
        self.me = psutil.Process()

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item, nextitem):
        sampler = DescendantSampler(self.me)
        wall0 = time.monotonic()
        self0 = _rusage(resource.RUSAGE_SELF)
        children0 = _rusage(resource.RUSAGE_CHILDREN)
        sampler.begin()
        try:
            yield
        finally:
            tree = sampler.end()
            own = _rusage(resource.RUSAGE_SELF) - self0
            descendants = _rusage(resource.RUSAGE_CHILDREN) - children0 + tree
            line = f"{item.nodeid}\t{time.monotonic() - wall0:.1f}\t{own:.1f}\t{descendants:.1f}\t{own + descendants:.1f}\n"
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, line.encode())
            finally:
                os.close(fd)


def read_log(path: str) -> list[tuple[str, float, float, float, float]]:
    rows = []
    for line in open(path):
        nodeid, wall, own, descendants, total = line.rstrip("\n").split("\t")
        rows.append((nodeid, float(wall), float(own), float(descendants), float(total)))
    return rows


def main(argv: list[str]) -> None:
    rows = read_log(argv[0])
    top = int(argv[1]) if len(argv) > 1 else 40
    print(f"{'cpu s':>8} {'own':>7} {'desc':>8} {'wall s':>7}  test")
    for nodeid, wall, own, descendants, total in sorted(rows, key=lambda r: -r[4])[:top]:
        print(f"{total:8.1f} {own:7.1f} {descendants:8.1f} {wall:7.1f}  {nodeid}")
    per_file: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0])
    for nodeid, wall, _, _, total in rows:
        entry = per_file[nodeid.split("::")[0]]
        entry[0] += total
        entry[1] += wall
        entry[2] += 1
    print(f"\n{'cpu s':>8} {'wall s':>7} {'tests':>5}  file")
    for name, (total, wall, count) in sorted(per_file.items(), key=lambda kv: -kv[1][0]):
        print(f"{total:8.1f} {wall:7.1f} {count:5d}  {name}")
    print(f"\n{sum(r[4] for r in rows):8.1f} cpu s, {sum(r[1] for r in rows):.1f} wall s, {len(rows)} tests")


if __name__ == "__main__":
    main(sys.argv[1:])
