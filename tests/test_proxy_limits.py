"""The HTTP proxy's limits (router/frontend/proxy.py) on a real uvicorn server, driven with raw
sockets: oversized and unterminated headers, oversized bodies, stalled and idle connections."""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import AsyncIterator

import pytest
import uvicorn

from radixserve.router.frontend import proxy
from radixserve.router.frontend.config import HTTPConfig
from radixserve.router.frontend.proxy import LimitedHttpToolsProtocol, ProxyLimits

LIMITS = ProxyLimits(
    max_header_bytes=4096,
    max_request_bytes=1000,
    header_timeout_s=0.5,
    body_timeout_s=0.5,
    body_total_timeout_s=1.5,
)


class Protocol(LimitedHttpToolsProtocol):
    limits = LIMITS


class App:
    """Reads the whole body and answers its length; records what each request received last."""

    def __init__(self) -> None:
        self.last: list[str] = []

    async def __call__(self, scope: dict, receive, send) -> None:
        if scope["path"] == "/early":  # answers before reading the body (as an auth check does)
            self.last.append("early")
            await send({"type": "http.response.start", "status": 401, "headers": [(b"content-length", b"0")]})
            await send({"type": "http.response.body", "body": b""})
            return
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                self.last.append("disconnect")
                return
            size += len(message.get("body", b""))
            if not message.get("more_body"):
                break
        self.last.append(f"body {size}")
        body = json.dumps({"size": size}).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-length", b"%d" % len(body))],
            }
        )
        await send({"type": "http.response.body", "body": body})


@pytest.fixture
async def server() -> AsyncIterator[tuple[int, App]]:
    app = App()
    config = uvicorn.Config(app, host="127.0.0.1", port=0, http=Protocol, lifespan="off", log_level="warning")
    srv = uvicorn.Server(config)
    task = asyncio.ensure_future(srv.serve())
    while not srv.started:
        await asyncio.sleep(0.01)
    port = srv.servers[0].sockets[0].getsockname()[1]
    yield port, app
    srv.should_exit = True
    await task


async def exchange(port: int, *parts: bytes, pause_s: float = 0.0) -> bytes:
    """Send the parts (pausing between them), then read until the server closes."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        for p in parts:
            writer.write(p)
            await writer.drain()
            if pause_s:
                await asyncio.sleep(pause_s)
        return await asyncio.wait_for(reader.read(), 10)
    finally:
        writer.close()


def status_and_error(raw: bytes) -> tuple[int, dict]:
    head, _, body = raw.partition(b"\r\n\r\n")
    assert b"connection: close" in head.lower()
    return int(head.split()[1]), json.loads(body)["error"]


def request(path: str = "/", headers: bytes = b"", body: bytes = b"") -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nhost: x\r\ncontent-length: {len(body)}\r\n".encode()
        + headers
        + b"\r\n"
        + body
    )


async def test_ordinary_requests_pass_and_keep_alive(server):
    port, app = server
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    for size in (0, 1000):  # two requests on one connection; the second at the body limit
        writer.write(request(headers=b"x-pad: " + b"a" * 3000 + b"\r\n", body=b"b" * size))
        head = await reader.readuntil(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200")
        assert json.loads(
            await reader.readexactly(int(head.split(b"content-length: ")[1].split(b"\r\n")[0]))
        ) == {"size": size}
    writer.close()
    assert app.last == ["body 0", "body 1000"]


async def test_oversized_headers_are_431(server):
    port, app = server
    status, err = status_and_error(await exchange(port, request(headers=b"x-big: " + b"a" * 8000 + b"\r\n")))
    assert (status, err) == (
        431,
        {
            "message": "Request headers exceed the limit of 4096 bytes.",
            "type": "invalid_request_error",
            "param": None,
            "code": "request_header_fields_too_large",
        },
    )
    assert app.last == []  # the app never saw it


async def test_unterminated_headers_are_cut_off_at_the_limit(server):
    port, _ = server
    start = b"GET / HTTP/1.1\r\nhost: x\r\nx-endless: "
    # 1 KiB at a time, never a blank line: the answer comes once the limit is passed.
    raw = await exchange(port, start, *[b"a" * 1024] * 5, pause_s=0.05)
    assert status_and_error(raw)[0] == 431


async def test_bodies_over_the_limit_are_413(server):
    port, app = server
    declared = b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: 5000\r\n\r\n"
    status, err = status_and_error(await exchange(port, declared))
    assert (status, err["code"], err["message"]) == (
        413,
        "request_too_large",
        "Request body exceeds the limit of 1000 bytes.",
    )
    chunked = (
        b"POST / HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n"
        + b"400\r\n"
        + b"c" * 1024
        + b"\r\n"
    )
    assert status_and_error(await exchange(port, chunked))[0] == 413
    assert app.last == ["disconnect"]  # the chunked one reached the app, which saw the client go


async def test_stalled_headers_are_408_and_idle_connections_closed(server):
    port, app = server
    status, err = status_and_error(await exchange(port, b"GET / HTTP/1.1\r\nhost: x\r\n"))
    assert (status, err["code"], err["message"]) == (
        408,
        "request_timeout",
        "The request headers did not arrive within 0.5s.",
    )
    assert await exchange(port) == b""  # connected, sent nothing: closed without an answer


async def test_a_stalled_body_is_408_and_the_app_sees_a_disconnect(server):
    port, app = server
    status, err = status_and_error(
        await exchange(port, b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: 100\r\n\r\n" + b"d" * 10)
    )
    assert (status, err["message"]) == (408, "The request body paused for more than 0.5s.")
    assert app.last == ["disconnect"]


async def test_a_body_trickled_in_never_pausing_long_is_408_at_the_total_deadline(server):
    port, app = server
    started = time.monotonic()
    head = b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: 100\r\n\r\n"
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(head)
        answer = asyncio.ensure_future(reader.readuntil(b"\r\n\r\n"))
        for _ in range(100):  # a byte every 0.2 s, until the server answers
            done, _ = await asyncio.wait([answer], timeout=0.2)
            if done:
                break
            writer.write(b"d")
        answered_after = time.monotonic() - started
        raw = await asyncio.wait_for(answer, 10) + await asyncio.wait_for(reader.read(), 10)
    finally:
        writer.close()
    status, err = status_and_error(raw)
    assert (status, err["message"]) == (408, "The request body did not arrive whole within 1.5s.")
    assert 1.5 <= answered_after < 5
    assert app.last == ["disconnect"]


def test_the_proxy_hook_installs_the_configured_limits(monkeypatch):
    from uvicorn import config

    http = HTTPConfig(
        max_header_bytes=1234,
        max_request_bytes=5678,
        header_timeout_s=3,
        body_timeout_s=4,
        body_total_timeout_s=9,
    )
    env = proxy.proxy_environment(http)
    assert env[proxy.CALLBACK_ENV] == "radixserve.router.frontend.proxy:install"
    monkeypatch.setattr(config, "HTTP_PROTOCOLS", dict(config.HTTP_PROTOCOLS))
    monkeypatch.setattr(LimitedHttpToolsProtocol, "limits", LimitedHttpToolsProtocol.limits)
    monkeypatch.setitem(os.environ, proxy.LIMITS_ENV, env[proxy.LIMITS_ENV])
    assert proxy.install() == []
    assert LimitedHttpToolsProtocol.limits == ProxyLimits(1234, 5678, 3, 4, 9)
    cfg = uvicorn.Config(lambda: None, http="auto")
    cfg.load()
    assert cfg.http_protocol_class is LimitedHttpToolsProtocol


def test_serve_transport_settings_leave_an_operators_own_alone():
    env = proxy.transport_environment(HTTPConfig(), {})
    assert env["RAY_SERVE_USE_GRPC_BY_DEFAULT"] == "1"
    assert env["RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP"] == "0"
    assert env["RAY_SERVE_CONTROL_LOOP_INTERVAL_S"] == "0.5"
    # a body up to the proxy's limit fits one gRPC message to the ingress, never under Ray's 4 MiB
    big = proxy.transport_environment(HTTPConfig(max_request_bytes=1 << 30), {})
    assert int(big[proxy.GRPC_MESSAGE_ENV]) >= (1 << 30) + proxy.GRPC_MESSAGE_MARGIN
    small = proxy.transport_environment(HTTPConfig(max_request_bytes=1000), {})
    assert int(small[proxy.GRPC_MESSAGE_ENV]) == proxy.GRPC_MESSAGE_MIN > 4 << 20
    mine = {
        "RAY_SERVE_USE_GRPC_BY_DEFAULT": "0",
        proxy.GRPC_MESSAGE_ENV: "123",
        "RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.1",
    }
    assert set(proxy.transport_environment(HTTPConfig(), mine)) == {"RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP"}


async def test_a_client_still_sending_a_big_body_reads_the_413(server):
    port, app = server
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: 3000000\r\n\r\n")
    for _ in range(3000):  # the whole body, as a client that does not read before it is done
        writer.write(b"e" * 1000)
        await writer.drain()
    status, err = status_and_error(await asyncio.wait_for(reader.read(), 10))
    writer.close()
    assert (status, err["code"]) == (413, "request_too_large")


async def test_a_stalled_body_after_an_early_answer_just_closes(server):
    port, app = server
    raw = await exchange(port, b"POST /early HTTP/1.1\r\nhost: x\r\ncontent-length: 100\r\n\r\n" + b"d" * 10)
    assert raw.startswith(b"HTTP/1.1 401 ") and raw.count(b"HTTP/1.1") == 1  # no 408 after it
    assert app.last == ["early"]
