"""The gateway's one error: answered in the OpenAI error format::

{"error": {"message": str, "type": str, "param": str | None, "code": str}}

An engine's error reaches the caller in the same shape (:func:`engine_error`), never as the
engine wrote it: its status is kept (a 5xx becomes 502, the gateway's upstream failed), and
of its body only a bounded, sanitised message of a 4xx (about the caller's own request, e.g.
a prompt longer than the context) and a parameter path are carried. A 5xx's text, a body that
is no OpenAI error object (a proxy's HTML page, a traceback) and anything else the engine sent
stay in the gateway's log.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

from starlette.responses import JSONResponse

__all__ = ["ENGINE_MESSAGE_MAX", "GatewayError", "engine_error", "invalid"]

#: The most characters of an engine's message a caller gets (vLLM's request errors, e.g. the
#: context-length one, fit in about 200).
ENGINE_MESSAGE_MAX = 300
#: A parameter path as OpenAI's errors name one (``messages[0].content``); anything else is dropped.
_PARAM = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(?:\[[0-9]{1,6}\]|\.[A-Za-z_][A-Za-z0-9_]*){0,8}$")


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


def _engine_message(raw: object, redact: Iterable[str]) -> str | None:
    """An engine's message as one printable line of at most :data:`ENGINE_MESSAGE_MAX`
    characters, with every string of ``redact`` (the engine's address) taken out; None when
    there is no non-blank string."""
    if not isinstance(raw, str):
        return None
    for secret in redact:
        if secret:
            raw = raw.replace(secret, "(engine)")
    line = " ".join("".join(c if c.isprintable() else " " for c in raw[: ENGINE_MESSAGE_MAX * 4]).split())
    if not line:
        return None
    return line if len(line) <= ENGINE_MESSAGE_MAX else line[: ENGINE_MESSAGE_MAX - 1] + "…"


def engine_error(status: int, body: object, *, redact: Iterable[str] = ()) -> tuple[int, dict[str, Any]]:
    """An engine's error answer (or a streamed error event) as the caller's error.

    Args:
        status: the engine's HTTP status (for a streamed event: its ``code`` when it is an
            HTTP status, else 502).
        body: the engine's parsed JSON body: vLLM's ``{"error": {"message", "type", "param",
            "code"}}`` (``vllm/entrypoints/serve/engine/protocol.py`` ``ErrorResponse``, where
            ``code`` is the status as an integer), an older server's flat ``{"object": "error",
            "message": ...}``, or anything else (None for a body that is no JSON).
        redact: strings taken out of the message (the engine's URL and address).

    Returns:
        ``(caller status, {"message", "type", "param", "code"})``: the status kept for a 4xx,
        502 otherwise; ``type`` ``invalid_request_error`` for a 4xx, ``server_error``
        otherwise; ``code`` ``engine_<status>``; ``message`` the engine's sanitised message
        for a 4xx (``"the engine refused the request: <message>"``), and for a 5xx or a
        body without one only the status; ``param`` the engine's when it is a parameter path.
    """
    error = body.get("error") if isinstance(body, Mapping) else None
    if not isinstance(error, Mapping):
        error = body if isinstance(body, Mapping) and body.get("object") == "error" else {}
    refused = 400 <= status < 500
    message = _engine_message(error.get("message"), redact) if refused else None
    param = error.get("param")
    return (status if refused else 502), {
        "message": f"the engine refused the request: {message}" if message else f"the engine answered HTTP {status}",
        "type": "invalid_request_error" if refused else "server_error",
        "param": param if refused and isinstance(param, str) and _PARAM.match(param) else None,
        "code": f"engine_{status}",
    }
