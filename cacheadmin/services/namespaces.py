"""Tenants, retention owners and cache namespaces."""

from __future__ import annotations

from pathlib import Path

from django.conf import settings
from django.db import IntegrityError, transaction

from cacheadmin.models import CacheNamespace, ModelVersion, RetentionOwner, Tenant
from cacheadmin.services.audit import audit_record
from inference.identity import cache_salt, namespace_id, storage_prefix


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
    """The retention owner named ``name``, created (and audited) if missing."""
    with transaction.atomic():
        owner, created = RetentionOwner.objects.get_or_create(name=name, defaults={"email": email})
        if created:
            audit_record(actor=actor, action="retention_owner.create", obj=owner, after={"name": name, "email": email})
    return owner


def namespace_get_or_create(
    *, model_version: ModelVersion, tenant: Tenant, retention_owner: RetentionOwner, actor: str
) -> CacheNamespace:
    """The cache namespace of (model version identity, tenant), created if missing.

    The id is derived (``inference.identity.namespace_id``), so every process
    computes the same one; concurrent callers end with the same row.

    Raises:
        NamespaceConflict: the derived id is held by another tenant or identity
            (e.g. a tenant slug was reused); isolation wins over convenience.
    """
    ns_id = namespace_id(model_version.identity, tenant.boundary)
    existing = CacheNamespace.objects.select_related("tenant", "model_version").filter(namespace_id=ns_id).first()
    if existing:
        return _same_owner_or_refuse(existing, model_version, tenant)
    try:
        with transaction.atomic():
            namespace = CacheNamespace.objects.create(
                namespace_id=ns_id,
                model_version=model_version,
                tenant=tenant,
                retention_owner=retention_owner,
                storage_prefix=storage_prefix(ns_id),
            )
            audit_record(
                actor=actor,
                action="namespace.create",
                obj=namespace,
                after={"namespace_id": ns_id, "model_version": model_version.label, "tenant": tenant.slug},
            )
    except IntegrityError:
        return _same_owner_or_refuse(CacheNamespace.objects.get(namespace_id=ns_id), model_version, tenant)
    return namespace


class NamespaceConflict(ValueError):
    """A namespace id is held by another (tenant, model version) row."""


def _same_owner_or_refuse(existing: CacheNamespace, model_version: ModelVersion, tenant: Tenant) -> CacheNamespace:
    if existing.tenant_id != tenant.pk or existing.model_version.identity != model_version.identity:
        raise NamespaceConflict(
            f"namespace {existing.namespace_id[:12]}… belongs to tenant {existing.tenant.slug} and "
            f"{existing.model_version.label}; it is never handed to another tenant or identity"
        )
    return existing


def namespace_cache_salt(namespace: CacheNamespace) -> str:
    """The namespace's vLLM ``cache_salt`` (HMAC under ``CACHE_SALT_SECRET``)."""
    return cache_salt(settings.CACHE_SALT_SECRET, namespace.namespace_id)


def namespace_storage_path(namespace: CacheNamespace) -> Path:
    """Directory of the namespace's hot persistent tier on disk."""
    return settings.KV_STORE_ROOT / namespace.storage_prefix
