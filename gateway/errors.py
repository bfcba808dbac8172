"""The gateway's one error: answered in the OpenAI error format::

{"error": {"message": str, "type": str, "param": str | None, "code": str}}
"""

from __future__ import annotations

from collections.abc import Mapping

from starlette.responses import JSONResponse

__all__ = ["GatewayError", "invalid"]


class GatewayError(Exception):
    """An error answered in the OpenAI error format."""

    def __init__(self, status: int, message: str, *, type_: str, code: str, param: str | None = None,
                 headers: Mapping[str, str] | None = None) -> None:  # fmt: skip
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = status, message, type_, code, param
        self.headers = dict(headers or {})

    def response(self) -> JSONResponse:
        """The error as an HTTP response."""
        body = {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}
        return JSONResponse(body, status_code=self.status, headers=self.headers)


def invalid(message: str, param: str | None = None, code: str = "invalid_request") -> GatewayError:
    """A 400 ``invalid_request_error`` naming the parameter at fault (``param``, a path such as ``messages[0].content``)."""
    return GatewayError(400, message, type_="invalid_request_error", code=code, param=param)
