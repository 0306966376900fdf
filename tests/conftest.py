"""Suite-wide guard: a test module leaves no Ray instance behind.

A Ray instance that outlives its module (a GCS and raylet still running) keeps its Serve
controller, which restarts that instance's HTTP proxy on the port it was given; Serve binds with
SO_REUSEPORT, so a later module's server on a port that the kernel handed out again would share
it with the stale proxy, and some of its requests would reach the old application. Each module's
new GCS and raylet processes must be gone shortly after it ends; any left are killed (with their
workers), so that they cannot reach into later modules, and named in a warning.

It also imports radixserve's kernels before any test module imports torch, so that the engines
under test run with the OpenMP spin-wait setting that the server has (radixserve/kernels).
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Iterator

import psutil
import pytest

import radixserve.kernels  # noqa: F401  (before torch)

RAY_SERVERS = {"gcs_server", "raylet"}
GONE_WITHIN_S = 30.0


def ray_servers() -> dict[int, str]:
    """The GCS and raylet processes running now: pid -> command line."""
    found = {}
    for p in psutil.process_iter(["name", "cmdline"]):
        if p.info["name"] in RAY_SERVERS:
            found[p.pid] = " ".join((p.info["cmdline"] or [])[:2])
    return found


def kill_tree(pid: int) -> None:
    try:
        root = psutil.Process(pid)
        procs = [*root.children(recursive=True), root]
    except psutil.NoSuchProcess:
        return
    for p in procs:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(procs, timeout=10)


@pytest.fixture(autouse=True, scope="module")
def no_ray_instance_left_behind(request: pytest.FixtureRequest) -> Iterator[None]:
    before = set(ray_servers())
    yield
    deadline = time.monotonic() + GONE_WITHIN_S
    while (left := {pid: cmd for pid, cmd in ray_servers().items() if pid not in before}) and (
        time.monotonic() < deadline
    ):
        time.sleep(0.5)
    if left:
        for pid in left:
            kill_tree(pid)
        warnings.warn(
            pytest.PytestWarning(f"{request.module.__name__} left a Ray instance running, killed: {left}"),
            stacklevel=1,
        )
