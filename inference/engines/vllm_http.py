"""Client for a vLLM server over its OpenAI-compatible HTTP API.

Covers what the control plane needs from an engine: greedy chat completions
with ``cache_salt``, per-token logprobs as token ids, streaming to measure
time-to-first-token, the cached-token count per request, the ``/metrics``
prefix-cache counters, health, and prefix-cache reset.

vLLM facts used here (vLLM 0.32, measured on these machines):
- ``usage.prompt_tokens_details.cached_tokens`` is reported when the server
  runs with ``--enable-prompt-tokens-details``; it counts tokens served from
  the engine's prefix cache *and* from a KV connector's external tier.
- ``return_tokens_as_token_ids`` makes logprob entries read ``"token_id:N"``.
- ``POST /reset_prefix_cache`` exists only with ``VLLM_SERVER_DEV_MODE=1``.
"""

from __future__ import annotations

import json
import logging
import re
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from inference.errors import EngineError
from inference.keepalive import CLIENT_IDLE_S

log = logging.getLogger(__name__)
#: An OpenAI/vLLM error ``type`` (``BadRequestError``, ``invalid_request_error``): the one part of an
#: error body worth repeating; anything else a server sends is logged here, never repeated to a caller.
_ERROR_TYPE = re.compile(r"[A-Za-z_]{1,40}")


def error_status(response: httpx.Response, where: str) -> str:
    """``"answered 400 (BadRequestError) on /v1/chat/completions"``: an error
    answer described in the control plane's own words.

    The body is not repeated: whatever the server sent (an engine's message, or
    an internal service's page when the URL was not an engine's) would reach
    the control plane's caller through job errors and API answers. Only the
    error ``type`` of an OpenAI-shaped error body is kept when it is a plain
    identifier; the body goes to this module's log (truncated) for operators.
    """
    kind = ""
    try:
        error = response.json().get("error")
        candidate = error.get("type") if isinstance(error, dict) else None
        if isinstance(candidate, str) and _ERROR_TYPE.fullmatch(candidate):
            kind = f" ({candidate})"
    except (ValueError, AttributeError):
        pass
    log.warning("engine answered %s on %s: %.300r", response.status_code, where, response.text)
    return f"answered {response.status_code}{kind} on {where}"


# httpx, httpx_sse and prometheus_client are imported in the methods that use
# them: this module is reached at app load (services.engines -> launcher), and
# they cost ~0.1 s (measured 65-120 ms) of every manage.py process (CLI
# command, worker) that never talks to an engine. After the client's
# constructor has run, the methods' imports are dictionary look-ups.
if TYPE_CHECKING:
    import httpx


def engine_http(*, timeout_s: float, headers: dict[str, str] | None = None, base_url: str = "") -> httpx.Client:
    """An ``httpx`` client of an engine's server: ``timeout_s`` per request, ``headers`` on every one,
    and an idle connection given up after :data:`inference.keepalive.CLIENT_IDLE_S`, before an engine's
    server (an adopted one: uvicorn's 5 s) would close it as a request is sent."""
    import httpx  # lazy: start-up cost of every CLI/worker process (see above)

    limits = httpx.Limits(keepalive_expiry=CLIENT_IDLE_S)
    return httpx.Client(base_url=base_url, timeout=timeout_s, headers=headers or {}, limits=limits)


#: The /metrics counters the control plane reads, by vLLM metric name.
PREFIX_CACHE_METRICS = (
    "vllm:prefix_cache_queries",
    "vllm:prefix_cache_hits",
    "vllm:external_prefix_cache_queries",
    "vllm:external_prefix_cache_hits",
    "vllm:kv_cache_usage_perc",
)


@dataclass
class ChatResult:
    """One greedy completion.

    Attributes:
        token_ids: generated token ids, in order.
        logprobs: natural-log probability of each generated token.
        text: the decoded completion.
        prompt_tokens: tokens in the rendered prompt.
        cached_tokens: prompt tokens the engine served from a cache (memory or
            connector tier) instead of computing them.
        ttft_ms: milliseconds from sending the request to the first token.
        total_ms: milliseconds to the end of the stream.
        top_logprobs: per generated token, the most likely candidates' ``{token id: logprob}``
            (empty unless asked for with ``top_logprobs``).
    """

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[dict[int, float]] = field(default_factory=list)
    text: str = ""
    prompt_tokens: int = 0
    cached_tokens: int = 0
    ttft_ms: float = 0.0
    total_ms: float = 0.0


def _token_id(token: str) -> int:
    if not token.startswith("token_id:"):
        raise EngineError("engine returned a token that is not a token id; it ignored return_tokens_as_token_ids")
    return int(token.split(":", 1)[1])


class VllmHttpClient:
    """A vLLM OpenAI-compatible server at ``base_url`` serving ``model``.

    Every method raises :class:`EngineError` (with the URL and cause) when the
    engine cannot be reached or answers with an error status.
    """

    def __init__(self, base_url: str, model: str, *, timeout_s: float = 120.0, headers: dict[str, str] | None = None) -> None:
        """A client of one server.

        Args:
            base_url: the server's origin (``http://host:port``).
            model: the served model name requests name.
            timeout_s: per-request timeout.
            headers: sent with every request (``Host`` when ``base_url`` was
                pinned to an address, see :func:`inference.netpolicy.pinned_url`).
        """
        self.base_url = base_url.rstrip("/")
        self.model = model
        self._http = engine_http(timeout_s=timeout_s, headers=headers, base_url=self.base_url)

    def close(self) -> None:
        """Release the connection pool."""
        self._http.close()

    def __enter__(self) -> VllmHttpClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        import httpx  # lazy: start-up cost of every CLI/worker process (see above)

        try:
            response = self._http.request(method, path, **kwargs)
        except httpx.HTTPError as exc:
            log.warning("engine at %s unreachable on %s: %r", self.base_url, path, exc)
            raise EngineError(f"engine at {self.base_url} unreachable on {path}") from exc
        if response.status_code >= 400:
            raise EngineError(f"engine at {self.base_url} {error_status(response, path)}")
        return response

    def prompt_cached_tokens(self, prompt: str, *, cache_salt: str | None) -> int | None:
        """Send ``prompt`` as a one-token greedy completion; the prompt tokens it reported cached.

        Returns:
            ``usage.prompt_tokens_details.cached_tokens`` (engine memory and
            connector tiers), or None when the engine does not report it
            (started without ``--enable-prompt-tokens-details``).

        Raises:
            EngineError: unreachable, or an error status.
        """
        return self.prompt_usage(prompt, cache_salt=cache_salt)[1]

    def prompt_usage(self, prompt: str, *, cache_salt: str | None) -> tuple[int | None, int | None]:
        """Send ``prompt`` as a one-token greedy completion; its prompt's length and cached part, in tokens.

        Returns:
            ``(usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens)``,
            each None where the answer lacks it.

        Raises:
            EngineError: unreachable, an error status, or an answer not in OpenAI's shape.
        """
        body: dict[str, Any] = {"model": self.model, "prompt": prompt, "max_tokens": 1, "temperature": 0.0}
        if cache_salt is not None:
            body["cache_salt"] = cache_salt
        try:
            usage = self._request("POST", "/v1/completions", json=body).json().get("usage") or {}
            details = usage.get("prompt_tokens_details")
            length = usage.get("prompt_tokens")
        except (ValueError, AttributeError):
            raise EngineError(f"engine at {self.base_url} answered a completion that is not OpenAI's shape") from None
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        return (
            length if isinstance(length, int) and not isinstance(length, bool) else None,
            cached if isinstance(cached, int) and not isinstance(cached, bool) else None,
        )

    def tokenize(self, text: str) -> list[int]:
        """The token ids of ``text`` under the served model's tokenizer, without special tokens:
        vLLM's ``POST /tokenize`` (``TokenizeCompletionRequest``: ``prompt``, ``add_special_tokens``;
        answer ``{"tokens": [...], "count", "max_model_len"}``; vllm/entrypoints/serve/tokenize/).

        Raises:
            EngineError: unreachable, an error status, or an answer without a list of integer tokens.
        """
        body = {"model": self.model, "prompt": text, "add_special_tokens": False}
        try:
            tokens = self._request("POST", "/tokenize", json=body).json().get("tokens")
        except (ValueError, AttributeError):
            tokens = None
        if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
            raise EngineError(f"engine at {self.base_url} answered /tokenize without a list of token ids")
        return tokens

    def healthy(self) -> bool:
        """True when ``GET /health`` answers 200; never raises."""
        import httpx  # lazy: start-up cost of every CLI/worker process (see above)

        try:
            return self._http.get("/health", timeout=2.0).status_code == 200
        except httpx.HTTPError:
            return False

    def served_models(self) -> list[str]:
        """Model names from ``GET /v1/models``."""
        return [m["id"] for m in self._request("GET", "/v1/models").json()["data"]]

    def reset_prefix_cache(self) -> None:
        """Drop the engine's in-memory prefix cache (needs ``VLLM_SERVER_DEV_MODE=1``).

        Connector tiers (disk, Redis) are not touched by this call.
        """
        self._request("POST", "/reset_prefix_cache")

    def metrics(self) -> dict[str, float]:
        """Prefix-cache counters and KV usage from ``GET /metrics``.

        Returns:
            ``{metric name: value}`` for :data:`PREFIX_CACHE_METRICS` (counters
            without the ``_total`` suffix), summed over engines/labels.
        """
        # Lazy: start-up cost of every CLI/worker process (see above).
        from prometheus_client.parser import text_string_to_metric_families

        text = self._request("GET", "/metrics").text
        values: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            if family.name not in PREFIX_CACHE_METRICS:
                continue
            for sample in family.samples:
                if sample.name.endswith("_created"):
                    continue
                values[family.name] = values.get(family.name, 0.0) + sample.value
        return values

    def chat_body(
        self,
        messages: list[dict[str, Any]],
        *,
        cache_salt: str | None,
        max_tokens: int,
        tools: list[dict[str, Any]] | None = None,
        top_logprobs: int = 0,
    ) -> dict[str, Any]:
        """The JSON body of :meth:`chat`'s request: greedy, streamed with usage,
        per-token logprobs (and ``top_logprobs`` candidates) with tokens as ids, ``cache_salt`` when given."""
        body: dict[str, Any] = {
            "model": self.model,
            "messages": messages,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "logprobs": True,
            "top_logprobs": top_logprobs,
            "stream": True,
            "stream_options": {"include_usage": True},
            "return_tokens_as_token_ids": True,
        }
        if tools:
            body["tools"] = tools
        if cache_salt is not None:
            body["cache_salt"] = cache_salt
        return body

    def chat(
        self,
        messages: list[dict[str, Any]],
        *,
        cache_salt: str | None,
        max_tokens: int,
        tools: list[dict[str, Any]] | None = None,
        top_logprobs: int = 0,
    ) -> ChatResult:
        """Greedy chat completion, streamed so that TTFT is measured client-side.

        Args:
            messages: OpenAI chat messages.
            cache_salt: the namespace's salt (vLLM ``cache_salt``), or None.
            max_tokens: tokens to generate (>= 1).
            tools: OpenAI tool definitions the conversation refers to.
            top_logprobs: candidates kept per generated token (:attr:`ChatResult.top_logprobs`), 0-20.

        Raises:
            EngineError: unreachable, error status, malformed stream, or a
                stream that ended without usage.
        """
        # Lazy: start-up cost of every CLI/worker process (see above).
        import httpx
        from httpx_sse import EventSource

        body = self.chat_body(messages, cache_salt=cache_salt, max_tokens=max_tokens, tools=tools, top_logprobs=top_logprobs)
        result = ChatResult()
        started = time.perf_counter()
        first: float | None = None
        usage: dict[str, Any] | None = None
        try:
            with self._http.stream("POST", "/v1/chat/completions", json=body) as response:
                if response.status_code >= 400:
                    response.read()
                    raise EngineError(f"engine at {self.base_url} {error_status(response, 'chat')}")
                for event in EventSource(response).iter_sse():
                    if event.data == "[DONE]":  # OpenAI's end-of-stream sentinel
                        break
                    chunk = json.loads(event.data)
                    if chunk.get("usage"):
                        usage = chunk["usage"]
                    for choice in chunk.get("choices", []):
                        result.text += (choice.get("delta") or {}).get("content") or ""
                        for entry in (choice.get("logprobs") or {}).get("content") or []:
                            if first is None:
                                first = time.perf_counter()
                            result.token_ids.append(_token_id(entry["token"]))
                            result.logprobs.append(float(entry["logprob"]))
                            if top_logprobs:
                                result.top_logprobs.append(
                                    {_token_id(c["token"]): float(c["logprob"]) for c in entry.get("top_logprobs") or []}
                                )
        except httpx.HTTPError as exc:
            log.warning("engine at %s failed during chat: %r", self.base_url, exc)
            raise EngineError(f"engine at {self.base_url} failed during chat") from exc
        except (json.JSONDecodeError, KeyError, ValueError, TypeError, AttributeError) as exc:
            # The exception's text may quote what the server sent: named by its class only.
            raise EngineError(f"engine at {self.base_url} sent a malformed stream ({type(exc).__name__})") from exc
        end = time.perf_counter()
        if usage is None:
            raise EngineError(f"engine at {self.base_url} ended the stream without usage")
        result.prompt_tokens = int(usage.get("prompt_tokens", 0))
        result.cached_tokens = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
        result.ttft_ms = ((first if first is not None else end) - started) * 1000.0
        result.total_ms = (end - started) * 1000.0
        return result
