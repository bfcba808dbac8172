"""Which request-body fields the gateway forwards to the engine, removes, or refuses.

A tenant holds a gateway key, not the engine: every field of a request body is
in exactly one class of :data:`REQUEST_FIELDS`:

- ``allowed``: forwarded to the engine and part of the canonical request (the
  response-cache key). OpenAI's public parameters of ``POST /v1/chat/completions``
  and ``POST /v1/completions``, and vLLM's extras that only shape the sampling,
  the prompt rendering or the output of this one request.
- ``stripped``: accepted and removed before forwarding; never in the key.
  Delivery the gateway owns (it always streams from the engine itself) and
  bookkeeping that vLLM ignores.
- ``refused``: answered with HTTP 400 naming the field (``param``), the reason
  being the message. Fields that drive the engine rather than this request's
  output: its KV connectors and transfers, its prefix-cache salt, its request
  and session identity, its scheduling priority, the hooks of custom extensions,
  its templates and media processors, its watermark policy; and OpenAI
  parameters vLLM 0.32 does not implement (it would ignore them silently).

A field in no class is refused as unknown. vLLM itself does not refuse unknown
fields: its request models inherit ``OpenAIBaseModel``, which sets
``model_config = ConfigDict(extra="allow")`` and only logs the extra names
(``vllm/entrypoints/serve/engine/protocol.py``), so only the gateway can
guarantee that nothing outside this table reaches an engine.

Source of the fields and of each reason: vLLM 0.32's request models,
``ChatCompletionRequest`` in ``vllm/entrypoints/openai/chat_completion/protocol.py``
and ``CompletionRequest`` in ``vllm/entrypoints/openai/completion/protocol.py``
(``to_sampling_params`` shows where each field goes: ``vllm_xargs``,
``kv_transfer_params`` and ``ec_transfer_params`` become
``SamplingParams.extra_args``); ``vllm/entrypoints/generate/base/serving.py``
(``_get_session_id`` also reads ``vllm_xargs["session_id"]``, ``_get_priority``);
``vllm/v1/core/block_pool.py`` (``session_id`` is written into every
``BlockStored`` KV event); ``vllm/v1/engine/input_processor.py``
(``resolve_watermarking``: ``false`` opts out of the engine's watermark);
``vllm/multimodal/media/image.py`` (per-request ``media_io_kwargs`` are merged
with ``--media-io-kwargs`` and handed to the media loaders);
``vllm/renderers/embed_utils.py`` (``prompt_embeds`` are ``torch.load``-ed in
the engine process); OpenAI's API reference (chat/create, completions/create)
for the OpenAI-only names. ``tests/gateway/test_request_fields.py`` walks the
installed vLLM's ``model_fields`` and fails on a field this table lacks.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final, Literal

if TYPE_CHECKING:
    from gateway.param_specs import Endpoint

__all__ = [
    "FIELD_CLASSES",
    "REQUEST_FIELDS",
    "FieldClass",
    "RequestField",
    "field_refusal",
    "fields_of",
]

FieldClass = Literal["allowed", "stripped", "refused"]
"""What the gateway does with a body field; see the module docstring."""

FIELD_CLASSES: Final[tuple[FieldClass, ...]] = ("allowed", "stripped", "refused")

_BOTH: Final = frozenset({"chat", "completions"})
_CHAT: Final = frozenset({"chat"})
_COMPLETIONS: Final = frozenset({"completions"})
_PATHS: Final[Mapping[str, str]] = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}


@dataclass(frozen=True)
class RequestField:
    """One body field: its class, why, and the endpoints that have it.

    Attributes:
        kind: ``"allowed"``, ``"stripped"`` or ``"refused"``.
        reason: one line. For a refused field it is the 400 message the caller
            gets (it starts with the field's name).
        endpoints: the endpoints whose body may carry it; on another endpoint
            the field is refused as not being a parameter of that endpoint.
    """

    kind: FieldClass
    reason: str
    endpoints: frozenset[str] = _BOTH


def _allowed(reason: str, endpoints: frozenset[str] = _BOTH) -> RequestField:
    return RequestField("allowed", reason, endpoints)


def _stripped(reason: str, endpoints: frozenset[str] = _BOTH) -> RequestField:
    return RequestField("stripped", reason, endpoints)


def _refused(reason: str, endpoints: frozenset[str] = _BOTH) -> RequestField:
    return RequestField("refused", reason, endpoints)


_OPENAI_NOT_IN_VLLM: Final = "is an OpenAI parameter that vLLM 0.32 does not implement: the engine would ignore it"
_SAMPLING: Final = "sampling of this request only (SamplingParams)"
_RENDER_ONLY: Final = "vLLM: used by the render endpoints only, ignored by generation endpoints"
_OPENAI_BOOKKEEPING: Final = "OpenAI bookkeeping; vLLM 0.32 has no such field and ignores it"

REQUEST_FIELDS: Final[Mapping[str, RequestField]] = {
    # --- OpenAI's public parameters ------------------------------------------------------
    "model": _allowed("which served model; the gateway routes by it and sends the engine's own served name"),
    "messages": _allowed("the conversation (OpenAI)", _CHAT),
    "prompt": _allowed("the prompt (OpenAI)", _COMPLETIONS),
    "suffix": _allowed("text after the completion (OpenAI)", _COMPLETIONS),
    "frequency_penalty": _allowed(_SAMPLING),
    "presence_penalty": _allowed(_SAMPLING),
    "logit_bias": _allowed(_SAMPLING),
    "seed": _allowed(_SAMPLING),
    "stop": _allowed("stop strings of this request"),
    "temperature": _allowed(_SAMPLING),
    "top_p": _allowed(_SAMPLING),
    "n": _allowed("number of choices of this request"),
    "max_tokens": _allowed("output length of this request (chat: deprecated alias of max_completion_tokens)"),
    "max_completion_tokens": _allowed("output length of this request (OpenAI's current chat name)", _CHAT),
    "logprobs": _allowed("log-probabilities in this request's output"),
    "top_logprobs": _allowed("log-probabilities in this request's output", _CHAT),
    "response_format": _allowed("structured output of this request (OpenAI; a vLLM extra on completions)"),
    "tools": _allowed("tools the model may call in this request", _CHAT),
    "tool_choice": _allowed("which tool this request may call", _CHAT),
    "parallel_tool_calls": _allowed("tool-call output of this request", _CHAT),
    "reasoning_effort": _allowed("reasoning length of this request, passed to the chat template", _CHAT),
    "echo": _allowed("echo the prompt in this request's output (OpenAI completions; a vLLM extra on chat)"),
    "best_of": _allowed("OpenAI sampling parameter; vLLM 0.32 has no field for it and ignores it", _COMPLETIONS),
    # --- vLLM's extras that shape only this request -----------------------------------------
    "top_k": _allowed(_SAMPLING),
    "min_p": _allowed(_SAMPLING),
    "repetition_penalty": _allowed(_SAMPLING),
    "length_penalty": _allowed("beam-search scoring of this request"),
    "use_beam_search": _allowed("beam search for this request; its sub-requests keep the request's cache_salt"),
    "stop_token_ids": _allowed("stop tokens of this request"),
    "include_stop_str_in_output": _allowed("output text of this request"),
    "ignore_eos": _allowed(_SAMPLING),
    "min_tokens": _allowed(_SAMPLING),
    "skip_special_tokens": _allowed("detokenization of this request's output"),
    "spaces_between_special_tokens": _allowed("detokenization of this request's output"),
    "truncate_prompt_tokens": _allowed("truncation of this request's prompt"),
    "truncation_side": _allowed("truncation of this request's prompt"),
    "prompt_logprobs": _allowed("prompt log-probabilities in this request's output"),
    "logprob_token_ids": _allowed("log-probabilities in this request's output"),
    "allowed_token_ids": _allowed(_SAMPLING),
    "bad_words": _allowed(_SAMPLING),
    "structured_outputs": _allowed("grammar constraint of this request's output"),
    "repetition_detection": _allowed("early stop of this request on repeated n-grams"),
    "thinking_token_budget": _allowed("reasoning length of this request"),
    "return_tokens_as_token_ids": _allowed("format of this request's logprobs"),
    "return_token_ids": _allowed("token ids in this request's output"),
    "routed_experts_prompt_start": _allowed("slice of the routed-expert data in this request's output"),
    "include_reasoning": _allowed("reasoning text in this request's output", _CHAT),
    "add_generation_prompt": _allowed("rendering of this request's prompt by the served chat template", _CHAT),
    "continue_final_message": _allowed("rendering of this request's prompt by the served chat template", _CHAT),
    "add_special_tokens": _allowed("tokenization of this request's prompt"),
    "documents": _allowed("documents for the served chat template (RAG), content of this request", _CHAT),
    "chat_template_kwargs": _allowed(
        "variables of the served chat template for this request (its chat_template key is refused)", _CHAT
    ),
    "return_prompt_text": _allowed("the rendered prompt of this request in its output", _CHAT),
    # --- stripped: accepted, never forwarded, never in the key -------------------------------
    "stream": _stripped("delivery to the caller; the gateway always streams from the engine itself"),
    "stream_options": _stripped("delivery to the caller; the gateway sets its own upstream"),
    "stream_interval": _stripped("chunking between engine and gateway, which re-chunks for the caller"),
    "user": _stripped("OpenAI attribution; the gateway routes by it (sticky releases), vLLM ignores it"),
    "safety_identifier": _stripped(_OPENAI_BOOKKEEPING),
    "metadata": _stripped(_OPENAI_BOOKKEEPING),
    "store": _stripped(_OPENAI_BOOKKEEPING),
    "service_tier": _stripped(_OPENAI_BOOKKEEPING),
    "prompt_cache_key": _stripped(_OPENAI_BOOKKEEPING),
    "prompt_cache_retention": _stripped(_OPENAI_BOOKKEEPING),
    "return_token_offsets": _stripped(_RENDER_ONLY),
    "mm_payload": _stripped(_RENDER_ONLY),
    "return_mm_kwargs": _stripped(_RENDER_ONLY),
    # --- refused: engine control (the reason is the 400 message) -----------------------------
    "cache_salt": _refused("cache_salt is set by the gateway from the tenant's cache namespace; do not send it"),
    "kv_transfer_params": _refused(
        "kv_transfer_params drives the engine's KV connector (loading and saving KV cache outside the tenant's "
        "namespace); the gateway does not forward it"
    ),
    "ec_transfer_params": _refused(
        "ec_transfer_params drives the engine's encoder-cache connector; the gateway does not forward it"
    ),
    "vllm_xargs": _refused(
        "vllm_xargs reaches the engine's extensions and KV connectors (SamplingParams.extra_args) and can set "
        "the session id; the gateway does not forward it"
    ),
    "priority": _refused("priority sets the engine's scheduling order; the gateway does not forward it"),
    "request_id": _refused("request_id names the request inside the engine; the gateway does not forward it"),
    "session_id": _refused(
        "session_id is the engine's session identity, written into its KV cache events; the gateway does not forward it"
    ),
    "watermarking": _refused(
        "watermarking opts in or out of the engine's configured watermark, an operator policy; the gateway does not forward it"
    ),
    "chat_template": _refused(
        "chat_template replaces the served chat template with one the engine would run; the gateway does not forward it",
        _CHAT,
    ),
    "media_io_kwargs": _refused(
        "media_io_kwargs overrides the engine's media loaders (merged with --media-io-kwargs); the gateway does not forward it",
        _CHAT,
    ),
    "mm_processor_kwargs": _refused(
        "mm_processor_kwargs overrides the engine's multimodal processor settings; the gateway does not forward it",
        _CHAT,
    ),
    "prompt_embeds": _refused(
        "prompt_embeds are tensors the engine deserializes (torch.load) past its tokenizer; the gateway does not forward them",
        _COMPLETIONS,
    ),
    # OpenAI parameters vLLM 0.32 lacks: an answer that silently ignores them would be wrong.
    "functions": _refused(f"functions {_OPENAI_NOT_IN_VLLM}; use tools", _CHAT),
    "function_call": _refused(f"function_call {_OPENAI_NOT_IN_VLLM}; use tool_choice", _CHAT),
    "audio": _refused(f"audio {_OPENAI_NOT_IN_VLLM}", _CHAT),
    "modalities": _refused(f"modalities {_OPENAI_NOT_IN_VLLM}", _CHAT),
    "prediction": _refused(f"prediction {_OPENAI_NOT_IN_VLLM}", _CHAT),
    "web_search_options": _refused(f"web_search_options {_OPENAI_NOT_IN_VLLM}", _CHAT),
    "verbosity": _refused(f"verbosity {_OPENAI_NOT_IN_VLLM}", _CHAT),
}
"""Every body field the gateway knows: name -> :class:`RequestField` (see the module docstring)."""

# A refused field's message names it first: the caller reads it without the param.
assert all(name == f.reason.split(" ", 1)[0] for name, f in REQUEST_FIELDS.items() if f.kind == "refused")
assert all(f.kind in FIELD_CLASSES and f.endpoints and f.endpoints <= _BOTH for f in REQUEST_FIELDS.values())


def fields_of(endpoint: Endpoint, kind: FieldClass) -> frozenset[str]:
    """The fields of one class on one endpoint.

    Args:
        endpoint: ``"chat"`` or ``"completions"``.
        kind: ``"allowed"``, ``"stripped"`` or ``"refused"``.

    Returns:
        Field names (a field of the other endpoint only is in none of the three).

    Raises:
        ValueError: an unknown endpoint or class.
    """
    if endpoint not in _PATHS or kind not in FIELD_CLASSES:
        raise ValueError(f"unknown endpoint or class: {endpoint!r}, {kind!r}")
    return frozenset(name for name, f in REQUEST_FIELDS.items() if f.kind == kind and endpoint in f.endpoints)


def field_refusal(endpoint: Endpoint, name: str) -> str | None:
    """The 400 message for body field ``name`` on ``endpoint``, or None when it is accepted.

    Args:
        endpoint: ``"chat"`` or ``"completions"``.
        name: a top-level body field.

    Returns:
        None for an allowed or stripped field; otherwise the message (the
        caller's error names ``name`` as ``param``): a refused field's reason,
        "is a parameter of <other path>, not of <path>" for a field of the other
        endpoint only, or "is not a parameter the gateway accepts on <path> ..."
        for a field in no class (vLLM would accept and ignore it: see the module
        docstring).

    Raises:
        ValueError: an unknown endpoint.
    """
    if endpoint not in _PATHS:
        raise ValueError(f"unknown endpoint: {endpoint!r}")
    spec = REQUEST_FIELDS.get(name)
    if spec is None:
        return (
            f"is not a parameter the gateway accepts on {_PATHS[endpoint]}: it forwards OpenAI's parameters and "
            "vLLM's sampling parameters only"
        )
    if endpoint not in spec.endpoints:
        (other,) = spec.endpoints
        return f"is a parameter of {_PATHS[other]}, not of {_PATHS[endpoint]}"
    return spec.reason if spec.kind == "refused" else None
