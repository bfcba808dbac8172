"""The canonical request key of the response cache, and which responses it may keep.

The response cache sits in front of vLLM. Its key must be canonical: two
requests that must produce the same output get the same key, and any two that
may produce different outputs get different keys. A request becomes a
*canonical request* (:func:`canonical_request`): parameters that cannot change
the output are removed, parameters equal to their default are removed, values
with several spellings get one spelling, and every string the model reads is
Unicode NFC. The gateway forwards :func:`normalized_body` upstream (the same
NFC strings), so the output really is a function of the canonical request.

Which body fields exist at all is :data:`gateway.request_fields.REQUEST_FIELDS`:
only ``allowed`` fields are forwarded and keyed; ``stripped`` ones are removed
from both; ``refused`` and unknown ones are refused (:class:`InvalidRequest`
naming the field) before anything else is checked.

Layout of a canonical request (a flat JSON object, keys sorted when encoded)::

    {"endpoint": "chat" | "completions",      # reserved: which API the body was for
     "model": str,
     "messages": [...] | "prompt": ...,        # NFC strings, structure as given
     <known output parameter>: <canonical value>}   # only those not at their default

Folding rules follow vLLM 0.32's OpenAI server, read in its source:
``vllm/entrypoints/openai/chat_completion/protocol.py`` (ChatCompletionRequest),
``vllm/entrypoints/openai/completion/protocol.py`` (CompletionRequest),
``vllm/sampling_params.py`` (SamplingParams.__post_init__ / _verify_args),
``vllm/config/model.py`` (ModelConfig.get_diff_sampling_param) and
``vllm/entrypoints/serve/utils/api_utils.py`` (get_max_tokens).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import unicodedata
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final, Literal

from gateway.request_fields import REQUEST_FIELDS, field_refusal, fields_of

__all__ = [
    "ADMISSION_REASONS",
    "ENDPOINTS",
    "ENGINE_DEFAULTED_PARAMETERS",
    "OUTPUT_DEFAULTS",
    "RESERVED_KEYS",
    "TOOL_CHOICE_DEFAULT_WITH_TOOLS",
    "Admission",
    "Endpoint",
    "InvalidRequest",
    "canonical_bytes",
    "canonical_request",
    "normalized_body",
    "response_admission",
    "response_cache_key",
]

Endpoint = Literal["chat", "completions"]
"""``chat`` is ``POST /v1/chat/completions``; ``completions`` is ``POST /v1/completions``."""

ENDPOINTS: Final[tuple[Endpoint, ...]] = ("chat", "completions")

RESERVED_KEYS: Final = frozenset({"endpoint"})
"""Keys of a canonical request that are not body parameters. ``endpoint`` is no
OpenAI or vLLM parameter; a body field of that name is refused as unknown, so
it cannot collide."""


class InvalidRequest(ValueError):
    """A request body the gateway refuses (answered as HTTP 400 in OpenAI's error format).

    Attributes:
        message: what is wrong, for a person.
        param: the parameter at fault as a path (``"temperature"``,
            ``"messages[2].content"``), or None when the body as a whole is wrong;
            OpenAI's error object names it ``param``.
    """

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(f"{param}: {message}" if param else message)
        self.message = message
        self.param = param


# ---------------------------------------------------------------------------
# Parameter tables
# ---------------------------------------------------------------------------

_COMMON_DEFAULTS: dict[str, object] = {
    # OpenAI API reference (chat/create, completions/create) and vLLM 0.32's
    # _DEFAULT_SAMPLING_PARAMS (protocol.py of both endpoints).
    "temperature": 1.0,
    "top_p": 1.0,
    "n": 1,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "stop": None,
    "seed": None,
    "logit_bias": None,
    # vLLM extras (the "sampling-params" and "extra-params" blocks of both protocol.py files).
    "top_k": 0,
    "min_p": 0.0,
    "repetition_penalty": 1.0,
    "min_tokens": 0,
    "ignore_eos": False,
    "skip_special_tokens": True,
    "spaces_between_special_tokens": True,
    "include_stop_str_in_output": False,
    "use_beam_search": False,
    "length_penalty": 1.0,
    "stop_token_ids": None,
    "bad_words": None,
    "allowed_token_ids": None,
    "truncate_prompt_tokens": None,
    "truncation_side": None,
    "prompt_logprobs": None,
    "logprob_token_ids": None,
    "structured_outputs": None,
    "return_tokens_as_token_ids": None,
    "return_token_ids": None,
    "routed_experts_prompt_start": 0,
    "repetition_detection": None,
    "thinking_token_budget": None,
}

OUTPUT_DEFAULTS: Final[Mapping[Endpoint, Mapping[str, object]]] = {
    "chat": {
        **_COMMON_DEFAULTS,
        "logprobs": False,
        "top_logprobs": None,
        "max_tokens": None,
        # OpenAI documents {"type": "text"}; vLLM's default is None, and its Kimi K3
        # renderer passes any non-null response_format into the chat template
        # (vllm/renderers/kimi_k3.py), so an explicit {"type": "text"} may render a
        # different prompt: only null is the default here.
        "response_format": None,
        "tools": None,
        # "auto" when tools are given: see TOOL_CHOICE_DEFAULT_WITH_TOOLS.
        "tool_choice": "none",
        "parallel_tool_calls": True,
        "reasoning_effort": None,
        "include_reasoning": True,
        "echo": False,
        "add_generation_prompt": True,
        "continue_final_message": False,
        "add_special_tokens": False,
        "documents": None,
        "chat_template_kwargs": None,
        "return_prompt_text": None,
    },
    "completions": {
        **_COMMON_DEFAULTS,
        "logprobs": None,
        # OpenAI and vLLM both default to 16; vLLM maps an explicit null to 16 too
        # (CompletionRequest.normalize_null_max_tokens).
        "max_tokens": 16,
        # Completions have no chat template: {"type": "text"} and null both mean
        # "no structured output" (structured_outputs_from_response_format).
        "response_format": None,
        "echo": False,
        "suffix": None,
        # OpenAI's parameter; vLLM 0.32 has no best_of and ignores it, but it would
        # change the output of any engine that implements it.
        "best_of": 1,
        "add_special_tokens": True,
    },
}
"""Per endpoint, every parameter that can change the output and whose default
is known, with that default: the documented OpenAI default where OpenAI has the
parameter, otherwise vLLM 0.32's (see the module docstring for the files).
A parameter equal to its default is left out of the canonical request.
Equivalent spellings are folded too: ``top_k`` -1 or 0, ``seed`` -1, ``stop``
``[]``, ``stop_token_ids``/``bad_words`` ``[]``, ``logit_bias``/
``chat_template_kwargs`` ``{}``, chat ``top_logprobs`` 0, chat ``logprobs`` null,
``return_token_ids``/``return_tokens_as_token_ids``/``return_prompt_text`` false,
completions ``response_format`` ``{"type": "text"}``."""

TOOL_CHOICE_DEFAULT_WITH_TOOLS: Final = "auto"
"""Chat ``tool_choice`` default when ``tools`` is given (OpenAI; vLLM's
ChatCompletionRequest.check_tool_usage sets it). Without tools it is ``"none"``."""

ENGINE_DEFAULTED_PARAMETERS: Final[Mapping[Endpoint, frozenset[str]]] = {
    "chat": frozenset(
        {"temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "max_tokens"}
    ),
    "completions": frozenset(
        {"temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"}
    ),
}
"""Parameters whose omission means *the engine's* default, not the OpenAI one.

vLLM resolves each as "user -> server default -> OpenAI default"
(``to_sampling_params`` in both protocol.py files); the server default comes
from the model's ``generation_config.json`` unless the engine runs with
``--generation-config vllm`` (``ModelConfig.get_diff_sampling_param``). Chat
``max_tokens`` falls back to the generation config's ``max_new_tokens``
(``get_max_tokens``). So an explicit ``temperature: 1.0`` and an omitted one
may sample differently, and they are folded only when the caller passes the
engine's defaults (``engine_defaults``)."""

# Strings the model reads; NFC-normalized in both the key and the forwarded body.
# tool_choice is here because a named tool must still match the normalized tool name.
_NFC_FIELDS: Final[Mapping[Endpoint, tuple[str, ...]]] = {
    "chat": ("messages", "tools", "tool_choice", "stop"),
    "completions": ("prompt", "suffix", "stop"),
}

_INT64_MIN: Final = -(2**63)
_INT64_MAX: Final = 2**63 - 1
# vllm/sampling_params.py: a temperature in (0, _MAX_TEMP) is raised to _MAX_TEMP.
_MIN_POSITIVE_TEMPERATURE: Final = 1e-2
_TOOL_CHOICE_MODES: Final = ("none", "auto", "required")


# ---------------------------------------------------------------------------
# Value checks: each takes (param path, non-null value) and returns the canonical value
# ---------------------------------------------------------------------------

_Check = Callable[[str, Any], Any]


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _float(lo: float, hi: float, *, lo_open: bool = False) -> _Check:
    def check(param: str, value: Any) -> float:
        if not _is_number(value):
            raise InvalidRequest(f"must be a number, got {_type_name(value)}", param)
        out = float(value)
        if not math.isfinite(out):
            raise InvalidRequest("must be a finite number", param)
        if out < lo or out > hi or (lo_open and out == lo):
            raise InvalidRequest(f"must be in {'(' if lo_open else '['}{lo:g}, {hi:g}], got {value!r}", param)
        return out + 0.0  # -0.0 becomes 0.0, so equal values encode equally

    return check


def _int(lo: int, hi: int = _INT64_MAX) -> _Check:
    def check(param: str, value: Any) -> int:
        # An integral float (2.0) is the same JSON number as 2; pydantic accepts it too.
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if not isinstance(value, int) or isinstance(value, bool):
            raise InvalidRequest(f"must be an integer, got {_type_name(value)}", param)
        if value < lo or value > hi:
            raise InvalidRequest(f"must be an integer in [{lo}, {hi}], got {value}", param)
        return value

    return check


def _bool(param: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise InvalidRequest(f"must be true or false, got {_type_name(value)}", param)
    return value


def _enum(*allowed: str) -> _Check:
    def check(param: str, value: Any) -> str:
        if value not in allowed or not isinstance(value, str):
            raise InvalidRequest(f"must be one of {', '.join(allowed)}; got {value!r}", param)
        return value

    return check


def _temperature(param: str, value: Any) -> float:
    out = _float(0.0, 2.0)(param, value)
    # vLLM raises any temperature in (0, 0.01) to 0.01 (SamplingParams.__post_init__).
    return _MIN_POSITIVE_TEMPERATURE if 0.0 < out < _MIN_POSITIVE_TEMPERATURE else out


def _top_k(param: str, value: Any) -> int:
    out = _int(-1)(param, value)
    # vLLM: "quietly accept -1 as disabled, but prefer 0" (SamplingParams._verify_args).
    return 0 if out == -1 else out


def _seed(param: str, value: Any) -> int | None:
    out = _int(_INT64_MIN)(param, value)
    # vLLM turns seed -1 into None (SamplingParams.__post_init__).
    return None if out == -1 else out


def _stop(param: str, value: Any) -> list[str] | None:
    if isinstance(value, str):
        return [_nfc(value)]
    if not isinstance(value, list | tuple):
        raise InvalidRequest(f"must be a string or a list of strings, got {_type_name(value)}", param)
    out = []
    for i, item in enumerate(value):
        if not isinstance(item, str):
            raise InvalidRequest(f"must be a string, got {_type_name(item)}", f"{param}[{i}]")
        out.append(_nfc(item))
    # Order is kept: vLLM reports the first stop string of the list that matches.
    return out or None


def _token_ids(param: str, value: Any) -> list[int]:
    if not isinstance(value, list | tuple):
        raise InvalidRequest(f"must be a list of token ids, got {_type_name(value)}", param)
    return [_int(0)(f"{param}[{i}]", item) for i, item in enumerate(value)]


def _stop_token_ids(param: str, value: Any) -> list[int] | None:
    # vLLM keeps these as a set of stop tokens (SamplingParams._all_stop_token_ids):
    # order and repeats cannot change the output.
    return sorted(set(_token_ids(param, value))) or None


def _strings(param: str, value: Any) -> list[str] | None:
    if not isinstance(value, list | tuple):
        raise InvalidRequest(f"must be a list of strings, got {_type_name(value)}", param)
    for i, item in enumerate(value):
        if not isinstance(item, str):
            raise InvalidRequest(f"must be a string, got {_type_name(item)}", f"{param}[{i}]")
    return list(value) or None


def _logit_bias(param: str, value: Any) -> dict[str, float] | None:
    if not isinstance(value, Mapping):
        raise InvalidRequest(f"must be an object mapping token ids to biases, got {_type_name(value)}", param)
    out: dict[str, float] = {}
    for key, bias in value.items():
        # vLLM parses each key with int(): "050256" and "50256" are the same token.
        try:
            token = int(key, 10) if isinstance(key, str) else None
        except ValueError:
            token = None
        if token is None or token < 0:
            raise InvalidRequest(f"keys must be token ids (non-negative integers as strings), got {key!r}", param)
        name = str(token)
        if name in out:
            raise InvalidRequest(f"token id {name} is given twice", param)
        out[name] = _float(-100.0, 100.0)(f"{param}.{key}", bias)
    return out or None


def _json_object(param: str, value: Any) -> dict[str, Any]:
    if not isinstance(value, Mapping):
        raise InvalidRequest(f"must be an object, got {_type_name(value)}", param)
    # {} is folded into the default only where a spec lists it as equivalent.
    return _plain_json(param, value)  # type: ignore[no-any-return]


def _json_value(param: str, value: Any) -> Any:
    return _plain_json(param, value)


def _chat_template_kwargs(param: str, value: Any) -> dict[str, Any]:
    out = _json_object(param, value)
    if "chat_template" in out:
        # The same template replacement as the refused top-level field: vLLM honours both
        # (vllm/renderers/online_renderer.py checks chat_template_kwargs["chat_template"] too).
        raise InvalidRequest(REQUEST_FIELDS["chat_template"].reason, f"{param}.chat_template")
    return out


def _response_format(param: str, value: Any) -> dict[str, Any]:
    out = _json_object(param, value)
    if not out or not isinstance(out.get("type"), str):
        raise InvalidRequest('must be an object with a string "type"', param)
    if out["type"] == "json_schema" and out.get("json_schema") is None:
        raise InvalidRequest('type "json_schema" needs a "json_schema" object', param)
    return out


def _tools(param: str, value: Any) -> list[Any]:
    if not isinstance(value, list | tuple):
        raise InvalidRequest(f"must be a list of tools, got {_type_name(value)}", param)
    if not value:
        # vLLM refuses an empty array, as OpenAI does (check_tool_usage).
        raise InvalidRequest("must not be an empty array; omit it instead", param)
    out = _nfc_json(param, value)
    for i, tool in enumerate(out):
        where = f"{param}[{i}]"
        if not isinstance(tool, dict):
            raise InvalidRequest(f"must be an object, got {_type_name(tool)}", where)
        function = tool.get("function")
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
            raise InvalidRequest('must have a "function" object with a non-empty string "name"', f"{where}.function")
    return out


def _tool_choice(param: str, value: Any) -> str | dict[str, Any]:
    if isinstance(value, str):
        return _enum(*_TOOL_CHOICE_MODES)(param, value)
    if not isinstance(value, Mapping):
        raise InvalidRequest(f'must be "none", "auto", "required" or a named function, got {_type_name(value)}', param)
    out = _nfc_json(param, value)
    function = out.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
        raise InvalidRequest('must name a function: {"type": "function", "function": {"name": ...}}', f"{param}.function.name")
    return out


def _messages(param: str, value: Any) -> list[dict[str, Any]]:
    if not isinstance(value, list | tuple) or not value:
        raise InvalidRequest("must be a non-empty list of message objects", param)
    out = []
    for i, message in enumerate(value):
        where = f"{param}[{i}]"
        if not isinstance(message, Mapping):
            raise InvalidRequest(f"must be an object, got {_type_name(message)}", where)
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise InvalidRequest("must be a non-empty string", f"{where}.role")
        content = message.get("content")
        if content is None:
            # OpenAI: content may be omitted only on assistant messages (tool calls, prefill).
            if role != "assistant":
                raise InvalidRequest(f"is required for a {role!r} message", f"{where}.content")
        elif isinstance(content, list | tuple):
            if not content:
                raise InvalidRequest("must not be an empty list", f"{where}.content")
            for j, part in enumerate(content):
                pwhere = f"{where}.content[{j}]"
                if not isinstance(part, Mapping) or not isinstance(part.get("type"), str):
                    raise InvalidRequest('must be an object with a string "type"', pwhere)
                if part["type"] == "text" and not isinstance(part.get("text"), str):
                    raise InvalidRequest("a text part needs a string text", f"{pwhere}.text")
        elif not isinstance(content, str):
            raise InvalidRequest(f"must be a string, a list of parts or null, got {_type_name(content)}", f"{where}.content")
        # A list of text parts stays a list: a chat template may render it unlike a string.
        out.append(_nfc_json(where, message))
    return out


def _prompt(param: str, value: Any) -> str | list[Any]:
    if isinstance(value, str):
        if not value:
            raise InvalidRequest("must not be empty", param)
        return _nfc(value)
    if not isinstance(value, list | tuple) or not value:
        raise InvalidRequest("must be a string, a list of strings, a list of token ids or a list of token-id lists", param)
    if all(isinstance(item, str) for item in value):
        return [_nfc(item) for item in value]
    if all(isinstance(item, list | tuple) for item in value):
        lists = []
        for i, item in enumerate(value):
            if not item:
                raise InvalidRequest("must not be an empty token list", f"{param}[{i}]")
            lists.append(_token_ids(f"{param}[{i}]", item))
        return lists
    return _token_ids(param, value)


def _suffix(param: str, value: Any) -> str:
    if not isinstance(value, str):
        raise InvalidRequest(f"must be a string, got {_type_name(value)}", param)
    return _nfc(value)


@dataclass(frozen=True)
class _Spec:
    """How one known parameter is checked and folded.

    ``nullable``: an explicit null is accepted and means the same as omitting it
    (the vLLM field is ``X | None``); otherwise null is refused.
    ``equivalents``: other canonical values that mean the default.
    """

    check: _Check
    nullable: bool = True
    equivalents: tuple[object, ...] = ()


_PENALTY = _float(-2.0, 2.0)
_COMMON_SPECS: dict[str, _Spec] = {
    "temperature": _Spec(_temperature),
    "top_p": _Spec(_float(0.0, 1.0, lo_open=True)),
    "presence_penalty": _Spec(_PENALTY),
    "frequency_penalty": _Spec(_PENALTY),
    "stop": _Spec(_stop, equivalents=([],)),
    "seed": _Spec(_seed),
    "logit_bias": _Spec(_logit_bias, equivalents=({},)),
    "top_k": _Spec(_top_k),
    "min_p": _Spec(_float(0.0, 1.0)),
    "repetition_penalty": _Spec(_float(0.0, math.inf, lo_open=True)),
    "min_tokens": _Spec(_int(0), nullable=False),
    "ignore_eos": _Spec(_bool, nullable=False),
    "skip_special_tokens": _Spec(_bool, nullable=False),
    "spaces_between_special_tokens": _Spec(_bool, nullable=False),
    "include_stop_str_in_output": _Spec(_bool, nullable=False),
    "use_beam_search": _Spec(_bool, nullable=False),
    "length_penalty": _Spec(_float(-math.inf, math.inf), nullable=False),
    "stop_token_ids": _Spec(_stop_token_ids),
    "bad_words": _Spec(_strings, nullable=False),
    "allowed_token_ids": _Spec(_token_ids),
    "truncate_prompt_tokens": _Spec(_int(-1)),
    "truncation_side": _Spec(_enum("left", "right")),
    "prompt_logprobs": _Spec(_int(-1)),
    "logprob_token_ids": _Spec(_token_ids),
    "structured_outputs": _Spec(_json_object),
    "return_tokens_as_token_ids": _Spec(_bool, equivalents=(False,)),
    "return_token_ids": _Spec(_bool, equivalents=(False,)),
    "routed_experts_prompt_start": _Spec(_int(0), nullable=False),
    "repetition_detection": _Spec(_json_object),
    "thinking_token_budget": _Spec(_json_value),
}

_SPECS: Final[Mapping[Endpoint, Mapping[str, _Spec]]] = {
    "chat": {
        **_COMMON_SPECS,
        "messages": _Spec(_messages, nullable=False),
        "n": _Spec(_int(1)),
        "logprobs": _Spec(_bool),
        "top_logprobs": _Spec(_int(-1), equivalents=(0,)),
        "max_tokens": _Spec(_int(1)),
        "response_format": _Spec(_response_format),
        "tools": _Spec(_tools),
        "tool_choice": _Spec(_tool_choice),
        "parallel_tool_calls": _Spec(_bool),
        "reasoning_effort": _Spec(_enum("none", "minimal", "low", "medium", "high", "xhigh", "max")),
        "include_reasoning": _Spec(_bool, nullable=False),
        "echo": _Spec(_bool, nullable=False),
        "add_generation_prompt": _Spec(_bool, nullable=False),
        "continue_final_message": _Spec(_bool, nullable=False),
        "add_special_tokens": _Spec(_bool, nullable=False),
        "documents": _Spec(_json_value),
        "chat_template_kwargs": _Spec(_chat_template_kwargs, equivalents=({},)),
        "return_prompt_text": _Spec(_bool, equivalents=(False,)),
    },
    "completions": {
        **_COMMON_SPECS,
        "prompt": _Spec(_prompt),
        "n": _Spec(_int(1), nullable=False),
        "logprobs": _Spec(_int(-1)),
        "max_tokens": _Spec(_int(0)),
        "response_format": _Spec(_response_format, equivalents=({"type": "text"},)),
        "echo": _Spec(_bool),
        "suffix": _Spec(_suffix),
        "best_of": _Spec(_int(1)),
        "add_special_tokens": _Spec(_bool, nullable=False),
    },
}
# The chat alias: max_completion_tokens is OpenAI's current name of max_tokens.
_ALIAS_MAX_COMPLETION_TOKENS: Final = "max_completion_tokens"
# Every defaulted parameter has a spec and vice versa (messages/prompt have no default);
# every allowed field is keyed (model and the alias are handled by _parse) and nothing
# else is; no allowed field shares a name with a reserved key.
assert all(set(OUTPUT_DEFAULTS[e]) == set(_SPECS[e]) - {"messages", "prompt"} for e in ENDPOINTS)
assert all(set(_SPECS[e]) == fields_of(e, "allowed") - {"model", _ALIAS_MAX_COMPLETION_TOKENS} for e in ENDPOINTS)
assert not RESERVED_KEYS & (fields_of("chat", "allowed") | fields_of("completions", "allowed"))
# Removed from the key and from the forwarded body (gateway/request_fields.py).
_STRIPPED: Final[Mapping[Endpoint, frozenset[str]]] = {e: fields_of(e, "stripped") for e in ENDPOINTS}
# vLLM's neutral sampling defaults (both protocol.py files): all that an engine may override.
_ENGINE_DEFAULT_NAMES: Final = frozenset(ENGINE_DEFAULTED_PARAMETERS["chat"])


# ---------------------------------------------------------------------------
# JSON helpers
# ---------------------------------------------------------------------------


def _type_name(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, Mapping):
        return "an object"
    if isinstance(value, list | tuple):
        return "a list"
    return type(value).__name__


def _nfc(text: str) -> str:
    # is_normalized is a fast scan; most text (and every ASCII string) is already NFC.
    return text if unicodedata.is_normalized("NFC", text) else unicodedata.normalize("NFC", text)


def _plain_json(param: str, value: Any, *, nfc: bool = False) -> Any:
    """A deep copy of ``value`` as plain JSON (dict, list, str, int, float, bool, None).

    Raises:
        InvalidRequest: a non-string key, NaN or infinity, or a non-JSON type, naming its path.
    """
    if value is None or isinstance(value, bool | int):
        return value
    if isinstance(value, str):
        return _nfc(value) if nfc else value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise InvalidRequest("must be a finite number (NaN and infinity are not JSON)", param)
        return value + 0.0
    if isinstance(value, Mapping):
        out: dict[str, Any] = {}
        for key, item in value.items():
            if not isinstance(key, str):
                raise InvalidRequest(f"object keys must be strings, got {_type_name(key)}", param)
            name = _nfc(key) if nfc else key
            if name in out:
                raise InvalidRequest(f"key {key!r} appears twice after Unicode NFC normalization", param)
            out[name] = _plain_json(f"{param}.{key}", item, nfc=nfc)
        return out
    if isinstance(value, list | tuple):
        return [_plain_json(f"{param}[{i}]", item, nfc=nfc) for i, item in enumerate(value)]
    raise InvalidRequest(f"must be JSON, got {type(value).__name__}", param)


def _nfc_json(param: str, value: Any) -> Any:
    return _plain_json(param, value, nfc=True)


def _same(a: object, b: object) -> bool:
    """JSON equality: 1 and True differ, 1.0 and 1 differ (canonical values are typed)."""
    if type(a) is not type(b):
        return False
    return a == b if not isinstance(a, dict | list) else canonical_bytes({"v": a}) == canonical_bytes({"v": b})


# ---------------------------------------------------------------------------
# Canonical request
# ---------------------------------------------------------------------------


def _check_endpoint(endpoint: Any) -> Endpoint:
    if endpoint not in ENDPOINTS:
        raise InvalidRequest(f"endpoint must be one of {', '.join(ENDPOINTS)}; got {endpoint!r}", None)
    return endpoint  # type: ignore[no-any-return]


def _check_engine_defaults(engine_defaults: Mapping[str, Any] | None) -> dict[str, Any] | None:
    if engine_defaults is None:
        return None
    if not isinstance(engine_defaults, Mapping):
        raise ValueError(f"engine_defaults must be a mapping or None, got {type(engine_defaults).__name__}")
    out: dict[str, Any] = {}
    for name, value in engine_defaults.items():
        if name not in _ENGINE_DEFAULT_NAMES:
            known = ", ".join(sorted(_ENGINE_DEFAULT_NAMES))
            raise ValueError(f"engine_defaults: {name!r} is not an engine-defaulted parameter ({known})")
        if value is not None:
            out[name] = _SPECS["chat"][name].check(f"engine_defaults.{name}", value)
    return out


def _check_fields(endpoint: Endpoint, body: Mapping[str, Any]) -> None:
    """Refuse the first body field (in body order) that is refused or unknown on ``endpoint``.

    Runs before any value is checked, so an engine-control field is answered as
    such whatever else the body holds (gateway/request_fields.py has the table).
    """
    for name in body:
        if not isinstance(name, str):
            raise InvalidRequest(f"parameter names must be strings, got {_type_name(name)}", None)
        message = field_refusal(endpoint, name)
        if message is not None:
            raise InvalidRequest(message, name)


def _parse(endpoint: Endpoint, body: Mapping[str, Any]) -> tuple[dict[str, Any], set[str]]:
    """Check ``body``; return (allowed parameters as canonical values, names given as explicit null)."""
    if not isinstance(body, Mapping):
        raise InvalidRequest(f"the request body must be a JSON object, got {_type_name(body)}", None)
    _check_fields(endpoint, body)
    specs = _SPECS[endpoint]
    known: dict[str, Any] = {}
    nulls: set[str] = set()
    for name, value in body.items():
        if name in _STRIPPED[endpoint] or (endpoint == "chat" and name == _ALIAS_MAX_COMPLETION_TOKENS):
            continue
        if name == "model":
            if not isinstance(value, str) or not value:
                raise InvalidRequest("must be a non-empty string", "model")
            known["model"] = value
            continue
        spec = specs[name]  # _check_fields let only allowed and stripped fields through
        if value is None:
            if not spec.nullable:
                raise InvalidRequest("must not be null", name)
            nulls.add(name)
            continue
        known[name] = spec.check(name, value)
    if "model" not in known:
        raise InvalidRequest("is required", "model")
    if endpoint == "chat":
        if "messages" not in known:
            raise InvalidRequest("is required", "messages")
        alias = body.get(_ALIAS_MAX_COMPLETION_TOKENS)
        if alias is not None:
            alias_value = specs["max_tokens"].check(_ALIAS_MAX_COMPLETION_TOKENS, alias)
            if "max_tokens" in known and known["max_tokens"] != alias_value:
                raise InvalidRequest(
                    f"is an alias of max_tokens; both are given and differ ({alias_value} != {known['max_tokens']})",
                    _ALIAS_MAX_COMPLETION_TOKENS,
                )
            known["max_tokens"] = alias_value
            nulls.discard("max_tokens")
    elif "prompt" not in known:
        raise InvalidRequest("is required", "prompt")
    _check_combinations(endpoint, known, body)
    return known, nulls


def _check_combinations(endpoint: Endpoint, known: Mapping[str, Any], body: Mapping[str, Any]) -> None:
    """Refuse combinations that vLLM 0.32 refuses, so a refusal never reaches the engine."""
    if known.get("temperature") == 0.0 and known.get("n", 1) > 1:
        raise InvalidRequest("must be 1 with greedy sampling (temperature 0)", "n")
    if "min_tokens" in known and known.get("max_tokens") is not None and known["min_tokens"] > known["max_tokens"]:
        raise InvalidRequest(f"must not exceed max_tokens ({known['max_tokens']})", "min_tokens")
    if endpoint == "chat":
        top_logprobs = known.get("top_logprobs")
        if top_logprobs is not None and top_logprobs != 0 and not known.get("logprobs"):
            raise InvalidRequest("needs logprobs: true", "top_logprobs")
        # vLLM checks the raw body here, so an omitted add_generation_prompt is not a conflict.
        if body.get("continue_final_message") is True and body.get("add_generation_prompt") is True:
            raise InvalidRequest("cannot be true together with add_generation_prompt", "continue_final_message")
        choice = known.get("tool_choice")
        if choice is not None and choice != "none" and not known.get("tools"):
            raise InvalidRequest("needs tools", "tool_choice")
        if isinstance(choice, dict):
            names = {tool["function"]["name"] for tool in known["tools"]}
            if choice["function"]["name"] not in names:
                raise InvalidRequest("names a function that is not among the tools", "tool_choice")
    else:
        if known.get("max_tokens") == 0 and not known.get("echo"):
            raise InvalidRequest("must be at least 1 unless echo is true", "max_tokens")
        if "best_of" in known and known["best_of"] < known.get("n", 1):
            raise InvalidRequest("must be at least n", "best_of")
    # Chat needs logprobs true; completions any logprobs value (0 included): check_logprobs in each protocol.py.
    logprobs = known.get("logprobs")
    if known.get("logprob_token_ids") and (logprobs is None or logprobs is False):
        raise InvalidRequest("needs logprobs", "logprob_token_ids")


def canonical_request(
    endpoint: Endpoint, body: Mapping[str, Any], *, engine_defaults: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """The canonical form of an OpenAI request body: equal for requests that must
    produce the same output, different for any that may not.

    Args:
        endpoint: ``"chat"`` or ``"completions"``.
        body: the parsed JSON body as the caller sent it (not modified).
        engine_defaults: the serving engine's default sampling parameters, in
            vLLM's names (what ``ModelConfig.get_diff_sampling_param()`` returns:
            any of :data:`ENGINE_DEFAULTED_PARAMETERS`, chat ``max_tokens`` from
            ``max_new_tokens``); ``{}`` for an engine on vLLM's neutral defaults
            (``--generation-config vllm``). None (the default) means unknown: an
            explicit value of an engine-defaulted parameter is then kept even when
            it equals the OpenAI default, because the omitted parameter may mean a
            different value on this engine. Either way an omitted parameter is
            absent from the result and means "the engine's default".

    Returns:
        A new flat dict (layout in the module docstring): ``endpoint``, ``model``,
        ``messages`` (chat) or ``prompt`` (completions), and every allowed
        output parameter not at its default. Rules:

        - ``stripped`` fields (gateway/request_fields.py: delivery such as
          ``stream``, bookkeeping such as ``user``) are dropped.
        - A known parameter equal to its :data:`OUTPUT_DEFAULTS` value, or to an
          equivalent spelling, is dropped (engine-defaulted ones: see above); an
          explicit null equals omission where vLLM's field is nullable.
        - Chat ``max_completion_tokens`` becomes ``max_tokens``; ``tool_choice``
          defaults to ``"auto"`` when ``tools`` is given, ``"none"`` otherwise.
        - Float parameters are floats (``0`` and ``0.0`` are the same); a
          temperature in (0, 0.01) is 0.01 (vLLM raises it so); ``top_k`` -1 is 0;
          ``seed`` -1 is no seed; ``stop`` as a string is a one-element list;
          ``stop_token_ids`` is sorted and deduplicated; ``logit_bias`` keys are
          decimal token ids without leading zeros.
        - With ``temperature`` 0, ``top_p``, ``top_k`` and ``min_p`` are dropped:
          vLLM resets them for greedy sampling (SamplingParams.__post_init__).
        - Every string in ``messages``, ``prompt``, ``suffix``, ``tools``,
          ``tool_choice`` and ``stop`` is Unicode NFC (keys included). A content
          given as a list of text parts stays a list.

    Raises:
        InvalidRequest: a ``refused`` field (``cache_salt``, ``kv_transfer_params``,
            ``priority``, ...: the message is its reason in
            :data:`gateway.request_fields.REQUEST_FIELDS`), a field of the other
            endpoint only, or a field in no class of that table (unknown);
            ``chat_template_kwargs`` holding ``chat_template``; ``model`` missing or not a
            non-empty string; chat ``messages`` missing, empty, or with a message
            that is not an object, lacks a string ``role``, or has a ``content``
            that is not a string / non-empty list of typed parts / null (null only
            for ``assistant``); completions ``prompt`` not a non-empty string, list
            of strings, token ids or token-id lists; a number out of range
            (temperature [0, 2], top_p (0, 1], n >= 1, max_tokens >= 1, penalties
            [-2, 2], ...), a boolean where a number is expected or the reverse,
            NaN or infinity anywhere; ``max_tokens`` and ``max_completion_tokens``
            both given and different; and the combinations vLLM 0.32 refuses
            (``n`` > 1 with temperature 0, ``tool_choice`` without ``tools``,
            ``top_logprobs`` without ``logprobs``, ...). ``param`` names the
            parameter as a path.
        ValueError: ``engine_defaults`` names a parameter that is not engine-defaulted.
    """
    endpoint = _check_endpoint(endpoint)
    engine = _check_engine_defaults(engine_defaults)
    known, nulls = _parse(endpoint, body)
    defaults = OUTPUT_DEFAULTS[endpoint]
    engine_defaulted = ENGINE_DEFAULTED_PARAMETERS[endpoint]
    specs = _SPECS[endpoint]

    if known.get("temperature") == 0.0:
        for name in ("top_p", "top_k", "min_p"):
            known.pop(name, None)

    out: dict[str, Any] = {"endpoint": endpoint}
    for name, value in known.items():
        if name in ("model", "messages", "prompt"):
            out[name] = value
            continue
        if name == "tool_choice":
            default: object = TOOL_CHOICE_DEFAULT_WITH_TOOLS if known.get("tools") else "none"
            if _same(value, default):
                continue
            out[name] = value
            continue
        if name in engine_defaulted:
            if engine is not None and name in engine:
                default = engine[name]
            elif engine is not None:
                default = defaults[name]
            else:
                # Unknown engine defaults: keep every explicit value (see engine_defaults).
                out[name] = value
                continue
            if value is not None and not _same(value, default):
                out[name] = value
            continue
        if value is None or _same(value, defaults[name]) or any(_same(value, eq) for eq in specs[name].equivalents):
            continue
        out[name] = value
    if "tool_choice" in nulls and known.get("tools"):
        # With tools, an explicit null is not the default "auto": vLLM fills in "auto"
        # only when the key is absent (check_tool_usage) and renders null as no choice.
        out["tool_choice"] = None
    return out


def normalized_body(endpoint: Endpoint, body: Mapping[str, Any]) -> dict[str, Any]:
    """The body to forward upstream, agreeing with :func:`canonical_request`.

    Args:
        endpoint: ``"chat"`` or ``"completions"``.
        body: the caller's parsed JSON body (not modified).

    Returns:
        A new dict: the caller's allowed parameters as given (``stripped`` ones
        such as ``stream`` or ``user`` removed; the gateway adds its own
        ``stream``, ``stream_options`` and ``cache_salt``), except that every
        string in ``messages``/``tools``/
        ``tool_choice``/``stop`` (chat) or ``prompt``/``suffix``/``stop``
        (completions) is Unicode NFC, and in chat the alias is resolved: exactly
        one of ``max_tokens``/``max_completion_tokens`` remains, named
        ``max_completion_tokens`` (vLLM 0.32 marks ``max_tokens`` deprecated for chat),
        or neither when both were omitted or null.

    Raises:
        InvalidRequest: as :func:`canonical_request`.
    """
    endpoint = _check_endpoint(endpoint)
    _parse(endpoint, body)
    out = {name: value for name, value in body.items() if name not in _STRIPPED[endpoint]}
    for name in _NFC_FIELDS[endpoint]:
        value = out.get(name)
        if value is not None:
            out[name] = _nfc_json(name, value)
    if endpoint == "chat":
        alias = out.pop(_ALIAS_MAX_COMPLETION_TOKENS, None)
        plain = out.pop("max_tokens", None)
        chosen = alias if alias is not None else plain
        if chosen is not None:
            out[_ALIAS_MAX_COMPLETION_TOKENS] = chosen
    return out


def canonical_bytes(canonical: Mapping[str, Any]) -> bytes:
    """Canonical JSON of a canonical request (or of any JSON object).

    Args:
        canonical: a JSON object; strings are encoded as given (normalization is
            :func:`canonical_request`'s job).

    Returns:
        UTF-8 bytes: keys sorted by code point, no whitespace, non-ASCII
        characters written as themselves (``ensure_ascii=False``); floats in
        Python's shortest round-trip form, so equal floats give equal bytes
        (``-0.0`` is written as ``0.0``); an int and a float stay distinct
        (``1`` vs ``1.0``), which is why :func:`canonical_request` types every
        float parameter as float. A lone surrogate (possible from a JSON
        ``"\\ud800"`` escape) is encoded with ``surrogatepass``, which no valid
        string's encoding can equal.

    Raises:
        InvalidRequest: NaN or infinity, a non-string key, or a value that is not
            JSON (``param`` is its path).
    """
    if not isinstance(canonical, Mapping):
        raise InvalidRequest(f"a canonical request must be a JSON object, got {_type_name(canonical)}", None)
    plain = _plain_json("canonical", canonical)
    text = json.dumps(plain, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    return text.encode("utf-8", "surrogatepass")


_KEY_DOMAIN: Final = b"kvcp.gateway.response-cache-key.v1"


def _labelled(label: bytes, value: bytes) -> bytes:
    # Label and value both length-prefixed: no two field lists encode alike.
    return len(label).to_bytes(2, "big") + label + len(value).to_bytes(8, "big") + value


def response_cache_key(canonical: Mapping[str, Any], *, namespace_key: str, tenant_secret: bytes) -> str:
    """The response-cache key of a canonical request.

    ``HMAC-SHA256(tenant_secret, L("domain", "kvcp.gateway.response-cache-key.v1")
    || L("namespace", namespace_key) || L("endpoint", endpoint) || L("request",
    canonical_bytes(canonical)))`` where ``L(label, value)`` is a 2-byte label
    length, the label, an 8-byte value length and the value (big-endian).
    The namespace is in the key, so a new model state is a new key space; the
    tenant secret makes keys unguessable, so nobody can probe another tenant's
    cache by computing its keys.

    Args:
        canonical: what :func:`canonical_request` returned (its ``endpoint`` is used).
        namespace_key: the cache namespace's stable id (UTF-8 encoded).
        tenant_secret: the tenant's secret, at least 16 bytes.

    Returns:
        64 lowercase hexadecimal characters.

    Raises:
        ValueError: an empty ``namespace_key``, a ``tenant_secret`` that is not
            bytes or shorter than 16 bytes, or a ``canonical`` without a valid
            ``endpoint`` (an :class:`InvalidRequest`, as is a non-JSON value).
    """
    if not isinstance(namespace_key, str) or not namespace_key:
        raise ValueError("namespace_key must be a non-empty string")
    if not isinstance(tenant_secret, bytes | bytearray) or len(tenant_secret) < 16:
        raise ValueError("tenant_secret must be at least 16 bytes")
    if not isinstance(canonical, Mapping):
        raise InvalidRequest(f"a canonical request must be a JSON object, got {_type_name(canonical)}", None)
    endpoint = _check_endpoint(canonical.get("endpoint"))
    message = b"".join(
        (
            _labelled(b"domain", _KEY_DOMAIN),
            _labelled(b"namespace", namespace_key.encode("utf-8", "surrogatepass")),
            _labelled(b"endpoint", endpoint.encode("ascii")),
            _labelled(b"request", canonical_bytes(canonical)),
        )
    )
    return hmac.new(bytes(tenant_secret), message, hashlib.sha256).hexdigest()


# ---------------------------------------------------------------------------
# Admission
# ---------------------------------------------------------------------------

ADMISSION_REASONS: Final = frozenset({"greedy", "seeded", "sampling_allowed", "sampling", "seed_not_guaranteed"})
"""Every :attr:`Admission.reason` (a closed set, usable as a metric label).

Admitted: ``greedy`` (temperature 0 or top_k 1), ``seeded`` (sampling with a
fixed seed, tenant policy ``allow_seeded``), ``sampling_allowed`` (anything
else, tenant policy ``allow_sampling``). Refused: ``sampling`` (temperature > 0,
or omitted, without a seed), ``seed_not_guaranteed`` (sampling with a seed
while the tenant does not vouch for seeded reproducibility)."""


@dataclass(frozen=True)
class Admission:
    """Whether a response may be stored in and served from the response cache.

    Attributes:
        admitted: True to store and serve it.
        reason: one of :data:`ADMISSION_REASONS`.
    """

    admitted: bool
    reason: str


def response_admission(
    canonical: Mapping[str, Any],
    *,
    allow_seeded: bool = False,
    allow_sampling: bool = False,
    engine_defaults: Mapping[str, Any] | None = None,
) -> Admission:
    """Whether the response to a canonical request is reproducible enough to cache.

    Only reproducible outputs are admitted:

    - greedy decoding (``temperature`` 0, or ``top_k`` 1 whatever the temperature)
      is ``greedy``. An omitted temperature is the engine's default: the OpenAI
      default 1.0 unless ``engine_defaults`` says otherwise; never assumed greedy.
    - sampling with a fixed ``seed`` is ``seeded`` only with ``allow_seeded``: vLLM
      "does not guarantee the reproducibility of the results by default" and in
      online serving only batch invariance (``VLLM_BATCH_INVARIANT=1``, beta, some
      GPUs) makes outputs independent of batching
      (https://docs.vllm.ai/en/latest/usage/reproducibility/,
      https://docs.vllm.ai/en/v0.32.0/features/batch_invariance/); vllm/sampling_params.py
      warns "Random sampling without an explicit seed may not be batch invariant".
      With ``n`` > 1 each choice gets seed + index (vllm/v1/engine/parallel_sampling.py),
      so a seeded request is seeded for every choice. The policy says the tenant's
      engines guarantee it; otherwise ``seed_not_guaranteed``.
    - anything else is ``sampling`` (refused), unless ``allow_sampling`` (the
      tenant accepts one sampled answer being reused): ``sampling_allowed``.

    Greedy outputs are reused even though vLLM without batch invariance may vary
    them in the last digits of a logprob or, rarely, a token; the comparison jobs
    measure that noise.

    Args:
        canonical: what :func:`canonical_request` returned.
        allow_seeded: tenant policy: seeded sampling is reproducible on its engines.
        allow_sampling: tenant policy: any answer may be reused.
        engine_defaults: the same value given to :func:`canonical_request`, if any.

    Returns:
        An :class:`Admission`.

    Raises:
        InvalidRequest: ``temperature``, ``top_k`` or ``seed`` of the wrong type
            (a canonical request never has that).
        ValueError: ``engine_defaults`` names a parameter that is not engine-defaulted.
    """
    engine = _check_engine_defaults(engine_defaults)
    if not isinstance(canonical, Mapping):
        raise InvalidRequest(f"a canonical request must be a JSON object, got {_type_name(canonical)}", None)

    def effective(name: str) -> Any:
        if name in canonical:
            return canonical[name]
        # Absent means the engine's default: known only when engine_defaults is given.
        if engine is None:
            return None
        return engine.get(name, OUTPUT_DEFAULTS["chat"][name])

    temperature = effective("temperature")
    top_k = effective("top_k")
    seed = canonical.get("seed")
    if temperature is not None:
        temperature = _temperature("temperature", temperature)
    if top_k is not None:
        top_k = _top_k("top_k", top_k)
    if seed is not None:
        seed = _seed("seed", seed)
    if temperature == 0.0 or top_k == 1:
        return Admission(True, "greedy")
    if seed is not None and allow_seeded:
        return Admission(True, "seeded")
    if allow_sampling:
        return Admission(True, "sampling_allowed")
    return Admission(False, "seed_not_guaranteed" if seed is not None else "sampling")
