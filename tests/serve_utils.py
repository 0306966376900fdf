"""Start and stop a real RadixServe app on a local Ray instance, for integration tests."""

from __future__ import annotations

import contextlib
import json
import socket
import uuid
from collections.abc import Callable, Iterator
from typing import Any


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def running_app(args: dict[str, Any], num_cpus: int = 2) -> Iterator[str]:
    """Yield the base URL of the app built from `args` (ServerArgs fields), bound to 127.0.0.1,
    behind a Serve proxy with the app's HTTP limits (as `radixserve serve` starts it)."""
    import os

    import ray
    from ray import serve

    from radixserve.cluster.app import build_app
    from radixserve.cluster.config import ServerArgs
    from radixserve.router.frontend.proxy import proxy_environment, transport_environment

    port = free_port()
    http = ServerArgs.from_dict({**args, "host": "127.0.0.1", "port": port}).http
    saved = dict(os.environ)
    os.environ.update(proxy_environment(http))
    os.environ.update(transport_environment(http))  # as `radixserve serve` runs Serve
    ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options=http.serve_http_options())
        serve.run(build_app(args), name="radixserve", route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()
        os.environ.clear()
        os.environ.update(saved)


def assert_error_shape(body: Any, what: object = None) -> None:
    """OpenAI's error body, exactly: {"error": {"message", "type", "param", "code"}}."""
    assert isinstance(body, dict) and set(body) == {"error"}, (body, what)
    err = body["error"]
    assert isinstance(err, dict) and set(err) == {"message", "type", "param", "code"}, (body, what)
    assert isinstance(err["message"], str) and err["message"], (body, what)
    assert isinstance(err["type"], str) and err["type"], (body, what)
    assert err["param"] is None or isinstance(err["param"], str), (body, what)
    assert err["code"] is None or isinstance(err["code"], str), (body, what)


def sse_events(text: str) -> list[str]:
    """The `data:` payloads of a server-sent event stream, in order."""
    return [line[len("data: ") :] for line in text.split("\n") if line.startswith("data: ")]


def wait_idle(http: Any, kv_total: int, timeout: float = 30.0) -> list[dict]:
    """Wait until every engine replica is idle, then check the KV pool's idle invariant: nothing
    running, queued or locked, and every slot either free or evictable in the radix tree."""
    import time

    deadline = time.monotonic() + timeout
    while True:
        replicas = http.get("/get_server_info").json()["replicas"]
        if replicas and all(
            r["running"] == 0 and r["queued"] == 0 and r["kv_protected"] == 0 for r in replicas
        ):
            for r in replicas:
                assert r["kv_free"] + r["kv_evictable"] == r["kv_total"] == kv_total, r
            return replicas
        assert time.monotonic() < deadline, f"not idle after {timeout}s: {replicas}"
        time.sleep(0.1)


def abort_mid_stream(
    http: Any, max_tokens: int = 1500, while_running: Callable[[], None] | None = None
) -> None:
    """Stream a long completion, abort it by its rid after the first event (`while_running` runs
    between the two): the stream ends with finish_reason "abort" and [DONE]."""
    rid = f"abort-me-{uuid.uuid4().hex}"
    body = {
        "prompt": "Write a long story.",
        "max_tokens": max_tokens,
        "stream": True,
        "rid": rid,
        "ignore_eos": True,
    }
    with http.stream("POST", "/v1/completions", json=body) as s:
        lines = s.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
        if while_running is not None:
            while_running()
        assert http.post("/abort_request", json={"rid": rid}).json() == {"rid": rid, "aborted": True}
        events = [line[6:] for line in lines if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["choices"][0]["finish_reason"] == "abort"
