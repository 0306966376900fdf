"""Limits for Ray Serve's HTTP proxy: header size, request body size, read timeouts.

Requests reach the ingress through Serve's proxy actor, which runs uvicorn. What Serve lets one
configure there (`http_options`) is host, port, TLS, `keep_alive_timeout_s` and `request_timeout_s`
(an end-to-end cap, wrong for long generations); the `uvicorn.Config` it builds
(ray/serve/_private/http_util.py `start_asgi_http_server`) sets no protocol, no
`h11_max_incomplete_event_size`, no read timeout, and `HTTPOptions.middlewares` is gone. uvicorn's
httptools protocol has no header limit and no read timeout of its own (its only timer is the
keep-alive one, armed after a response), and the proxy buffers a request's whole body before the
ingress reads it. So unlimited headers, stalled connections and huge bodies would all live in the
proxy's memory.

The one hook Serve runs inside the proxy process is the function named by
`RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH`, called when the proxy starts and before its uvicorn
server loads its protocol class. `install` is that function: it makes `LimitedHttpToolsProtocol`
uvicorn's "auto" HTTP protocol in that process, with the limits from `RADIXSERVE_PROXY_LIMITS`.
Both variables must be in the environment Ray starts its workers with: `proxy_environment` gives
them, and `radixserve serve` sets them before it starts Ray, with `transport_environment`'s
(how Serve moves requests and streams between its processes). A Ray cluster started elsewhere
(`ray start`, `serve run` against a running cluster) needs them in the environment of `ray start`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from radixserve.router.frontend import errors
from radixserve.router.frontend.config import HTTPConfig

if TYPE_CHECKING:  # Ray is not imported here: `radixserve serve` sets its environment first
    from ray.serve.handle import DeploymentHandle

logger = logging.getLogger("radixserve.proxy")

CALLBACK_ENV = "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"
LIMITS_ENV = "RADIXSERVE_PROXY_LIMITS"
_REASONS = {408: "Request Timeout", 413: "Content Too Large", 431: "Request Header Fields Too Large"}
# After answering a refusal the connection reads and drops what the client still sends before it
# closes (closing on unread data makes the kernel reset the connection, and a client still
# sending its body would see the reset instead of the answer): until the client is quiet this
# long, and never longer than LINGER_TOTAL_S.
LINGER_IDLE_S = 2.0
LINGER_TOTAL_S = 10.0


@dataclass(frozen=True)
class ProxyLimits:
    max_header_bytes: int
    max_request_bytes: int
    header_timeout_s: float
    body_timeout_s: float
    body_total_timeout_s: float = HTTPConfig.body_total_timeout_s

    @classmethod
    def of(cls, http: HTTPConfig) -> ProxyLimits:
        return cls(**{f.name: getattr(http, f.name) for f in dataclasses.fields(cls)})


# How Serve carries a request and its stream between its processes (proxy -> ingress -> engine
# replica): gRPC streams between them instead of Ray actor calls and object refs, and each
# process's request router on the event loop that calls it instead of a thread of its own.
# Every streamed chunk crosses both hops, and what the hops cost is taken from the forward, which
# shares the node's cores with them. Measured on 2 cores (shared-prompt benchmark, 32 streams):
# 4.22-4.49 s with Ray's defaults, 3.69-3.92 s with these; one stream of 762 chunks cost the
# ingress 1.38 and the proxy 0.77 CPU-s with the defaults, 0.61 and 0.37 with these. Ray reads
# them when its processes start; an operator's own values win.
# Serve's controller also wakes every 0.5 s instead of every 0.1 s (Ray's default): each of its
# control-loop passes asks the GCS for the cluster's nodes and resources and reconciles every
# deployment, work that also runs on those cores. Measured on 2 cores, two shared-prompt runs:
# the controller 0.58-0.62 CPU-s and the GCS 0.30-0.34 with 0.1 s, 0.21-0.28 and 0.13-0.17 with
# 0.5; idle, the controller burned 0.24 CPU-s every 10 s. Replicas take seconds to start and
# autoscaling decisions wait tens of seconds, so half a second more to notice either costs
# nothing a client sees; health checks keep their own period.
GRPC_ENV = "RAY_SERVE_USE_GRPC_BY_DEFAULT"
TRANSPORT_ENV = {
    GRPC_ENV: "1",
    "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0",
    "RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.5",
}
# The largest gRPC message between Serve's processes, either way (Ray's default: 4 MiB). A request
# body up to the proxy's limit crosses to the ingress in one, and so does a whole non-streamed
# response (n choices with their logprobs can pass 4 MiB), which Ray's actor calls never limited.
GRPC_MESSAGE_ENV = "RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH"
GRPC_MESSAGE_MIN = 256 << 20
GRPC_MESSAGE_MARGIN = 1024 * 1024  # the request's headers and Serve's own metadata


def on_process_transport(handle: DeploymentHandle) -> DeploymentHandle:
    """`handle` on the transport that this process's environment names (TRANSPORT_ENV). A handle
    made in another process (the driver that built the app, whose Ray may have been imported before
    TRANSPORT_ENV was set) keeps that process's choice otherwise."""
    return handle.options(_by_reference=os.environ.get(GRPC_ENV) != "1")


def proxy_environment(http: HTTPConfig) -> dict[str, str]:
    """Environment variables that make Serve's proxy (started after them) enforce `http`'s limits."""
    return {
        CALLBACK_ENV: f"{__name__}:install",
        LIMITS_ENV: json.dumps(dataclasses.asdict(ProxyLimits.of(http))),
    }


def transport_environment(http: HTTPConfig, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """Serve's transport settings (TRANSPORT_ENV, and a gRPC message size that carries a body of
    `http.max_request_bytes` and a large response) that `environ` (default: this process's) does
    not set already."""
    given = os.environ if environ is None else environ
    message = max(GRPC_MESSAGE_MIN, http.max_request_bytes + GRPC_MESSAGE_MARGIN)
    wanted = {**TRANSPORT_ENV, GRPC_MESSAGE_ENV: str(message)}
    return {k: v for k, v in wanted.items() if k not in given}


def install() -> list[Any]:
    """Serve's proxy callback: registers the limited protocol; returns no middlewares."""
    from uvicorn import config

    given = os.environ.get(LIMITS_ENV)
    LimitedHttpToolsProtocol.limits = (
        ProxyLimits(**json.loads(given)) if given else ProxyLimits.of(HTTPConfig())
    )
    config.HTTP_PROTOCOLS["auto"] = f"{__name__}:LimitedHttpToolsProtocol"
    logger.info("HTTP proxy limits: %s", LimitedHttpToolsProtocol.limits)
    return []


class LimitedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with limits.

    - Headers (request line included) over `max_header_bytes`: 431, counted as bytes arrive, so
      an unterminated header section is cut off at the limit too.
    - A body over `max_request_bytes` (declared or sent): 413.
    - Headers not complete `header_timeout_s` after the connection opened or the request began,
      or a body that pauses longer than `body_timeout_s` while the app waits for it, or that is
      not whole `body_total_timeout_s` after the headers (a body trickled in a byte at a time
      never pauses long): 408 (or the connection is just closed when a response has started).
    Each answer ends the connection (after a short linger that drops what the client still sends).
    """

    limits = ProxyLimits.of(HTTPConfig())

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._in_headers = True  # between requests or inside a header section
        self._request_begun = False
        self._header_bytes = 0  # raw bytes received while in the header section
        self._parsed_header_bytes = 0  # the request line and headers as parsed
        self._body_bytes = 0
        self._body_deadline = 0.0
        self._timer: asyncio.TimerHandle | None = None
        self._refused = False
        self._linger_until = 0.0

    # Connection events -------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm(self.limits.header_timeout_s, self._headers_late)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._refused:  # lingering after an answer: drop it
            if self.loop.time() < self._linger_until:
                self._arm(LINGER_IDLE_S, self._close)
            else:
                self._close()
            return
        if self._in_headers:
            self._header_bytes += len(data)
        super().data_received(data)
        if self._in_headers and self._header_bytes > self.limits.max_header_bytes:
            self._refuse(431, self._headers_too_large())

    def send_400_response(self, msg: str) -> None:
        if not self._refused:  # a limit already answered and stopped the parser
            super().send_400_response(msg)

    # Parser callbacks --------------------------------------------------------------------------
    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._in_headers = self._request_begun = True
        self._parsed_header_bytes = 0
        if self._timer is None:
            self._arm(self.limits.header_timeout_s, self._headers_late)

    def on_url(self, url: bytes) -> None:
        self._count_parsed(len(url))
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count_parsed(len(name) + len(value) + 4)  # ": " and CRLF
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._disarm()
        declared = _content_length(self.headers)
        if declared is not None and declared > self.limits.max_request_bytes:
            self._refuse(413, _too_large(self.limits.max_request_bytes))
            raise _Refused()
        self._in_headers = False
        self._header_bytes = self._body_bytes = 0
        self._body_deadline = self.loop.time() + self.limits.body_total_timeout_s
        super().on_headers_complete()
        self._arm(self.limits.body_timeout_s, self._body_late)

    def on_body(self, body: bytes) -> None:
        self._body_bytes += len(body)
        if self._body_bytes > self.limits.max_request_bytes:
            self._refuse(413, _too_large(self.limits.max_request_bytes))
            raise _Refused()
        if self.loop.time() > self._body_deadline:
            total = self.limits.body_total_timeout_s
            self._refuse(408, f"The request body did not arrive whole within {total:g}s.")
            raise _Refused()
        super().on_body(body)
        self._arm(self.limits.body_timeout_s, self._body_late)

    def on_message_complete(self) -> None:
        self._disarm()
        self._in_headers, self._request_begun = True, False
        super().on_message_complete()

    def _count_parsed(self, n: int) -> None:
        self._parsed_header_bytes += n
        if self._parsed_header_bytes > self.limits.max_header_bytes:
            self._refuse(431, self._headers_too_large())
            raise _Refused()

    def _headers_too_large(self) -> str:
        return f"Request headers exceed the limit of {self.limits.max_header_bytes} bytes."

    # Timers and answers ------------------------------------------------------------------------
    def _arm(self, delay: float, callback: Any) -> None:
        self._disarm()
        self._timer = self.loop.call_later(delay, callback)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _headers_late(self) -> None:
        self._timer = None
        if not self._request_begun:  # an idle connection that never sent a request: just close it
            self._refused = True
            self._close()
            return
        self._refuse(408, f"The request headers did not arrive within {self.limits.header_timeout_s:g}s.")

    def _body_late(self) -> None:
        self._timer = None
        if self.flow.read_paused:  # the app is not reading: the wait is ours, not the client's
            self._arm(self.limits.body_timeout_s, self._body_late)
            return
        self._refuse(408, f"The request body paused for more than {self.limits.body_timeout_s:g}s.")

    def _refuse(self, status: int, message: str) -> None:
        """Answer `status` and close the connection. No answer where one cannot go: the request
        was already answered (or its answer has begun), or an earlier request's answer is still
        being written (pipelining)."""
        if self._refused or self.transport.is_closing():
            return
        self._refused = True
        self._disarm()
        cycle = self.cycle
        busy = cycle is not None and not cycle.response_complete
        if busy:
            # The app sees a disconnect and its later writes are dropped, as if the client left.
            cycle.disconnected = True
            cycle.message_event.set()
        # In the header section `cycle` is an earlier request's; in the body, this request's.
        answerable = cycle is None or (
            not busy if self._in_headers else not (cycle.response_started or cycle.response_complete)
        )
        logger.info("HTTP %d for %s: %s", status, self.client, message)
        if not answerable:
            self._close()
            return
        self.transport.write(_response(status, message))
        self._linger_until = self.loop.time() + LINGER_TOTAL_S
        self.flow.resume_reading()
        self._arm(LINGER_IDLE_S, self._close)

    def _close(self) -> None:
        self._disarm()
        if not self.transport.is_closing():
            self.transport.close()


class _Refused(Exception):
    """Raised from a parser callback to stop parsing after a limit answered."""


def _too_large(limit: int) -> str:
    return errors.too_large(limit).message


def _content_length(headers: list[tuple[bytes, bytes]]) -> int | None:
    for name, value in headers:
        if name == b"content-length":
            return int(value) if value.strip().isdigit() else None
    return None


def _response(status: int, message: str) -> bytes:
    code = {408: "request_timeout", 413: "request_too_large", 431: "request_header_fields_too_large"}
    body = json.dumps(errors.APIError(status, message, code=code[status]).body()).encode()
    head = (
        f"HTTP/1.1 {status} {_REASONS[status]}\r\n"
        "content-type: application/json\r\n"
        f"content-length: {len(body)}\r\n"
        "connection: close\r\n\r\n"
    )
    return head.encode("latin-1") + body
