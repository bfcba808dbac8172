"""Tenants, retention owners and cache namespaces."""

from __future__ import annotations

import unicodedata
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

from django.conf import settings
from django.core.exceptions import ValidationError
from django.db import IntegrityError, transaction
from django.db.models import Exists, F, OuterRef, Q, QuerySet

from cacheadmin.models import (
    CacheNamespace,
    ModelVersion,
    RetentionOwner,
    RetentionPolicy,
    SharedGroup,
    SharedGroupMembership,
    Tenant,
)
from cacheadmin.models.naming import NOT_DIFFERENT, name_key, validate_display_name
from cacheadmin.services.audit import audit_record, reason_check
from cacheadmin.services.quotas import quota_check
from inference.errors import InvalidField, Refused
from inference.identity import cache_salt, namespace_key, storage_prefix


def tenant_get_or_create(*, slug: str, name: str, actor: str) -> Tenant:
    """The tenant with ``slug``, created (and audited) if missing.

    Raises:
        django.core.exceptions.ValidationError: malformed slug.
    """
    tenant = Tenant(slug=slug, name=name)
    tenant.full_clean(validate_unique=False)
    with transaction.atomic():
        tenant, created = Tenant.objects.get_or_create(slug=slug, defaults={"name": name})
        if created:
            audit_record(actor=actor, action="tenant.create", obj=tenant, after={"slug": slug, "name": name})
    return tenant


def retention_owner_get_or_create(*, name: str, email: str, actor: str) -> RetentionOwner:
    """The retention owner named ``name`` (compared by :func:`name_key`), created (and audited) if missing.

    Raises:
        ValidationError: a blank name, or one with invisible or control characters.
    """
    validate_display_name(name)
    with transaction.atomic():
        owner = RetentionOwner.objects.filter(name_key=name_key(name)).first()
        created = owner is None
        if created:
            owner = RetentionOwner.objects.create(name=name, email=email)
        if created:
            audit_record(actor=actor, action="retention_owner.create", obj=owner, after={"name": name, "email": email})
    return owner


def tenant_create(*, slug: str, name: str, actor: str) -> Tenant:
    """Create a tenant (audited); the API, the CLI and the admin create through this.

    Raises:
        django.core.exceptions.ValidationError: malformed slug or name.
        InvalidField: ``slug`` is taken (400 on ``slug``, exit 2).
    """
    if Tenant.objects.filter(slug=slug).exists():
        raise InvalidField("slug", f"tenant {slug!r} already exists")
    return tenant_get_or_create(slug=slug, name=name, actor=actor)


def retention_owner_create(*, name: str, email: str, actor: str) -> RetentionOwner:
    """Create a retention owner (audited); the API, the CLI and the admin create through this.

    Raises:
        django.core.exceptions.ValidationError: a blank or invisible-character
            name, or a malformed email.
        InvalidField: another owner's name equals it by :func:`name_key`
            (case, Unicode form, look-alike letters) (400 on ``name``, exit 2).
    """
    clash = RetentionOwner.objects.filter(name_key=name_key(name)).first()
    if clash is not None:
        raise InvalidField("name", f"retention owner {clash.name!r} already exists ({NOT_DIFFERENT})")
    RetentionOwner(name=name, email=email).full_clean(exclude=["name_key"])
    return retention_owner_get_or_create(name=name, email=email, actor=actor)


@dataclass(frozen=True)
class RetentionPolicySpec:
    """A namespace's retention policy as asked for (validated on creation).

    Attributes:
        max_age_since_last_hit_s: seconds a namespace may go without a cache hit; None = no limit.
        max_bytes: bytes its cached state may take in each tier; None = no limit.
        versions_kept: model versions of the served model kept hot (>= 1).
        cold_versions_kept: versions after the hot ones kept archived in the cold tier (>= 0).
        lru_k: K of LRU-K for entries over the byte budget (>= 1).
        pinned: legal hold: never evicted while set; needs ``hold_by`` and ``hold_reason``.
    """

    max_age_since_last_hit_s: int | None
    max_bytes: int | None
    versions_kept: int = 1
    cold_versions_kept: int = 1
    lru_k: int = 2
    pinned: bool = False
    hold_by: str = ""
    hold_reason: str = ""

    def errors(self) -> dict[str, list[str]]:
        """Field → problems; empty when valid."""
        problems: dict[str, list[str]] = {}
        for name in ("max_age_since_last_hit_s", "max_bytes"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                problems[name] = ["must be a positive integer or null (no limit)"]
        if not isinstance(self.versions_kept, int) or isinstance(self.versions_kept, bool) or not 1 <= self.versions_kept <= 100:
            problems["versions_kept"] = ["must be an integer within 1..100"]
        for name, low, high in (("cold_versions_kept", 0, 100), ("lru_k", 1, 8)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
                problems[name] = [f"must be an integer within {low}..{high}"]
        for name in ("hold_by", "hold_reason"):
            value = getattr(self, name)
            if value and any(
                unicodedata.category(c) in ("Cf", "Zl", "Zp") or (unicodedata.category(c) == "Cc" and c not in "\n\t")
                for c in value
            ):
                problems[name] = ["invisible or control characters are not allowed"]
        if not self.pinned and (self.hold_by.strip() or self.hold_reason.strip()):
            problems["pinned"] = ["hold_by and hold_reason describe a hold: set pinned, or leave them empty"]
        if self.pinned and not self.hold_by.strip():
            problems["hold_by"] = ["a hold needs who placed it"]
        if self.pinned and not self.hold_reason.strip():
            problems["hold_reason"] = ["a hold needs a reason"]
        return problems

    def as_dict(self) -> dict[str, object]:
        """Plain fields, for audit records and the policy row."""
        return asdict(self)


#: The demo's policy: a day without hits, 1 GiB, two versions warm.
DEMO_POLICY = RetentionPolicySpec(max_age_since_last_hit_s=86400, max_bytes=1 << 30, versions_kept=2)


def namespace_get_or_create(
    *,
    model_version: ModelVersion,
    retention_owner: RetentionOwner,
    policy: RetentionPolicySpec,
    actor: str,
    tenant: Tenant | None = None,
    group: SharedGroup | None = None,
) -> tuple[CacheNamespace, bool]:
    """The cache namespace of (model version identity, boundary), created if
    missing, and whether this call created it (as Django's ``get_or_create``).

    The boundary is ``tenant`` or, for prefixes shared on purpose, the current
    generation of ``group`` (exactly one of the two). The id is derived
    (``inference.identity.namespace_id``), so every process computes the same
    one; concurrent callers end with the same row.

    A new namespace is created with its retention owner and policy in one
    transaction; an existing one is returned as it is (its policy unchanged).

    Raises:
        ValidationError: the policy is invalid, or not exactly one boundary (nothing is written).
        NamespaceConflict: the derived id is held by another boundary or identity
            (e.g. a tenant slug was reused; isolation wins over convenience), or
            the model version is retired.
    """
    problems = policy.errors()
    if (tenant is None) == (group is None):
        problems["tenant"] = ["give exactly one of tenant and group"]
    if problems:
        raise ValidationError(problems)
    boundary = tenant.boundary if tenant is not None else group.boundary
    where = {"tenant": tenant} if tenant is not None else {"group": group, "group_generation": group.generation}
    new_key = namespace_key(model_version.identity, boundary)
    existing = CacheNamespace.objects.select_related("tenant", "group", "model_version").filter(namespace_key=new_key).first()
    if existing:
        return _same_owner_or_refuse(existing, model_version, where), False
    if model_version.status == ModelVersion.Status.RETIRED:
        raise NamespaceConflict(f"{model_version.label} is retired: no new namespace is created for it")
    stale = CacheNamespace.objects.filter(model_version=model_version, **where).first()
    if stale is not None:
        raise NamespaceConflict(
            f"{boundary} already has namespace {stale.namespace_key[:12]}… for {model_version.label}, "
            f"but its identity and boundary now derive {new_key[:12]}… (was the tenant renamed?); resolve that first"
        )
    try:
        with transaction.atomic():
            quota_check(tenant=tenant, kind="namespaces")
            namespace = CacheNamespace.objects.create(
                namespace_key=new_key,
                model_version=model_version,
                retention_owner=retention_owner,
                storage_prefix=storage_prefix(new_key),
                **where,
            )
            RetentionPolicy.objects.create(namespace=namespace, **policy.as_dict())
            audit_record(
                actor=actor,
                action="namespace.create",
                obj=namespace,
                after={
                    "namespace_key": new_key,
                    "model_version": model_version.label,
                    "boundary": boundary,
                    "retention_owner": retention_owner.name,
                    "policy": policy.as_dict(),
                },
            )
    except IntegrityError:  # a concurrent caller created it first
        return _same_owner_or_refuse(CacheNamespace.objects.get(namespace_key=new_key), model_version, where), False
    return namespace, True


class NamespaceConflict(Refused):
    """A namespace id is held by another (boundary, model version) row (409, exit 4)."""

    code = "namespace_conflict"


def _same_owner_or_refuse(existing: CacheNamespace, model_version: ModelVersion, where: dict[str, object]) -> CacheNamespace:
    same_boundary = all(
        getattr(existing, f"{k}_id" if k in ("tenant", "group") else k) == (v.pk if hasattr(v, "pk") else v)
        for k, v in where.items()
    )
    if not same_boundary or existing.model_version.identity != model_version.identity:
        # The holder is not named: it may be another tenant.
        raise NamespaceConflict(
            f"namespace {existing.namespace_key[:12]}… belongs to another boundary or identity; "
            "it is never handed to another boundary or identity"
        )
    return existing


def namespaces_visible_to(tenant_id: int, path: str = "") -> Q:
    """Namespaces a tenant may see and name: its own, and those of the shared
    groups it is a member of now, from the generation it joined on (earlier
    generations are other members' history). ``path``: the lookup prefix,
    e.g. ``"namespace__"``.

    A correlated subquery, no join: callers need no ``distinct()``.
    """
    member = SharedGroupMembership.objects.filter(
        tenant_id=tenant_id,
        group_id=OuterRef(f"{path}group_id"),
        joined_generation__lte=OuterRef(f"{path}group_generation"),
    )
    return Q(**{f"{path}tenant_id": tenant_id}) | Q(Exists(member))


def namespace_ids_visible_to(tenant_id: int) -> QuerySet:
    """The ids of the namespaces :func:`namespaces_visible_to` lets a tenant see,
    as a subquery: its own (``tenant_id``, an index lookup) and those of the
    groups it is a member of (``group_id``, an index lookup) from the
    generation it joined on. No two parts hold the same namespace (one has a
    tenant, the other a group), hence ``UNION ALL``.

    For the namespace list itself: ``pk__in`` this is answered from the
    indexes on ``tenant_id`` and ``group_id``, where the ``OR EXISTS`` filter is
    checked row by row over the whole table (PostgreSQL cannot combine an OR
    with a correlated subquery into index scans), so a tenant's page cost grew
    with every other tenant's namespaces.
    """
    own = CacheNamespace.objects.order_by().filter(tenant_id=tenant_id).values("pk")
    # The groups' namespaces by group_id (an index lookup per group, in
    # PostgreSQL and SQLite alike), then the generation each was joined on; a
    # join through the group instead makes PostgreSQL guess a third of the
    # table, and EXISTS alone makes SQLite test every row.
    groups = SharedGroupMembership.objects.filter(tenant_id=tenant_id).values("group_id")
    member = SharedGroupMembership.objects.filter(
        tenant_id=tenant_id, group_id=OuterRef("group_id"), joined_generation__lte=OuterRef("group_generation")
    )
    shared = CacheNamespace.objects.order_by().filter(group_id__in=groups).filter(Exists(member)).values("pk")
    return own.union(shared, all=True)


class GroupError(Refused):
    """A shared-group change that cannot be made (already a member, not a member...) (409, exit 4)."""

    code = "group_conflict"


def shared_group_create(*, slug: str, name: str, actor: str) -> SharedGroup:
    """Create a shared group (audited).

    Raises:
        django.core.exceptions.ValidationError: malformed slug or name.
        GroupError: the slug is taken.
    """
    group = SharedGroup(slug=slug, name=name)
    group.full_clean(validate_unique=False, exclude=["generation"])
    try:
        with transaction.atomic():
            group.save()
            audit_record(actor=actor, action="shared_group.create", obj=group, after={"slug": slug, "name": name})
    except IntegrityError as exc:
        raise GroupError(f"shared group {slug!r} already exists") from exc
    return group


def shared_group_join(*, group: SharedGroup, tenant: Tenant, actor: str, reason: str) -> SharedGroupMembership:
    """Add ``tenant`` to ``group``: from now on it may use the group's namespaces (audited).

    Raises:
        ValidationError: no reason given (400, exit 2).
        GroupError: already a member.
    """
    reason_check(reason, required_for="joining a shared group")
    try:
        with transaction.atomic():
            group.refresh_from_db()
            membership = SharedGroupMembership.objects.create(
                group=group, tenant=tenant, added_by=actor, joined_generation=group.generation
            )
            audit_record(actor=actor, action="shared_group.join", obj=group, after={"tenant": tenant.slug}, reason=reason)
    except IntegrityError as exc:
        raise GroupError(f"tenant {tenant.slug} is already a member of {group.slug}") from exc
    return membership


def shared_group_leave(*, group: SharedGroup, tenant: Tenant, actor: str, reason: str) -> SharedGroup:
    """Remove ``tenant`` from ``group`` and start a new generation (audited).

    The leaver may still hold the salts of the group's namespaces, so those
    namespaces are superseded: their salts are no longer served, and the
    remaining members get namespaces of the new generation (new ids, salts
    and storage prefixes). The superseded ones are left for eviction.

    Raises:
        ValidationError: no reason given (400, exit 2).
        GroupError: not a member.
    """
    reason_check(reason, required_for="leaving a shared group")
    with transaction.atomic():
        deleted, _ = SharedGroupMembership.objects.filter(group=group, tenant=tenant).delete()
        if not deleted:
            raise GroupError(f"tenant {tenant.slug} is not a member of {group.slug}")
        before = group.generation
        SharedGroup.objects.filter(pk=group.pk).update(generation=F("generation") + 1)
        group.refresh_from_db()
        audit_record(
            actor=actor,
            action="shared_group.leave",
            obj=group,
            before={"tenant": tenant.slug, "generation": before},
            after={"generation": group.generation},
            reason=reason,
        )
    return group


def namespace_check_current(namespace: CacheNamespace) -> None:
    """Refuse a superseded shared-group namespace as the target of new work
    (serving, prewarming, comparing, reading its salt): a member left since,
    and the salt it may still hold must not be served again.

    Raises:
        NamespaceConflict: the namespace is of an earlier generation of its group (409, exit 4).
    """
    if namespace.superseded:
        raise NamespaceConflict(
            f"namespace {namespace.namespace_key[:12]}… is of generation {namespace.group_generation} of "
            f"group {namespace.group.slug}, now at {namespace.group.generation} (a member left): use the new generation's"
        )


def namespace_salts(keys: Iterable[tuple[int, str]]) -> dict[int, str]:
    """The vLLM ``cache_salt`` of each namespace of ``keys`` ((pk, namespace key) pairs), by pk:
    the one place a salt is computed (:func:`inference.identity.cache_salt` under
    ``CACHE_SALT_SECRET``; a test holds every other module to it).

    Unaudited, for the control plane's own processes only, where a salt never
    leaves it: the gateways' routing snapshot and the KV-event consumer's map of
    salts back to namespaces. A salt handed to anyone else (a router, a job's
    engine, the CLI) is read through :func:`namespace_salt_read`, which audits it.
    """
    secret = settings.CACHE_SALT_SECRET
    return {pk: cache_salt(secret, key) for pk, key in keys}


def namespace_salt_read(namespace: CacheNamespace, *, actor: str, purpose: str, superseded_ok: bool = False) -> str:
    """The namespace's vLLM ``cache_salt`` (:func:`namespace_salts`), for anyone outside
    the control plane's own processes: every read is audited
    (``namespace.read_salt`` with ``{"purpose": purpose}``).

    Args:
        actor: who reads it (a user, ``"cli:<OS user>"``, a job's creator).
        purpose: why, in a few words: ``"router"``, ``"prewarm job #3"``,
            ``"routing of release #7"``, ``"eviction probe"``.
        superseded_ok: the control plane's own use of a superseded group
            namespace's salt (an eviction probe, which never leaves it).

    Raises:
        NamespaceConflict: a superseded shared-group namespace (a member left
            since; its salt is not handed out any more), unless ``superseded_ok``.
            Refused before the audit: a refused read is no read.
    """
    if not superseded_ok:
        namespace_check_current(namespace)
    audit_record(actor=actor, action="namespace.read_salt", obj=namespace, after={"purpose": purpose})
    return namespace_salts([(namespace.pk, namespace.namespace_key)])[namespace.pk]


def namespace_storage_path(namespace: CacheNamespace) -> Path:
    """Directory of the namespace's hot persistent tier on disk."""
    return settings.KV_STORE_ROOT / namespace.storage_prefix


def namespace_policy_update(
    *, namespace: CacheNamespace, policy: RetentionPolicySpec, actor: str, reason: str, release_hold: bool = False
) -> RetentionPolicy:
    """Replace a namespace's retention policy (audited with before and after).

    A legal hold is lifted only on purpose: replacing the policy of a held
    namespace with an unpinned one, or with another holder or reason (lifting
    one hold to set another), needs ``release_hold``.

    Raises:
        ValidationError: invalid policy, or no reason given; nothing changes.
        NamespaceConflict: the namespace is held, the change lifts or rewrites
            the hold and ``release_hold`` was not given.
    """
    problems = policy.errors()
    if not reason.strip():
        problems["reason"] = ["a policy change needs a reason"]
    else:
        try:
            reason_check(reason)
        except ValidationError as exc:
            problems.update(exc.message_dict)
    if problems:
        raise ValidationError(problems)
    with transaction.atomic():
        current, _ = RetentionPolicy.objects.select_for_update().get_or_create(namespace=namespace, defaults={"versions_kept": 1})
        rewritten = (policy.hold_by, policy.hold_reason) != (current.hold_by, current.hold_reason)
        if current.pinned and (not policy.pinned or rewritten) and not release_hold:
            what = "lifting it" if not policy.pinned else "replacing its holder or reason"
            raise NamespaceConflict(
                f"namespace {namespace.namespace_key[:12]}… is under a legal hold by {current.hold_by} "
                f"({current.hold_reason}); {what} needs release_hold"
            )
        before = {k: getattr(current, k) for k in policy.as_dict()}
        for key, value in policy.as_dict().items():
            setattr(current, key, value)
        current.save()
        audit_record(
            actor=actor, action="namespace.policy_update", obj=namespace, before=before, after=policy.as_dict(), reason=reason
        )
    return current
