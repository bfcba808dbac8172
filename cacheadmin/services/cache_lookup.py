"""The fleet's cache directory: where a request is cached now, for one tenant.

For a request body (or a token list) and a tenant, every live namespace of the
tenant is looked up: each engine serving it (its block index, as the gateways
read it: :mod:`gateway.prefix.index`) reports how many of the request's
leading blocks it holds in each medium; the response and semantic layers say
whether they hold an answer to it (looked up as a gateway does, nothing
served, nothing echoed). The twin of ``manage.py cache lookup``
(``POST /api/cache/lookup``).

A token list is the prompt as the engine reads it, so only the engines are
looked up (the layers key on the request's text); a request body is
tokenized per namespace with its model version's own tokenizer and chat
template, as precise routing does.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from functools import lru_cache
from typing import Any

from django.conf import settings

from cacheadmin.models import CacheNamespace, Residency, Tenant
from cacheadmin.services.block_index import block_index_store
from cacheadmin.services.gateway import routing_snapshot_build, semantic_rules
from cacheadmin.services.gateway_stores import response_store, semantic_store
from gateway.canonical import canonical_request
from gateway.layers import build_layers
from gateway.layers.base import StoreUnavailable
from gateway.layers.semantic.embedder import default_embedder
from gateway.layers.semantic.layer import SemanticLayer
from gateway.param_specs import InvalidRequest
from gateway.pipeline import RequestContext
from gateway.prefix.index import MEDIUM_BITS, BlockIndex, IndexUnavailable
from gateway.prefix.predict import Prediction, Tokenizers, predict
from gateway.prefix.router import scheme_of
from gateway.records import Recorder
from gateway.routing import NamespaceTarget, Routed, RouteTarget, RoutingSnapshot, TenantTarget
from gateway.server import Runtime, check_body
from inference.errors import InvalidField

log = logging.getLogger(__name__)

#: Longest token list a lookup takes (a model's context is shorter).
MAX_TOKENS = 1_000_000


@lru_cache(maxsize=1)
def _tokenizers() -> Tokenizers:
    return Tokenizers()


def _check_tokens(tokens: Any) -> list[int]:
    if not isinstance(tokens, list) or not tokens or len(tokens) > MAX_TOKENS:
        raise InvalidField("tokens", f"must be a non-empty list of at most {MAX_TOKENS:,} token ids")
    if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2**31 for t in tokens):
        raise InvalidField("tokens", "must hold token ids: integers within 0..2^31-1")
    return list(tokens)


def _engines(ns: NamespaceTarget, prediction: Prediction, index: BlockIndex | None) -> list[dict[str, Any]]:
    """Each engine of ``ns``: the leading blocks of the prediction it holds, per medium and in any."""
    out = []
    for engine in ns.engines:
        row: dict[str, Any] = {"engine": engine.name, "engine_id": engine.id, "block_size": engine.block_size}
        scheme = scheme_of(engine)
        why = (
            prediction.reason or ("hash_scheme" if scheme is None else None)
            or ("index_unavailable" if index is None else index.usable(engine.id))
        )  # fmt: skip
        if why is not None or scheme is None or index is None:
            out.append({**row, "blocks": None, "cached_blocks": None, "unknown": why})
            continue
        hashes = prediction.hashes(scheme, ns.cache_salt)
        masks = index.held(engine.id, hashes, now=0.0)  # no speculative entry lives in this process
        per_medium = {}
        for medium, bit in MEDIUM_BITS.items():
            run = 0
            for mask in masks:
                if not mask & bit:
                    break
                run += 1
            per_medium[medium] = run
        out.append({**row, "blocks": len(hashes), "cached_blocks": {**per_medium, "any": len(masks)}, "unknown": None})
    return out


def _layers(
    snap: RoutingSnapshot, tenant: TenantTarget, ns: NamespaceTarget, endpoint: str, body: Mapping[str, Any]
) -> dict[str, Any]:
    """Whether the response and semantic layers hold an answer to ``body`` in ``ns``: ``{"holds": bool}``,
    or ``{"bypass": reason}`` when the layer would not be looked up (or its store cannot answer)."""

    route = RouteTarget(ns.version_id, ns.version_label, 100, ns.pk, None)
    ctx = RequestContext(snap, tenant, endpoint, body, canonical_request(endpoint, body), None, (), Routed(tenant, route, ns))  # type: ignore[arg-type]
    out: dict[str, Any] = {}
    for layer in _lookup_layers(bool(settings.GATEWAY_SEMANTIC)):
        why = layer.bypass(ctx)
        if why is not None:
            out[f"{layer.name}_cache"] = {"bypass": why}
            continue
        try:
            found = asyncio.run(layer.lookup(ctx))
        except StoreUnavailable:
            out[f"{layer.name}_cache"] = {"bypass": "store_unavailable"}
            continue
        out[f"{layer.name}_cache"] = {"holds": found.record is not None}
    return out


@lru_cache(maxsize=2)
def _lookup_layers(semantic_on: bool) -> list[Any]:
    """The response and semantic layers as the deployment's gateway builds them, once per process
    (the embedding model loads once)."""

    semantic = None
    if semantic_on:
        embedder = default_embedder(onnx_dir=settings.GATEWAY_EMBEDDER_DIR)
        semantic = SemanticLayer(semantic_store(), embedder, rules=semantic_rules())
    # The layers read the snapshot from each request's context: the runtime's is never asked for.
    runtime = Runtime(snapshot=routing_snapshot_build, response_store=response_store(), semantic=semantic, recorder=Recorder())
    return build_layers(runtime)


def cache_lookup(
    *, tenant: Tenant, endpoint: str = "chat", body: Mapping[str, Any] | None = None, tokens: Any = None
) -> dict[str, Any]:
    """Where ``body`` (or ``tokens``) is cached now, in every live namespace of ``tenant``.

    Returns:
        ``{"namespaces": [{"namespace", "namespace_key", "model_version", "prompt_tokens", "engines":
        [{"engine", "engine_id", "block_size", "blocks", "cached_blocks": {"GPU", "CPU", "STORAGE", "any"}
        (leading blocks held, per medium and in any; None when ``unknown`` says why)}], "response_cache",
        "semantic_cache" (``{"holds": bool}`` or ``{"bypass": reason}``; absent for a token list)}]}``.

    Raises:
        InvalidField: neither or both of body and tokens, an unknown endpoint, a malformed body or
            token list (400, exit 2).
    """

    if (body is None) == (tokens is None):
        raise InvalidField("request", "give a request body or a token list, not both")
    if endpoint not in ("chat", "completions"):
        raise InvalidField("endpoint", "must be chat or completions")
    token_ids = _check_tokens(tokens) if tokens is not None else None
    if body is not None:
        try:
            check_body(body)
            canonical_request(endpoint, body)  # type: ignore[arg-type]
        except InvalidRequest as exc:
            raise InvalidField(exc.param or "request", exc.message) from exc
    snap = routing_snapshot_build()
    target = snap.tenants[tenant.pk]
    index: BlockIndex | None = BlockIndex(block_index_store(), stale_s=settings.GATEWAY_PREFIX_INDEX_STALE_S)
    try:
        index.refresh()  # type: ignore[union-attr]
    except IndexUnavailable as exc:
        log.warning("cache lookup: %s", exc)
        index = None
    namespaces = CacheNamespace.objects.filter(tenant=tenant).exclude(residency=Residency.DROPPED).order_by("pk")
    out = []
    for pk in namespaces.values_list("pk", flat=True):
        ns = snap.namespaces.get(pk)
        if ns is None:
            continue
        if token_ids is not None:
            prediction = Prediction(tuple(token_ids))
        else:
            payload = {**body, "cache_salt": ns.cache_salt}  # type: ignore[dict-item]
            tokenizer = _tokenizers().get(ns.tokenizer_path, wait=True) if ns.tokenizer_path else None
            prediction = predict(tokenizer, endpoint, payload) if ns.tokenizer_path else Prediction(reason="no_tokenizer")
        row: dict[str, Any] = {
            "namespace": ns.pk, "namespace_key": ns.namespace_key, "model_version": ns.version_label,
            "prompt_tokens": len(prediction.token_ids) if prediction.reason is None else None,
            "engines": _engines(ns, prediction, index),
        }  # fmt: skip
        if body is not None:
            row.update(_layers(snap, target, ns, endpoint, body))
        out.append(row)
    return {"namespaces": out}
