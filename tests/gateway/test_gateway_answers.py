"""A cached answer is the whole answer, and only finished answers are kept: the gateway
against the real database and the deployment's stores, with an engine that answers as vLLM
does behind a reasoning parser (tests/gateway/reasoning_stub.py). Every field the engine
returned reaches the caller of a live answer and of its replays, in both shapes and from
both layers; only ``id``, ``created`` and ``usage`` (what was computed now) differ. An answer
that did not finish, however its stream ended, is served once and kept nowhere."""

from __future__ import annotations

import json
from typing import Any

import httpx2
import pytest

from cacheadmin.services.gateway import tenant_gateway_policy_update
from gateway.answers import AnswerAssembler
from tests.gateway.harness import call, chat, refresh
from tests.gateway.reasoning_stub import PROMPT_IDS, ReasoningEngine

pytestmark = pytest.mark.django_db(transaction=True)

STREAM: dict[str, Any] = {"stream": True, "stream_options": {"include_usage": True}}


def _engine(setup: dict[str, Any], **script: Any) -> ReasoningEngine:
    engine = ReasoningEngine(**script)
    setup["gateway"].proxy.transport = httpx2.MockTransport(engine)
    return engine


def _chunks(answer: Any) -> list[dict[str, Any]]:
    assert answer.text.endswith("data: [DONE]\n\n"), answer.text[-300:]
    return [json.loads(line[6:]) for line in answer.text.splitlines() if line.startswith("data: {")]


def _folded(answer: Any) -> dict[str, Any]:
    fold = AnswerAssembler("chat")
    for chunk in _chunks(answer):
        fold.feed(chunk)
    return fold.answer()


def _but(answer: dict[str, Any], *names: str) -> dict[str, Any]:
    return {k: v for k, v in answer.items() if k not in names}


def test_a_non_streamed_answer_and_its_replays_carry_every_field_the_engine_returned(setup) -> None:
    engine = _engine(setup)
    live = call(setup, chat(temperature=0))
    assert live.headers["x-kvcp-served-by"] == "engine"
    sent = engine.whole(engine.received[0])
    body = live.json()
    # Every field of the engine's answer, reasoning and vLLM's own and later fields included;
    # the model is the name the caller asked for, the fingerprint the routed state's.
    assert _but(body, "id", "created", "model", "system_fingerprint") == _but(
        sent, "id", "created", "model", "system_fingerprint"
    )
    assert body["choices"][0]["message"]["reasoning"] == "The user asks for a capital."
    assert (body["model"], body["system_fingerprint"]) == ("tiny", live.headers["x-kvcp-fingerprint"])
    again = call(setup, chat(temperature=0))
    assert again.headers["x-kvcp-served-by"] == "response" and len(engine.received) == 1
    replay = again.json()
    assert _but(replay, "id", "created", "usage") == _but(body, "id", "created", "usage")
    assert replay["id"] != body["id"]
    # Nothing was computed for the hit: every prompt and completion token is cached (README: usage).
    assert replay["usage"] == {
        "prompt_tokens": 4, "completion_tokens": 5, "total_tokens": 9,
        "prompt_tokens_details": {"cached_tokens": 4}, "completion_tokens_details": {"reasoning_tokens": 2, "cached_tokens": 5},
    }  # fmt: skip
    assert body["usage"] == engine.usage()  # the engine computed the live one: its own usage
    # The same record replayed as a stream: every field on vLLM's chunks, folded back into the answer.
    streamed = call(setup, chat(temperature=0, **STREAM))
    assert streamed.headers["x-kvcp-served-by"] == "response"
    chunks = _chunks(streamed)
    assert chunks[0]["prompt_token_ids"] == PROMPT_IDS and chunks[0]["choices"][0]["delta"] == {
        "role": "assistant",
        "content": "",
    }
    out = chunks[1]["choices"][0]
    assert out["delta"] == {"content": "Paris is the capital.", "reasoning": "The user asks for a capital.", "refusal": None,
                            "annotations": None, "audio": None, "function_call": None}  # fmt: skip
    assert (out["finish_reason"], out["stop_reason"], out["token_ids"], out["routed_experts"]) == (
        "stop",
        None,
        [100, 101, 102, 103, 104],
        "k05VTVBZ",
    )
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == replay["usage"]
    assert chunks[-1]["kv_transfer_params"] == {"remote_block_ids": [7]} and chunks[-1]["a_later_field"] == {"kept": True}
    folded = _folded(streamed)
    assert _but(folded, "usage") == _but(body, "id", "created", "model", "usage")


@pytest.mark.parametrize("field", ["reasoning", "reasoning_content"])
def test_a_streamed_answer_and_its_replays_carry_every_field_the_engine_streamed(setup, field: str) -> None:
    engine = _engine(setup, reasoning_field=field)
    live = call(setup, chat(temperature=0, **STREAM))
    assert live.headers["x-kvcp-served-by"] == "engine"
    live_chunks = _chunks(live)
    assert [c["choices"][0]["delta"].get(field) for c in live_chunks[1:3]] == ["The user asks", " for a capital."]
    assert live_chunks[-2]["choices"][0]["stop_reason"] is None and "stop_reason" in live_chunks[-2]["choices"][0]
    original = _folded(live)
    assert original["choices"] == [{
        "index": 0, "message": {"role": "assistant", "content": "Paris is the capital.", field: "The user asks for a capital."},
        "logprobs": None, "finish_reason": "stop", "token_ids": [100, 101, 102, 103, 104], "stop_reason": None,
    }]  # fmt: skip
    assert original["prompt_token_ids"] == PROMPT_IDS and original["kv_transfer_params"] == {"remote_block_ids": [7]}
    replay = call(setup, chat(temperature=0, **STREAM))
    assert replay.headers["x-kvcp-served-by"] == "response" and len(engine.received) == 1
    chunks = _chunks(replay)
    assert chunks[1]["choices"][0]["delta"][field] == "The user asks for a capital."
    assert chunks[1]["choices"][0]["token_ids"] == [100, 101, 102, 103, 104] and "stop_reason" in chunks[1]["choices"][0]
    assert _but(_folded(replay), "usage") == _but(original, "usage")
    assert {c["model"] for c in chunks} == {c["model"] for c in live_chunks} == {"tiny"}
    # The streamed answer replayed whole: the non-streamed shape of the same fields, with the
    # fields vLLM's whole answer always carries and its stream leaves unset as null.
    whole = call(setup, chat(temperature=0)).json()
    assert whole["object"] == "chat.completion" and whole["choices"] == [{
        "index": 0, "message": {"role": "assistant", "content": "Paris is the capital.", field: "The user asks for a capital.",
                                "refusal": None, "annotations": None, "audio": None, "function_call": None,
                                **({"reasoning": None} if field != "reasoning" else {})},
        "logprobs": None, "finish_reason": "stop", "token_ids": [100, 101, 102, 103, 104], "stop_reason": None,
        "routed_experts": None,
    }]  # fmt: skip
    assert (whole["service_tier"], whole["prompt_logprobs"], whole["prompt_text"], whole["ec_transfer_params"]) == (None,) * 4
    assert whole["kv_transfer_params"] == {"remote_block_ids": [7]}
    assert whole["prompt_token_ids"] == PROMPT_IDS and whole["usage"]["prompt_tokens_details"]["cached_tokens"] == 4


def test_a_paraphrase_served_by_the_semantic_layer_carries_every_field_too(semantic_setup) -> None:
    s = semantic_setup
    engine = _engine(s)
    first = call(s, chat("How do I reset my password?", temperature=0, max_tokens=16))
    assert first.headers["x-kvcp-served-by"] == "engine"
    paraphrase = call(s, chat("How can I reset my password?", temperature=0, max_tokens=16, **STREAM))
    assert paraphrase.headers["x-kvcp-served-by"] == "semantic" and len(engine.received) == 1
    folded = _folded(paraphrase)
    original = first.json()
    assert folded["choices"][0]["message"]["reasoning"] == "The user asks for a capital."
    assert folded["choices"][0]["token_ids"] == [100, 101, 102, 103, 104] and folded["a_later_field"] == {"kept": True}
    assert folded["choices"][0]["routed_experts"] == original["choices"][0]["routed_experts"]
    assert folded["usage"]["prompt_tokens_details"]["cached_tokens"] == 4
    whole = call(s, chat("How could I reset my password?", temperature=0, max_tokens=16))
    assert whole.headers["x-kvcp-served-by"] == "semantic"
    assert _but(whole.json(), "id", "created", "usage") == _but(original, "id", "created", "usage")


SERVER_ERROR_500 = '"message": "the engine answered HTTP 500", "type": "server_error", "param": null, "code": "engine_500"'
#: Every way a stream ends that is no finished answer: (engine script, what the caller's stream ends with).
UNFINISHED_STREAMS: dict[str, tuple[dict[str, Any], str | None]] = {
    "early_close": ({"ending": "cut"}, "engine_failed"),
    # An engine's 5xx error event (code 500) reaches the caller in the gateway's shape, its text only in the log.
    "error_event": ({"ending": "error"}, SERVER_ERROR_500),
    "flat_error_event": ({"ending": "flat_error"}, SERVER_ERROR_500),
    "eof_without_done": ({"ending": "eof"}, None),
    "finish_reason_null": ({"finish": None}, "[DONE]"),
    "content_empty": ({"content": []}, "[DONE]"),
    "content_and_reasoning_empty": ({"content": [], "reasoning": []}, "[DONE]"),
    "length": ({"finish": "length"}, "[DONE]"),
    "content_filter": ({"finish": "content_filter"}, "[DONE]"),
    "abort": ({"finish": "abort"}, "[DONE]"),
    "cut_tool_call": (
        {"content": [], "finish": "tool_calls", "tool_call": {"name": "weather", "arguments": '{"city": "Par'}}, "[DONE]"
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(UNFINISHED_STREAMS))
def test_a_stream_that_did_not_finish_is_served_once_and_kept_nowhere(setup, case: str) -> None:
    script, tail = UNFINISHED_STREAMS[case]
    engine = _engine(setup, **script)
    first = call(setup, chat(temperature=0, **STREAM))
    assert first.status_code == 200 and first.headers["x-kvcp-served-by"] == "engine"
    if tail is not None:
        assert tail in first.text.rstrip().splitlines()[-1]
    assert setup["store"].entries("ns-acme") == []
    again = call(setup, chat(temperature=0, **STREAM))
    assert again.headers["x-kvcp-served-by"] == "engine" and len(engine.received) == 2


@pytest.mark.parametrize("case", ["finish_reason_null", "content_empty", "length", "content_filter", "abort", "cut_tool_call"])
def test_a_whole_answer_that_did_not_finish_is_served_once_and_kept_nowhere(setup, case: str) -> None:
    engine = _engine(setup, **UNFINISHED_STREAMS[case][0])
    first = call(setup, chat(temperature=0))
    assert first.status_code == 200 and first.json()["choices"][0]["finish_reason"] == engine.finish
    assert setup["store"].entries("ns-acme") == []
    assert call(setup, chat(temperature=0)).headers["x-kvcp-served-by"] == "engine" and len(engine.received) == 2


def test_a_semantic_layer_keeps_no_unfinished_answer_either(semantic_setup) -> None:
    s = semantic_setup
    engine = _engine(s, finish="length")
    assert call(s, chat("How do I reset my password?", temperature=0, **STREAM)).headers["x-kvcp-served-by"] == "engine"
    assert s["semantic_store"].entries("ns-acme") == []
    assert call(s, chat("How can I reset my password?", temperature=0)).headers["x-kvcp-served-by"] == "engine"
    assert len(engine.received) == 2


@pytest.mark.parametrize("stream", [False, True])
def test_answers_cut_at_max_tokens_are_kept_where_the_tenant_admits_length(setup, stream: bool) -> None:
    tenant_gateway_policy_update(tenant=setup["acme"], actor="t", changes={"admit_length": True})
    refresh(setup)
    engine = _engine(setup, finish="length")
    params: dict[str, Any] = STREAM if stream else {}
    assert call(setup, chat(temperature=0, **params)).headers["x-kvcp-served-by"] == "engine"
    again = call(setup, chat(temperature=0, **params))
    assert again.headers["x-kvcp-served-by"] == "response" and len(engine.received) == 1
    assert (_folded(again) if stream else again.json())["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("stream", [False, True])
def test_a_finished_tool_call_is_kept_and_replayed_whole(setup, stream: bool) -> None:
    engine = _engine(setup, content=[], finish="tool_calls", tool_call={"name": "weather", "arguments": '{"city": "Paris"}'})
    params: dict[str, Any] = STREAM if stream else {}
    first = call(setup, chat(temperature=0, **params))
    again = call(setup, chat(temperature=0, **params))
    assert again.headers["x-kvcp-served-by"] == "response" and len(engine.received) == 1
    calls = (_folded(again) if stream else again.json())["choices"][0]["message"]["tool_calls"]
    assert calls == [
        {"id": "chatcmpl-tool-1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}
    ]
    assert (_folded(first) if stream else first.json())["choices"][0]["message"]["tool_calls"] == calls
