"""A namespace id is reproducible by its original tenant only: a tenant (or
group) created under a deleted one's slug gets other ids, salts and storage."""

from __future__ import annotations

import pytest
from django.conf import settings

from cacheadmin.models import CacheNamespace, RetentionOwner, SharedGroup, Tenant
from cacheadmin.services.namespaces import DEMO_POLICY, namespace_get_or_create, tenant_get_or_create
from inference.identity import cache_salt
from tests.cacheadmin.conftest import make_version

pytestmark = pytest.mark.django_db


def test_a_recreated_tenant_gets_new_ids_salts_and_storage() -> None:
    version = make_version("v1", "1" * 64)
    owner = RetentionOwner.objects.create(name="platform", email="p@example.com")
    first = tenant_get_or_create(slug="acme", name="Acme", actor="alice")
    old, _ = namespace_get_or_create(model_version=version, tenant=first, retention_owner=owner, policy=DEMO_POLICY, actor="a")
    # What deleting through the old admin did: the rows go, the tiers stay.
    CacheNamespace.objects.filter(pk=old.pk).delete()
    first.delete()
    second = tenant_get_or_create(slug="acme", name="Acme again", actor="mallory")
    new, _ = namespace_get_or_create(model_version=version, tenant=second, retention_owner=owner, policy=DEMO_POLICY, actor="m")
    assert len(first.key) == len(second.key) == 32 and first.key != second.key
    assert new.namespace_key != old.namespace_key
    assert new.storage_prefix != old.storage_prefix
    assert cache_salt(settings.CACHE_SALT_SECRET, new.namespace_key) != cache_salt(settings.CACHE_SALT_SECRET, old.namespace_key)


def test_a_tenant_from_before_keys_keeps_its_ids() -> None:
    legacy = Tenant.objects.create(slug="legacy", name="Legacy", key="")
    assert legacy.boundary == "tenant:legacy"
    group = SharedGroup.objects.create(slug="partners", name="P", key="")
    assert group.boundary == "group:partners:1"
    keyed = SharedGroup.objects.create(slug="partners2", name="P2")
    assert keyed.boundary == f"group:partners2:{keyed.key}:1"


def test_namespaces_cannot_be_deleted_from_the_admin(admin_client) -> None:
    version = make_version("v1", "1" * 64)
    owner = RetentionOwner.objects.create(name="platform", email="p@example.com")
    tenant = tenant_get_or_create(slug="acme", name="Acme", actor="alice")
    ns, _ = namespace_get_or_create(model_version=version, tenant=tenant, retention_owner=owner, policy=DEMO_POLICY, actor="a")
    response = admin_client.post(f"/admin/cacheadmin/cachenamespace/{ns.pk}/delete/", {"post": "yes"})
    assert response.status_code == 403
    assert CacheNamespace.objects.filter(pk=ns.pk).exists()
