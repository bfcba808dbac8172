"""The control plane's side of the gateway: keys, the routing epoch and the
snapshot gateways route from, cache layer switches and policies, routing
holds, and the figures gateways flush.

Gateways never query the database on a request's path: each process holds a
:class:`gateway.routing.RoutingSnapshot` built whole at start
(:func:`routing_snapshot_parts`) and, when :func:`routing_epoch` moves, updated
from the entries the epoch's changes name (:func:`routing_snapshot_update`).
Every change that can alter a routing decision bumps the epoch when its
transaction commits and records what it changed (:func:`routing_changed`):
the models' save and delete signals cover the changes made through the ORM's
instances, their querysets' bulk writes name the rows they touch, and the
services that change other rows call it themselves.
"""

from __future__ import annotations

import gc
import hashlib
import hmac
import ipaddress
import json
import logging
import math
import secrets
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from typing import Any
from urllib.parse import urlsplit

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured, ValidationError
from django.db import IntegrityError, connection, transaction
from django.db.models import BooleanField, ExpressionWrapper, F, Model, Q, Sum
from django.db.models.signals import m2m_changed, post_delete, post_save
from django.utils import timezone

from cacheadmin.models import (
    CacheLayerSwitch,
    CacheNamespace,
    Engine,
    GatewayKey,
    GatewayStat,
    LayerNotPaying,
    ModelVersion,
    NamespaceRouting,
    Release,
    Residency,
    RetentionPolicy,
    RoutingChange,
    RoutingEpoch,
    SharedGroup,
    SharedGroupMembership,
    Tenant,
    TenantGatewayPolicy,
    Tier,
)
from cacheadmin.models.gateway import routing_changed, routing_relevant, routing_scope
from cacheadmin.models.naming import validate_display_name
from cacheadmin.services.addresses import engine_headers_of, engine_target
from cacheadmin.services.audit import audit_record, reason_check
from cacheadmin.services.heat import prefix_heat_record
from cacheadmin.services.namespaces import namespace_salts
from cacheadmin.services.prompt_templates import template_indexes, template_stats_flush
from cacheadmin.services.quotas import QuotaExceeded, quota_check
from cacheadmin.services.retirement import answer_retirements_rerun
from cacheadmin.services.serving import serving_route_rows
from cacheadmin.services.tiers import tiers_configured
from gateway.layers import LAYERS as CACHE_LAYERS
from gateway.layers.semantic.admission import DEFAULT_RULES, Rule, rules_from_config
from gateway.layers.semantic.embedder import MODEL_LANGUAGES
from gateway.param_specs import InvalidRequest
from gateway.pii.gate import PERSONAL_DATA_POLICIES
from gateway.records import TTFT_BUCKET_PREFIX, benefit_ratio, layer_figures
from gateway.routing import (
    NOT_PAYING_SAMPLE,
    EngineTarget,
    KeyTarget,
    NamespaceTarget,
    RouteTarget,
    RoutingSnapshot,
    TenantPolicy,
    TenantTarget,
    key_hash,
    model_fingerprint,
)
from inference.errors import InvalidField, Refused
from inference.netpolicy import AddressRefused
from inference.tiers.base import TierUnavailable

log = logging.getLogger(__name__)

#: Head of every gateway key: ``kvgw_<prefix>_<secret>``.
KEY_HEAD = "kvgw"
#: A key's token bucket: requests per second, and burst (one request per 1,000 s at the slowest).
MIN_RATE, MAX_RATE, MAX_BURST = 0.001, 1_000_000.0, 1_000_000
#: Layers a kill switch governs (the engine's own prefix cache has none here).
SWITCHED_LAYERS = CACHE_LAYERS  # plain strings: schema keys, YAML


class GatewayRefused(Refused):
    """A gateway decision refused (409, exit 4)."""

    code = "gateway_refused"


# --- routing epoch ----------------------------------------------------------


def routing_epoch() -> int:
    """The current routing epoch (0 before any change)."""
    # Plain SQL: every gateway process reads this every poll, and the ORM's query building was most of its cost.
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT value FROM {RoutingEpoch._meta.db_table} WHERE id = 1")  # noqa: S608 - a model's own table name
        row = cursor.fetchone()
    return int(row[0]) if row else 0


#: Models whose rows feed the snapshot: any saved or deleted instance moves the epoch.
_ROUTING_MODELS = (
    CacheLayerSwitch,
    CacheNamespace,
    Engine,
    GatewayKey,
    LayerNotPaying,
    ModelVersion,
    NamespaceRouting,
    Release,
    RetentionPolicy,
    SharedGroup,
    SharedGroupMembership,
    Tenant,
    TenantGatewayPolicy,
)


def _on_routing_row(
    sender: type[Model], instance: Model | None = None, update_fields: Iterable[str] | None = None, **_kwargs: object
) -> None:
    if routing_relevant(sender, update_fields):
        # The instance names the entries (for the engines' attachments, the through model: the engines section).
        routing_changed(routing_scope(sender, [instance] if instance is not None else None), model=sender._meta.label_lower)


def routing_signals_connect() -> None:
    """Connect the save/delete signals of :data:`_ROUTING_MODELS` (and the engines'
    attached namespaces) to :func:`routing_changed`; called once at app load."""
    for model in _ROUTING_MODELS:
        post_save.connect(_on_routing_row, sender=model, dispatch_uid=f"routing-save-{model.__name__}")
        post_delete.connect(_on_routing_row, sender=model, dispatch_uid=f"routing-delete-{model.__name__}")
    m2m_changed.connect(_on_routing_row, sender=Engine.attached_namespaces.through, dispatch_uid="routing-engine-attach")


# --- keys --------------------------------------------------------------------


def gateway_key_issue(
    *, tenant: Tenant, name: str, actor: str, rate_per_s: float | None = None, burst: int | None = None
) -> tuple[GatewayKey, str]:
    """Issue a gateway key for ``tenant``; the key is returned once, only its hash is kept.

    Args:
        rate_per_s, burst: the key's token bucket (requests per second, and
            how many may come at once); None: the gateway's defaults.

    Returns:
        (row, ``"kvgw_<prefix>_<secret>"``).

    Raises:
        InvalidField: a blank, too long or invisible-character name; a rate
            that is not a positive finite number; a burst below 1 (400, exit 2).
    """
    name_max = GatewayKey._meta.get_field("name").max_length
    if not name.strip() or len(name) > name_max:
        raise InvalidField("name", f"1..{name_max} characters")
    try:
        validate_display_name(name)
    except ValidationError as exc:
        raise InvalidField("name", exc.messages[0]) from exc
    if rate_per_s is not None and (
        isinstance(rate_per_s, bool) or not isinstance(rate_per_s, int | float) or not MIN_RATE <= rate_per_s <= MAX_RATE
    ):
        raise InvalidField("rate_per_s", f"must be a number of requests per second within {MIN_RATE}..{MAX_RATE:g}")
    if burst is not None and (isinstance(burst, bool) or not isinstance(burst, int) or not 1 <= burst <= MAX_BURST):
        raise InvalidField("burst", f"must be an integer within 1..{MAX_BURST}")
    prefix = secrets.token_hex(6)
    plain = f"{KEY_HEAD}_{prefix}_{secrets.token_urlsafe(32)}"
    with transaction.atomic():
        quota_check(tenant=tenant, kind="gateway_keys")
        key = GatewayKey.objects.create(
            tenant=tenant, name=name, prefix=prefix, key_hash=key_hash(plain), rate_per_s=rate_per_s, burst=burst,
            created_by=actor,
        )  # fmt: skip
        audit_record(
            actor=actor, action="gateway_key.issue", obj=key,
            after={"name": name, "tenant": tenant.slug, "rate_per_s": rate_per_s, "burst": burst},
        )  # fmt: skip
    return key, plain


def gateway_key_revoke(*, key: GatewayKey, actor: str) -> GatewayKey:
    """Revoke a key: gateways refuse it within a second (idempotent).

    Raises:
        GatewayRefused: never; a revoked key is answered as it is.
    """
    if key.revoked_at is None:
        with transaction.atomic():
            key.revoked_at = timezone.now()
            key.save(update_fields=["revoked_at"])
            audit_record(actor=actor, action="gateway_key.revoke", obj=key, after={"tenant": key.tenant.slug})
    return key


# --- switches, policies, routing holds ---------------------------------------


def layer_switch_set(*, layer: str, enabled: bool, actor: str, reason: str) -> CacheLayerSwitch:
    """Turn a gateway cache layer on or off for all traffic (the kill switch).

    Raises:
        InvalidField: an unknown layer, or no reason for turning one off (400, exit 2).
    """
    if layer not in SWITCHED_LAYERS:
        raise InvalidField("layer", f"must be one of {', '.join(SWITCHED_LAYERS)}")
    reason_check(reason, required_for=None if enabled else "turning a cache layer off")
    with transaction.atomic():
        switch, _ = CacheLayerSwitch.objects.select_for_update().get_or_create(layer=layer)
        before = switch.enabled
        switch.enabled, switch.reason, switch.changed_by = enabled, reason, actor
        switch.save()
        audit_record(
            actor=actor, action="gateway.layer_switch", obj=switch, before={"enabled": before},
            after={"enabled": enabled, "reason": reason},
        )  # fmt: skip
    return switch


def layer_states() -> dict[str, dict[str, Any]]:
    """Each switched layer → ``{"enabled", "reason", "changed_by", "changed_at"}`` (on until switched)."""
    rows = {s.layer: s for s in CacheLayerSwitch.objects.all()}
    out: dict[str, dict[str, Any]] = {}
    for layer in SWITCHED_LAYERS:
        row = rows.get(layer)
        out[layer] = {
            "enabled": row.enabled if row else True,
            "reason": row.reason if row else "",
            "changed_by": row.changed_by if row else "",
            "changed_at": row.changed_at if row else None,
        }
    return out


#: Fields of :class:`TenantGatewayPolicy` operators set, with their checks.
POLICY_FIELDS = ("response_cache", "allow_seeded", "allow_sampling", "admit_length", "semantic_cache", "semantic_threshold",
                 "shadow_sample_rate", "canary_shadow_sample_rate", "suspend_on_deceptive_hit", "personal_data", "benefit_floor",
                 "benefit_window_minutes", "benefit_min_requests")  # fmt: skip
#: Policy fields that are shares or similarities within 0..1 (``semantic_threshold`` may be None: the shipped one).
RATE_FIELDS = ("semantic_threshold", "shadow_sample_rate", "canary_shadow_sample_rate")
#: Bounds of the not-paying policy: the floor (a benefit ratio), the window (minutes), the minimum lookups.
MAX_BENEFIT_FLOOR, MAX_BENEFIT_WINDOW_MINUTES, MAX_BENEFIT_MIN_REQUESTS = 1000.0, 1440, 1_000_000


def tenant_gateway_policy(tenant: Tenant) -> TenantGatewayPolicy:
    """The tenant's policy row (an unsaved one with the defaults when it has none)."""
    try:
        return tenant.gateway_policy
    except TenantGatewayPolicy.DoesNotExist:
        return TenantGatewayPolicy(tenant=tenant)


def tenant_gateway_policy_update(*, tenant: Tenant, actor: str, changes: Mapping[str, Any]) -> TenantGatewayPolicy:
    """Change a tenant's gateway policy (only the fields given).

    Raises:
        InvalidField: an unknown field, a flag that is not a boolean, a
            threshold or sample rate outside 0..1, a benefit floor outside
            0..1000, a window outside 1..1440 minutes, a minimum of requests
            outside 1..1,000,000 (400, exit 2).
    """
    for name, value in changes.items():
        if name not in POLICY_FIELDS:
            raise InvalidField(name, f"unknown policy field; known: {', '.join(POLICY_FIELDS)}")
        if name == "benefit_floor":
            if isinstance(value, bool) or not isinstance(value, int | float) or not 0.0 <= float(value) <= MAX_BENEFIT_FLOOR:
                raise InvalidField(name, f"must be a number within 0..{MAX_BENEFIT_FLOOR:g}")
        elif name in ("benefit_window_minutes", "benefit_min_requests"):
            top = MAX_BENEFIT_WINDOW_MINUTES if name == "benefit_window_minutes" else MAX_BENEFIT_MIN_REQUESTS
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= top:
                raise InvalidField(name, f"must be an integer within 1..{top}")
        elif name in RATE_FIELDS:
            if value is None and name == "semantic_threshold":
                continue
            if isinstance(value, bool) or not isinstance(value, int | float) or not 0.0 <= float(value) <= 1.0:
                raise InvalidField(name, "must be a number within 0..1")
        elif name == "personal_data":
            if value not in PERSONAL_DATA_POLICIES:
                raise InvalidField(name, f"one of {', '.join(PERSONAL_DATA_POLICIES)}")
        elif not isinstance(value, bool):
            raise InvalidField(name, "must be true or false")
    # As stored: numbers as floats (-0.0 as 0.0, what the database keeps), so the answer and the audit say what is kept.
    after = {
        name: float(value) + 0.0 if name in (*RATE_FIELDS, "benefit_floor") and value is not None
        else value
        for name, value in changes.items()
    }  # fmt: skip
    with transaction.atomic():
        policy = tenant_gateway_policy(tenant)
        before = {name: getattr(policy, name) for name in after}
        changed = {name: value for name, value in after.items() if before[name] != value}
        if not changed:
            return policy  # nothing to change: no write, no audit event
        for name, value in changed.items():
            setattr(policy, name, value)
        policy.updated_by = actor
        policy.save()
        audit_record(actor=actor, action="gateway.policy_update", obj=tenant,
                     before={name: before[name] for name in changed}, after=changed)  # fmt: skip
    return policy


def namespace_routing_suspend(*, namespace: CacheNamespace, reason: str, actor: str) -> NamespaceRouting:
    """Stop routing a namespace's requests (gateways answer 503) until resumed; idempotent."""
    with transaction.atomic():
        hold, _ = NamespaceRouting.objects.select_for_update().get_or_create(namespace=namespace)
        if hold.suspended_at is None:
            hold.suspended_at, hold.suspended_reason = timezone.now(), reason
            hold.save()
            audit_record(actor=actor, action="namespace.routing_suspend", obj=namespace, after={"reason": reason})
    return hold


def namespace_routing_resume(*, namespace: CacheNamespace, actor: str, reason: str) -> NamespaceRouting:
    """Route a suspended namespace again: the operator's decision after a deceptive hit. The
    retirements of cached answers recorded since the last resume are run again first
    (:func:`cacheadmin.services.retirement.answer_retirements_rerun`); routing resumes only
    once every one completed.

    Raises:
        InvalidField: no reason (400, exit 2).
        GatewayRefused: the namespace is not suspended, or a retirement could not complete
            (a cache store down; the hold stays) (409, exit 4).
    """
    reason_check(reason, required_for="resuming a suspended namespace")
    hold = NamespaceRouting.objects.filter(namespace=namespace).first()
    if hold is None or hold.suspended_at is None:
        raise GatewayRefused(f"namespace {namespace.namespace_key[:12]}… is not suspended")
    # The suspect engine's cached answers go before traffic comes back (again: a gateway that had
    # not yet seen the suspension may have stored one since the first run).
    left = answer_retirements_rerun(namespace=namespace, since=hold.resumed_at, actor=actor)
    if left:
        # The layers only: a store's own error (its file path, its address) is for the operators' log and
        # the retirement's row, not for whoever asked (a tenant-bound token may resume its namespace).
        layers = sorted({part.split(":", 1)[0] for r in left for part in r.error.split("; ") if part})
        raise GatewayRefused(
            f"namespace {namespace.namespace_key[:12]}… stays suspended: the cached answers of engine(s) "
            f"{', '.join(sorted({str(r.engine_ref) for r in left}))} are not all retired (the {' and '.join(layers)} "
            f"cache store{'s' if len(layers) > 1 else ''} did not answer); resume again once the gateway's cache stores answer"
        )
    with transaction.atomic():
        hold = NamespaceRouting.objects.select_for_update().filter(namespace=namespace).first()
        if hold is None or hold.suspended_at is None:
            raise GatewayRefused(f"namespace {namespace.namespace_key[:12]}… is not suspended")
        before = hold.suspended_reason
        hold.suspended_at, hold.suspended_reason = None, ""
        hold.resumed_by, hold.resumed_at = actor, timezone.now()
        hold.save()
        audit_record(
            actor=actor, action="namespace.routing_resume", obj=namespace, before={"suspended_reason": before},
            after={"reason": reason},
        )  # fmt: skip
    return hold


# --- the snapshot ------------------------------------------------------------


def tenant_secret(tenant_key: str) -> bytes:
    """The secret that keys a tenant's response-cache entries and sticky buckets:
    HMAC-SHA256 of the tenant's boundary key under ``CACHE_SALT_SECRET``, so no
    tenant can compute another's keys or probe its entries."""
    return hmac.new(
        settings.CACHE_SALT_SECRET.encode("utf-8"), b"gateway-tenant\0" + tenant_key.encode("ascii"), hashlib.sha256
    ).digest()


#: :class:`TenantGatewayPolicy` fields a snapshot carries (:class:`gateway.routing.TenantPolicy`'s, in its order).
_POLICY_READ = ("response_cache", "allow_seeded", "allow_sampling", "admit_length", "semantic_cache", "semantic_threshold",
                "shadow_sample_rate", "canary_shadow_sample_rate", "personal_data")  # fmt: skip
#: Sections of a snapshot an update touches whole (see :data:`cacheadmin.models.gateway.SECTIONS`).
_WHOLE_SECTIONS = ("engines", "layers", "not_paying", "templates")
#: Tenants plus namespaces one update re-reads at most; more, and the snapshot is built whole (one pass).
MAX_INCREMENTAL_ENTRIES = 1000

#: One engine address as resolved at a build: (pinned url, headers), or None when the policy refused it.
Pinned = tuple[str, tuple[tuple[str, str], ...]] | None
#: (tenant id, served name).
Pair = tuple[int, str]


@dataclass(frozen=True)
class SnapshotParts:
    """A routing snapshot's sections with what an incremental update needs besides them: which keys
    and served names each tenant has, the engines per namespace before the identity filter, each
    engine's identity and its resolved address. Never changed once built: an update makes new maps
    for the sections it touches (a snapshot being read by a request is never changed under it).

    Attributes:
        epoch: the routing epoch the parts are up to date with.
        keys_of: tenant id → hashes of its live keys.
        names_of: tenant id → served names it has routes for.
        engines_of: namespace pk → engines in service attached to it (engine-id order).
        identity_of: engine id → its model version's identity.
        addresses: engine id → its ``(base_url, pinned)`` as last resolved (every ready, verified engine).
        The rest: as :class:`gateway.routing.RoutingSnapshot`'s.
    """

    epoch: int
    tenants: dict[int, TenantTarget]
    keys: dict[str, KeyTarget]
    keys_of: dict[int, frozenset[str]]
    routes: dict[Pair, tuple[RouteTarget, ...]]
    names_of: dict[int, frozenset[str]]
    namespaces: dict[int, NamespaceTarget]
    engines_of: dict[int, tuple[EngineTarget, ...]]
    identity_of: dict[int, str]
    references: dict[int, tuple[EngineTarget, ...]]
    addresses: dict[int, tuple[str, Pinned]]
    layers: dict[str, bool]
    templates: dict[int | None, Any]
    not_paying: frozenset[tuple[int, str]]

    def snapshot(self) -> RoutingSnapshot:
        """The snapshot gateways route by (sharing these parts' maps: neither changes them)."""
        return RoutingSnapshot(
            epoch=self.epoch, keys=self.keys, tenants=self.tenants, routes=self.routes, namespaces=self.namespaces,
            references=self.references, layers=self.layers, templates=self.templates, not_paying=self.not_paying,
        )  # fmt: skip


def _read_tenants(ids: Iterable[int] | None) -> dict[int, TenantTarget]:
    # No ORDER BY (the model's is by slug): a map is made of them.
    rows = (Tenant.objects.all() if ids is None else Tenant.objects.filter(pk__in=list(ids))).order_by()
    out: dict[int, TenantTarget] = {}
    for pk, slug, key, policy_pk, *policy in rows.values_list(
        "pk", "slug", "key", "gateway_policy__pk", *(f"gateway_policy__{name}" for name in _POLICY_READ)
    ):
        out[pk] = TenantTarget(pk, slug, tenant_secret(key), TenantPolicy(*policy) if policy_pk is not None else TenantPolicy())
    return out


def _read_keys(tenant_ids: Iterable[int] | None) -> dict[str, KeyTarget]:
    rows = GatewayKey.objects.filter(revoked_at__isnull=True)
    if tenant_ids is not None:
        rows = rows.filter(tenant_id__in=list(tenant_ids))
    return {
        hash_: KeyTarget(pk, tenant_id, name, rate, burst)
        for hash_, pk, tenant_id, name, rate, burst in rows.order_by().values_list(
            "key_hash", "pk", "tenant_id", "name", "rate_per_s", "burst"
        )
    }


def _read_routes(tenant_ids: Iterable[int] | None) -> dict[Pair, tuple[RouteTarget, ...]]:
    """The routes of ``tenant_ids`` (None: every tenant): their current releases', then the pairs
    without a release served as operators set them up: the tenant's live namespace of an active
    version of that served name (the newest version when several are active)."""
    ids = None if tenant_ids is None else list(tenant_ids)
    labels = dict(ModelVersion.objects.values_list("pk", "label"))
    routes: dict[Pair, tuple[RouteTarget, ...]] = {}
    for route in serving_route_rows(tenant_ids=ids):
        pair = (route.tenant_id, route.served_name)
        target = RouteTarget(route.model_version_id, labels.get(route.model_version_id, ""), route.percent, route.namespace_pk,
                             route.release_id, canary=route.canary)  # fmt: skip
        routes[pair] = (*routes.get(pair, ()), target)
    released = set(routes)
    namespaces = CacheNamespace.objects.filter(tenant__isnull=False, model_version__status=ModelVersion.Status.ACTIVE).exclude(
        residency=Residency.DROPPED
    )
    if ids is not None:
        namespaces = namespaces.filter(tenant_id__in=ids)
    for pk, tenant_id, version_id, served_name, label in namespaces.order_by("model_version_id", "id").values_list(
        "pk", "tenant_id", "model_version_id", "model_version__served_name", "model_version__label"
    ):
        if (tenant_id, served_name) not in released:
            routes[(tenant_id, served_name)] = (RouteTarget(version_id, label, 100, pk, None),)
    return routes


def _hash_scheme(facts: Any) -> tuple[int, str]:
    """``(block_size, prefix_caching_hash_algo)`` of an engine as its verified ``/metrics`` showed them
    (``cache_config_info`` in its ``verified_facts``, :func:`inference.engines.verify.drift_baseline`), or
    ``(0, "")`` when unread: precise routing then leaves the engine to affinity."""
    cache = (facts or {}).get("cache_config") or {}
    block, algo = cache.get("block_size"), cache.get("prefix_caching_hash_algo")
    try:
        return int(block), str(algo or "")
    except (TypeError, ValueError):
        return 0, ""


def _pin(name: str, base_url: str, *, quiet: bool = False) -> Pinned:
    """The engine's address checked and pinned (gateways contact no address the policy refuses), or None."""
    try:
        url, headers = engine_target("base_url", base_url)
    except AddressRefused as exc:
        if not quiet:
            log.warning("engine %s is not routed: %s", name, exc.problem)
        return None
    return url, tuple(headers.items())


_Engines = tuple[
    dict[int, tuple[EngineTarget, ...]], dict[int, str], dict[int, tuple[EngineTarget, ...]], dict[int, tuple[str, Pinned]]
]


def _read_engines(pinned: Mapping[int, tuple[str, Pinned]] | None = None) -> _Engines:
    """The engines in service (ready and verified): per namespace (engine-id order), their
    identities, the reference engines per version, and their resolved addresses. An address
    already in ``pinned`` for the same ``base_url`` is not resolved again."""
    rows = list(
        Engine.objects.filter(status=Engine.Status.READY, verification=Engine.Verification.VERIFIED)
        .order_by("id")
        .values_list(
            "pk", "name", "base_url", "model_version__served_name", "role", "model_version_id", "model_version__identity",
            "origin", "generation", "namespace_id", "verified_facts",
        )
    )  # fmt: skip
    attached: dict[int, list[int]] = {}
    through = Engine.attached_namespaces.through
    for engine_id, namespace_id in through.objects.filter(engine_id__in=[row[0] for row in rows]).values_list(
        "engine_id", "cachenamespace_id"
    ):
        attached.setdefault(engine_id, []).append(namespace_id)
    engines_of: dict[int, list[EngineTarget]] = {}
    references: dict[int, list[EngineTarget]] = {}
    identity_of: dict[int, str] = {}
    addresses: dict[int, tuple[str, Pinned]] = {}
    for pk, name, base_url, served, role, version_id, identity, origin, generation, namespace_id, facts in rows:
        held = (pinned or {}).get(pk)
        address = held[1] if held is not None and held[0] == base_url else _pin(name, base_url)
        addresses[pk] = (base_url, address)
        if address is None:
            continue
        url, headers = address
        identity_of[pk] = identity
        target = EngineTarget(
            pk, name, url, served, role == Engine.Role.REFERENCE, version_id, model_fingerprint(identity),
            tuple({**dict(headers), **engine_headers_of(pk, origin, generation)}.items()), *_hash_scheme(facts),
        )  # fmt: skip
        if target.reference:
            references.setdefault(version_id, []).append(target)
            continue
        for ns in {namespace_id, *attached.get(pk, ())} - {None}:
            engines_of.setdefault(ns, []).append(target)
    return (
        {ns: tuple(v) for ns, v in engines_of.items()},
        identity_of,
        {k: tuple(v) for k, v in references.items()},
        addresses,
    )


def _read_namespaces(
    pks: Iterable[int] | None, engines_of: Mapping[int, tuple[EngineTarget, ...]], identity_of: Mapping[int, str]
) -> dict[int, NamespaceTarget]:
    """The namespaces ``pks`` (None: all) that route: not dropped, not superseded."""
    rows = CacheNamespace.objects.exclude(residency=Residency.DROPPED)
    if pks is not None:
        rows = rows.filter(pk__in=list(pks))
    held = ExpressionWrapper(Q(routing__suspended_at__isnull=False), output_field=BooleanField())
    rows = rows.annotate(held=held).order_by()  # no ORDER BY: a map is made of them
    fetched = list(
        rows.values_list(
            "pk", "namespace_key", "storage_prefix", "model_version_id", "model_version__label", "model_version__identity",
            "model_version__path", "policy__max_age_since_last_hit_s", "policy__max_bytes", "held",
            "routing__suspended_reason", "group_id", "group_generation", "group__generation",
        )
    )  # fmt: skip
    salts = namespace_salts((row[0], row[1]) for row in fetched)
    out: dict[int, NamespaceTarget] = {}
    for (pk, key, prefix, version_id, label, identity, path, max_age, max_bytes, held, reason, group_id, generation,
         group_generation) in fetched:  # fmt: skip
        if group_id is not None and generation != group_generation:
            continue  # a member left its group since: its salt is not served again
        out[pk] = NamespaceTarget(
            pk=pk,
            namespace_key=key,
            storage_prefix=prefix,
            cache_salt=salts[pk],
            version_id=version_id,
            version_label=label,
            # Only engines computing the namespace's state (their version's identity is
            # the namespace version's: the same version, or one a verified reuse shares
            # it with): one started there on another identity (an override, e.g. to show
            # the unsafe upgrade) computes another model state and never gets its traffic.
            engines=tuple(e for e in engines_of.get(pk, ()) if identity_of[e.id] == identity),
            ttl_s=float(max_age) if max_age else None,
            max_bytes=max_bytes,
            suspended=(reason or "suspended") if held else None,
            fingerprint=model_fingerprint(identity),
            tokenizer_path=path,
        )
    return out


def _read_layers() -> dict[str, bool]:
    states = dict(CacheLayerSwitch.objects.values_list("layer", "enabled"))
    return {layer: states.get(layer, True) for layer in SWITCHED_LAYERS}


def _read_not_paying() -> frozenset[tuple[int, str]]:
    return frozenset(LayerNotPaying.objects.filter(cleared_at__isnull=True).values_list("namespace_id", "layer"))


def _index(entries: Iterable[tuple[int, str]]) -> dict[int, frozenset[str]]:
    grouped: dict[int, set[str]] = {}
    for owner, item in entries:
        grouped.setdefault(owner, set()).add(item)
    return {owner: frozenset(items) for owner, items in grouped.items()}


def routing_snapshot_parts() -> SnapshotParts:
    """Everything gateways route from, read whole in one pass (a handful of queries, plain rows).

    The epoch is read first: a change committed while the rest is read moves it
    again, and the gateway updates at its next poll.
    """
    # The cyclic collector paused while ~10 objects per tenant are made: none of them is garbage
    # yet, and its full passes over a growing heap were a third of a build's time.
    was_on = gc.isenabled()
    gc.disable()
    try:
        return _parts()
    finally:
        if was_on:
            gc.enable()


def _parts() -> SnapshotParts:
    epoch = routing_epoch()
    keys = _read_keys(None)
    routes = _read_routes(None)
    engines_of, identity_of, references, addresses = _read_engines()
    return SnapshotParts(
        epoch=epoch,
        tenants=_read_tenants(None),
        keys=keys,
        keys_of=_index((k.tenant_id, h) for h, k in keys.items()),
        routes=routes,
        names_of=_index(routes),
        namespaces=_read_namespaces(None, engines_of, identity_of),
        engines_of=engines_of,
        identity_of=identity_of,
        references=references,
        addresses=addresses,
        layers=_read_layers(),
        templates=template_indexes(),
        not_paying=_read_not_paying(),
    )


def routing_snapshot_build() -> RoutingSnapshot:
    """Everything gateways route from, read whole (:func:`routing_snapshot_parts`)."""
    return routing_snapshot_parts().snapshot()


def routing_changes(since: int, until: int) -> tuple[set[int], set[int], set[str]] | None:
    """What moved the epoch from ``since`` to ``until`` (:class:`RoutingChange` rows):
    (tenant ids, namespace pks, whole sections), or None when a full build is needed: a change
    of everything, an epoch without rows (pruned, or written before changes were recorded), or
    more than :data:`MAX_INCREMENTAL_ENTRIES` entries."""
    if until < since:
        return None  # the epoch went back (a restored database): nothing said is comparable
    tenants: set[int] = set()
    namespaces: set[int] = set()
    sections: set[str] = set()
    epochs: set[int] = set()
    for epoch, section, ref in RoutingChange.objects.filter(epoch__gt=since, epoch__lte=until).values_list(
        "epoch", "section", "ref"
    ):
        epochs.add(epoch)
        if section == "tenant" and ref is not None:
            tenants.add(ref)
        elif section == "namespace" and ref is not None:
            namespaces.add(ref)
        elif section in _WHOLE_SECTIONS:
            sections.add(section)
        else:
            return None
    if len(epochs) != until - since or len(tenants) + len(namespaces) > MAX_INCREMENTAL_ENTRIES:
        return None
    return tenants, namespaces, sections


def routing_snapshot_apply(
    parts: SnapshotParts, epoch: int, tenants: set[int], namespaces: set[int], sections: set[str],
    engines: _Engines | None = None,
) -> SnapshotParts:  # fmt: skip
    """``parts`` brought to ``epoch`` by re-reading only what changed: each tenant of ``tenants``
    (its entry, keys and routes), each namespace of ``namespaces``, and the ``sections`` whole
    (``engines`` also re-reads the namespaces whose engines changed; ``engines`` given: those
    engines, already read). ``parts`` is not changed."""
    changes: dict[str, Any] = {"epoch": epoch}
    namespaces, sections = set(namespaces), set(sections)
    engines_of, identity_of = parts.engines_of, parts.identity_of
    if engines is not None or "engines" in sections:
        engines_of, identity_of, references, addresses = engines or _read_engines(parts.addresses)
        namespaces |= {pk for pk in parts.engines_of.keys() | engines_of.keys() if parts.engines_of.get(pk) != engines_of.get(pk)}
        changes.update(engines_of=engines_of, identity_of=identity_of, references=references, addresses=addresses)
    if namespaces:
        fresh_ns = _read_namespaces(namespaces, engines_of, identity_of)
        ns_map = dict(parts.namespaces)
        for pk in namespaces:
            ns_map.pop(pk, None)
        ns_map.update(fresh_ns)
        changes["namespaces"] = ns_map
    if tenants:
        fresh_tenants = _read_tenants(tenants)
        tenant_map = dict(parts.tenants)
        for pk in tenants:
            tenant_map.pop(pk, None)
        tenant_map.update(fresh_tenants)
        if not tenants <= fresh_tenants.keys():
            sections.add("templates")  # a tenant deleted takes its templates along (they send no signal)
        fresh_keys = _read_keys(tenants)
        keys, keys_of = dict(parts.keys), dict(parts.keys_of)
        for pk in tenants:
            for hash_ in keys_of.pop(pk, ()):
                if keys.get(hash_) is not None and keys[hash_].tenant_id == pk:
                    keys.pop(hash_)
        keys.update(fresh_keys)
        keys_of.update(_index((k.tenant_id, h) for h, k in fresh_keys.items()))
        fresh_routes = _read_routes(tenants)
        routes, names_of = dict(parts.routes), dict(parts.names_of)
        for pk in tenants:
            for name in names_of.pop(pk, ()):
                routes.pop((pk, name), None)
        routes.update(fresh_routes)
        names_of.update(_index(fresh_routes))
        changes.update(tenants=tenant_map, keys=keys, keys_of=keys_of, routes=routes, names_of=names_of)
    if "layers" in sections:
        changes["layers"] = _read_layers()
    if "not_paying" in sections:
        changes["not_paying"] = _read_not_paying()
    if "templates" in sections:
        changes["templates"] = template_indexes()
    return replace(parts, **changes)


def routing_snapshot_update(parts: SnapshotParts) -> SnapshotParts | None:
    """``parts`` brought to the current epoch: ``parts`` itself when the epoch did not move, the
    entries that changed re-read when it did (:func:`routing_changes`), or None when only a full
    build (:func:`routing_snapshot_parts`) can tell."""
    epoch = routing_epoch()
    if epoch == parts.epoch:
        return parts
    changed = routing_changes(parts.epoch, epoch)
    if changed is None:
        return None
    return routing_snapshot_apply(parts, epoch, *changed)


def _literal(url: str) -> bool:
    """Whether ``url`` names its host by an IP address (no DNS answer can move it)."""
    try:
        ipaddress.ip_address(urlsplit(url).hostname or "")
    except ValueError:
        return False
    return True


def routing_addresses_recheck(parts: SnapshotParts) -> SnapshotParts:
    """Resolve the engines' addresses again (a host's DNS records change without any row changing):
    ``parts`` itself when each resolves as before, else ``parts`` with the engines section updated
    (and the namespaces they serve). Reads no row unless an address changed."""
    fresh = {
        # An address given as an IP literal resolves to itself: nothing to ask again.
        pk: (base_url, address if _literal(base_url) else _pin(f"#{pk}", base_url, quiet=True))
        for pk, (base_url, address) in parts.addresses.items()
    }
    if fresh == parts.addresses:
        return parts
    return routing_snapshot_apply(parts, parts.epoch, set(), set(), set(), engines=_read_engines(fresh))


# --- figures -----------------------------------------------------------------

#: Counters of :class:`GatewayStat` a flush adds (all but the bypass map).
STAT_COUNTERS = (
    "requests", "hits", "misses", "bypasses", "prompt_tokens", "cached_prompt_tokens", "output_tokens",
    "ttft_hit_ms_sum", "ttft_hit_count", "ttft_miss_ms_sum", "ttft_miss_count", "lookup_ms_sum", "lookup_count",
    "store_ms_sum", "store_count",
)  # fmt: skip
#: Further counters a flush adds, read by the dashboard's charts only (not part of the figures' sums).
CHART_COUNTERS = ("errors",)


def gateway_stats_flush(rows: Iterable[tuple[int, str, datetime, Mapping[str, float], Mapping[str, int]]]) -> int:
    """Add one gateway process's increments to the per-minute figures.

    Args:
        rows: (namespace pk, layer, minute, counter increments by
            :data:`STAT_COUNTERS` or :data:`CHART_COUNTERS` name or TTFT histogram bucket
            (:func:`gateway.records.ttft_bucket`), bypass reason → count).
            Namespaces dropped since are skipped.

    Returns:
        Rows written.
    """
    written = 0
    # One order for every process: two flushes lock the same rows in the same order, never in a cycle.
    rows = sorted(rows, key=lambda row: (row[0], row[1], row[2]))
    live = set(CacheNamespace.objects.filter(pk__in={row[0] for row in rows}).values_list("pk", flat=True))
    for namespace_pk, layer, minute, counters, bypass in rows:
        if namespace_pk not in live:
            continue
        added = (*STAT_COUNTERS, *CHART_COUNTERS)
        increments = {name: F(name) + value for name, value in counters.items() if name in added and value}
        with transaction.atomic():
            where = {"namespace_id": namespace_pk, "layer": layer, "minute": minute}
            try:
                with transaction.atomic():
                    stat, _ = GatewayStat.objects.get_or_create(**where)
            except IntegrityError:  # another gateway process created this minute's row first
                stat = GatewayStat.objects.get(**where)
            if increments:
                GatewayStat.objects.filter(pk=stat.pk).update(**increments)
            if bypass:
                # Locked: two processes merging their maps must not lose a count.
                merged = dict(GatewayStat.objects.select_for_update().filter(pk=stat.pk).values_list("bypass", flat=True).get())
                for reason, count in bypass.items():
                    merged[reason] = merged.get(reason, 0) + count
                GatewayStat.objects.filter(pk=stat.pk).update(bypass=merged)
            buckets = {n[len(TTFT_BUCKET_PREFIX) :]: v for n, v in counters.items() if n.startswith(TTFT_BUCKET_PREFIX) and v}
            if buckets:
                # The TTFT histogram (gateway.records.ttft_bucket), merged under the same lock as the bypass map.
                held = GatewayStat.objects.select_for_update().filter(pk=stat.pk).values_list("ttft_buckets", flat=True).get()
                histogram = dict(held)
                for bound, count in buckets.items():
                    histogram[bound] = histogram.get(bound, 0) + int(count)
                GatewayStat.objects.filter(pk=stat.pk).update(ttft_buckets=histogram)
        written += 1
    return written


def gateway_flush(rows: Iterable[Any], heat: Iterable[tuple[int, str, Any, Any, int]], templates: Iterable[Any] = ()) -> None:
    """Write what one gateway process drained: its figures (:func:`gateway_stats_flush`)
    and the prefix heat of its traffic (the source prewarm uses for a successor
    namespace), and its prompt-template counts (:func:`template_stats_flush`).
    Heat of a namespace dropped since, or a prompt the heat record
    refuses, is skipped.

    All of it is one transaction: a reader sees a drain whole or not at all, and
    a failure writes nothing, so the caller puts the drain back without counting
    any of it twice.
    """
    with transaction.atomic():
        gateway_stats_flush(rows)
        template_stats_flush(templates)
        namespaces = CacheNamespace.objects.in_bulk({ns for ns, *_ in heat})
        for namespace_pk, _digest, messages, tools, hits in heat:
            namespace = namespaces.get(namespace_pk)
            if namespace is None:
                continue
            try:
                with transaction.atomic():
                    prefix_heat_record(namespace=namespace, messages=messages, tools=tools, hits=hits)
            except (InvalidField, QuotaExceeded):
                # A full heat keeps its hottest prompts; a new one is dropped, not an error of the gateway's.
                continue


def semantic_rules() -> tuple[Rule, ...]:
    """The semantic layer's admission rules of this deployment (``GATEWAY_SEMANTIC_RULES``, else the shipped ones).

    Raises:
        ImproperlyConfigured: the setting is not JSON or not a valid rule list (the message names the entry).
    """
    if not settings.GATEWAY_SEMANTIC_RULES.strip():
        return DEFAULT_RULES
    try:
        return rules_from_config(json.loads(settings.GATEWAY_SEMANTIC_RULES))
    except (ValueError, RecursionError) as exc:
        raise ImproperlyConfigured(f"GATEWAY_SEMANTIC_RULES: {exc}") from exc


def _explain_router() -> Any:
    """The precise router as a gateway process has it, read once from the block index store
    (None when the store cannot be read: the affinity choice is explained then)."""
    # Lazy as gateway_explain's own imports: the router brings the gateway's request path and tokenizers.
    from cacheadmin.services.block_index import block_index_store
    from gateway.prefix.index import BlockIndex, IndexUnavailable
    from gateway.prefix.router import PrefixRouter

    index = BlockIndex(block_index_store(), stale_s=settings.GATEWAY_PREFIX_INDEX_STALE_S)
    try:
        index.refresh()
    except IndexUnavailable as exc:
        log.warning("explain: %s", exc)
        return None
    return PrefixRouter(index, load_weight=settings.GATEWAY_ROUTING_LOAD_WEIGHT)


def gateway_explain(*, tenant: Tenant, endpoint: str, body: Mapping[str, Any], tags: Iterable[str] = ()) -> dict[str, Any]:
    """How the gateway would serve ``body`` for ``tenant`` now, with the request's ``X-Cache-Tags``
    ``tags`` (see :func:`gateway.server.explain`): the deployment's layers, in its order.

    Raises:
        InvalidField: an unknown endpoint, a malformed body or bad tags, naming the parameter (400, exit 2).
    """
    # Lazy: the gateway's request path (starlette, httpx, libphonenumber: ~190 ms) is
    # not loaded by every process that imports the services, only by explain.
    from cacheadmin.services.gateway_stores import response_store
    from gateway.errors import GatewayError
    from gateway.layers import build_layers
    from gateway.layers.semantic.layer import SemanticLayer
    from gateway.records import Recorder
    from gateway.server import Runtime, explain, request_tags

    if endpoint not in ("chat", "completions"):
        raise InvalidField("endpoint", "must be chat or completions")
    try:
        # One reading of tags for both: as the gateway reads its header (UTF-8 text, comma separated).
        cache_tags = request_tags([",".join(tags).encode("utf-8", "surrogatepass").decode("latin-1")])
    except GatewayError as exc:
        raise InvalidField("tags", exc.message.split(": ", 1)[-1]) from None
    snap = routing_snapshot_build()
    # The layers as the deployment's gateway builds them (gateway.asgi); admission needs the
    # semantic rules and the bundled embedder's languages only: no semantic store is opened and no model loaded.
    semantic = (
        SemanticLayer(None, None, rules=semantic_rules(), languages=MODEL_LANGUAGES)  # type: ignore[arg-type]
        if settings.GATEWAY_SEMANTIC
        else None
    )
    runtime = Runtime(snapshot=lambda: snap, response_store=response_store(), semantic=semantic, recorder=Recorder())
    router = _explain_router() if settings.GATEWAY_ENGINE_CHOICE == "precise" else None
    try:
        return explain(snap, tenant.pk, endpoint, body, layers=build_layers(runtime), tags=cache_tags, router=router)
    except InvalidRequest as exc:
        raise InvalidField(exc.param or "body", exc.message) from exc


def semantic_invalidate(*, tenant: Tenant, tags: Iterable[str], actor: str) -> int:
    """Remove, at once, every semantic-cache entry of ``tenant`` stored with any of ``tags``.

    Returns:
        Entries removed.

    Raises:
        InvalidField: no tags, or a tag that is blank, longer than 200 characters or not printable (400, exit 2).
        TierUnavailable: the store is down (``store_unavailable``, 503, exit 3).
    """
    tags = list(tags)
    if not tags or any(not isinstance(t, str) or not t.strip() or len(t) > 200 or not t.isprintable() for t in tags):
        raise InvalidField("tags", "a non-empty list of printable tags of 1..200 characters")
    store = tiers_configured().hot_tiers[Tier.SEMANTIC]
    removed = store.invalidate_tags(str(tenant.pk), [t.strip() for t in tags])  # type: ignore[attr-defined]
    audit_record(actor=actor, action="semantic_cache.invalidate", obj=tenant, after={"tags": tags, "removed": removed})
    return removed


def gateway_caches_retire(*, namespace: CacheNamespace, actor: str, reason: str) -> dict[str, int]:
    """Drop the gateway's cached answers of a namespace that no longer serves
    (a release moved all its traffic to another model state).

    Returns:
        ``{"response": entries removed, "semantic": entries removed}``.
    """
    tiers = tiers_configured()
    removed = {"response": 0, "semantic": 0}
    for layer in removed:
        store = tiers.hot_tiers[layer]
        try:
            removed[layer] = store.usage(namespace.storage_prefix).entries
            store.delete_prefix(namespace.storage_prefix)
        except TierUnavailable:
            continue  # the namespace's next eviction sweep drops them (they are tiers of it)
    audit_record(actor=actor, action="gateway.caches_retire", obj=namespace, after={**removed, "reason": reason})
    return removed


def gateway_figures(*, since: datetime, namespace_pks: Iterable[int] | None = None) -> dict[int, dict[str, dict[str, Any]]]:
    """Summed per-minute figures since ``since``, per namespace and layer, with
    hit ratio, cost savings rate and benefit ratio (:func:`gateway.records.layer_figures`)
    and, for a layer bypassed as not paying now, ``not_paying_since``.

    Returns:
        namespace pk → layer → summed counters, ``bypass`` map, the derived figures and
        ``not_paying_since`` (when its open :class:`LayerNotPaying` opened; None when it pays).
    """
    rows = GatewayStat.objects.filter(minute__gte=since)
    if namespace_pks is not None:
        rows = rows.filter(namespace_id__in=list(namespace_pks))
    sums: dict[int, dict[str, dict[str, Any]]] = {}
    for stat in rows:
        layer = sums.setdefault(stat.namespace_id, {}).setdefault(
            stat.layer, {name: 0 for name in STAT_COUNTERS} | {"bypass": {}}
        )
        for name in STAT_COUNTERS:
            layer[name] += getattr(stat, name)
        for reason, count in stat.bypass.items():
            layer["bypass"][reason] = layer["bypass"].get(reason, 0) + count
    held = layers_not_paying()
    for pk, layers in sums.items():
        for name, derived in layer_figures(layers).items():
            hold = held.get((pk, name))
            layers[name].update(derived, not_paying_since=hold.opened_at if hold is not None else None)
    return sums


# --- layers that do not pay ----------------------------------------------------

#: Who opens and clears the not-paying holds (audit).
BENEFIT_ACTOR = "benefit check"


def layers_not_paying() -> dict[tuple[int, str], LayerNotPaying]:
    """The open not-paying holds: (namespace pk, layer) → its row (the alarm)."""
    return {(row.namespace_id, row.layer): row for row in LayerNotPaying.objects.filter(cleared_at__isnull=True)}


def benefit_window_start(now: datetime, minutes: int) -> datetime:
    """The first minute of a window of ``minutes`` ending now: the current minute (partly
    recorded) and the ``minutes - 1`` before it, as ``GatewayStat.minute`` values."""
    return now.replace(second=0, microsecond=0) - timedelta(minutes=minutes - 1)


def gateway_benefit_check(*, now: datetime | None = None) -> dict[str, list[tuple[int, str]]]:
    """Decide, from every gateway process's ``GatewayStat`` rows, which (namespace, layer)
    pairs do not pay, and open or clear their holds (:class:`LayerNotPaying`).

    Per response or semantic layer of each namespace, over the tenant's
    ``benefit_window_minutes`` (:func:`benefit_window_start`; a namespace of no
    tenant, a shared group's, takes the defaults): lookups (hits + misses) and the
    benefit ratio (:func:`gateway.records.benefit_ratio`; a window of lookups
    without a single hit saved nothing: 0). A pair that pays opens a hold when
    the window has at least ``benefit_min_requests`` lookups and a ratio under
    ``benefit_floor``. A held pair is looked up by the measuring sample only
    (:data:`gateway.routing.NOT_PAYING_SAMPLE`), so it is cleared on fewer: at
    least ``benefit_min_requests × NOT_PAYING_SAMPLE`` lookups (rounded up) and a
    ratio at or above the floor. Anything else leaves a pair as it is. Opening and
    clearing are audited and move the routing epoch; the gateways act on the
    snapshot they rebuild.

    Returns:
        ``{"opened": [(namespace pk, layer)], "cleared": [...], "held": [...]}`` (held: open after the check).
    """
    now = now or timezone.now()
    namespaces = list(CacheNamespace.objects.values_list("pk", "tenant_id"))
    defaults = TenantGatewayPolicy()
    policies = {row.tenant_id: row for row in TenantGatewayPolicy.objects.all()}
    policy_of = {pk: policies.get(tenant_id, defaults) for pk, tenant_id in namespaces}
    by_window: dict[int, list[int]] = {}
    for pk, policy in policy_of.items():
        by_window.setdefault(policy.benefit_window_minutes, []).append(pk)
    sums: dict[tuple[int, str], dict[str, float]] = {}
    counters = ("hits", "misses", "ttft_hit_ms_sum", "ttft_hit_count", "ttft_miss_ms_sum", "ttft_miss_count",
                "lookup_ms_sum", "store_ms_sum")  # fmt: skip
    for minutes, pks in by_window.items():
        rows = (
            GatewayStat.objects.filter(
                minute__gte=benefit_window_start(now, minutes), minute__lte=now, layer__in=CACHE_LAYERS, namespace_id__in=pks
            )
            .values("namespace_id", "layer")
            .annotate(**{name: Sum(name) for name in counters})
            .order_by()
        )
        for row in rows:
            sums[(row.pop("namespace_id"), row.pop("layer"))] = row
    held = layers_not_paying()
    out: dict[str, list[tuple[int, str]]] = {"opened": [], "cleared": [], "held": []}
    for pair in sorted(set(sums) | set(held)):
        policy = policy_of.get(pair[0])
        r = sums.get(pair)
        hold = held.get(pair)
        if policy is None or r is None:
            if hold is not None:
                out["held"].append(pair)
            continue
        lookups = int(r["hits"] + r["misses"])
        ratio = benefit_ratio(r)
        if ratio is None and lookups and not r["hits"] and r["lookup_ms_sum"] + r["store_ms_sum"] > 0:
            ratio = 0.0  # looked up, never hit: it saved nothing
        floor = policy.benefit_floor
        if hold is None:
            if ratio is not None and lookups >= policy.benefit_min_requests and ratio < floor:
                with transaction.atomic():
                    try:
                        with transaction.atomic():
                            row = LayerNotPaying.objects.create(
                                namespace_id=pair[0], layer=pair[1], benefit_ratio=ratio, lookups=lookups, floor=floor
                            )
                    except IntegrityError:  # another check opened it meanwhile
                        out["held"].append(pair)
                        continue
                    audit_record(
                        actor=BENEFIT_ACTOR, action="gateway.layer_not_paying", obj=row.namespace,
                        after={"layer": pair[1], "benefit_ratio": ratio, "lookups": lookups, "floor": floor,
                               "window_minutes": policy.benefit_window_minutes},
                    )  # fmt: skip
                out["opened"].append(pair)
                out["held"].append(pair)
            continue
        sample_minimum = math.ceil(policy.benefit_min_requests * NOT_PAYING_SAMPLE)
        if ratio is not None and lookups >= sample_minimum and ratio >= floor:
            with transaction.atomic():
                if LayerNotPaying.objects.filter(pk=hold.pk, cleared_at__isnull=True).update(
                    cleared_at=now, benefit_ratio=ratio, lookups=lookups, checked_at=now
                ):
                    audit_record(
                        actor=BENEFIT_ACTOR, action="gateway.layer_pays_again", obj=hold.namespace,
                        after={"layer": pair[1], "benefit_ratio": ratio, "lookups": lookups, "floor": floor},
                    )  # fmt: skip
            out["cleared"].append(pair)
            continue
        LayerNotPaying.objects.filter(pk=hold.pk).update(benefit_ratio=ratio, lookups=lookups, checked_at=now)
        out["held"].append(pair)
    return out
