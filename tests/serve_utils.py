"""Start and stop a real RadixServe app on a local Ray instance, for integration tests."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator
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
    from radixserve.router.frontend.proxy import proxy_environment

    port = free_port()
    http = ServerArgs.from_dict({**args, "host": "127.0.0.1", "port": port}).http
    saved = dict(os.environ)
    os.environ.update(proxy_environment(http))
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
