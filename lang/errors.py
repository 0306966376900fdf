"""The exceptions a program raises: its own mistakes, and the server's refusals."""

from __future__ import annotations


class LangError(Exception):
    """A program asked for something the language or its backend cannot do."""


class BackendError(LangError):
    """The server (or the offline engine) refused or failed a request.

    `status` is the HTTP status (400 for a bad request offline too), `message` the server's own
    text, `param` the field it named, `type` its error type."""

    def __init__(self, status: int, message: str, param: str | None = None, type: str | None = None):
        super().__init__(f"{status}: {message}" + (f" (param {param!r})" if param else ""))
        self.status = status
        self.message = message
        self.param = param
        self.type = type
