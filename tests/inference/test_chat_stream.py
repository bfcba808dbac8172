"""The streamed chat's framing and its faults, on recorded server-sent event bodies.

The engine itself is exercised by every vLLM test (prewarm, comparison, the
demo); here the HTTP transport is replaced so that each malformed stream the
engine could send is answered exactly, without starting one.
"""

from __future__ import annotations

import json

import httpx
import pytest

from inference.engines.vllm_http import VllmHttpClient
from inference.errors import EngineError

SSE = {"content-type": "text/event-stream; charset=utf-8"}


def _chunk(token_id: int, logprob: float, text: str) -> dict:
    return {
        "choices": [
            {"delta": {"content": text}, "logprobs": {"content": [{"token": f"token_id:{token_id}", "logprob": logprob}]}}
        ]
    }


USAGE = {"choices": [], "usage": {"prompt_tokens": 40, "prompt_tokens_details": {"cached_tokens": 32}}}


def _client(body: str, *, headers: dict[str, str] = SSE, status: int = 200) -> tuple[VllmHttpClient, list[dict]]:
    sent: list[dict] = []

    def handler(request: httpx.Request) -> httpx.Response:
        sent.append(json.loads(request.content))
        return httpx.Response(status, headers=headers, content=body.encode())

    client = VllmHttpClient("http://engine.test", "tiny")
    client._http = httpx.Client(base_url=client.base_url, transport=httpx.MockTransport(handler))
    return client, sent


def _events(*payloads: object, sep: str = "data: ") -> str:
    return "".join(f"{sep}{p if isinstance(p, str) else json.dumps(p)}\n\n" for p in payloads)


def test_a_stream_yields_token_ids_logprobs_text_and_usage() -> None:
    # Comments, an "event:" field and "data:" without its optional space are all
    # valid server-sent events (WHATWG HTML, "Parsing an event stream").
    body = ": keep-alive\n\n" + _events(_chunk(7, -0.5, "Hi")) + "event: message\ndata:" + json.dumps(_chunk(9, -1.25, "!"))
    body += "\n\n" + _events(USAGE, "[DONE]")
    client, sent = _client(body)
    result = client.chat([{"role": "user", "content": "hello"}], cache_salt="s" * 43, max_tokens=2)
    assert (result.token_ids, result.logprobs, result.text) == ([7, 9], [-0.5, -1.25], "Hi!")
    assert (result.prompt_tokens, result.cached_tokens) == (40, 32)
    assert 0.0 <= result.ttft_ms <= result.total_ms
    assert sent[0]["cache_salt"] == "s" * 43 and sent[0]["stream"] is True and sent[0]["temperature"] == 0.0


@pytest.mark.parametrize(
    ("body", "headers", "status", "message"),
    [
        (_events(_chunk(7, -0.5, "Hi"), "[DONE]"), SSE, 200, "ended the stream without usage"),
        (_events("{not json"), SSE, 200, "sent a malformed stream"),
        (_events({"choices": [{"logprobs": {"content": [{"token": "token_id:7"}]}}]}), SSE, 200, "sent a malformed stream"),
        (_events(_chunk(7, -0.5, "Hi")).replace("token_id:7", "Hi"), SSE, 200, "it ignored return_tokens_as_token_ids"),
        ('{"choices": []}', {"content-type": "application/json"}, 200, "failed during chat"),
        ('{"error": "model not found"}', {"content-type": "application/json"}, 404, "answered 404 on chat"),
    ],
    ids=["no-usage", "bad-json", "no-logprob", "text-tokens", "not-sse", "error-status"],
)
def test_a_malformed_stream_is_an_engine_error(body: str, headers: dict[str, str], status: int, message: str) -> None:
    client, _ = _client(body, headers=headers, status=status)
    with pytest.raises(EngineError, match=message):
        client.chat([{"role": "user", "content": "hello"}], cache_salt=None, max_tokens=1)
