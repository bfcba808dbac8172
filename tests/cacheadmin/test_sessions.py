"""Browser sessions: any active account signs in and reads; what it may change
comes from its Django permissions, never from ``is_staff`` alone."""

from __future__ import annotations

import pytest
from django.contrib.auth.models import Permission, User
from django.test import Client

from cacheadmin.models import AuditEvent, Tenant

pytestmark = pytest.mark.django_db


def signed_in(username: str, *, staff: bool = False, perms: tuple[str, ...] = ()) -> Client:
    """A browser that signed in through the login page, as a person does."""
    user = User.objects.create_user(username, password="pw-" + username, is_staff=staff)
    user.user_permissions.set(Permission.objects.filter(codename__in=perms))
    client = Client()
    response = client.post("/login/", {"username": username, "password": "pw-" + username})
    assert (response.status_code, response["Location"]) == (302, "/")
    return client


def test_an_operator_without_staff_rights_signs_in_and_reads() -> None:
    reader = signed_in("rita")
    assert reader.get("/").status_code == 200
    assert reader.get("/api/tenants/").status_code == 200
    assert reader.get("/login/").status_code == 200
    assert reader.post("/logout/").status_code == 302
    assert reader.get("/").status_code == 302


@pytest.mark.parametrize(
    ("perms", "tenant_create", "audit_read", "plan_page"),
    [
        ((), 403, 403, 403),  # staff flag alone: read only
        (("operate_cache",), 403, 403, 302),
        (("administer_cache",), 201, 200, 302),
    ],
)
def test_a_sessions_scope_is_what_its_permissions_give(perms, tenant_create, audit_read, plan_page, settings, tmp_path) -> None:
    settings.KV_STORE_ROOT, settings.KV_COLD_ROOT, settings.KV_REDIS_URL = tmp_path / "kv", tmp_path / "cold", ""
    client = signed_in("sam", staff=True, perms=perms)
    response = client.post("/api/tenants/", {"slug": "acme", "name": "Acme"}, content_type="application/json")
    assert response.status_code == tenant_create
    assert Tenant.objects.filter(slug="acme").exists() is (tenant_create == 201)
    assert client.get("/api/audit-events/").status_code == audit_read
    assert client.post("/eviction-runs/plan", {"reason": "r"}).status_code == plan_page
    if plan_page == 403:
        assert not AuditEvent.objects.filter(action__startswith="eviction_run").exists()


def test_repeated_failed_sign_ins_lock_the_account_out(settings) -> None:
    """django-axes: after LOGIN_FAILURE_LIMIT failures for one username and
    address, even the right password is refused until the cool-off ends."""
    User.objects.create_user("rita", password="right-password")
    client = Client()
    for _ in range(settings.AXES_FAILURE_LIMIT - 1):
        wrong = client.post("/login/", {"username": "rita", "password": "guess"})
        assert wrong.status_code == 200 and "did not match" in wrong.content.decode()
    locked = client.post("/login/", {"username": "rita", "password": "guess"})
    assert locked.status_code == 429
    refused = client.post("/login/", {"username": "rita", "password": "right-password"})
    assert refused.status_code == 429 and client.get("/").status_code == 302
    # Another address is not locked out by this one's guesses.
    other = Client(REMOTE_ADDR="10.9.8.7")
    assert other.post("/login/", {"username": "rita", "password": "right-password"}).status_code == 302
