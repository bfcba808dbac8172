"""The gateway's routing snapshot and its decisions, without a database.

A :class:`RoutingSnapshot` is an immutable picture of everything a request
needs (keys, tenants and their policies, routes per served name, namespaces
with their salts and the engines serving them, the cache layers' switches),
built by the control plane and swapped in whole when its routing epoch moves.
The functions here decide from a snapshot alone: which route a conversation
takes during a gray release, and which engine among those serving a
namespace gets a request.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from gateway.errors import GatewayError

#: Characters of the leading prompt text that decide engine affinity. vLLM
#: caches whole blocks (16 tokens by default on GPUs, 32 or more on CPUs), and
#: a token is about 4 characters of English text, so 512 characters cover the
#: first 4-8 blocks: requests that share them reuse the same engine's cache.
AFFINITY_CHARS = 512


def model_fingerprint(identity: str) -> str:
    """The ``system_fingerprint`` of a model state: ``fp_`` and the first 16 hex
    digits of its model version's identity (BLAKE3, 64 hex digits).

    OpenAI answers carry ``system_fingerprint`` for "the backend configuration
    that the model runs with" (its API reference); the gateway puts the state
    that computed an answer there, so a caller can tell which model state it got.
    """
    return "fp_" + identity[:16]


#: Share of the requests a layer bypassed as not paying (the snapshot's ``not_paying``) still
#: looks up and stores, so its figures keep coming: 1 in 20, drawn at random per request
#: (``gateway.pipeline.RequestContext.measured``); ``explain`` shows what the others get.
NOT_PAYING_SAMPLE = 0.05

#: An affinity choice stands while its engine has at most this many requests
#: in flight above the least-loaded engine; past it the least-loaded wins.
AFFINITY_SLACK = 4


@dataclass(frozen=True)
class EngineTarget:
    """An engine that may serve a namespace's requests now (ready and verified).

    Attributes:
        id, name: the engine's row.
        base_url: its OpenAI-compatible server, e.g. ``http://127.0.0.1:8100``.
        served_model: the model name the engine answers to.
        reference: a reference engine (no prefix caching, no connector), used
            by shadow verification only, never for traffic.
        version_id: the model version it computes.
        fingerprint: that version's :func:`model_fingerprint` (what its answers carry).
        headers: sent with every request to it (``Host`` when ``base_url`` was
            pinned to the address the control plane checked).
        block_size, hash_algorithm: its prefix cache's block size and
            ``--prefix-caching-hash-algo`` as its verified metrics showed them
            (0 and "" when unknown: precise routing then leaves it to affinity).
    """

    id: int
    name: str
    base_url: str
    served_model: str
    reference: bool = False
    version_id: int = 0
    fingerprint: str = ""
    headers: tuple[tuple[str, str], ...] = ()
    block_size: int = 0
    hash_algorithm: str = ""


@dataclass(frozen=True)
class NamespaceTarget:
    """A cache namespace as the gateway needs it.

    Attributes:
        pk, namespace_key: the namespace's primary key and its stable key (64 hex).
        storage_prefix: its name in every tier (response and semantic caches too).
        cache_salt: the vLLM ``cache_salt`` the gateway adds to each request.
        version_id, version_label: the model version it belongs to.
        fingerprint: that version's :func:`model_fingerprint`: what every answer
            served under the namespace must have been computed by.
        engines: engines in service that serve it, by id.
        ttl_s: the retention policy's age limit since last hit (seconds), or None.
        max_bytes: its byte budget, or None.
        suspended: why routing is suspended (a deceptive hit on live traffic), or None.
        tokenizer_path: the version's checkpoint folder, whose tokenizer and chat template
            precise routing tokenizes requests with ("" when this host cannot read it).
    """

    pk: int
    namespace_key: str
    storage_prefix: str
    cache_salt: str
    version_id: int
    version_label: str
    engines: tuple[EngineTarget, ...] = ()
    ttl_s: float | None = None
    max_bytes: int | None = None
    suspended: str | None = None
    fingerprint: str = ""
    tokenizer_path: str = ""


@dataclass(frozen=True)
class RouteTarget:
    """One version's share of a (tenant, served name): ``percent`` 0–100."""

    version_id: int
    version_label: str
    percent: int
    namespace_pk: int | None
    release_id: int | None
    #: The new version of a gray release while both versions carry traffic.
    canary: bool = False


@dataclass(frozen=True)
class TenantPolicy:
    """A tenant's use of the cache layers (see ``TenantGatewayPolicy``)."""

    response_cache: bool = True
    allow_seeded: bool = False
    allow_sampling: bool = False
    #: Answers cut at ``max_tokens`` (``finish_reason: length``) may be kept (:func:`gateway.answers.unkept_reason`).
    admit_length: bool = False
    semantic_cache: bool = True
    semantic_threshold: float | None = None
    shadow_sample_rate: float = 0.05
    #: The rate for a gray release's canary (:attr:`RouteTarget.canary`); the higher one applies.
    canary_shadow_sample_rate: float = 0.5
    #: ``skip`` or ``redact`` (see :mod:`gateway.pii.gate`).
    personal_data: str = "skip"


def shadow_rate(policy: TenantPolicy, route: RouteTarget) -> float:
    """The share (0..1) of a request's cached answers that shadow verification
    replays: the tenant's rate, or its canary rate where that is higher and the
    request was routed to a gray release's canary (few requests, judged soon)."""
    if route.canary:
        return max(policy.shadow_sample_rate, policy.canary_shadow_sample_rate)
    return policy.shadow_sample_rate


@dataclass(frozen=True)
class TenantTarget:
    """A tenant: ``secret`` keys its response-cache entries (HMAC) and its sticky buckets."""

    id: int
    slug: str
    secret: bytes
    policy: TenantPolicy = TenantPolicy()


@dataclass(frozen=True)
class KeyTarget:
    """A gateway key (by the SHA-256 of the key): its tenant and token bucket (None: defaults)."""

    id: int
    tenant_id: int
    name: str
    rate_per_s: float | None = None
    burst: int | None = None


@dataclass(frozen=True)
class RoutingSnapshot:
    """Everything the hot path reads, built at routing epoch ``epoch``.

    Attributes:
        epoch: the routing epoch it was built at.
        keys: SHA-256 hex of a gateway key → its target.
        tenants: tenant id → target.
        routes: (tenant id, served name) → its routes (percents sum to 100).
        namespaces: namespace pk → target.
        references: model version id → reference engines of that version.
        layers: cache layer → enabled (kill switches).
        templates: prompt templates' fingerprints (``gateway.templates.TemplateIndex``): tenant id →
            its own and the global ones, None → the global ones (tenants without templates of their own).
        not_paying: (namespace pk, layer) pairs whose layer does not pay (its benefit ratio stayed under
            the tenant's floor): bypassed with reason ``not_paying`` but for a measuring sample
            (:data:`NOT_PAYING_SAMPLE`).
    """

    epoch: int
    keys: Mapping[str, KeyTarget] = field(default_factory=dict)
    tenants: Mapping[int, TenantTarget] = field(default_factory=dict)
    routes: Mapping[tuple[int, str], tuple[RouteTarget, ...]] = field(default_factory=dict)
    namespaces: Mapping[int, NamespaceTarget] = field(default_factory=dict)
    references: Mapping[int, tuple[EngineTarget, ...]] = field(default_factory=dict)
    layers: Mapping[str, bool] = field(default_factory=dict)
    templates: Mapping[int | None, Any] = field(default_factory=dict)
    not_paying: frozenset[tuple[int, str]] = frozenset()

    def served_names(self, tenant_id: int) -> list[str]:
        """The served model names a tenant has routes for, sorted."""
        return sorted(name for tid, name in self.routes if tid == tenant_id)


def key_hash(key: str) -> str:
    """SHA-256 hex of a gateway key: what is stored and looked up, never the key."""
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


def sticky_id(body: Mapping[str, Any]) -> str:
    """What keeps a conversation on one side of a gray release: the caller's
    ``user`` when given, else the conversation's opening (its system and first
    user message, or a completion prompt's first 512 characters), which every
    later turn of the same conversation repeats."""
    user = body.get("user")
    if isinstance(user, str) and user:
        return "user:" + user
    messages = body.get("messages")
    if isinstance(messages, list):
        opening = []
        for message in messages:
            if not isinstance(message, Mapping):
                continue
            opening.append([message.get("role"), message.get("content")])
            if message.get("role") == "user":
                break
        return "conversation:" + repr(opening)
    return "prompt:" + repr(body.get("prompt"))[:AFFINITY_CHARS]


def sticky_bucket(secret: bytes, sticky: str) -> int:
    """The conversation's bucket, 0..99, under the tenant's secret (callers
    cannot pick their side by choosing a user id)."""
    digest = hmac.new(secret, sticky.encode("utf-8", "surrogatepass"), hashlib.sha256).digest()
    return int.from_bytes(digest[:8], "big") % 100


def choose_route(routes: Sequence[RouteTarget], bucket: int) -> RouteTarget:
    """The route a bucket falls in: routes cover 0..99 in order, each its
    ``percent`` wide, the *last* (the newest version) first, so that raising its
    share only moves conversations onto it, never back.

    Raises:
        ValueError: no route carries traffic (every percent is 0).
    """
    live = [r for r in routes if r.percent > 0]
    if not live:
        raise ValueError("no route carries traffic")
    start = 0
    for route in reversed(live):
        if bucket < start + route.percent:
            return route
        start += route.percent
    return live[0]


def prompt_affinity_text(body: Mapping[str, Any]) -> str:
    """The leading :data:`AFFINITY_CHARS` characters of a request's prompt as
    the engine will see it first: each message's role and text in order (a
    completion's prompt as is)."""
    messages = body.get("messages")
    if isinstance(messages, list):
        parts: list[str] = []
        size = 0
        for message in messages:
            if not isinstance(message, Mapping):
                continue
            content = message.get("content")
            if isinstance(content, list):
                content = "".join(p.get("text", "") for p in content if isinstance(p, Mapping) and isinstance(p.get("text"), str))
            text = f"{message.get('role')}\n{content if isinstance(content, str) else ''}\n"
            parts.append(text)
            size += len(text)
            if size >= AFFINITY_CHARS:
                break
        return "".join(parts)[:AFFINITY_CHARS]
    prompt = body.get("prompt")
    if isinstance(prompt, list):
        prompt = prompt[0] if prompt else ""
    return (prompt if isinstance(prompt, str) else repr(prompt))[:AFFINITY_CHARS]


def rendezvous_score(affinity: str, engine: EngineTarget) -> int:
    """The engine's rendezvous-hash weight for a prompt's leading text (higher wins)."""
    return int.from_bytes(
        hashlib.blake2b(f"{engine.id}\0{affinity}".encode("utf-8", "surrogatepass"), digest_size=8).digest(), "big"
    )


def choose_engine(
    engines: Sequence[EngineTarget], affinity: str, in_flight: Mapping[int, int], *, slack: int = AFFINITY_SLACK
) -> EngineTarget:
    """Prefix affinity with a load-aware fallback.

    Rendezvous hashing of the prompt's leading text over the engines: requests
    that share their leading blocks go to the same engine (whose prefix cache
    holds them), and removing an engine moves only its own share. When the
    chosen engine has more than ``slack`` requests in flight above the
    least-loaded one, the least-loaded takes the request instead.

    Args:
        engines: candidates (non-empty).
        affinity: :func:`prompt_affinity_text` of the request.
        in_flight: engine id → requests this process has in flight there.

    Raises:
        ValueError: no engine.
    """
    if not engines:
        raise ValueError("no engine")
    ranked = sorted(engines, key=lambda e: rendezvous_score(affinity, e), reverse=True)
    least = min(in_flight.get(e.id, 0) for e in engines)
    chosen = ranked[0]
    if in_flight.get(chosen.id, 0) > least + slack:
        chosen = min(ranked, key=lambda e: in_flight.get(e.id, 0))
    return chosen


class RoundRobin:
    """The baseline engine choice (each request to the next engine), kept to
    measure prefix affinity against it."""

    def __init__(self) -> None:
        self._next = 0

    def choose(self, engines: Sequence[EngineTarget]) -> EngineTarget:
        """The next engine in turn.

        Raises:
            ValueError: no engine.
        """
        if not engines:
            raise ValueError("no engine")
        engine = engines[self._next % len(engines)]
        self._next += 1
        return engine


@dataclass
class Routed:
    """Where a request goes: its tenant, route and namespace (engines may be empty)."""

    tenant: TenantTarget
    route: RouteTarget
    namespace: NamespaceTarget


def route_request(snap: RoutingSnapshot, tenant: TenantTarget, body: Mapping[str, Any]) -> Routed:
    """Served name → the tenant's routes → the conversation's route → its namespace.

    Raises:
        GatewayError: unknown model (404 ``model_not_found``), no namespace for
            the route (503 ``no_namespace``), namespace suspended (503
            ``namespace_suspended``).
    """
    model = body.get("model")
    routes = snap.routes.get((tenant.id, model)) if isinstance(model, str) else None
    if not routes:
        raise GatewayError(404, f"The model `{model}` does not exist or tenant {tenant.slug} has no routing for it.",
                           type_="invalid_request_error", code="model_not_found", param="model")  # fmt: skip
    try:
        route = choose_route(routes, sticky_bucket(tenant.secret, sticky_id(body)))
    except ValueError:
        raise GatewayError(503, f"no version of {model} carries traffic for tenant {tenant.slug}", type_="server_error",
                           code="no_route") from None  # fmt: skip
    namespace = snap.namespaces.get(route.namespace_pk) if route.namespace_pk is not None else None
    if namespace is None:
        raise GatewayError(503, f"{model} ({route.version_label}) has no live cache namespace for tenant {tenant.slug}",
                           type_="server_error", code="no_namespace")  # fmt: skip
    if namespace.suspended:
        raise GatewayError(503, f"routing of {model} ({route.version_label}) is suspended for tenant {tenant.slug}: "
                           f"{namespace.suspended}", type_="server_error", code="namespace_suspended")  # fmt: skip
    return Routed(tenant, route, namespace)
