"""JSON over HTTP with the standard library: posts, server-sent events, OpenAI-shaped errors."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

from radixserve.lang.errors import BackendError


class HttpClient:
    def __init__(self, base_url: str, api_key: str | None = None, timeout_s: float = 600.0):
        self.base_url = base_url.rstrip("/")
        self.api_key = api_key
        self.timeout_s = timeout_s

    def _request(self, method: str, path: str, body: dict[str, Any] | None) -> Any:
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.base_url + path, data=data, headers=headers, method=method)
        try:
            return urllib.request.urlopen(req, timeout=self.timeout_s)
        except urllib.error.HTTPError as e:
            raise _error(e.code, e.read()) from None
        except urllib.error.URLError as e:
            raise BackendError(503, f"cannot reach {self.base_url}: {e.reason}") from None

    def get(self, path: str) -> Any:
        with self._request("GET", path, None) as resp:
            return json.loads(resp.read())

    def post(self, path: str, body: dict[str, Any]) -> Any:
        with self._request("POST", path, body) as resp:
            return json.loads(resp.read())

    def events(self, path: str, body: dict[str, Any]) -> Iterator[dict[str, Any]]:
        """The stream's `data:` events until [DONE]; an in-band error raises BackendError."""
        with self._request("POST", path, body) as resp:
            for raw in resp:
                line = raw.decode().strip()
                if not line.startswith("data:"):
                    continue
                data = line[len("data:") :].strip()
                if data == "[DONE]":
                    return
                event = json.loads(data)
                if "error" in event:
                    raise _error(int(event["error"].get("code") or 500), json.dumps(event).encode())
                yield event


def _error(status: int, body: bytes) -> BackendError:
    try:
        err = json.loads(body)["error"]
        return BackendError(status, str(err.get("message")), err.get("param"), err.get("type"))
    except (ValueError, KeyError, TypeError):
        return BackendError(status, body.decode(errors="replace")[:1000])
