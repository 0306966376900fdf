"""`radixserve serve ...`: start (or join) Ray, deploy the application, serve until a signal.

On Ctrl-C or SIGTERM the server drains, then stops: every ingress replica stops taking requests
(new ones get 503 `shutting_down`; /ready turns 503 too, so a load balancer moves on) while those
in flight finish, for up to `--drain-timeout-s`; a second signal stops waiting. Then the
application is torn down: Serve stops its replicas (their engines abort whatever is still in
flight and release their KV), and, when this command started Ray itself, the local Ray instance
goes with it, so no process is left behind.

A Ray started here serves this machine only, so it listens on loopback only: its node IP is
127.0.0.1 (Ray's single-machine mode, the one it uses on macOS and Windows), which puts GCS, the
raylet, every worker's gRPC server, the dashboard agent, the runtime-env agent and the metrics
ports (autoscaler, dashboard, `--ray-metrics-export-port`) on 127.0.0.1; the dashboard itself is
not started. Serve's HTTP proxy binds `--host` (127.0.0.1 unless told otherwise). One kind of
socket cannot follow: every Serve replica's inter-deployment gRPC server, which Ray Serve binds to
`[::]:0` unconditionally (ray/serve/_private/replica.py). It is why this Ray runs with token
authentication (RAY_AUTH_MODE=token unless the environment says otherwise; Ray keeps the token
in ~/.ray/auth_token): that server, like every Ray server, then refuses callers without it.
"""

from __future__ import annotations

import errno
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Sequence
from typing import Any

from radixserve.cluster.config import ServerArgs, parse_cli
from radixserve.router.frontend.proxy import proxy_environment, transport_environment

logger = logging.getLogger("radixserve")

# Read by Ray when it is imported (ray._private.ray_constants.ENABLE_RAY_CLUSTER): "0" makes a new
# local instance take 127.0.0.1 as its node IP, and Ray's servers bind the node IP.
SINGLE_MACHINE_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
AUTH_MODE_ENV = "RAY_AUTH_MODE"
# Ray lowers its worker processes (the engine replicas among them) to nice 15 unless this says
# otherwise: every other busy process of the machine then preempts the forward. Measured with a
# neighbour using ~40% of one core on 2 cores: the shared-prompt benchmark ran in 6.29 s at nice
# 15 and 5.53 s at 0. Our own Ray runs its workers at 0, as vLLM's and SGLang's processes run.
WORKER_NICENESS_ENV = "RAY_worker_niceness"

USAGE = """usage: radixserve serve [flags]   (radixserve serve --help lists them)

Starts the OpenAI-compatible RadixServe server on Ray Serve."""


DRAIN_POLL_S = 0.2
DRAIN_CALL_TIMEOUT_S = 30.0


class Interrupted(Exception):
    pass


def _on_signal(signum: int, frame: object) -> None:
    # Later signals are ignored so that a second Ctrl-C cannot cut the teardown short.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise Interrupted(signal.Signals(signum).name)


def ray_init_kwargs(args: ServerArgs, address: str | None) -> dict[str, Any]:
    """`ray.init` options: join `address`, or (None) start a loopback-only instance of our own,
    never one that another `ray start` on this machine recorded as its "current cluster"."""
    kwargs: dict[str, Any] = {
        "address": address or "local",
        "include_dashboard": False,
        "logging_level": args.http.log_level.upper(),
        "configure_logging": True,
    }
    if address is None and args.deployment.ray_metrics_export_port is not None:
        kwargs["_metrics_export_port"] = args.deployment.ray_metrics_export_port
    return kwargs


def _loopback_only() -> None:
    os.environ[SINGLE_MACHINE_ENV] = "0"  # for the processes Ray starts
    os.environ.setdefault(AUTH_MODE_ENV, "token")
    os.environ.setdefault(WORKER_NICENESS_ENV, "0")
    if "ray" in sys.modules:  # this process read the constant when it imported Ray
        from ray._private import ray_constants

        ray_constants.ENABLE_RAY_CLUSTER = False


def port_taken(host: str, port: int) -> str | None:
    """Why `host:port` cannot be ours, or None. Serve's proxy binds its port with SO_REUSEPORT,
    which lets a second server of the same user bind it too and take part of its connections without
    an error; so a Ray started here checks first that nothing listens there (SO_REUSEADDR only:
    connections in TIME_WAIT from a server just stopped do not count)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                return f"{host}:{port} is already in use by another server"
            return f"cannot listen on {host}:{port}: {e.strerror}"
    return None


def serve_forever(args: ServerArgs) -> int:
    address = args.deployment.ray_address or os.environ.get("RAY_ADDRESS")
    if address is None:
        if (taken := port_taken(args.http.host, args.http.port)) is not None:
            print(f"radixserve serve: error: {taken} (--port, --host)", file=sys.stderr, flush=True)
            return 2
        _loopback_only()
    import ray
    from ray import serve

    from radixserve.cluster.app import build

    signal.signal(signal.SIGINT, _on_signal)
    signal.signal(signal.SIGTERM, _on_signal)
    started_ray = serving = False
    # Serve's proxy reads its limits from the environment Ray starts its workers with.
    os.environ.update(proxy_environment(args.http))
    os.environ.update(transport_environment(args.http))
    try:
        ray.init(**ray_init_kwargs(args, address))
        # Ray's core worker installs its own SIGTERM handler (it aborts); ours must win.
        signal.signal(signal.SIGINT, _on_signal)
        signal.signal(signal.SIGTERM, _on_signal)
        started_ray = address is None
        try:
            app = build(args)  # checks the arguments against the cluster (its GPUs)
        except ValueError as e:
            print(f"radixserve serve: error: {e}", file=sys.stderr, flush=True)
            return 2
        serve.start(http_options=args.http.serve_http_options())
        serve.run(app, name=args.deployment.app_name, route_prefix="/")
        serving = True
        d = args.deployment
        layout = (
            f"PD: {d.prefill_replicas} prefill + {d.decode_replicas} decode replica(s)"
            if d.pd
            else f"{d.dp} engine replica(s)"
        )
        print(f"RadixServe is ready at {args.url} ({layout}); Ctrl-C stops it.", flush=True)
        while True:
            time.sleep(3600)
    except Interrupted as e:
        print(f"received {e}; shutting down", flush=True)
        if serving:
            drain(args.deployment.app_name, args.autoscale.drain_timeout_s)
        return 0
    finally:
        _teardown(args, started_ray)


def drain(app_name: str, timeout_s: float) -> bool:
    """Have every ingress replica of `app_name` refuse new requests, then wait until none has a
    request in flight, for up to `timeout_s`; a signal stops the wait. True if all finished."""
    from ray import serve

    # Until now later signals were ignored; during the wait, one more means "stop now".
    signal.signal(signal.SIGINT, _on_signal)
    signal.signal(signal.SIGTERM, _on_signal)
    deadline = time.monotonic() + timeout_s
    try:
        handle = serve.get_app_handle(app_name)
        while True:
            answers = handle.broadcast("drain").results(
                timeout_s=DRAIN_CALL_TIMEOUT_S, return_exceptions=True
            )
            left = sum(a for a in answers if isinstance(a, int))
            if left == 0:
                print("drained: no request in flight", flush=True)
                return True
            if time.monotonic() >= deadline:
                print(f"{left} request(s) still in flight after {timeout_s:g}s; stopping", flush=True)
                return False
            time.sleep(DRAIN_POLL_S)
    except Interrupted as e:
        print(f"received {e} while draining; stopping now", flush=True)
    except Exception:
        logger.exception("draining failed; stopping now")
    return False


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
