"""The canonical request key, the forwarded body and response-cache admission (gateway/canonical.py)."""

from __future__ import annotations

import ast
import copy
import hashlib
import hmac
import importlib.util
import json
import math
from pathlib import Path
from typing import Any

import pytest

from gateway.canonical import (
    ADMISSION_REASONS,
    Admission,
    canonical_bytes,
    canonical_request,
    normalized_body,
    response_admission,
    response_cache_key,
)
from gateway.param_specs import ENGINE_DEFAULTED_PARAMETERS, OUTPUT_DEFAULTS, InvalidRequest
from gateway.request_fields import fields_of
from tests.docs_pages import docs_page

SECRET = b"tenant-secret-0123456789abcdef"
NS = "ns-7f3a"


def chat(**params: Any) -> dict[str, Any]:
    return {"model": "tiny", "messages": [{"role": "user", "content": "Hello"}], **params}


def completion(**params: Any) -> dict[str, Any]:
    return {"model": "tiny", "prompt": "Once upon a time", **params}


def key(endpoint: str, body: dict[str, Any], **kwargs: Any) -> str:
    return response_cache_key(canonical_request(endpoint, body, **kwargs), namespace_key=NS, tenant_secret=SECRET)  # type: ignore[arg-type]


BASE_CHAT = {"endpoint": "chat", "model": "tiny", "messages": [{"role": "user", "content": "Hello"}]}


# --- folding: same output, same key --------------------------------------------------------


def test_minimal_chat_request_is_endpoint_model_and_messages() -> None:
    assert canonical_request("chat", chat()) == BASE_CHAT


def test_parameters_at_their_fixed_default_are_removed() -> None:
    body = chat(
        n=1,
        stop=None,
        seed=None,
        logprobs=False,
        top_logprobs=None,
        max_tokens=None,
        tool_choice="none",
        parallel_tool_calls=True,
        logit_bias={},
        min_tokens=0,
        ignore_eos=False,
        skip_special_tokens=True,
        spaces_between_special_tokens=True,
        include_stop_str_in_output=False,
        add_generation_prompt=True,
        continue_final_message=False,
        add_special_tokens=False,
        echo=False,
        use_beam_search=False,
        length_penalty=1.0,
        stop_token_ids=[],
        bad_words=[],
        include_reasoning=True,
        routed_experts_prompt_start=0,
        return_token_ids=False,
        chat_template_kwargs={},
    )
    assert canonical_request("chat", body) == BASE_CHAT


def test_stripped_parameters_are_removed() -> None:
    body = chat(
        stream=True,
        stream_options={"include_usage": True},
        user="alice",
        metadata={"a": "b"},
        store=True,
        service_tier="auto",
        prompt_cache_key="k",
        safety_identifier="x",
        stream_interval=4,
    )
    assert canonical_request("chat", body) == BASE_CHAT
    assert {"stream", "user"} <= fields_of("chat", "stripped")
    # Engine identity and scheduling were ignored before; now they are refused (tests/gateway/test_request_fields.py).
    assert {"priority", "request_id", "session_id", "cache_salt"} <= fields_of("chat", "refused")
    assert "cache_salt" not in OUTPUT_DEFAULTS["chat"]


def test_engine_defaulted_parameter_is_kept_when_engine_defaults_are_unknown() -> None:
    # An omitted temperature is the engine's default (possibly generation_config.json's),
    # so an explicit 1.0 is not the same request.
    assert canonical_request("chat", chat(temperature=1.0)) == {**BASE_CHAT, "temperature": 1.0}
    assert key("chat", chat(temperature=1.0)) != key("chat", chat())
    assert canonical_request("chat", chat(temperature=None)) == BASE_CHAT


def test_engine_on_neutral_defaults_folds_openai_defaults() -> None:
    body = chat(temperature=1, top_p=1.0, top_k=-1, min_p=0, repetition_penalty=1.0, presence_penalty=0, frequency_penalty=0.0)
    assert canonical_request("chat", body, engine_defaults={}) == BASE_CHAT
    assert key("chat", body, engine_defaults={}) == key("chat", chat(), engine_defaults={})


def test_engine_generation_config_defaults_fold_their_own_values_only() -> None:
    engine = {"temperature": 0.6, "top_p": 0.9, "max_tokens": 256}
    assert canonical_request("chat", chat(temperature=0.6, top_p=0.9, max_tokens=256), engine_defaults=engine) == BASE_CHAT
    assert canonical_request("chat", chat(temperature=1.0, top_p=1.0), engine_defaults=engine) == {
        **BASE_CHAT,
        "temperature": 1.0,
        "top_p": 1.0,
    }


def test_engine_defaults_naming_a_fixed_parameter_are_refused() -> None:
    with pytest.raises(ValueError, match="'n' is not an engine-defaulted parameter"):
        canonical_request("chat", chat(), engine_defaults={"n": 2})


@pytest.mark.parametrize(
    ("a", "b"),
    [
        ({"temperature": 0}, {"temperature": 0.0}),
        ({"temperature": 0.005}, {"temperature": 0.01}),  # vLLM raises (0, 0.01) to 0.01
        ({"top_k": -1, "temperature": 0.5}, {"top_k": 0, "temperature": 0.5}),
        ({"seed": -1, "temperature": 0.5}, {"temperature": 0.5}),
        ({"stop": "END"}, {"stop": ["END"]}),
        ({"stop": []}, {}),
        ({"stop_token_ids": [7, 2, 7]}, {"stop_token_ids": [2, 7]}),
        ({"logit_bias": {"050": 5}}, {"logit_bias": {"50": 5.0}}),
        ({"max_completion_tokens": 20}, {"max_tokens": 20}),
        ({"max_completion_tokens": 20, "max_tokens": 20}, {"max_tokens": 20}),
        ({"n": 2.0, "temperature": 0.5}, {"n": 2, "temperature": 0.5}),
        ({"logprobs": None}, {}),
        ({"logprobs": True, "top_logprobs": 0}, {"logprobs": True}),
        ({"temperature": 0, "top_p": 0.3, "top_k": 5, "min_p": 0.2}, {"temperature": 0}),  # greedy ignores them
        ({"parallel_tool_calls": None}, {}),
        ({"tool_choice": None}, {}),  # no tools: null is "none"
        ({"presence_penalty": -0.0}, {"presence_penalty": 0.0}),
    ],
)
def test_equivalent_spellings_get_one_key(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert canonical_request("chat", chat(**a)) == canonical_request("chat", chat(**b))
    assert key("chat", chat(**a)) == key("chat", chat(**b))


def test_canonical_values_are_typed() -> None:
    got = canonical_request("chat", chat(temperature=1, presence_penalty=1, n=3.0, stop="x", seed=42, logit_bias={"7": 1}))
    assert got == {
        **BASE_CHAT,
        "temperature": 1.0,
        "presence_penalty": 1.0,
        "n": 3,
        "stop": ["x"],
        "seed": 42,
        "logit_bias": {"7": 1.0},
    }
    assert type(got["temperature"]) is float and type(got["n"]) is int


def test_tool_choice_default_depends_on_tools() -> None:
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]
    with_tools = {**BASE_CHAT, "tools": tools}
    assert canonical_request("chat", chat(tools=tools)) == with_tools
    assert canonical_request("chat", chat(tools=tools, tool_choice="auto")) == with_tools
    assert canonical_request("chat", chat(tools=tools, tool_choice="none")) == {**with_tools, "tool_choice": "none"}
    # With tools an explicit null is not "auto": vLLM fills "auto" only for an absent key.
    assert canonical_request("chat", chat(tools=tools, tool_choice=None)) == {**with_tools, "tool_choice": None}
    named = {"type": "function", "function": {"name": "lookup"}}
    assert canonical_request("chat", chat(tools=tools, tool_choice=named)) == {**with_tools, "tool_choice": named}


def test_completions_defaults() -> None:
    base = {"endpoint": "completions", "model": "tiny", "prompt": "Once upon a time"}
    same = completion(
        max_tokens=16, echo=None, response_format={"type": "text"}, suffix=None, best_of=1, add_special_tokens=True, logprobs=None
    )
    assert canonical_request("completions", same) == base
    assert canonical_request("completions", completion(max_tokens=None)) == base  # vLLM: null max_tokens is 16
    assert canonical_request("completions", completion(max_tokens=17, logprobs=0)) == {**base, "max_tokens": 17, "logprobs": 0}


def test_chat_response_format_text_is_not_folded() -> None:
    # A non-null response_format reaches some chat templates (vLLM's Kimi K3 renderer).
    assert canonical_request("chat", chat(response_format={"type": "text"})) == {**BASE_CHAT, "response_format": {"type": "text"}}


def test_unicode_is_nfc_in_messages_tools_and_stop() -> None:
    decomposed = chat(
        messages=[{"role": "user", "content": [{"type": "text", "text": "Cafe\u0301"}]}],
        stop=["e\u0301"],
        tools=[{"type": "function", "function": {"name": "re\u0301sume\u0301"}}],
        tool_choice={"type": "function", "function": {"name": "re\u0301sume\u0301"}},
    )
    composed = chat(
        messages=[{"role": "user", "content": [{"type": "text", "text": "Café"}]}],
        stop=["é"],
        tools=[{"type": "function", "function": {"name": "résumé"}}],
        tool_choice={"type": "function", "function": {"name": "résumé"}},
    )
    assert canonical_request("chat", decomposed) == canonical_request("chat", composed)
    assert key("chat", decomposed) == key("chat", composed)
    assert normalized_body("chat", decomposed) == composed
    assert canonical_request("completions", completion(prompt="Cafe\u0301", suffix="e\u0301"))["prompt"] == "Café"


# --- splitting: different output, different key ----------------------------------------------


@pytest.mark.parametrize(
    ("a", "b"),
    [
        ({"temperature": 0.7}, {"temperature": 0.8}),
        (
            {"messages": [{"role": "user", "content": "Hello"}]},
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "Hello"}]}]},
        ),
        ({"stop": ["a", "b"]}, {"stop": ["b", "a"]}),  # vLLM reports the first stop string of the list that matches
        ({"max_tokens": 10}, {"max_tokens": 11}),
        ({"seed": 1, "temperature": 0.5}, {"seed": 2, "temperature": 0.5}),
        ({"model": "tiny"}, {"model": "tiny-lora"}),
        ({"chat_template_kwargs": {"x": 1}}, {"chat_template_kwargs": {"x": 1.0}}),
        ({"logprobs": True}, {}),
        (
            {"messages": [{"role": "user", "content": "Hello"}]},
            {"messages": [{"role": "user", "content": "Hello", "name": "bob"}]},
        ),
    ],
)
def test_requests_that_may_differ_get_different_keys(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert key("chat", chat(**a)) != key("chat", chat(**b))


def test_unknown_parameters_are_refused_so_none_collides_with_a_reserved_key() -> None:
    # Unknown parameters used to be kept under "unknown_parameters"; vLLM would act on some of
    # them (its models accept extra fields), so the gateway now refuses them.
    for name in ("endpoint", "unknown_parameters", "x_custom"):
        with pytest.raises(InvalidRequest) as err:
            canonical_request("chat", chat(**{name: 1}))
        assert err.value.param == name
        assert err.value.message.startswith("is not a parameter the gateway accepts on /v1/chat/completions")


def test_same_body_on_another_endpoint_namespace_or_tenant_gets_another_key() -> None:
    body = {"model": "tiny", "prompt": "x", "temperature": 0}
    chat_key = key("chat", {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "temperature": 0})
    completions = canonical_request("completions", body)
    assert key("completions", body) != chat_key
    assert response_cache_key(completions, namespace_key="other", tenant_secret=SECRET) != key("completions", body)
    assert response_cache_key(completions, namespace_key=NS, tenant_secret=b"another-secret-0123456789") != key(
        "completions", body
    )


def test_response_cache_key_is_the_documented_hmac() -> None:
    canonical = canonical_request("chat", chat(temperature=0))

    def field(label: bytes, value: bytes) -> bytes:
        return len(label).to_bytes(2, "big") + label + len(value).to_bytes(8, "big") + value

    message = (
        field(b"domain", b"kvcp.gateway.response-cache-key.v1")
        + field(b"namespace", NS.encode())
        + field(b"endpoint", b"chat")
        + field(
            b"request",
            b'{"endpoint":"chat","messages":[{"content":"Hello","role":"user"}],"model":"tiny","temperature":0.0}',
        )
    )
    expected = hmac.new(SECRET, message, hashlib.sha256).hexdigest()
    got = response_cache_key(canonical, namespace_key=NS, tenant_secret=SECRET)
    assert got == expected
    assert len(got) == 64 and int(got, 16) >= 0


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"namespace_key": "", "tenant_secret": SECRET}, "namespace_key must be a non-empty string"),
        ({"namespace_key": NS, "tenant_secret": b"short"}, "tenant_secret must be at least 16 bytes"),
        ({"namespace_key": NS, "tenant_secret": "a-string-not-bytes-!!"}, "tenant_secret must be at least 16 bytes"),
    ],
)
def test_response_cache_key_refuses_bad_arguments(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        response_cache_key(canonical_request("chat", chat()), **kwargs)


def test_response_cache_key_needs_the_endpoint() -> None:
    with pytest.raises(InvalidRequest, match="endpoint must be one of chat, completions; got None"):
        response_cache_key({"model": "tiny"}, namespace_key=NS, tenant_secret=SECRET)


# --- canonical bytes ---------------------------------------------------------------------


def test_canonical_bytes_exact_encoding() -> None:
    value = {"b": [1, 1.0, -0.0, 1e100, 0.1], "a": "é", "c": {"z": None, "y": True}}
    assert canonical_bytes(value) == '{"a":"é","b":[1,1.0,0.0,1e+100,0.1],"c":{"y":true,"z":null}}'.encode()


def test_canonical_bytes_equal_floats_encode_equally() -> None:
    assert canonical_bytes({"t": 0.1 + 0.2 - 0.2}) != canonical_bytes({"t": 0.1})  # 0.10000000000000003 is another float
    assert canonical_bytes({"t": float("0.50")}) == canonical_bytes({"t": 0.5}) == b'{"t":0.5}'


@pytest.mark.parametrize(("value", "param"), [({"t": math.nan}, "canonical.t"), ({"t": [math.inf]}, "canonical.t[0]")])
def test_canonical_bytes_refuses_nan_and_infinity(value: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequest) as err:
        canonical_bytes(value)
    assert err.value.param == param


def test_canonical_bytes_refuses_non_json() -> None:
    with pytest.raises(InvalidRequest, match="must be JSON, got set"):
        canonical_bytes({"s": {1, 2}})
    with pytest.raises(InvalidRequest, match="object keys must be strings"):
        canonical_bytes({1: "x"})  # type: ignore[dict-item]


def test_canonical_bytes_keeps_lone_surrogates_distinct() -> None:
    assert canonical_bytes({"s": "\ud800"}) == b'{"s":"\xed\xa0\x80"}'


# --- normalized body ---------------------------------------------------------------------


def test_normalized_body_resolves_the_alias_and_strips_delivery_parameters() -> None:
    body = chat(max_tokens=5, stream=True, user="alice", top_k=3)
    original = copy.deepcopy(body)
    out = normalized_body("chat", body)
    assert out == {
        "model": "tiny",
        "messages": [{"role": "user", "content": "Hello"}],
        "max_completion_tokens": 5,
        "top_k": 3,
    }
    assert body == original
    assert normalized_body("chat", chat(max_completion_tokens=7, max_tokens=7))["max_completion_tokens"] == 7
    assert "max_tokens" not in normalized_body("chat", chat(max_completion_tokens=7, max_tokens=7))
    assert normalized_body("chat", chat(max_tokens=None)) == chat()
    assert normalized_body("completions", completion(max_tokens=5)) == completion(max_tokens=5)


def test_normalized_body_and_canonical_request_agree() -> None:
    body = chat(messages=[{"role": "user", "content": "Cafe\u0301"}], max_completion_tokens=9, temperature=0)
    assert canonical_request("chat", normalized_body("chat", body)) == canonical_request("chat", body)


# --- refusals ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        ({"messages": [{"role": "user", "content": "x"}]}, "model", "is required"),
        (chat(model=""), "model", "must be a non-empty string"),
        (chat(model=3), "model", "must be a non-empty string"),
        ({"model": "tiny"}, "messages", "is required"),
        (chat(messages=[]), "messages", "must be a non-empty list of message objects"),
        (chat(messages="hi"), "messages", "must be a non-empty list of message objects"),
        (chat(messages=["hi"]), "messages[0]", "must be an object, got a string"),
        (chat(messages=[{"content": "x"}]), "messages[0].role", "must be a non-empty string"),
        (chat(messages=[{"role": "user", "content": 5}]), "messages[0].content", "must be a string, a list of parts or null"),
        (chat(messages=[{"role": "user"}]), "messages[0].content", "is required for a 'user' message"),
        (chat(messages=[{"role": "user", "content": []}]), "messages[0].content", "must not be an empty list"),
        (
            chat(messages=[{"role": "user", "content": [{"text": "x"}]}]),
            "messages[0].content[0]",
            'must be an object with a string "type"',
        ),
        (
            chat(messages=[{"role": "user", "content": [{"type": "text", "text": 1}]}]),
            "messages[0].content[0].text",
            "a text part",
        ),
        (chat(temperature=2.5), "temperature", "must be in [0, 2], got 2.5"),
        (chat(temperature=-0.1), "temperature", "must be in [0, 2]"),
        (chat(temperature="0.5"), "temperature", "must be a number, got a string"),
        (chat(temperature=True), "temperature", "must be a number, got a boolean"),
        (chat(temperature=math.nan), "temperature", "must be a finite number"),
        (chat(top_p=0), "top_p", "must be in (0, 1], got 0"),
        (chat(top_p=1.5), "top_p", "must be in (0, 1]"),
        (chat(n=0), "n", "must be an integer in [1, "),
        (chat(n=1.5), "n", "must be an integer, got a number"),
        (chat(n=True), "n", "must be an integer, got a boolean"),
        (chat(max_tokens=0), "max_tokens", "must be an integer in [1, "),
        (chat(max_completion_tokens=0), "max_completion_tokens", "must be an integer in [1, "),
        (chat(max_tokens=5, max_completion_tokens=6), "max_completion_tokens", "both are given and differ (6 != 5)"),
        (chat(presence_penalty=2.5), "presence_penalty", "must be in [-2, 2]"),
        (chat(top_k=-2), "top_k", "must be an integer in [-1, "),
        (chat(min_p=1.5), "min_p", "must be in [0, 1]"),
        (chat(repetition_penalty=0), "repetition_penalty", "must be in (0, inf]"),
        (chat(seed="1"), "seed", "must be an integer, got a string"),
        (chat(seed=2**63), "seed", "must be an integer in ["),
        (chat(stop=[1]), "stop[0]", "must be a string, got a number"),
        (chat(stop=5), "stop", "must be a string or a list of strings"),
        (chat(logit_bias={"abc": 1}), "logit_bias", "keys must be token ids"),
        (chat(logit_bias={"5": 101}), "logit_bias.5", "must be in [-100, 100]"),
        (chat(logit_bias={"5": 1, "05": 2}), "logit_bias", "token id 5 is given twice"),
        (chat(logprobs="yes"), "logprobs", "must be true or false, got a string"),
        (chat(ignore_eos=None), "ignore_eos", "must not be null"),
        (chat(top_logprobs=2), "top_logprobs", "needs logprobs: true"),
        (chat(temperature=0, n=2), "n", "must be 1 with greedy sampling"),
        (chat(continue_final_message=True, add_generation_prompt=True), "continue_final_message", "cannot be true together"),
        (chat(tools=[]), "tools", "must not be an empty array"),
        (chat(tools=[{"type": "function"}]), "tools[0].function", 'must have a "function" object'),
        (chat(tool_choice="auto"), "tool_choice", "needs tools"),
        (chat(tool_choice="sometimes"), "tool_choice", "must be one of none, auto, required"),
        (
            chat(tools=[{"function": {"name": "a"}}], tool_choice={"type": "function", "function": {"name": "b"}}),
            "tool_choice",
            "names a function that is not among the tools",
        ),
        (chat(response_format={"type": "json_schema"}), "response_format", 'needs a "json_schema" object'),
        (chat(response_format="json"), "response_format", "must be an object, got a string"),
        (chat(min_tokens=10, max_tokens=5), "min_tokens", "must not exceed max_tokens (5)"),
        (chat(chat_template_kwargs={"x": [math.inf]}), "chat_template_kwargs.x[0]", "must be a finite number"),
        (chat(x_custom=1), "x_custom", "is not a parameter the gateway accepts"),
        (chat(cache_salt="abc"), "cache_salt", "cache_salt is set by the gateway"),
        ({"model": "tiny"}, "prompt", "is required"),
    ],
)
def test_malformed_chat_bodies_are_refused_naming_the_parameter(body: dict[str, Any], param: str, message: str) -> None:
    endpoint = "completions" if param == "prompt" else "chat"
    with pytest.raises(InvalidRequest) as err:
        canonical_request(endpoint, body)  # type: ignore[arg-type]
    assert err.value.param == param
    assert message in err.value.message
    with pytest.raises(InvalidRequest):
        normalized_body(endpoint, body)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        (completion(prompt=""), "prompt", "must not be empty"),
        (completion(prompt=[]), "prompt", "must be a string, a list of strings"),
        (completion(prompt=[1, "a"]), "prompt[1]", "must be an integer, got a string"),
        (completion(prompt=[[1, 2], []]), "prompt[1]", "must not be an empty token list"),
        (completion(prompt=[5, -1]), "prompt[1]", "must be an integer in [0, "),
        (completion(prompt={"text": "x"}), "prompt", "must be a string, a list of strings"),
        (completion(max_tokens=0), "max_tokens", "must be at least 1 unless echo is true"),
        (completion(n=3, best_of=2), "best_of", "must be at least n"),
        (completion(logprobs=True), "logprobs", "must be an integer, got a boolean"),
        (completion(n=None), "n", "must not be null"),
        (completion(suffix=3), "suffix", "must be a string, got a number"),
    ],
)
def test_malformed_completion_bodies_are_refused_naming_the_parameter(body: dict[str, Any], param: str, message: str) -> None:
    with pytest.raises(InvalidRequest) as err:
        canonical_request("completions", body)
    assert err.value.param == param
    assert message in err.value.message


def test_completion_prompt_shapes() -> None:
    assert canonical_request("completions", completion(prompt=["a", "b"]))["prompt"] == ["a", "b"]
    assert canonical_request("completions", completion(prompt=[1, 2.0]))["prompt"] == [1, 2]
    assert canonical_request("completions", completion(prompt=[[1], [2, 3]]))["prompt"] == [[1], [2, 3]]
    assert canonical_request("completions", completion(max_tokens=0, echo=True))["max_tokens"] == 0


def test_refusals_are_value_errors_with_the_openai_fields() -> None:
    with pytest.raises(ValueError) as err:
        canonical_request("chat", chat(temperature=3))
    assert isinstance(err.value, InvalidRequest)
    assert (err.value.param, err.value.message, str(err.value)) == (
        "temperature",
        "must be in [0, 2], got 3",
        "temperature: must be in [0, 2], got 3",
    )
    assert InvalidRequest("do not send it", param="cache_salt").param == "cache_salt"
    with pytest.raises(InvalidRequest, match="endpoint must be one of chat, completions; got 'embeddings'"):
        canonical_request("embeddings", chat())  # type: ignore[arg-type]
    with pytest.raises(InvalidRequest, match="the request body must be a JSON object, got a list"):
        canonical_request("chat", [])  # type: ignore[arg-type]


# --- admission -------------------------------------------------------------------------------

# Every sampling parameter whose omission means the model's generation_config default.
_SEEDED = {"temperature": 0.7, "top_p": 0.9, "top_k": 40, "min_p": 0.05}


@pytest.mark.parametrize(
    ("params", "policy", "expected"),
    [
        ({}, {}, Admission(False, "sampling")),  # omitted temperature is the default 1.0, not greedy
        ({"temperature": 0}, {}, Admission(True, "greedy")),
        ({"temperature": 0.9, "top_k": 1}, {}, Admission(True, "greedy")),
        ({"temperature": 0.7}, {}, Admission(False, "sampling")),
        ({"temperature": 0.7, "seed": 11}, {}, Admission(False, "seed_not_guaranteed")),
        ({"temperature": 0.7, "seed": 11}, {"allow_seeded": True}, Admission(False, "sampling_defaults_unknown")),
        ({"temperature": 0.7, "top_p": 0.9, "seed": 11}, {"allow_seeded": True}, Admission(False, "sampling_defaults_unknown")),
        ({**_SEEDED, "seed": 11}, {"allow_seeded": True}, Admission(True, "seeded")),
        ({**_SEEDED, "seed": 11, "n": 3}, {"allow_seeded": True}, Admission(True, "seeded")),
        ({"temperature": 0.7}, {"allow_seeded": True}, Admission(False, "sampling")),
        ({"temperature": 0.7}, {"allow_sampling": True}, Admission(True, "sampling_allowed")),
        ({"temperature": 0.7, "seed": 3}, {"allow_sampling": True}, Admission(True, "sampling_allowed")),
        ({"temperature": 0.7, "seed": 3}, {"allow_seeded": True, "allow_sampling": True}, Admission(True, "sampling_allowed")),
        ({**_SEEDED, "seed": 3}, {"allow_seeded": True, "allow_sampling": True}, Admission(True, "seeded")),
        ({"temperature": 0}, {"allow_sampling": True}, Admission(True, "greedy")),
        ({"seed": -1, "temperature": 0.7}, {"allow_seeded": True}, Admission(False, "sampling")),  # -1 is no seed
    ],
)
def test_response_admission(params: dict[str, Any], policy: dict[str, bool], expected: Admission) -> None:
    got = response_admission(canonical_request("chat", chat(**params)), **policy)
    assert got == expected
    assert got.reason in ADMISSION_REASONS


def test_admission_uses_known_engine_defaults_for_an_omitted_temperature() -> None:
    greedy_engine = {"temperature": 0.0}
    canonical = canonical_request("chat", chat(temperature=0), engine_defaults=greedy_engine)
    assert canonical == BASE_CHAT
    assert response_admission(canonical, engine_defaults=greedy_engine) == Admission(True, "greedy")
    assert response_admission(canonical) == Admission(False, "sampling")
    assert response_admission(canonical, engine_defaults={}) == Admission(False, "sampling")


def test_a_seeded_answer_is_reused_only_when_no_sampling_parameter_is_left_to_the_models_defaults() -> None:
    # generation_config.json's temperature/top_p/top_k/min_p are not identity (they never change the KV
    # state), so a seeded answer that left one of them to the engine may have been sampled differently.
    for missing in ("temperature", "top_p", "top_k", "min_p"):
        params = {k: v for k, v in _SEEDED.items() if k != missing}
        canonical = canonical_request("chat", chat(**params, seed=5))
        assert response_admission(canonical, allow_seeded=True) == Admission(False, "sampling_defaults_unknown")
        known = {"temperature": 0.7, "top_p": 0.9, "top_k": 40, "min_p": 0.05}
        assert response_admission(canonical, allow_seeded=True, engine_defaults=known) == Admission(True, "seeded")
    canonical = canonical_request("chat", chat(**_SEEDED, seed=5))
    assert response_admission(canonical, allow_seeded=True) == Admission(True, "seeded")


def test_admission_reasons_are_a_closed_set() -> None:
    assert ADMISSION_REASONS == frozenset(
        {"greedy", "seeded", "sampling_allowed", "sampling", "seed_not_guaranteed", "sampling_defaults_unknown"}
    )


def test_admission_refuses_a_malformed_canonical() -> None:
    with pytest.raises(InvalidRequest) as err:
        response_admission({"endpoint": "chat", "temperature": "hot"})
    assert err.value.param == "temperature"


# --- the defaults are vLLM 0.32's ------------------------------------------------------------


def _vllm_fields(relative: str, class_name: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """(field -> default, _DEFAULT_SAMPLING_PARAMS) of a request class, read from vLLM's source."""
    spec = importlib.util.find_spec("vllm")
    # vLLM is a requirement of the project: its source is always there to compare with.
    assert spec is not None and spec.origin is not None, "vllm is not installed"
    source = (Path(spec.origin).parent / relative).read_text()
    cls = next(n for n in ast.parse(source).body if isinstance(n, ast.ClassDef) and n.name == class_name)
    fields: dict[str, Any] = {}
    sampling: dict[str, Any] = {}
    for node in cls.body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            value = node.value
            if isinstance(value, ast.Call) and getattr(value.func, "id", None) == "Field":
                kw = {k.arg: k.value for k in value.keywords}
                if "default_factory" in kw:
                    factory = ast.unparse(kw["default_factory"])
                    fields[node.target.id] = {"list": [], "dict": {}}.get(factory, factory)
                    continue
                value = kw.get("default", value.args[0] if value.args else None)
            if node.target.id == "_DEFAULT_SAMPLING_PARAMS":
                sampling = ast.literal_eval(value)  # type: ignore[arg-type]
                continue
            if node.target.id.startswith("_"):
                continue  # private attributes, not request fields
            try:
                fields[node.target.id] = ast.literal_eval(value) if value is not None else "<required>"
            except ValueError:
                fields[node.target.id] = ast.unparse(value)  # type: ignore[arg-type]
    return fields, sampling


# Allowed parameters without a default: the body itself and the chat alias.
NOT_DEFAULTED = {"messages", "prompt", "model", "max_completion_tokens"}
# OpenAI parameters vLLM 0.32 does not have.
OPENAI_ONLY = {"best_of"}
EQUIVALENT_DEFAULTS = {("stop", ()): [], ("top_logprobs", None): 0, ("stop_token_ids", None): [], ("bad_words", None): []}


@pytest.mark.parametrize(
    ("endpoint", "relative", "class_name"),
    [
        ("chat", "entrypoints/openai/chat_completion/protocol.py", "ChatCompletionRequest"),
        ("completions", "entrypoints/openai/completion/protocol.py", "CompletionRequest"),
    ],
)
def test_defaults_match_the_installed_vllm_source(endpoint: str, relative: str, class_name: str) -> None:
    fields, sampling = _vllm_fields(relative, class_name)
    ours = OUTPUT_DEFAULTS[endpoint]  # type: ignore[index]
    # Every vLLM request field has a default here or is not keyed (stripped, refused, or has no default).
    not_keyed = fields_of(endpoint, "stripped") | fields_of(endpoint, "refused") | NOT_DEFAULTED  # type: ignore[arg-type]
    assert set(fields) - set(ours) == set(fields) & not_keyed
    assert set(ours) - set(fields) == OPENAI_ONLY & set(ours)
    mismatched = {}
    for name, default in ours.items():
        if name in OPENAI_ONLY:
            continue
        vllm_default = fields[name]
        if vllm_default is None and name in sampling:
            vllm_default = sampling[name]  # "user -> server default -> OpenAI default"
        if vllm_default == [] and default is None:
            continue  # an empty list is folded into null
        if vllm_default == 0 and name == "top_logprobs" and default is None:
            continue  # vLLM: null top_logprobs means 0
        if vllm_default != default or type(vllm_default) is not type(default):
            mismatched[name] = (vllm_default, default)
    assert mismatched == {}
    assert set(sampling) == set(ENGINE_DEFAULTED_PARAMETERS[endpoint]) - {"max_tokens"}  # type: ignore[index]


def test_the_docs_list_every_parameter_with_its_default() -> None:
    # The docs page on the response-cache key: canonical request, key and admission.
    text = docs_page("gateway/cache-key.md")
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[0].startswith("`") and cells[1] != "chat":
            rows[cells[0].strip("`")] = (cells[1], cells[2])

    def shown(endpoint: str, name: str) -> str:
        defaults = OUTPUT_DEFAULTS[endpoint]  # type: ignore[index]
        return f"`{json.dumps(defaults[name])}`" if name in defaults else "—"

    names = set(OUTPUT_DEFAULTS["chat"]) | set(OUTPUT_DEFAULTS["completions"])
    assert set(rows) == names
    assert {n: rows[n] for n in names} == {n: (shown("chat", n), shown("completions", n)) for n in names}
    removed = fields_of("chat", "stripped") | fields_of("completions", "stripped")
    refused = fields_of("chat", "refused") | fields_of("completions", "refused")
    assert [n for n in sorted(removed | refused) if f"`{n}`" not in text] == []
    assert [r for r in ADMISSION_REASONS if f"| `{r}` |" not in text] == []
