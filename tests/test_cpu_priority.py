"""The service processes' renicing (router/frontend/cpu_priority.py), on real processes."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from radixserve.router.frontend import cpu_priority

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice is Linux's")

# A child with a second thread, both alive until killed; prints "ready" once both run.
THREADED = """
import threading, time
threading.Thread(target=time.sleep, args=(600,), daemon=True).start()
print("ready", flush=True)
time.sleep(600)
"""


def thread_nices(pid: int) -> dict[int, int]:
    return {int(t): os.getpriority(os.PRIO_PROCESS, int(t)) for t in os.listdir(f"/proc/{pid}/task")}


def start_threaded() -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", THREADED], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    return proc


def test_renice_reaches_every_thread_and_never_raises_priority():
    proc = start_threaded()
    try:
        tids = sorted(thread_nices(proc.pid))
        assert len(tids) == 2
        # One thread already nicer than asked keeps its value.
        os.setpriority(os.PRIO_PROCESS, tids[1], 15)
        assert cpu_priority.renice_process(proc.pid, 10) == 1
        assert thread_nices(proc.pid) == {tids[0]: 10, tids[1]: 15}
        assert cpu_priority.renice_process(proc.pid, 5) == 0  # lower nice: nothing changes
        assert thread_nices(proc.pid) == {tids[0]: 10, tids[1]: 15}
    finally:
        proc.kill()
        proc.wait()
    assert cpu_priority.renice_process(proc.pid, 10) == 0  # gone: nothing to do, no error


def test_service_processes_are_found_by_title_and_reniced(monkeypatch):
    sleeper = subprocess.Popen(["ray::ProxyActor", "600"], executable="sleep")
    other = subprocess.Popen(["ray::ServeReplica:app:EngineReplica", "600"], executable="sleep")
    try:
        deadline = time.monotonic() + 10
        while sleeper.pid not in cpu_priority.processes_titled(("ray::ProxyActor",)):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert other.pid not in cpu_priority.processes_titled(cpu_priority.SERVE_SERVICE_TITLES)
        # This test's own process stays as it is: renice a stand-in for "this process".
        stand_in = start_threaded()
        try:
            monkeypatch.setattr(cpu_priority.os, "getpid", lambda: stand_in.pid)
            assert cpu_priority.lower_service_priority(0) == 0
            assert set(thread_nices(sleeper.pid).values()) == {0}
            assert cpu_priority.lower_service_priority(12) >= 3  # the sleeper's thread, the stand-in's two
            assert set(thread_nices(sleeper.pid).values()) == {12}
            assert set(thread_nices(stand_in.pid).values()) == {12}
            assert set(thread_nices(other.pid).values()) == {0}  # an engine replica keeps its priority
        finally:
            stand_in.kill()
            stand_in.wait()
    finally:
        for proc in (sleeper, other):
            proc.kill()
            proc.wait()
