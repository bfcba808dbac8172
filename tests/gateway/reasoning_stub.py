"""An OpenAI-compatible engine at the HTTP level that answers as vLLM 0.32 does behind a
reasoning parser (``--reasoning-parser``): ``reasoning`` deltas (or the older
``reasoning_content``) before the content, ``token_ids`` and ``stop_reason`` on every
choice, ``prompt_token_ids`` on the first chunk, and the non-streamed object with every
field ``ChatCompletionResponse`` serializes (``vllm/entrypoints/openai/chat_completion/protocol.py``),
a field of a later version among them. Its stream can end every way a stream ends.

The tiny model vLLM serves on CPU here has no reasoning parser: this is what the
gateway's answers are checked against for reasoning; tests/gateway/test_gateway_vllm.py
checks the other fields on the real engine.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import httpx2

PROMPT_IDS = [1, 733, 16289, 28793]
#: How a stream ends: ``done`` (the end event), ``eof`` (the body ends without it), ``cut``
#: (the connection drops mid-answer), ``error`` / ``flat_error`` (an error event, then the end event).
ENDINGS = ("done", "eof", "cut", "error", "flat_error")


@dataclass
class ReasoningEngine:
    """The answer it gives, and what it received.

    Attributes:
        reasoning, content: the pieces streamed (one chunk each, one token id each).
        tool_call: a tool call (``{"name", "arguments"}``) streamed after the content, or None.
        finish: the finish reason of the last chunk (None: a server that never sets one).
        ending: one of :data:`ENDINGS`.
        reasoning_field: the delta's reasoning field: ``reasoning`` (vLLM 0.32) or ``reasoning_content`` (earlier).
    """

    reasoning: list[str] = field(default_factory=lambda: ["The user asks", " for a capital."])
    content: list[str] = field(default_factory=lambda: ["Paris", " is", " the capital."])
    tool_call: dict[str, str] | None = None
    finish: str | None = "stop"
    ending: str = "done"
    reasoning_field: str = "reasoning"
    received: list[dict[str, Any]] = field(default_factory=list)

    def token_ids(self) -> list[int]:
        return [100 + i for i in range(len(self.reasoning) + len(self.content) + (1 if self.tool_call else 0))]

    def usage(self) -> dict[str, Any]:
        n = len(self.token_ids())
        return {"prompt_tokens": len(PROMPT_IDS), "total_tokens": len(PROMPT_IDS) + n, "completion_tokens": n,
                "prompt_tokens_details": {"cached_tokens": 0},
                "completion_tokens_details": {"reasoning_tokens": len(self.reasoning)}}  # fmt: skip

    async def __call__(self, request: httpx2.Request) -> httpx2.Response:
        body = json.loads(request.content)
        self.received.append(body)
        if not body.get("stream"):
            return httpx2.Response(200, json=self.whole(body))
        events = [b"data: " + json.dumps(c).encode() + b"\n\n" for c in self.chunks(body)]
        ending = self.ending

        async def stream():  # type: ignore[no-untyped-def]
            for n, event in enumerate(events):
                if ending == "cut" and n == 2:
                    raise httpx2.ReadError("engine died")
                if ending in ("error", "flat_error") and n == 2:
                    error = {"message": "KV load failed", "type": "InternalServerError", "param": None, "code": 500}
                    yield b"data: " + json.dumps({"error": error} if ending == "error" else {"object": "error", **error}).encode()
                    yield b"\n\ndata: [DONE]\n\n"
                    return
                yield event
            if ending != "eof":
                yield b"data: [DONE]\n\n"

        return httpx2.Response(200, headers={"content-type": "text/event-stream"}, content=stream())

    def _head(self, body: dict[str, Any], obj: str) -> dict[str, Any]:
        return {"id": "chatcmpl-engine", "object": obj, "created": 1700000000, "model": body["model"]}

    def chunks(self, body: dict[str, Any]) -> list[dict[str, Any]]:
        """The stream as vLLM writes it (``exclude_unset``): role chunk, a chunk per piece, finish, usage."""
        head = self._head(body, "chat.completion.chunk")
        ids = iter(self.token_ids())
        out = [{**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                     "finish_reason": None}], "prompt_token_ids": PROMPT_IDS}]  # fmt: skip
        pieces: list[dict[str, Any]] = [{self.reasoning_field: r} for r in self.reasoning]
        pieces += [{"content": c} for c in self.content]
        if self.tool_call is not None:
            pieces.append({"tool_calls": [{"id": "chatcmpl-tool-1", "type": "function", "index": 0, "function": self.tool_call}]})
        for delta in pieces:
            out.append({**head, "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": None,
                                             "token_ids": [next(ids)]}]})  # fmt: skip
        out.append({**head, "choices": [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": self.finish,
                                         "stop_reason": None, "token_ids": []}]})  # fmt: skip
        out.append({**head, "choices": [], "usage": self.usage(), "kv_transfer_params": {"remote_block_ids": [7]}})
        return out

    def whole(self, body: dict[str, Any]) -> dict[str, Any]:
        """The non-streamed answer, every field ``ChatCompletionResponse`` serializes."""
        message: dict[str, Any] = {
            "role": "assistant", "content": "".join(self.content), "refusal": None, "annotations": None, "audio": None,
            "function_call": None, self.reasoning_field: "".join(self.reasoning),
        }  # fmt: skip
        if self.tool_call is not None:
            message["tool_calls"] = [{"id": "chatcmpl-tool-1", "type": "function", "function": self.tool_call}]
        choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": self.finish, "stop_reason": None,
                  "token_ids": self.token_ids(), "routed_experts": "k05VTVBZ"}  # fmt: skip
        return {**self._head(body, "chat.completion"), "choices": [choice], "service_tier": None,
                "system_fingerprint": None, "usage": self.usage(), "prompt_logprobs": None,
                "prompt_token_ids": PROMPT_IDS, "prompt_text": None, "kv_transfer_params": {"remote_block_ids": [7]},
                "ec_transfer_params": None, "metrics": None, "a_later_field": {"kept": True}}  # fmt: skip
