"""The parameters of the two OpenAI endpoints the gateway serves, as vLLM 0.32 reads
them: their defaults, the values each accepts and how each is folded to one canonical
spelling (:class:`ParamSpec`), and the JSON helpers those checks share.

:mod:`gateway.canonical` builds the canonical request from these tables; the sources
are the ones named in its docstring (vLLM's two ``protocol.py`` files and
``vllm/sampling_params.py``).
"""

from __future__ import annotations

import math
import unicodedata
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final, Literal

from gateway.request_fields import REQUEST_FIELDS, fields_of

__all__ = [
    "ALIAS_MAX_COMPLETION_TOKENS",
    "ENDPOINTS",
    "ENGINE_DEFAULTED_PARAMETERS",
    "ENGINE_DEFAULT_NAMES",
    "NFC_FIELDS",
    "OUTPUT_DEFAULTS",
    "RESERVED_KEYS",
    "SPECS",
    "STRIPPED",
    "TOOL_CHOICE_DEFAULT_WITH_TOOLS",
    "Endpoint",
    "InvalidRequest",
    "check_seed",
    "check_temperature",
    "check_top_k",
    "nfc_json",
    "plain_json",
    "type_name",
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
NFC_FIELDS: Final[Mapping[Endpoint, tuple[str, ...]]] = {
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
            raise InvalidRequest(f"must be a number, got {type_name(value)}", param)
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
            raise InvalidRequest(f"must be an integer, got {type_name(value)}", param)
        if value < lo or value > hi:
            raise InvalidRequest(f"must be an integer in [{lo}, {hi}], got {value}", param)
        return value

    return check


def _bool(param: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise InvalidRequest(f"must be true or false, got {type_name(value)}", param)
    return value


def _enum(*allowed: str) -> _Check:
    def check(param: str, value: Any) -> str:
        if value not in allowed or not isinstance(value, str):
            raise InvalidRequest(f"must be one of {', '.join(allowed)}; got {value!r}", param)
        return value

    return check


def check_temperature(param: str, value: Any) -> float:
    out = _float(0.0, 2.0)(param, value)
    # vLLM raises any temperature in (0, 0.01) to 0.01 (SamplingParams.__post_init__).
    return _MIN_POSITIVE_TEMPERATURE if 0.0 < out < _MIN_POSITIVE_TEMPERATURE else out


def check_top_k(param: str, value: Any) -> int:
    out = _int(-1)(param, value)
    # vLLM: "quietly accept -1 as disabled, but prefer 0" (SamplingParams._verify_args).
    return 0 if out == -1 else out


def check_seed(param: str, value: Any) -> int | None:
    out = _int(_INT64_MIN)(param, value)
    # vLLM turns seed -1 into None (SamplingParams.__post_init__).
    return None if out == -1 else out


def _stop(param: str, value: Any) -> list[str] | None:
    if isinstance(value, str):
        return [_nfc(value)]
    if not isinstance(value, list | tuple):
        raise InvalidRequest(f"must be a string or a list of strings, got {type_name(value)}", param)
    out = []
    for i, item in enumerate(value):
        if not isinstance(item, str):
            raise InvalidRequest(f"must be a string, got {type_name(item)}", f"{param}[{i}]")
        out.append(_nfc(item))
    # Order is kept: vLLM reports the first stop string of the list that matches.
    return out or None


def _token_ids(param: str, value: Any) -> list[int]:
    if not isinstance(value, list | tuple):
        raise InvalidRequest(f"must be a list of token ids, got {type_name(value)}", param)
    return [_int(0)(f"{param}[{i}]", item) for i, item in enumerate(value)]


def _stop_token_ids(param: str, value: Any) -> list[int] | None:
    # vLLM keeps these as a set of stop tokens (SamplingParams._all_stop_token_ids):
    # order and repeats cannot change the output.
    return sorted(set(_token_ids(param, value))) or None


def _strings(param: str, value: Any) -> list[str] | None:
    if not isinstance(value, list | tuple):
        raise InvalidRequest(f"must be a list of strings, got {type_name(value)}", param)
    for i, item in enumerate(value):
        if not isinstance(item, str):
            raise InvalidRequest(f"must be a string, got {type_name(item)}", f"{param}[{i}]")
    return list(value) or None


def _logit_bias(param: str, value: Any) -> dict[str, float] | None:
    if not isinstance(value, Mapping):
        raise InvalidRequest(f"must be an object mapping token ids to biases, got {type_name(value)}", param)
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
        raise InvalidRequest(f"must be an object, got {type_name(value)}", param)
    # {} is folded into the default only where a spec lists it as equivalent.
    return plain_json(param, value)  # type: ignore[no-any-return]


def _json_value(param: str, value: Any) -> Any:
    return plain_json(param, value)


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
        raise InvalidRequest(f"must be a list of tools, got {type_name(value)}", param)
    if not value:
        # vLLM refuses an empty array, as OpenAI does (check_tool_usage).
        raise InvalidRequest("must not be an empty array; omit it instead", param)
    out: list[Any] = nfc_json(param, value)
    for i, tool in enumerate(out):
        where = f"{param}[{i}]"
        if not isinstance(tool, dict):
            raise InvalidRequest(f"must be an object, got {type_name(tool)}", where)
        function = tool.get("function")
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
            raise InvalidRequest('must have a "function" object with a non-empty string "name"', f"{where}.function")
    return out


def _tool_choice(param: str, value: Any) -> str | dict[str, Any]:
    if isinstance(value, str):
        mode: str = _enum(*_TOOL_CHOICE_MODES)(param, value)
        return mode
    if not isinstance(value, Mapping):
        raise InvalidRequest(f'must be "none", "auto", "required" or a named function, got {type_name(value)}', param)
    out: dict[str, Any] = nfc_json(param, value)
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
            raise InvalidRequest(f"must be an object, got {type_name(message)}", where)
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
            raise InvalidRequest(f"must be a string, a list of parts or null, got {type_name(content)}", f"{where}.content")
        # A list of text parts stays a list: a chat template may render it unlike a string.
        out.append(nfc_json(where, message))
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
        raise InvalidRequest(f"must be a string, got {type_name(value)}", param)
    return _nfc(value)


@dataclass(frozen=True)
class ParamSpec:
    """How one known parameter is checked and folded.

    ``nullable``: an explicit null is accepted and means the same as omitting it
    (the vLLM field is ``X | None``); otherwise null is refused.
    ``equivalents``: other canonical values that mean the default.
    """

    check: _Check
    nullable: bool = True
    equivalents: tuple[object, ...] = ()


_PENALTY = _float(-2.0, 2.0)
_COMMON_SPECS: dict[str, ParamSpec] = {
    "temperature": ParamSpec(check_temperature),
    "top_p": ParamSpec(_float(0.0, 1.0, lo_open=True)),
    "presence_penalty": ParamSpec(_PENALTY),
    "frequency_penalty": ParamSpec(_PENALTY),
    "stop": ParamSpec(_stop, equivalents=([],)),
    "seed": ParamSpec(check_seed),
    "logit_bias": ParamSpec(_logit_bias, equivalents=({},)),
    "top_k": ParamSpec(check_top_k),
    "min_p": ParamSpec(_float(0.0, 1.0)),
    "repetition_penalty": ParamSpec(_float(0.0, math.inf, lo_open=True)),
    "min_tokens": ParamSpec(_int(0), nullable=False),
    "ignore_eos": ParamSpec(_bool, nullable=False),
    "skip_special_tokens": ParamSpec(_bool, nullable=False),
    "spaces_between_special_tokens": ParamSpec(_bool, nullable=False),
    "include_stop_str_in_output": ParamSpec(_bool, nullable=False),
    "use_beam_search": ParamSpec(_bool, nullable=False),
    "length_penalty": ParamSpec(_float(-math.inf, math.inf), nullable=False),
    "stop_token_ids": ParamSpec(_stop_token_ids),
    "bad_words": ParamSpec(_strings, nullable=False),
    "allowed_token_ids": ParamSpec(_token_ids),
    "truncate_prompt_tokens": ParamSpec(_int(-1)),
    "truncation_side": ParamSpec(_enum("left", "right")),
    "prompt_logprobs": ParamSpec(_int(-1)),
    "logprob_token_ids": ParamSpec(_token_ids),
    "structured_outputs": ParamSpec(_json_object),
    "return_tokens_as_token_ids": ParamSpec(_bool, equivalents=(False,)),
    "return_token_ids": ParamSpec(_bool, equivalents=(False,)),
    "routed_experts_prompt_start": ParamSpec(_int(0), nullable=False),
    "repetition_detection": ParamSpec(_json_object),
    "thinking_token_budget": ParamSpec(_json_value),
}

SPECS: Final[Mapping[Endpoint, Mapping[str, ParamSpec]]] = {
    "chat": {
        **_COMMON_SPECS,
        "messages": ParamSpec(_messages, nullable=False),
        "n": ParamSpec(_int(1)),
        "logprobs": ParamSpec(_bool),
        "top_logprobs": ParamSpec(_int(-1), equivalents=(0,)),
        "max_tokens": ParamSpec(_int(1)),
        "response_format": ParamSpec(_response_format),
        "tools": ParamSpec(_tools),
        "tool_choice": ParamSpec(_tool_choice),
        "parallel_tool_calls": ParamSpec(_bool),
        "reasoning_effort": ParamSpec(_enum("none", "minimal", "low", "medium", "high", "xhigh", "max")),
        "include_reasoning": ParamSpec(_bool, nullable=False),
        "echo": ParamSpec(_bool, nullable=False),
        "add_generation_prompt": ParamSpec(_bool, nullable=False),
        "continue_final_message": ParamSpec(_bool, nullable=False),
        "add_special_tokens": ParamSpec(_bool, nullable=False),
        "documents": ParamSpec(_json_value),
        "chat_template_kwargs": ParamSpec(_chat_template_kwargs, equivalents=({},)),
        "return_prompt_text": ParamSpec(_bool, equivalents=(False,)),
    },
    "completions": {
        **_COMMON_SPECS,
        "prompt": ParamSpec(_prompt),
        "n": ParamSpec(_int(1), nullable=False),
        "logprobs": ParamSpec(_int(-1)),
        "max_tokens": ParamSpec(_int(0)),
        "response_format": ParamSpec(_response_format, equivalents=({"type": "text"},)),
        "echo": ParamSpec(_bool),
        "suffix": ParamSpec(_suffix),
        "best_of": ParamSpec(_int(1)),
        "add_special_tokens": ParamSpec(_bool, nullable=False),
    },
}
# The chat alias: max_completion_tokens is OpenAI's current name of max_tokens.
ALIAS_MAX_COMPLETION_TOKENS: Final = "max_completion_tokens"
# Every defaulted parameter has a spec and vice versa (messages/prompt have no default);
# every allowed field is keyed (model and the alias are handled by _parse) and nothing
# else is; no allowed field shares a name with a reserved key.
assert all(set(OUTPUT_DEFAULTS[e]) == set(SPECS[e]) - {"messages", "prompt"} for e in ENDPOINTS)
assert all(set(SPECS[e]) == fields_of(e, "allowed") - {"model", ALIAS_MAX_COMPLETION_TOKENS} for e in ENDPOINTS)
assert not RESERVED_KEYS & (fields_of("chat", "allowed") | fields_of("completions", "allowed"))
# Removed from the key and from the forwarded body (gateway/request_fields.py).
STRIPPED: Final[Mapping[Endpoint, frozenset[str]]] = {e: fields_of(e, "stripped") for e in ENDPOINTS}
# vLLM's neutral sampling defaults (both protocol.py files): all that an engine may override.
ENGINE_DEFAULT_NAMES: Final = frozenset(ENGINE_DEFAULTED_PARAMETERS["chat"])


# ---------------------------------------------------------------------------
# JSON helpers
# ---------------------------------------------------------------------------


def type_name(value: Any) -> str:
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


def plain_json(param: str, value: Any, *, nfc: bool = False) -> Any:
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
                raise InvalidRequest(f"object keys must be strings, got {type_name(key)}", param)
            name = _nfc(key) if nfc else key
            if name in out:
                raise InvalidRequest(f"key {key!r} appears twice after Unicode NFC normalization", param)
            out[name] = plain_json(f"{param}.{key}", item, nfc=nfc)
        return out
    if isinstance(value, list | tuple):
        return [plain_json(f"{param}[{i}]", item, nfc=nfc) for i, item in enumerate(value)]
    raise InvalidRequest(f"must be JSON, got {type(value).__name__}", param)


def nfc_json(param: str, value: Any) -> Any:
    return plain_json(param, value, nfc=True)
