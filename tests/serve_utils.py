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
    """Yield the base URL of the app built from `args` (ServerArgs fields), bound to 127.0.0.1."""
    import ray
    from ray import serve

    from radixserve.cluster.app import build_app

    ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False)
    port = free_port()
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_app(args), name="radixserve", route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()
