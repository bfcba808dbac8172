"""What an answer is, whoever computed it: the cache record kept of an engine's answer
(its one JSON object, or the object folded from its streamed chunks), that record as
the caller's answer object or chunks again, the ``usage`` a replay reports, and whether
an answer finished so that it may be kept at all.

A record is the engine's answer object as vLLM 0.32 writes it
(``vllm/entrypoints/openai/chat_completion/protocol.py`` ``ChatCompletionResponse``,
``vllm/entrypoints/openai/completion/protocol.py`` ``CompletionResponse``) without the
fields made per caller (:data:`PER_CALL_FIELDS`): every other field of the answer, of each
choice and of each message is kept, known to the gateway or not (``reasoning``,
``stop_reason``, ``token_ids``, ``prompt_token_ids``, ``kv_transfer_params``, fields of
later vLLM versions), so a replay equals the original but for ``id``, ``created`` and
``usage`` (:func:`served_usage`). A record's fields whose name starts with ``_`` are the
gateway's own and never reach a caller.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Final

#: Fields of an answer made for each caller, never stored: its id and time, and the served name it asked for.
PER_CALL_FIELDS: Final = frozenset({"id", "created", "model"})
#: Top-level fields vLLM streams on the first chunk only (``chat_completion/serving.py``, the role chunk).
FIRST_CHUNK_FIELDS: Final = ("prompt_token_ids", "prompt_text")
#: Finish reasons of an answer that ended by itself: ``tool_calls`` is vLLM's name for ``stop``
#: after the model called tools (``chat_completion/serving.py``: ``finish_reason_ = "tool_calls"``).
FINISHED: Final = frozenset({"stop", "tool_calls"})
#: Why an answer is not kept (:func:`unkept_reason`), a bounded label.
UNKEPT_REASONS: Final = ("no_choices", "unfinished", "length", "finish_reason", "empty_content", "incomplete_tool_call")


def object_name(endpoint: str, *, chunk: bool = False) -> str:
    """The ``object`` of an answer of ``endpoint`` (``"chat"`` or ``"completions"``), or of one of its chunks."""
    if endpoint == "completions":
        return "text_completion"
    return "chat.completion.chunk" if chunk else "chat.completion"


def record_of_answer(answer: Mapping[str, Any], endpoint: str, fingerprint: str) -> dict[str, Any]:
    """A non-streamed engine answer as a cache record: every field but :data:`PER_CALL_FIELDS`,
    with the ``system_fingerprint`` of the model state that computed it (vLLM's own is the
    engine's build, not the state the gateway routes by)."""
    record = {k: v for k, v in answer.items() if k not in PER_CALL_FIELDS}
    record["object"] = object_name(endpoint)
    record["system_fingerprint"] = fingerprint
    record.setdefault("usage", {})
    return record


def _last(held: dict[str, Any], name: str, value: Any) -> None:
    """A field repeated across chunks: the last value that is not null (a null kept when nothing else came)."""
    if value is not None or name not in held:
        held[name] = value


def _extend(held: dict[str, Any], name: str, value: Any) -> None:
    """A field streamed in pieces: strings joined, lists extended, objects merged field by field."""
    old = held.get(name)
    if value is None:
        held.setdefault(name, None)
    elif isinstance(value, str) and isinstance(old, str):
        held[name] = old + value
    elif isinstance(value, list) and isinstance(old, list):
        held[name] = old + value
    elif isinstance(value, Mapping) and isinstance(old, Mapping):
        merged = dict(old)
        for key, item in value.items():
            _extend(merged, key, item)
        held[name] = merged
    else:
        held[name] = list(value) if isinstance(value, list) else dict(value) if isinstance(value, Mapping) else value


class AnswerAssembler:
    """Folds an engine's streamed chunks into the answer object it would have sent whole,
    every field carried: in each chunk's delta, strings are joined (``content``,
    ``reasoning``, ``reasoning_content``, ``refusal``...) and tool calls merged by index;
    in each choice, ``text`` is joined, lists extended (``token_ids``), ``logprobs`` merged
    list by list, and other fields (``finish_reason``, ``stop_reason``...) keep their last
    non-null value; top-level fields (``prompt_token_ids``, ``usage``, ``metrics``...) too.

    Args:
        endpoint: ``"chat"`` or ``"completions"``.
    """

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self.top: dict[str, Any] = {}
        self.choices: dict[int, dict[str, Any]] = {}
        #: Whether a chunk carried generated output yet (content, reasoning, text or a tool call).
        self.generated = False

    def feed(self, chunk: Mapping[str, Any]) -> bool:
        """Fold one chunk in; True when it is the first to carry generated output (its TTFT)."""
        first = not self.generated
        for name, value in chunk.items():
            if name == "choices":
                for choice in value or []:
                    self._choice(choice)
            elif name not in PER_CALL_FIELDS and name != "object":
                _last(self.top, name, value)
        return first and self.generated

    def _choice(self, choice: Mapping[str, Any]) -> None:
        index = int(choice.get("index", 0))
        held = self.choices.setdefault(index, {"index": index})
        for name, value in choice.items():
            if name == "index":
                continue
            if name == "delta":
                self._delta(held.setdefault("message", {}), value or {})
            elif name in ("text", "token_ids", "logprobs"):
                self.generated = self.generated or (name == "text" and bool(value))
                _extend(held, name, value)
            else:
                _last(held, name, value)

    def _delta(self, message: dict[str, Any], delta: Mapping[str, Any]) -> None:
        for name, value in delta.items():
            if name == "tool_calls":
                calls = message.setdefault("tool_calls", [])
                for call in value or []:
                    self.generated = True
                    at = int(call.get("index", len(calls)))
                    while len(calls) <= at:
                        calls.append({})
                    for key, item in call.items():
                        if key != "index":
                            (_extend if key == "function" else _last)(calls[at], key, item)
            elif name == "role":
                _last(message, name, value)
            else:
                self.generated = self.generated or (isinstance(value, str) and bool(value))
                _extend(message, name, value)

    def answer(self) -> dict[str, Any]:
        """The answer object folded so far (without :data:`PER_CALL_FIELDS`): choices by index, then the top-level fields."""
        choices = []
        for index in sorted(self.choices):
            choice = dict(self.choices[index])
            if "message" in choice:
                message = {"role": "assistant", **choice["message"]}
                if not message.get("tool_calls"):
                    message.pop("tool_calls", None)  # vLLM's ChatMessage drops an empty list too
                choice["message"] = message
            choices.append(choice)
        return {"object": object_name(self.endpoint), "choices": choices, **self.top, "usage": self.top.get("usage") or {}}


#: Fields of vLLM 0.32's whole answer that default to null, per level: ``top``, ``choice``,
#: ``message`` (``ChatCompletionResponse``/``ChatCompletionResponseChoice``/``ChatMessage`` in
#: ``vllm/entrypoints/openai/chat_completion/protocol.py``; ``CompletionResponse``/
#: ``CompletionResponseChoice`` in ``vllm/entrypoints/openai/completion/protocol.py``). A whole
#: answer carries them all (``model_dump()``); a stream only those set (``exclude_unset``), so
#: a streamed record replayed whole gets the ones its stream left out.
WHOLE_ANSWER_NULLS: Final[Mapping[str, Mapping[str, tuple[str, ...]]]] = {
    "chat": {
        "top": ("service_tier", "system_fingerprint", "prompt_logprobs", "prompt_token_ids", "prompt_text",
                "kv_transfer_params", "ec_transfer_params", "metrics"),
        "choice": ("logprobs", "stop_reason", "token_ids", "routed_experts"),
        "message": ("content", "refusal", "annotations", "audio", "function_call", "reasoning"),
    },
    "completions": {
        "top": ("service_tier", "system_fingerprint", "kv_transfer_params", "ec_transfer_params", "metrics"),
        "choice": ("logprobs", "stop_reason", "token_ids", "prompt_logprobs", "prompt_token_ids", "routed_experts"),
        "message": (),
    },
}  # fmt: skip


#: Record field (hidden from callers, as every ``_`` field) marking a record folded from a stream.
STREAMED: Final = "_streamed"


def _with_nulls(value: Mapping[str, Any], names: tuple[str, ...]) -> dict[str, Any]:
    return {**dict.fromkeys(names), **value}


def answer_object(record: Mapping[str, Any], *, endpoint: str, model: str, cid: str, created: int,
                  usage: Mapping[str, Any]) -> dict[str, Any]:  # fmt: skip
    """A record as the caller's answer object: a fresh id and time, the served name it asked
    for, ``usage`` as given, every other field of the record as stored (but ``_``-prefixed ones),
    and, for a record folded from a stream (:data:`STREAMED`), each of :data:`WHOLE_ANSWER_NULLS`
    it lacks as null, as the engine answers whole."""
    nulls = WHOLE_ANSWER_NULLS[endpoint] if record.get(STREAMED) else {"top": (), "choice": (), "message": ()}
    body = {k: v for k, v in record.items() if not k.startswith("_") and k not in PER_CALL_FIELDS}
    choices = []
    for stored in record.get("choices") or []:
        choice = _with_nulls(stored, nulls["choice"])
        if "message" in choice:
            choice["message"] = _with_nulls(choice["message"], nulls["message"])
        choices.append(choice)
    return {"id": cid, "object": object_name(endpoint), "created": created, "model": model,
            **_with_nulls(body, nulls["top"]), "choices": choices, "usage": dict(usage)}  # fmt: skip


def answer_chunks(record: Mapping[str, Any], *, endpoint: str, model: str, cid: str, created: int,
                  usage: Mapping[str, Any] | None) -> list[dict[str, Any]]:  # fmt: skip
    """A record as the chunks an engine streams, in vLLM's shape: per choice a role chunk (chat;
    with ``prompt_token_ids``/``prompt_text`` on the first), a chunk with the whole output and
    every other field of the choice; then the usage chunk when ``usage`` is given. The record's
    other top-level fields ride on the last chunk, as vLLM stamps ``system_fingerprint`` and
    ``metrics`` there; :class:`AnswerAssembler` folds the chunks back into the record."""
    head = {"id": cid, "object": object_name(endpoint, chunk=True), "created": created, "model": model,
            "system_fingerprint": record.get("system_fingerprint")}  # fmt: skip
    skip = PER_CALL_FIELDS | {"object", "choices", "usage", "system_fingerprint"}
    first = {k: v for k, v in record.items() if k in FIRST_CHUNK_FIELDS}
    last = {k: v for k, v in record.items() if k not in skip and k not in first and not k.startswith("_")}
    chunks: list[dict[str, Any]] = []
    for choice in record.get("choices") or []:
        rest = {k: v for k, v in choice.items() if k not in ("index", "message")}
        index = choice.get("index", 0)
        if endpoint == "completions":
            chunks.append({**head, **(first if not chunks else {}), "choices": [{"index": index, **rest}]})
            continue
        message = choice.get("message") or {}
        role = {"index": index, "delta": {"role": message.get("role", "assistant"), "content": ""}, "logprobs": None,
                "finish_reason": None}  # fmt: skip
        chunks.append({**head, **(first if not chunks else {}), "choices": [role]})
        # Every field of the message but its role (sent on the role chunk), nulls too (a whole
        # answer's ``refusal: null``), so the chunks fold back into the very record.
        delta = {k: v for k, v in message.items() if k not in ("role", "tool_calls")}
        if message.get("tool_calls"):
            delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(message["tool_calls"])]
        chunks.append({**head, "choices": [{"index": index, "delta": delta, **rest}]})
    if usage is not None:
        chunks.append({**head, "choices": [], "usage": dict(usage)})
    if chunks:
        chunks[-1].update(last)
    return chunks


def served_usage(usage: Mapping[str, Any]) -> dict[str, Any]:
    """The ``usage`` of an answer served from a cache layer: the tokens served, and none of them
    computed for this request. ``prompt_tokens`` and ``completion_tokens`` are the stored answer's;
    ``prompt_tokens_details.cached_tokens`` (OpenAI's field for prompt tokens not computed) is all
    of ``prompt_tokens``, ``completion_tokens_details.cached_tokens`` (the gateway's, on the same
    convention) all of ``completion_tokens``, and vLLM's ``created_cache_tokens``, when the
    stored answer had it, 0: computed = prompt - cached + completion - cached = 0. Other fields
    (``reasoning_tokens``, ``multimodal_tokens``) stay as stored: they describe the answer."""
    prompt, completion = int(usage.get("prompt_tokens") or 0), int(usage.get("completion_tokens") or 0)
    prompt_details = dict(usage.get("prompt_tokens_details") or {})
    prompt_details["cached_tokens"] = prompt
    if "created_cache_tokens" in prompt_details:
        prompt_details["created_cache_tokens"] = 0
    completion_details = {**(usage.get("completion_tokens_details") or {}), "cached_tokens": completion}
    return {**usage, "prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": prompt_details, "completion_tokens_details": completion_details}  # fmt: skip


def unkept_reason(record: Mapping[str, Any], *, endpoint: str, n: int, admit_length: bool) -> str | None:
    """Why an answer must not be kept by a cache layer, or None when it may.

    Kept: ``n`` choices, indices 0..n-1, each finished by itself (``stop``, or ``tool_calls``:
    :data:`FINISHED`), or by ``length`` when the tenant's policy admits truncated answers, with
    its output whole: text or content not empty (reasoning alone is no answer), or tool calls
    each with a name and JSON arguments. Anything else (no finish reason: a stream cut short;
    ``abort``, ``error``, ``content_filter``, ``repetition``...) is served to its caller but kept
    nowhere. Returns one of :data:`UNKEPT_REASONS`."""
    choices = record.get("choices")
    if not isinstance(choices, list) or sorted(c.get("index", 0) for c in choices) != list(range(n)):
        return "no_choices"
    for choice in choices:
        reason = choice.get("finish_reason")
        if reason is None:
            return "unfinished"
        if reason == "length" and not admit_length:
            return "length"
        if reason not in FINISHED and reason != "length":
            return "finish_reason"
        why = _unkept_output(choice, endpoint)
        if why is not None:
            return why
    return None


def _unkept_output(choice: Mapping[str, Any], endpoint: str) -> str | None:
    if endpoint == "completions":
        return None if isinstance(choice.get("text"), str) and choice["text"] else "empty_content"
    message = choice.get("message") or {}
    calls = message.get("tool_calls") or []
    for call in calls:
        function = call.get("function") or {}
        try:
            json.loads(function.get("arguments") or "")
        except ValueError:
            return "incomplete_tool_call"
        if not function.get("name"):
            return "incomplete_tool_call"
    content = message.get("content")
    return None if calls or (isinstance(content, str) and content) else "empty_content"
