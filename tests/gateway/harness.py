"""The gateway app against the real database and the deployment's response
store, with an engine emulated at the HTTP level (the real vLLM path is
tests/gateway/test_gateway_vllm.py); the ``setup`` fixture is in this folder's conftest."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import httpx2

from cacheadmin.services.gateway import routing_snapshot_build


class FakeEngine:
    """An OpenAI-compatible engine at the HTTP level: streams a fixed answer,
    reports cached tokens from the second identical prompt on, records what it got."""

    def __init__(self, answer: str = "Paris is the capital.") -> None:
        self.answer = answer
        self.received: list[dict[str, Any]] = []
        self.seen_prompts: set[str] = set()
        self.fail_mid_stream = False
        #: An error event the engine streams instead of an answer (as vLLM does for a request it refuses late).
        self.stream_error: dict[str, Any] | None = None
        self.down = False
        self.delay_s = 0.0
        #: How many of the first calls fail mid-answer (as an engine that dies does).
        self.fail_first = 0
        #: A status and raw body the engine answers every request with (a proxy's page, a server error).
        self.raw_answer: tuple[int, bytes] | None = None

    async def __call__(self, request: httpx2.Request) -> httpx2.Response:
        if self.down:
            raise httpx2.ConnectError("connection refused", request=request)
        body = json.loads(request.content)
        self.received.append(body)
        if self.raw_answer is not None:
            return httpx2.Response(self.raw_answer[0], content=self.raw_answer[1])
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        prompt = json.dumps(body.get("messages"), sort_keys=True)
        cached = 32 if prompt in self.seen_prompts else 0
        self.seen_prompts.add(prompt)
        words = self.answer.split(" ")
        chunks = [{"id": "c1", "object": "chat.completion.chunk", "model": body["model"],
                   "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}]  # fmt: skip
        for i, word in enumerate(words):
            text = word if i == 0 else " " + word
            chunks.append({"id": "c1", "object": "chat.completion.chunk", "model": body["model"],
                           "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}]})  # fmt: skip
        chunks.append({"id": "c1", "object": "chat.completion.chunk", "model": body["model"],
                       "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})  # fmt: skip
        usage = {"prompt_tokens": 40, "completion_tokens": len(words), "total_tokens": 40 + len(words),
                 "prompt_tokens_details": {"cached_tokens": cached}}  # fmt: skip
        chunks.append({"id": "c1", "object": "chat.completion.chunk", "model": body["model"], "choices": [], "usage": usage})
        fail = self.fail_mid_stream or len(self.received) <= self.fail_first
        if not body.get("stream"):
            return self._whole(body, words, usage, fail)
        if self.stream_error is not None:
            chunks = [chunks[0], self.stream_error]

        async def stream():  # type: ignore[no-untyped-def]
            for n, chunk in enumerate(chunks):
                if fail and n == 2:
                    raise httpx2.ReadError("engine died")
                yield b"data: " + json.dumps(chunk).encode() + b"\n\n"
            yield b"data: [DONE]\n\n"

        return httpx2.Response(200, headers={"content-type": "text/event-stream"}, content=stream())

    def _whole(self, body: dict[str, Any], words: list[str], usage: dict[str, Any], fail: bool) -> httpx2.Response:
        """A non-streamed answer, as vLLM sends one: the whole object, or its error with the error's status."""
        if self.stream_error is not None:
            return httpx2.Response(int(self.stream_error["error"].get("code") or 400), json=self.stream_error)
        message = {"role": "assistant", "content": " ".join(words), "tool_calls": []}
        answer = {"id": "c1", "object": "chat.completion", "created": 1, "model": body["model"],
                  "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": "stop",
                               "stop_reason": None}], "usage": usage}  # fmt: skip
        raw = json.dumps(answer).encode()

        async def cut_off():  # type: ignore[no-untyped-def]
            yield raw[: len(raw) // 2]
            raise httpx2.ReadError("engine died")

        if fail:
            return httpx2.Response(200, headers={"content-type": "application/json"}, content=cut_off())
        return httpx2.Response(200, headers={"content-type": "application/json"}, content=raw)


def call(setup: dict[str, Any], body: Any, *, key: str | None = None, path: str = "/v1/chat/completions",
         headers: dict[str, str] | None = None) -> httpx.Response:  # fmt: skip
    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=setup["gateway"].app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
            h = {"authorization": f"Bearer {key or setup['key']}", **(headers or {})}
            content = body if isinstance(body, bytes) else json.dumps(body).encode()
            return await client.post(path, content=content, headers=h)

    return asyncio.run(go())


def chat(content: str = "What is the capital of France?", **params: Any) -> dict[str, Any]:
    return {"model": "tiny", "messages": [{"role": "user", "content": content}], **params}


def refresh(setup: dict[str, Any]) -> None:
    setup["holder"]["snap"] = routing_snapshot_build()
