"""The control plane's machine endpoints outside DRF (``/metrics``, ``/healthz``)
over real HTTP: ``HEAD`` answers like ``GET`` without a body; every other method
is 405 in the error envelope with ``Allow: GET, HEAD`` (never Django's CSRF
page), whatever the token, and changes nothing."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest
from django.conf import settings
from django.test import Client

from cacheadmin.models import AuditEvent, CacheNamespace, RetentionOwner, Tenant
from tests.cacheadmin.conftest import make_version

pytestmark = pytest.mark.django_db(transaction=True)  # the live server's thread reads committed rows

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def bearer(token: str | None = None) -> dict[str, str]:
    return {"Authorization": f"Bearer {token or settings.METRICS_TOKEN}"}


@pytest.fixture
def namespace() -> CacheNamespace:
    tenant = Tenant.objects.create(slug="acme", name="Acme")
    owner = RetentionOwner.objects.create(name="platform", email="p@example.com")
    return CacheNamespace.objects.create(namespace_key="a" * 64, model_version=make_version("v1", "1" * 64), tenant=tenant,
                                         retention_owner=owner, storage_prefix="ns-acme")  # fmt: skip


def snapshot() -> dict[str, Any]:
    """What a write would have touched: the rows and the audit trail."""
    return {
        "namespaces": list(CacheNamespace.objects.values_list("pk", "namespace_key", "residency", "tenant_id").order_by("pk")),
        "tenants": list(Tenant.objects.values_list("pk", "slug").order_by("pk")),
        "audit": AuditEvent.objects.count(),
    }


@pytest.mark.parametrize("method", ["POST", "PUT", "PATCH", "DELETE", "OPTIONS"])
@pytest.mark.parametrize("token", ["right", "wrong", "none"])
@pytest.mark.parametrize("path", ["/metrics", "/healthz"])
def test_other_methods_are_405_in_the_envelope_whatever_the_token(
    live_server: Any, namespace: CacheNamespace, method: str, token: str, path: str
) -> None:
    headers = {"right": bearer(), "wrong": bearer("x" * 64), "none": {}}[token]
    before = snapshot()
    with httpx.Client(base_url=live_server.url, timeout=30) as client:
        # A browser-like form post with a session cookie and no CSRF token: still the 405, not the CSRF page.
        form = {"Content-Type": "application/x-www-form-urlencoded", "Cookie": "sessionid=x"}
        response = client.request(method, path, headers={**headers, **form}, content=b"namespace=1")
    assert response.status_code == 405
    assert response.headers["allow"] == "GET, HEAD"
    assert response.headers["content-type"] == "application/json"
    assert response.json() == {
        "error": {"status": 405, "code": "method_not_allowed", "message": f"{method} is not allowed on {path} (GET, HEAD)"}
    }
    assert settings.METRICS_TOKEN not in response.text
    assert snapshot() == before


def test_the_django_client_with_csrf_checks_gets_the_same_405(namespace: CacheNamespace) -> None:
    response = Client(enforce_csrf_checks=True).post("/metrics", HTTP_AUTHORIZATION=f"Bearer {settings.METRICS_TOKEN}")
    assert (response.status_code, response["Allow"]) == (405, "GET, HEAD")
    assert response.json()["error"]["code"] == "method_not_allowed"


def test_head_answers_like_get_without_a_body(live_server: Any, namespace: CacheNamespace) -> None:
    with httpx.Client(base_url=live_server.url, timeout=30) as client:
        # With every namespace's series: the namespace has nothing else to say, so only the detail names it.
        got = client.get("/metrics?detail=namespaces", headers=bearer())
        head = client.head("/metrics?detail=namespaces", headers=bearer())
        assert (got.status_code, head.status_code) == (200, 200)
        assert "kvcp_namespace_info{" in got.text and f'namespace="{"a" * 64}"' in got.text
        assert head.content == b""
        assert head.headers["content-type"] == got.headers["content-type"] == CONTENT_TYPE
        # Same families, same rows: the length HEAD announces is the length GET sends.
        assert int(head.headers["content-length"]) == len(got.content)
        unauthenticated = client.head("/metrics")
        assert (unauthenticated.status_code, unauthenticated.content) == (401, b"")
        assert unauthenticated.headers["www-authenticate"] == 'Bearer realm="metrics"'
        wrong = client.head("/metrics", headers=bearer("x" * 64))
        assert (wrong.status_code, wrong.content) == (403, b"")


def test_healthz_answers_get_and_head(live_server: Any) -> None:
    with httpx.Client(base_url=live_server.url, timeout=30) as client:
        got = client.get("/healthz")
        head = client.head("/healthz")
    assert (got.status_code, got.json()) == (200, {"status": "ok", "database": {"read": True, "write": True}})
    assert (head.status_code, head.content) == (200, b"")


def test_the_gateways_metrics_answers_other_methods_the_same_way(setup: dict[str, Any]) -> None:  # noqa: F811
    """The gateway's ``/metrics`` (Starlette) says ``Allow`` on its 405 too, in its own (OpenAI-style) envelope."""

    async def go() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=setup["gateway"].app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
            auth = {"authorization": f"Bearer {'m' * 48}"}
            return [await client.request(m, "/metrics", headers=auth) for m in ("POST", "DELETE", "HEAD")]

    setup["gateway"].metrics_token = "m" * 48
    post, delete, head = asyncio.run(go())
    for response, method in ((post, "POST"), (delete, "DELETE")):
        assert (response.status_code, response.headers["allow"]) == (405, "GET, HEAD")
        assert response.json()["error"]["code"] == "method_not_allowed"
        assert response.json()["error"]["message"] == f"{method} is not allowed on /metrics"
    assert (head.status_code, head.content) == (200, b"")
