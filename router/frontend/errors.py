"""Errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}` with the right status.

Every failure the HTTP layer reports goes through `APIError`, so clients (the official SDKs
included) always see the same body shape, and invalid input is always a 400: never FastAPI's 422,
never a 500 from a parameter that slipped past validation. A failure of the server itself (a
replica's `EngineError`, a replica that died, a bug) is a 500 whose body says only "internal
error" and the request id; what happened goes to the server log under that id.
"""

from __future__ import annotations

import json
import logging
import re
import uuid
from typing import Any

from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.requests import ClientDisconnect, HTTPConnection

from radixserve.workers.protocol import InvalidRequest, QueueFull

logger = logging.getLogger("radixserve.http")

QUEUE_FULL_RETRY_AFTER_S = 1
# Ray Serve's proxy gives every request an id in this header (the client's own, if it sent one)
# and returns it as X-Request-ID.
REQUEST_ID_HEADER = "x-request-id"
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:\-]{1,128}")


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)

    def sse_event(self) -> str:
        """The in-band error event of a stream that already sent its 200 headers."""
        return f"data: {json.dumps(self.body())}\n\n"


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def model_not_found(model: str) -> APIError:
    return APIError(404, f"The model `{model}` does not exist.", param="model", code="model_not_found")


def unauthorized() -> APIError:
    return APIError(
        401, "Incorrect or missing API key. Send 'Authorization: Bearer <key>'.", code="invalid_api_key"
    )


def forbidden() -> APIError:
    return APIError(403, "This endpoint needs the admin API key.", code="admin_key_required")


def too_large(limit: int) -> APIError:
    return APIError(413, f"Request body exceeds the limit of {limit} bytes.", code="request_too_large")


def not_found(path: str) -> APIError:
    return APIError(404, f"Unknown endpoint {path}.", code="not_found")


def method_not_allowed(method: str, path: str) -> APIError:
    return APIError(405, f"Method {method} is not allowed on {path}.", code="method_not_allowed")


def queue_full(message: str = "") -> APIError:
    return APIError(
        503,
        message or "The server is at its queue limit; retry later.",
        type="server_error",
        code="queue_full",
        headers={"Retry-After": str(QUEUE_FULL_RETRY_AFTER_S)},
    )


def not_ready(reason: str) -> APIError:
    return APIError(
        503,
        f"No engine can serve requests: {reason}.",
        type="server_error",
        code="not_ready",
        headers={"Retry-After": str(QUEUE_FULL_RETRY_AFTER_S)},
    )


def shutting_down() -> APIError:
    return APIError(
        503,
        "The server is shutting down and takes no new requests; retry on another instance.",
        type="server_error",
        code="shutting_down",
        headers={"Retry-After": str(QUEUE_FULL_RETRY_AFTER_S)},
    )


def internal(request_id: str) -> APIError:
    return APIError(
        500, f"Internal server error (request id {request_id})", type="server_error", code="internal_error"
    )


def request_id(conn: HTTPConnection) -> str:
    """The id this request is logged under: the proxy's X-Request-ID, else a new one."""
    given = conn.headers.get(REQUEST_ID_HEADER, "")
    return given if _REQUEST_ID.fullmatch(given) else uuid.uuid4().hex


def from_exception(exc: BaseException, request_id: str) -> APIError:
    """Map what the validation layer or a replica raised to the HTTP error a client sees.

    Anything that is not the client's fault is logged here with `request_id` and becomes a
    generic 500: exception texts (a replica's traceback, actor ids, addresses) never reach a client.
    """
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, InvalidRequest):
        return bad_request(exc.message, exc.param, exc.code)
    if isinstance(exc, QueueFull):
        return queue_full(str(exc))
    if isinstance(exc, ValidationError):
        return from_validation_errors([dict(e) for e in exc.errors()])
    if isinstance(exc, ClientDisconnect):  # nobody reads this answer; nothing failed here
        return bad_request("The client disconnected before its request was read.", code="client_disconnected")
    logger.error("request %s failed: %s: %s", request_id, type(exc).__name__, exc, exc_info=exc)
    return internal(request_id)


def from_validation_errors(errors: list[dict[str, Any]]) -> APIError:
    """pydantic / FastAPI validation errors -> one 400 naming the first offending parameter."""
    if not errors:
        return bad_request("Invalid request.")
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    # Union members add their type name to the location ("prompt.str"); the user never wrote it.
    loc = [p for p in loc if not _is_type_tag(p)]
    param = ".".join(loc) or None
    kind = first.get("type", "")
    if kind == "json_invalid":
        return bad_request(f"Request body is not valid JSON: {first.get('msg', '')}")
    if kind == "extra_forbidden":
        return bad_request(f"Unrecognized request argument supplied: {param}", param)
    if kind == "missing":
        return bad_request(f"Missing required parameter: '{param}'.", param)
    msg = first.get("msg", "invalid value")
    return bad_request(f"Invalid value for '{param}': {msg}." if param else f"{msg}.", param)


def _is_type_tag(part: str) -> bool:
    return part in ("str", "int", "float", "bool", "list", "dict") or part.startswith(
        ("list[", "dict[", "function-", "constrained-", "literal[", "tagged-union[")
    )
