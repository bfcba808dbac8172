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
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from gateway.param_specs import (
    ALIAS_MAX_COMPLETION_TOKENS,
    ENDPOINTS,
    ENGINE_DEFAULT_NAMES,
    ENGINE_DEFAULTED_PARAMETERS,
    NFC_FIELDS,
    OUTPUT_DEFAULTS,
    SPECS,
    STRIPPED,
    TOOL_CHOICE_DEFAULT_WITH_TOOLS,
    Endpoint,
    InvalidRequest,
    check_seed,
    check_temperature,
    check_top_k,
    nfc_json,
    plain_json,
    type_name,
)
from gateway.request_fields import field_refusal

__all__ = [
    "ADMISSION_REASONS",
    "Admission",
    "canonical_bytes",
    "canonical_request",
    "normalized_body",
    "response_admission",
    "response_cache_key",
]


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
        if name not in ENGINE_DEFAULT_NAMES:
            known = ", ".join(sorted(ENGINE_DEFAULT_NAMES))
            raise ValueError(f"engine_defaults: {name!r} is not an engine-defaulted parameter ({known})")
        if value is not None:
            out[name] = SPECS["chat"][name].check(f"engine_defaults.{name}", value)
    return out


def _check_fields(endpoint: Endpoint, body: Mapping[str, Any]) -> None:
    """Refuse the first body field (in body order) that is refused or unknown on ``endpoint``.

    Runs before any value is checked, so an engine-control field is answered as
    such whatever else the body holds (gateway/request_fields.py has the table).
    """
    for name in body:
        if not isinstance(name, str):
            raise InvalidRequest(f"parameter names must be strings, got {type_name(name)}", None)
        message = field_refusal(endpoint, name)
        if message is not None:
            raise InvalidRequest(message, name)


def _parse(endpoint: Endpoint, body: Mapping[str, Any]) -> tuple[dict[str, Any], set[str]]:
    """Check ``body``; return (allowed parameters as canonical values, names given as explicit null)."""
    if not isinstance(body, Mapping):
        raise InvalidRequest(f"the request body must be a JSON object, got {type_name(body)}", None)
    _check_fields(endpoint, body)
    specs = SPECS[endpoint]
    known: dict[str, Any] = {}
    nulls: set[str] = set()
    for name, value in body.items():
        if name in STRIPPED[endpoint] or (endpoint == "chat" and name == ALIAS_MAX_COMPLETION_TOKENS):
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
        alias = body.get(ALIAS_MAX_COMPLETION_TOKENS)
        if alias is not None:
            alias_value = specs["max_tokens"].check(ALIAS_MAX_COMPLETION_TOKENS, alias)
            if "max_tokens" in known and known["max_tokens"] != alias_value:
                raise InvalidRequest(
                    f"is an alias of max_tokens; both are given and differ ({alias_value} != {known['max_tokens']})",
                    ALIAS_MAX_COMPLETION_TOKENS,
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
    specs = SPECS[endpoint]

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
    out = {name: value for name, value in body.items() if name not in STRIPPED[endpoint]}
    for name in NFC_FIELDS[endpoint]:
        value = out.get(name)
        if value is not None:
            out[name] = nfc_json(name, value)
    if endpoint == "chat":
        alias = out.pop(ALIAS_MAX_COMPLETION_TOKENS, None)
        plain = out.pop("max_tokens", None)
        chosen = alias if alias is not None else plain
        if chosen is not None:
            out[ALIAS_MAX_COMPLETION_TOKENS] = chosen
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
        raise InvalidRequest(f"a canonical request must be a JSON object, got {type_name(canonical)}", None)
    plain = plain_json("canonical", canonical)
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
        raise InvalidRequest(f"a canonical request must be a JSON object, got {type_name(canonical)}", None)
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

ADMISSION_REASONS: Final = frozenset(
    {"greedy", "seeded", "sampling_allowed", "sampling", "seed_not_guaranteed", "sampling_defaults_unknown"}
)
"""Every :attr:`Admission.reason` (a closed set, usable as a metric label).

Admitted: ``greedy`` (temperature 0 or top_k 1), ``seeded`` (sampling with a
fixed seed, tenant policy ``allow_seeded``), ``sampling_allowed`` (anything
else, tenant policy ``allow_sampling``). Refused: ``sampling`` (temperature > 0,
or omitted, without a seed), ``seed_not_guaranteed`` (sampling with a seed
while the tenant does not vouch for seeded reproducibility),
``sampling_defaults_unknown`` (sampling with a seed that leaves one of
:data:`SEEDED_SAMPLING_PARAMETERS` to the engine's unknown default)."""

SEEDED_SAMPLING_PARAMETERS: Final = ("temperature", "top_p", "top_k", "min_p")
"""What a seeded answer depends on beyond the seed and the state identity.

The model's ``generation_config.json`` defaults for these (applied to an
omitted parameter: ``ModelConfig.get_diff_sampling_param``) are not part of
the state identity, because they never change the KV state of a prompt and a
greedy request ignores them (``vllm/sampling_params.py``
``SamplingParams.__post_init__``). So a release that changes them keeps its
namespace, and a seeded answer is reusable only when the request names each
one itself (or the caller passed the engine's defaults)."""


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
    - sampling with a fixed ``seed`` is ``seeded`` only with ``allow_seeded``, and
      only when every one of :data:`SEEDED_SAMPLING_PARAMETERS` is in the request
      or ``engine_defaults`` is given (else ``sampling_defaults_unknown``): vLLM
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
        raise InvalidRequest(f"a canonical request must be a JSON object, got {type_name(canonical)}", None)

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
        temperature = check_temperature("temperature", temperature)
    if top_k is not None:
        top_k = check_top_k("top_k", top_k)
    if seed is not None:
        seed = check_seed("seed", seed)
    if temperature == 0.0 or top_k == 1:
        return Admission(True, "greedy")
    defaults_unknown = engine is None and any(name not in canonical for name in SEEDED_SAMPLING_PARAMETERS)
    if seed is not None and allow_seeded and not defaults_unknown:
        return Admission(True, "seeded")
    if allow_sampling:
        return Admission(True, "sampling_allowed")
    if seed is None:
        return Admission(False, "sampling")
    return Admission(False, "sampling_defaults_unknown" if allow_seeded else "seed_not_guaranteed")
