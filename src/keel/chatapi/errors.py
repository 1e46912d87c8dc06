"""Errors answered in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`.

Every refusal of the server is an `APIError` with its HTTP status; `code` is the kind counted in
`keel_serve_errors_total{kind}`."""

from __future__ import annotations

from typing import Any


class APIError(Exception):
    """An HTTP error answered as OpenAI answers it."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        code: str,
        param: str | None = None,
        type: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.type = type or _default_type(status)
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


def _default_type(status: int) -> str:
    if status == 401:
        return "authentication_error"
    if status == 429:
        return "rate_limit_error"
    if status >= 500:
        return "server_error"
    return "invalid_request_error"


def bad_request(message: str, *, code: str = "invalid_value", param: str | None = None) -> APIError:
    """400: the request asks for something invalid or unsupported."""
    return APIError(400, message, code=code, param=param)
