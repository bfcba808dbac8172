"""What the gateway answers with, whoever computed the answer: an answer object or its
server-sent events from a cache record, the stream response that stops its source
when the client goes away, and the headers naming the layer, version and engine."""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import random
import time
import urllib.parse
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from gateway.answers import answer_chunks, answer_object, served_usage

if TYPE_CHECKING:
    from gateway.prefix.router import Decision
    from gateway.routing import EngineTarget, Routed

log = logging.getLogger("gateway")

#: Header the gateway answers with: which layer served (``response``, ``semantic``, ``engine``).
SERVED_BY_HEADER = "x-kvcp-served-by"
#: Headers naming the model version a request was routed to and that version's
#: ``system_fingerprint``: an answer whose body carries another fingerprint was
#: computed by another model state (a cross-version answer; there must be none).
VERSION_HEADER, FINGERPRINT_HEADER = "x-kvcp-version", "x-kvcp-fingerprint"
#: How the engine that computed an answer was chosen, and the cached prompt tokens a precise choice predicted.
ROUTING_HEADER, PREDICTED_HEADER = "x-kvcp-routing", "x-kvcp-predicted-cached-tokens"


def served_headers(
    routed: Routed, layer: str, engine: EngineTarget | None = None, decision: Decision | None = None
) -> dict[str, str]:
    """The headers of an answer: the layer that served it, the version the request
    was routed to (under a verified reuse, another version than the namespace's,
    with the same identity) and its fingerprint, and the engine when one computed it now,
    with how it was chosen (:data:`ROUTING_HEADER`: ``precise``, or ``approximate; reason=...``)
    and the cached prompt tokens a precise choice predicted (:data:`PREDICTED_HEADER`)."""
    headers = {
        SERVED_BY_HEADER: layer, VERSION_HEADER: header_text(routed.route.version_label),
        FINGERPRINT_HEADER: routed.namespace.fingerprint,
    }  # fmt: skip
    if engine is not None:
        headers["x-kvcp-engine"] = header_text(engine.name)
    if decision is not None:
        headers[ROUTING_HEADER] = decision.mode + (f"; reason={decision.reason}" if decision.reason else "")
        if decision.mode == "precise":
            headers[PREDICTED_HEADER] = str(decision.predicted_cached_tokens)
    return headers


def header_text(value: str) -> str:
    """A label or name as a header value: percent-encoded UTF-8 (RFC 3986), since
    header values are Latin-1 bytes and labels may be any script; ASCII names
    without reserved characters pass unchanged."""
    return urllib.parse.quote(value, safe=" !#$&'()*+,/:;=?@[]^`{|}~")


def completion_id(endpoint: str) -> str:
    """A fresh answer id: ``cmpl-`` or ``chatcmpl-`` and 24 hex (ids are made per caller, never cached)."""
    return ("cmpl-" if endpoint == "completions" else "chatcmpl-") + hashlib.blake2b(
        random.randbytes(16), digest_size=12
    ).hexdigest()


def answer_from_record(record: Mapping[str, Any], endpoint: str, model: str, *, cached: bool) -> dict[str, Any]:
    """A cache record (or an engine's answer as one) as the OpenAI answer object the caller
    gets: a fresh id and time, the served name it asked for, and every other field of the
    answer as the engine wrote it (:func:`gateway.answers.answer_object`); ``usage`` says what
    was computed for this request: the engine's own when it computed the answer now, all of
    it cached on a cache layer's hit (``cached``: :func:`gateway.answers.served_usage`)."""
    usage = record.get("usage") or {}
    return answer_object(record, endpoint=endpoint, model=model, cid=completion_id(endpoint), created=int(time.time()),
                         usage=served_usage(usage) if cached else usage)  # fmt: skip


def sse(data: Any) -> bytes:
    """One server-sent event: ``data: <json>`` and a blank line (``data`` as JSON, or bytes as they are)."""
    return b"data: " + (data if isinstance(data, bytes) else json.dumps(data, ensure_ascii=False).encode("utf-8")) + b"\n\n"


def stream_record(record: Mapping[str, Any], endpoint: str, model: str, include_usage: bool) -> list[bytes]:
    """A cached answer as SSE events, in the shape the engine streams them, every field of the
    answer carried (:func:`gateway.answers.answer_chunks`), its usage chunk (when asked for)
    saying that nothing was computed for this request (:func:`gateway.answers.served_usage`)."""
    usage = served_usage(record.get("usage") or {}) if include_usage else None
    chunks = answer_chunks(record, endpoint=endpoint, model=model, cid=completion_id(endpoint), created=int(time.time()),
                           usage=usage)  # fmt: skip
    return [*(sse(chunk) for chunk in chunks), b"data: [DONE]\n\n"]


class ProxyStream(StreamingResponse):
    """A streamed answer that stops its source when the client goes away: the
    body comes from an async generator pumped in its own task while another
    task waits for ``http.disconnect``; the first to finish cancels the other,
    and closing the generator closes the engine's connection (vLLM then aborts
    the request)."""

    def __init__(
        self, source: AsyncIterator[bytes], headers: Mapping[str, str], *, on_close: Callable[[], Awaitable[None]] | None = None
    ) -> None:
        super().__init__(
            source, status_code=200, headers={**headers, "cache-control": "no-cache"}, media_type="text/event-stream"
        )
        self.source = source
        #: Called once the source is closed: what a source closed before it ever ran must still end.
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def pump() -> None:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            async for chunk in self.source:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        async def gone() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass

        pumping, watching = asyncio.create_task(pump()), asyncio.create_task(gone())
        try:
            await asyncio.wait({pumping, watching}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (pumping, watching):
                task.cancel()
            for outcome in await asyncio.gather(pumping, watching, return_exceptions=True):
                if isinstance(outcome, Exception):
                    log.error("stream ended by an error: %r", outcome, exc_info=outcome)
            await self.source.aclose()  # type: ignore[attr-defined]
            if self.on_close is not None:
                await self.on_close()
