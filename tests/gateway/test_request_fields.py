"""Which body fields reach the engine (gateway/request_fields.py): every field of
the installed vLLM's request models is classified, refused fields are answered
with a 400 naming them and reach no engine, stripped ones are never forwarded,
allowed ones are forwarded and keyed."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from gateway.canonical import canonical_request, normalized_body
from gateway.param_specs import InvalidRequest
from gateway.request_fields import FIELD_CLASSES, REQUEST_FIELDS, field_refusal, fields_of
from gateway.server import explain
from tests.gateway.harness import call, chat

ENDPOINTS = ("chat", "completions")
PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}
BASE: dict[str, dict[str, Any]] = {
    "chat": {"model": "tiny", "messages": [{"role": "user", "content": "Hello"}]},
    "completions": {"model": "tiny", "prompt": "Once upon a time"},
}
TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]

# A valid value off the default for every allowed field, with what it needs beside it
# (top_logprobs needs logprobs, tool_choice needs tools). ASCII only: NFC leaves it as is.
ALLOWED_SAMPLES: dict[str, dict[str, Any]] = {
    "model": {"model": "tiny-2"},
    "messages": {"messages": [{"role": "user", "content": "Bye"}]},
    "prompt": {"prompt": "Twice"},
    "suffix": {"suffix": "end"},
    "frequency_penalty": {"frequency_penalty": 0.5},
    "presence_penalty": {"presence_penalty": 0.5},
    "logit_bias": {"logit_bias": {"5": 1.0}},
    "seed": {"seed": 7},
    "stop": {"stop": ["x"]},
    "temperature": {"temperature": 0.5},
    "top_p": {"top_p": 0.5},
    "n": {"n": 2},
    "max_tokens": {"max_tokens": 5},
    "max_completion_tokens": {"max_completion_tokens": 5},
    "logprobs": {"logprobs": True},
    "top_logprobs": {"top_logprobs": 2, "logprobs": True},
    "response_format": {"response_format": {"type": "json_object"}},
    "tools": {"tools": TOOLS},
    "tool_choice": {"tool_choice": "required", "tools": TOOLS},
    "parallel_tool_calls": {"parallel_tool_calls": False},
    "reasoning_effort": {"reasoning_effort": "low"},
    "echo": {"echo": True},
    "best_of": {"best_of": 2},
    "top_k": {"top_k": 5},
    "min_p": {"min_p": 0.1},
    "repetition_penalty": {"repetition_penalty": 1.1},
    "length_penalty": {"length_penalty": 0.5},
    "use_beam_search": {"use_beam_search": True},
    "stop_token_ids": {"stop_token_ids": [3]},
    "include_stop_str_in_output": {"include_stop_str_in_output": True},
    "ignore_eos": {"ignore_eos": True},
    "min_tokens": {"min_tokens": 1},
    "skip_special_tokens": {"skip_special_tokens": False},
    "spaces_between_special_tokens": {"spaces_between_special_tokens": False},
    "truncate_prompt_tokens": {"truncate_prompt_tokens": 10},
    "truncation_side": {"truncation_side": "left"},
    "prompt_logprobs": {"prompt_logprobs": 1},
    "logprob_token_ids": {"logprob_token_ids": [1], "logprobs": True},
    "allowed_token_ids": {"allowed_token_ids": [1, 2]},
    "bad_words": {"bad_words": ["x"]},
    "structured_outputs": {"structured_outputs": {"regex": "a+"}},
    "repetition_detection": {"repetition_detection": {"max_pattern_size": 4, "min_count": 3}},
    "thinking_token_budget": {"thinking_token_budget": 10},
    "return_tokens_as_token_ids": {"return_tokens_as_token_ids": True},
    "return_token_ids": {"return_token_ids": True},
    "routed_experts_prompt_start": {"routed_experts_prompt_start": 1},
    "include_reasoning": {"include_reasoning": False},
    "add_generation_prompt": {"add_generation_prompt": False},
    "continue_final_message": {"continue_final_message": True},
    "add_special_tokens": {"add_special_tokens": True},
    "documents": {"documents": [{"title": "a", "text": "b"}]},
    "chat_template_kwargs": {"chat_template_kwargs": {"enable_thinking": False}},
    "return_prompt_text": {"return_prompt_text": True},
}
# Completions defaults differ: logprobs is a count there, add_special_tokens defaults to true.
COMPLETIONS_SAMPLES: dict[str, dict[str, Any]] = {
    "logprobs": {"logprobs": 1},
    "logprob_token_ids": {"logprob_token_ids": [1], "logprobs": 1},
    "add_special_tokens": {"add_special_tokens": False},
}
STRIPPED_SAMPLES: dict[str, Any] = {
    "stream": True,
    "stream_options": {"include_usage": True},
    "stream_interval": 4,
    "user": "alice",
    "safety_identifier": "s",
    "metadata": {"a": "b"},
    "store": True,
    "service_tier": "auto",
    "prompt_cache_key": "k",
    "prompt_cache_retention": "24h",
    "return_token_offsets": True,
    "mm_payload": "none",
    "return_mm_kwargs": False,
}
REFUSED_SAMPLES: dict[str, Any] = {
    "cache_salt": "salt-of-another-tenant",
    "kv_transfer_params": {"do_remote_prefill": True, "remote_block_ids": [1, 2], "remote_engine_id": "e"},
    "ec_transfer_params": {"do_remote_encode": True},
    "vllm_xargs": {"session_id": "s", "lmcache.skip_save": 1},
    "priority": -10,
    "request_id": "cmpl-of-another-tenant",
    "session_id": "s",
    "watermarking": False,
    "chat_template": "{{ messages }}",
    "media_io_kwargs": {"video": {"num_frames": 10_000}},
    "mm_processor_kwargs": {"max_pixels": 10**9},
    "prompt_embeds": "AAAA",
    "functions": [{"name": "f"}],
    "function_call": "auto",
    "audio": {"voice": "alloy", "format": "wav"},
    "modalities": ["text"],
    "prediction": {"type": "content", "content": "x"},
    "web_search_options": {},
    "verbosity": "low",
}
KV_TRANSFER_MESSAGE = (
    "kv_transfer_params drives the engine's KV connector (loading and saving KV cache outside the tenant's "
    "namespace); the gateway does not forward it"
)


@pytest.fixture(scope="module")
def vllm_models() -> Iterator[dict[str, Any]]:
    """vLLM's request models, imported once (the import loads torch: about 20 s)."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    yield {"chat": ChatCompletionRequest, "completions": CompletionRequest}


def sample(endpoint: str, name: str) -> dict[str, Any]:
    if endpoint == "completions" and name in COMPLETIONS_SAMPLES:
        return COMPLETIONS_SAMPLES[name]
    return ALLOWED_SAMPLES[name]


def cases(kind: str) -> list[tuple[str, str]]:
    return [(e, n) for e in ENDPOINTS for n in sorted(fields_of(e, kind))]  # type: ignore[arg-type]


# --- the table against the installed vLLM ----------------------------------------------------


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_every_field_of_vllms_request_model_is_in_exactly_one_class(endpoint: str, vllm_models: dict[str, Any]) -> None:
    fields = set(vllm_models[endpoint].model_fields)
    classes = {kind: fields_of(endpoint, kind) for kind in FIELD_CLASSES}  # type: ignore[arg-type]
    unclassified = sorted(name for name in fields if sum(name in names for names in classes.values()) != 1)
    assert unclassified == [], "classify these fields in gateway/request_fields.py"
    # The classes do not overlap, and the table names no field twice (a mapping) nor on no endpoint.
    assert not (classes["allowed"] & classes["stripped"] or classes["allowed"] & classes["refused"])
    assert not classes["stripped"] & classes["refused"]
    assert len(fields) == {"chat": 68, "completions": 55}[endpoint]


def test_vllm_accepts_unknown_fields_so_the_gateway_must_refuse_them(vllm_models: dict[str, Any]) -> None:
    request = vllm_models["chat"].model_validate({**BASE["chat"], "x_custom": 1})
    assert request.model_extra == {"x_custom": 1}  # kept, not refused: extra="allow"
    assert field_refusal("chat", "x_custom") is not None


def test_the_samples_cover_the_table() -> None:
    assert set(ALLOWED_SAMPLES) == fields_of("chat", "allowed") | fields_of("completions", "allowed")
    assert set(STRIPPED_SAMPLES) == fields_of("chat", "stripped") | fields_of("completions", "stripped")
    assert set(REFUSED_SAMPLES) == fields_of("chat", "refused") | fields_of("completions", "refused")
    assert set(REQUEST_FIELDS) == set(ALLOWED_SAMPLES) | set(STRIPPED_SAMPLES) | set(REFUSED_SAMPLES)


# --- what each class does to a body ------------------------------------------------------------


@pytest.mark.parametrize(("endpoint", "name"), cases("refused"))
def test_a_refused_field_is_answered_with_its_reason_naming_it(endpoint: str, name: str) -> None:
    body = {**BASE[endpoint], name: REFUSED_SAMPLES[name]}
    for function in (canonical_request, normalized_body):
        with pytest.raises(InvalidRequest) as err:
            function(endpoint, body)  # type: ignore[operator]
        assert (err.value.param, err.value.message) == (name, REQUEST_FIELDS[name].reason)
        assert err.value.message.startswith(f"{name} ")


def test_kv_transfer_params_is_refused_with_the_documented_message() -> None:
    for endpoint in ENDPOINTS:
        with pytest.raises(InvalidRequest) as err:
            canonical_request(endpoint, {**BASE[endpoint], "kv_transfer_params": REFUSED_SAMPLES["kv_transfer_params"]})  # type: ignore[arg-type]
        assert (err.value.param, err.value.message) == ("kv_transfer_params", KV_TRANSFER_MESSAGE)


def test_a_refusal_comes_before_any_value_check() -> None:
    body = {**BASE["chat"], "temperature": "hot", "priority": 1}
    with pytest.raises(InvalidRequest) as err:
        canonical_request("chat", body)
    assert err.value.param == "priority"


def test_chat_template_inside_chat_template_kwargs_is_refused_like_the_field() -> None:
    body = {**BASE["chat"], "chat_template_kwargs": {"chat_template": "{{ messages }}"}}
    with pytest.raises(InvalidRequest) as err:
        canonical_request("chat", body)
    assert err.value.param == "chat_template_kwargs.chat_template"
    assert err.value.message == REQUEST_FIELDS["chat_template"].reason


@pytest.mark.parametrize(
    ("endpoint", "name", "message"),
    [
        ("chat", "prompt", "is a parameter of /v1/completions, not of /v1/chat/completions"),
        ("completions", "messages", "is a parameter of /v1/chat/completions, not of /v1/completions"),
        ("completions", "tools", "is a parameter of /v1/chat/completions, not of /v1/completions"),
        (
            "chat",
            "x_custom",
            "is not a parameter the gateway accepts on /v1/chat/completions: it forwards OpenAI's parameters and "
            "vLLM's sampling parameters only",
        ),
        (
            "completions",
            "guided_json",
            "is not a parameter the gateway accepts on /v1/completions: it forwards OpenAI's parameters and "
            "vLLM's sampling parameters only",
        ),
    ],
)
def test_unknown_fields_and_fields_of_the_other_endpoint_are_refused(endpoint: str, name: str, message: str) -> None:
    with pytest.raises(InvalidRequest) as err:
        canonical_request(endpoint, {**BASE[endpoint], name: "x"})  # type: ignore[arg-type]
    assert (err.value.param, err.value.message) == (name, message)


@pytest.mark.parametrize(("endpoint", "name"), cases("stripped"))
def test_a_stripped_field_is_not_forwarded_and_leaves_the_key_alone(endpoint: str, name: str) -> None:
    body = {**BASE[endpoint], name: STRIPPED_SAMPLES[name]}
    assert name not in normalized_body(endpoint, body)  # type: ignore[arg-type]
    assert normalized_body(endpoint, body) == normalized_body(endpoint, BASE[endpoint])  # type: ignore[arg-type]
    assert canonical_request(endpoint, body) == canonical_request(endpoint, BASE[endpoint])  # type: ignore[arg-type]


@pytest.mark.parametrize(("endpoint", "name"), cases("allowed"))
def test_an_allowed_field_is_forwarded_and_keyed(endpoint: str, name: str) -> None:
    params = sample(endpoint, name)
    body = {**BASE[endpoint], **params}
    forwarded = normalized_body(endpoint, body)  # type: ignore[arg-type]
    canonical = canonical_request(endpoint, body)  # type: ignore[arg-type]
    # Chat forwards max_tokens under vLLM's current name and keys it under the old one.
    sent = "max_completion_tokens" if (endpoint, name) == ("chat", "max_tokens") else name
    keyed = "max_tokens" if name == "max_completion_tokens" else name
    assert forwarded[sent] == params[name]
    # What reaches the engine is in the key: a non-default value splits it.
    assert keyed in canonical
    assert canonical != canonical_request(endpoint, {**BASE[endpoint], **{k: v for k, v in params.items() if k != name}})  # type: ignore[arg-type]


# --- through the real gateway app -----------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_the_gateway_answers_400_for_kv_transfer_params_and_no_engine_sees_the_request(setup) -> None:  # noqa: F811
    answer = call(setup, chat(temperature=0, kv_transfer_params=REFUSED_SAMPLES["kv_transfer_params"]))
    assert answer.status_code == 400
    assert answer.json() == {
        "error": {"message": KV_TRANSFER_MESSAGE, "type": "invalid_request_error", "param": "kv_transfer_params",
                  "code": "invalid_request"}
    }  # fmt: skip
    assert setup["fake"].received == []
    # The same body without the field is served, and the engine gets only allowed fields.
    served = call(setup, chat(temperature=0, user="alice", stream_interval=2))
    assert served.status_code == 200, served.text
    (sent,) = setup["fake"].received
    # Non-streamed: the engine is asked for its whole answer (no stream options).
    assert set(sent) == {"model", "messages", "temperature", "cache_salt", "stream"} and sent["stream"] is False


@pytest.mark.django_db(transaction=True)
def test_every_refused_field_gets_the_same_400_from_the_gateway_and_from_explain(setup) -> None:  # noqa: F811
    from cacheadmin.services.gateway import gateway_explain
    from inference.errors import InvalidField

    snap = setup["holder"]["snap"]
    for endpoint, name in cases("refused"):
        body = {**BASE[endpoint], "temperature": 0, name: REFUSED_SAMPLES[name]}
        answer = call(setup, body, path=PATHS[endpoint])
        assert answer.status_code == 400, (endpoint, name)
        error = answer.json()["error"]
        assert (error["param"], error["message"], error["code"]) == (name, REQUEST_FIELDS[name].reason, "invalid_request")
        with pytest.raises(InvalidRequest) as err:
            explain(snap, setup["acme"].pk, endpoint, body, layers=setup["gateway"].pipeline.layers)
        assert (err.value.param, err.value.message) == (name, REQUEST_FIELDS[name].reason)
        with pytest.raises(InvalidField) as invalid:
            gateway_explain(tenant=setup["acme"], endpoint=endpoint, body=body)
        assert (invalid.value.field, invalid.value.problem) == (name, REQUEST_FIELDS[name].reason)
    assert setup["fake"].received == []
