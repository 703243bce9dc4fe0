"""Errors the gateway answers with, in OpenAI's error JSON shape.

`{"error": {"message": ..., "type": ..., "param": ..., "code": ...}}`: the official client reads
`message` and raises the exception class of the HTTP status (BadRequestError for 400, ...).
Messages name the field and the limit and say what to do.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param
        self.code = code
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


def bad_request(param: str | None, message: str, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def unavailable(message: str) -> APIError:
    """No node can take the request now: the client may retry later."""
    return APIError(
        503, message, type_="service_unavailable", code="no_capacity", headers={"Retry-After": "1"}
    )


class GenerationFailed(APIError):
    """A node failed after tokens were already sent and the choice could not be moved to
    another node (out of --migration-limit moves, or of nodes): the stream ends with it."""

    def __init__(self, message: str) -> None:
        super().__init__(502, message, type_="upstream_error", code="node_failed")
