"""The ingress's drain (router/frontend/api.py `Drain`): what a stopping server answers, and how it
counts what is still in flight. The live path (SIGTERM to `radixserve serve` under load) is in
tests/test_server_cli.py."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import httpx
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse, StreamingResponse
from starlette.routing import Route

from radixserve.router.frontend.api import DRAIN_EXEMPT, Drain
from tests.serve_utils import assert_error_shape


def app_with_drain(release: asyncio.Event, ing: SimpleNamespace) -> Drain:
    async def slow_stream(request):
        async def body():
            yield b"data: 1\n\n"
            await release.wait()
            yield b"data: [DONE]\n\n"

        return StreamingResponse(body(), media_type="text/event-stream")

    async def ok(request):
        return PlainTextResponse("ok")

    routes = [Route("/v1/completions", slow_stream, methods=["POST"])]
    routes += [Route(path, ok) for path in ["/v1/models", *DRAIN_EXEMPT]]
    return Drain(Starlette(routes=routes), ing)


async def test_drain_finishes_streams_in_flight_and_refuses_new_requests():
    ing = SimpleNamespace(draining=False, in_flight=0)
    release = asyncio.Event()
    transport = httpx.ASGITransport(app=app_with_drain(release, ing))
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
        task = asyncio.create_task(c.post("/v1/completions"))  # its body waits for `release`
        for _ in range(200):
            if ing.in_flight:
                break
            await asyncio.sleep(0.01)
        assert ing.in_flight == 1
        ing.draining = True  # what Ingress.drain does
        for method, path in [("POST", "/v1/completions"), ("GET", "/v1/models"), ("GET", "/ready")]:
            r = await c.request(method, path)
            assert (r.status_code, r.headers["retry-after"]) == (503, "1")
            assert_error_shape(r.json())
            assert r.json()["error"]["code"] == "shutting_down"
        for path in sorted(DRAIN_EXEMPT):
            assert (await c.get(path)).status_code == 200
        assert ing.in_flight == 1  # refusals and exempt routes left nothing behind
        release.set()
        r = await asyncio.wait_for(task, 10)
        assert (r.status_code, r.text) == (200, "data: 1\n\ndata: [DONE]\n\n")
    assert ing.in_flight == 0
