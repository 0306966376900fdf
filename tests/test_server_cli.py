"""`radixserve serve` and `serve run deploy/serve.yaml` as a user runs them: subprocesses that
start their own Ray, serve real requests, and leave no process behind when stopped."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest
import torch
import yaml

from load_tests import bench_serving
from tests.serve_utils import free_port

pytestmark = pytest.mark.slow  # starts a live Ray Serve app

REPO = Path(__file__).resolve().parents[1]


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def start(cmd: list[str], url: str, log: Path) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.Popen(
        cmd,
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        env=env,
        cwd=REPO,
        start_new_session=True,
        # As from a terminal: a suite run in the background (`cmd &`) ignores SIGINT, and a child
        # would inherit that and never see the Ctrl-C these tests send it.
        preexec_fn=_default_sigint,
    )
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        assert proc.poll() is None, log.read_text()[-3000:]
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200 and httpx.get(
                url + "/get_server_info", timeout=5
            ).status_code in (200, 401):
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(1)
    proc.kill()
    raise AssertionError("server did not start:\n" + log.read_text()[-3000:])


def run_cli(*args: str) -> subprocess.CompletedProcess:
    """`radixserve serve ARGS` to its end (for arguments it refuses), output captured."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    return subprocess.run(
        [sys.executable, "-m", "radixserve.cluster.cli", "serve", *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=180,
    )


def listeners(port: int) -> list[tuple[int | None, list[str]]]:
    """Every process listening on `port` (pid, command line): for a failure's message."""
    found = []
    for c in psutil.net_connections("tcp"):
        if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port:
            try:
                found.append((c.pid, psutil.Process(c.pid).cmdline()[:3] if c.pid else []))
            except psutil.Error:
                found.append((c.pid, []))
    return found


def family(proc: subprocess.Popen) -> list[int]:
    """The command and every process it started (Ray's included), as of now."""
    return [proc.pid] + [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]


def stop(proc: subprocess.Popen, sig: int) -> None:
    """Signal the command; it must exit by itself, taking every process it started with it."""
    pids = family(proc)
    proc.send_signal(sig)
    assert proc.wait(timeout=90) == 0
    assert_gone(pids)


def assert_gone(family: list[int]) -> None:
    deadline = time.monotonic() + 30
    while (
        alive := [
            p for p in family if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE
        ]
    ) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not alive, [psutil.Process(p).cmdline()[:2] for p in alive]


async def queue_limit_scenario(url: str) -> None:
    """One request running, one queued (the limits are 1 and 1): the third gets 503."""
    long = {"model": "smol", "prompt": "A story:", "max_tokens": 2000, "ignore_eos": True, "stream": True}
    async with httpx.AsyncClient(base_url=url, timeout=60) as c:

        async def hold(started: asyncio.Event) -> None:
            async with c.stream("POST", "/v1/completions", json=long) as r:
                assert r.status_code == 200
                started.set()
                await asyncio.sleep(3600)  # keep it running until cancelled

        def replica() -> dict:
            return httpx.get(url + "/get_server_info", timeout=10).json()["replicas"][0]

        running_started, queued_started = asyncio.Event(), asyncio.Event()
        running = asyncio.create_task(hold(running_started))
        await asyncio.wait_for(running_started.wait(), 30)
        queued = asyncio.create_task(hold(queued_started))
        deadline = time.monotonic() + 10
        while (await asyncio.to_thread(replica))["queued"] != 1:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)
        refused = await c.post("/v1/completions", json={**long, "stream": False})
        assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
        assert refused.json()["error"]["code"] == "queue_full"
        assert not queued_started.is_set()  # its headers wait for its first token
        for t in (running, queued):
            t.cancel()
        await asyncio.gather(running, queued, return_exceptions=True)
    deadline = time.monotonic() + 10
    while (r := replica())["running"] + r["queued"]:
        assert time.monotonic() < deadline, r
        await asyncio.sleep(0.1)


async def sigterm_under_load_scenario(proc: subprocess.Popen, url: str) -> None:
    """SIGTERM with one request running and one queued (the limits are 1 and 1): both finish
    with every token; from the signal on, new requests get 503 shutting_down until the server
    is gone (then the connection is refused); the command exits 0 and leaves no process."""
    tokens = 48
    body = {"model": "smol", "prompt": "A story:", "max_tokens": tokens, "ignore_eos": True}
    stream_body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    async with httpx.AsyncClient(base_url=url, timeout=120) as c:

        async def streamed(started: asyncio.Event) -> dict:
            async with c.stream("POST", "/v1/completions", json=stream_body) as r:
                assert r.status_code == 200
                events = []
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        events.append(line[len("data: ") :])
                        started.set()
            assert events[-1] == "[DONE]", events[-3:]
            return json.loads(events[-2])["usage"]

        async def whole() -> dict:
            r = await c.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            return r.json()["usage"]

        async def replica() -> dict:
            return (await c.get("/get_server_info")).json()["replicas"][0]

        started = asyncio.Event()
        running = asyncio.create_task(streamed(started))
        await asyncio.wait_for(started.wait(), 60)
        queued = asyncio.create_task(whole())
        deadline = time.monotonic() + 10
        while (await replica())["queued"] != 1:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)
        pids = family(proc)
        proc.send_signal(signal.SIGTERM)
        seen: list[object] = []  # what a newcomer gets, in order, until the server is gone
        while proc.poll() is None:
            try:
                r = await c.post("/v1/completions", json={**body, "max_tokens": 1}, timeout=10)
                seen.append((r.status_code, r.json()["error"]["code"] if r.status_code != 200 else None))
            except httpx.TransportError:
                seen.append("refused")
            await asyncio.sleep(0.1)
            assert len(seen) < 900, seen[-5:]
        usages = await asyncio.gather(running, queued)
    assert [u["completion_tokens"] for u in usages] == [tokens, tokens]
    refused = [x for x in seen if x != "refused"]
    # One newcomer may still slip in before the drain starts; once it has, every one is refused.
    assert (503, "shutting_down") in refused and set(refused[refused.index((503, "shutting_down")) :]) == {
        (503, "shutting_down")
    }, seen
    assert proc.wait(timeout=90) == 0
    assert_gone(pids)


def test_cli_serves_queues_503_and_drains_on_sigterm(tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start(
        [
            sys.executable,
            "-m",
            "radixserve.cluster.cli",
            "serve",
            "--port",
            str(port),
            "--max-total-tokens",
            "4096",
            "--num-threads",
            "2",
            "--max-running-requests",
            "1",
            "--max-queued-requests",
            "1",
            "--served-model-name",
            "smol",
            "--max-header-bytes",
            "8192",
        ],
        url,
        tmp_path / "cli.log",
    )
    try:
        # The CLI starts Ray with the proxy's limits in its environment.
        big = httpx.get(url + "/health", headers={"x-big": "a" * 10_000}, timeout=30)
        assert big.status_code == 431 and big.json()["error"]["code"] == "request_header_fields_too_large", (
            big.status_code,
            listeners(port),
            [p.pid for p in psutil.Process(proc.pid).children(recursive=True)],
        )
        asyncio.run(queue_limit_scenario(url))
        with httpx.Client(base_url=url, timeout=60):
            reports = bench_serving.main(
                [
                    "--base-url",
                    url,
                    "--num-prompts",
                    "4",
                    "--random-input-len",
                    "16",
                    "--random-output-len",
                    "4",
                    "--ignore-eos",
                    "--max-concurrency",
                    "1",
                    "--output-file",
                    str(tmp_path / "bench.json"),
                ]
            )
            (report,) = reports.values()
            assert (report["completed"], report["failed"], report["total_output_tokens"]) == (4, 0, 16)
            saved = json.loads((tmp_path / "bench.json").read_text())
            assert saved["reports"]["server"]["model"] == "smol"
            assert saved["floor"]["floor_s"] > 0 and report["x_floor"] > 1
        asyncio.run(sigterm_under_load_scenario(proc, url))
    finally:
        if proc.poll() is None:
            stop(proc, signal.SIGTERM)
    log = (tmp_path / "cli.log").read_text()
    assert "RadixServe is ready at " + url in log and "drained: no request in flight" in log


def test_serve_run_yaml_with_two_replicas_and_sigint(tmp_path):
    config = yaml.safe_load((REPO / "deploy" / "serve.yaml").read_text())
    port = free_port()
    config["http_options"]["port"] = port
    (app,) = config["applications"]
    assert app["import_path"] == "radixserve.cluster.app:build_app"
    app["args"].update(port=port, dp=2, max_total_tokens=4096, num_threads=1)
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump(config))
    url = f"http://127.0.0.1:{port}"
    serve_bin = str(Path(sys.executable).parent / "serve")
    proc = start([serve_bin, "run", str(path)], url, tmp_path / "serve.log")
    try:
        with httpx.Client(base_url=url, timeout=60) as c:
            # Serving starts when the first replica is up; the second may still be loading.
            deadline = time.monotonic() + 120
            while True:
                replicas = c.get("/get_server_info").json()["replicas"]
                if len(replicas) == 2 or time.monotonic() > deadline:
                    break
                time.sleep(0.5)
            assert len(replicas) == 2 and len({r["replica_id"] for r in replicas}) == 2
            r = c.post(
                "/v1/chat/completions",
                json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "ignore_eos": True},
            ).json()
            assert r["usage"]["completion_tokens"] == 4
    finally:
        stop(proc, signal.SIGINT)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible")
def test_cli_device_cuda_without_gpus_is_a_clear_error():
    """No GPU in the cluster it starts: one line names the problem, the exit code is 2, and no
    process is left behind (it never deploys a replica that Ray could not place)."""
    proc = run_cli("--device", "cuda", "--port", str(free_port()))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert (
        "radixserve serve: error: --device cuda, but the Ray cluster has no GPU (ray status lists none): "
        "start GPU nodes, or run with --device cpu" in proc.stderr
    )
    assert "Traceback" not in proc.stderr


def test_cli_refuses_a_port_that_another_server_listens_on():
    """Serve's proxy binds with SO_REUSEPORT, which would let it share a port with another server
    of the same user, each taking part of the connections; the CLI refuses the port instead,
    before it starts Ray."""
    import socket

    with socket.socket() as other:
        other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)  # as another Serve proxy does
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]
        proc = run_cli("--port", str(port))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert (
        f"radixserve serve: error: 127.0.0.1:{port} is already in use by another server (--port, --host)"
        in proc.stderr
    )
    assert "Started a local Ray instance" not in proc.stdout + proc.stderr
