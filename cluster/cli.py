"""`radixserve serve ...`: start (or join) Ray, deploy the application, serve until a signal.

On Ctrl-C or SIGTERM the application is torn down: Serve stops its replicas (their engines abort
what is in flight and release their KV), and, when this command started Ray itself, the local Ray
instance goes with it, so no process is left behind.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
from collections.abc import Sequence

from radixserve.cluster.config import ServerArgs, parse_cli
from radixserve.router.frontend.proxy import proxy_environment

logger = logging.getLogger("radixserve")

USAGE = """usage: radixserve serve [flags]   (radixserve serve --help lists them)

Starts the OpenAI-compatible RadixServe server on Ray Serve."""


class Interrupted(Exception):
    pass


def _on_signal(signum: int, frame: object) -> None:
    # Later signals are ignored so that a second Ctrl-C cannot cut the teardown short.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise Interrupted(signal.Signals(signum).name)


def serve_forever(args: ServerArgs) -> int:
    import ray
    from ray import serve

    from radixserve.cluster.app import build

    address = args.deployment.ray_address or os.environ.get("RAY_ADDRESS")
    level = args.http.log_level.upper()
    signal.signal(signal.SIGINT, _on_signal)
    signal.signal(signal.SIGTERM, _on_signal)
    started_ray = False
    # Serve's proxy reads its limits from the environment Ray starts its workers with.
    os.environ.update(proxy_environment(args.http))
    try:
        ray.init(address=address, include_dashboard=False, logging_level=level, configure_logging=True)
        # Ray's core worker installs its own SIGTERM handler (it aborts); ours must win.
        signal.signal(signal.SIGINT, _on_signal)
        signal.signal(signal.SIGTERM, _on_signal)
        started_ray = address is None
        serve.start(http_options=args.http.serve_http_options())
        serve.run(build(args), name=args.deployment.app_name, route_prefix="/")
        print(
            f"RadixServe is ready at {args.url} ({args.deployment.dp} engine replica(s)); Ctrl-C stops it.",
            flush=True,
        )
        while True:
            time.sleep(3600)
    except Interrupted as e:
        print(f"received {e}; shutting down", flush=True)
        return 0
    finally:
        _teardown(args, started_ray)


def _teardown(args: ServerArgs, started_ray: bool) -> None:
    import ray
    from ray import serve

    if not ray.is_initialized():
        return
    try:
        if started_ray:
            serve.shutdown()  # the whole Serve instance is ours
        else:
            serve.delete(args.deployment.app_name)  # a shared cluster keeps its other apps
    except Exception:
        logger.exception("Serve teardown failed")
    ray.shutdown()


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    if argv[0] != "serve":
        print(f"unknown command {argv[0]!r}\n\n{USAGE}", file=sys.stderr)
        return 2
    args = parse_cli(argv[1:])
    logging.basicConfig(
        level=args.http.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    return serve_forever(args)


if __name__ == "__main__":
    sys.exit(main())
