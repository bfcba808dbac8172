"""What one tenant may create (TENANT_QUOTA_*): each created row is a metric
series, a polled target or a worker's time. At the limit: 429
``quota_exceeded`` naming the kind and the limit, nothing created; the
limit counts the tenant's rows whoever creates them."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from django.db import connection, transaction
from django.test import override_settings
from django.utils import timezone

from cacheadmin.models import CacheNamespace, Engine, GatewayKey, PrefixHeat, PrewarmJob, PromptTemplate, Tenant
from cacheadmin.services.gateway import gateway_flush, gateway_key_issue
from cacheadmin.services.quotas import QuotaExceeded, quota_check

pytestmark = pytest.mark.django_db

TEXT = "You are the support assistant of Acme Travel. Answer briefly and politely. Question: {question}"


def _quotas(**limits: int) -> dict[str, int]:
    base = {"engines": 8, "namespaces": 32, "gateway_keys": 50, "prompt_templates": 100, "jobs": 20, "prefix_heat": 10_000}
    return {**base, **limits}


def _refusal(kind: str, limit: int, what: str) -> tuple[int, dict[str, Any]]:
    message = f"quota reached: {what} (limit {limit}, setting TENANT_QUOTA_{kind.upper()})"
    return 429, {"error": {"status": 429, "code": "quota_exceeded", "message": message}}


def test_gateway_keys(world) -> None:
    bob = world["clients"]["bob"]
    with override_settings(TENANT_QUOTAS=_quotas(gateway_keys=2)):
        for name in ("k1", "k2"):
            assert bob.post("/api/gateway-keys/", {"tenant": "acme", "name": name}, format="json").status_code == 201
        answer = bob.post("/api/gateway-keys/", {"tenant": "acme", "name": "k3"}, format="json")
        assert (answer.status_code, answer.json()) == _refusal("gateway_keys", 2, "unrevoked gateway keys of the tenant")
        assert GatewayKey.objects.filter(tenant=world["acme"]).count() == 2
        # A revoked key frees its place; another tenant has its own quota.
        first = GatewayKey.objects.get(name="k1")
        assert bob.post(f"/api/gateway-keys/{first.pk}/revoke/", format="json").status_code == 200
        assert bob.post("/api/gateway-keys/", {"tenant": "acme", "name": "k3"}, format="json").status_code == 201
        gateway_key_issue(tenant=world["globex"], name="g1", actor="alice")


def test_prompt_templates_and_an_unbound_admin_counts_for_the_tenant_too(world) -> None:
    bob, alice = world["clients"]["bob"], world["clients"]["alice"]
    with override_settings(TENANT_QUOTAS=_quotas(prompt_templates=1)):
        body = {"name": "t1", "tenant": "acme", "text": TEXT, "samples": [{"question": "q"}]}
        assert bob.post("/api/prompt-templates/", body, format="json").status_code == 201
        again = alice.post("/api/prompt-templates/", {**body, "name": "t2", "text": "B " + TEXT}, format="json")
        assert (again.status_code, again.json()) == _refusal("prompt_templates", 1, "prompt templates of the tenant")
        # A template of every tenant is no tenant's.
        assert alice.post("/api/prompt-templates/", {**body, "name": "g", "tenant": None}, format="json").status_code == 201
    assert PromptTemplate.objects.count() == 2


def test_namespaces(world) -> None:
    bob = world["clients"]["bob"]
    body = {"model_version": world["v2"].pk, "tenant": "acme", "retention_owner": world["ns"]["acme"].retention_owner_id,
            "policy": {"max_age_since_last_hit_s": 3600, "max_bytes": 1 << 20, "versions_kept": 1}}  # fmt: skip
    with override_settings(TENANT_QUOTAS=_quotas(namespaces=1)):  # acme holds one already
        answer = bob.post("/api/namespaces/", body, format="json")
        assert (answer.status_code, answer.json()) == _refusal("namespaces", 1, "cache namespaces of the tenant")
    assert CacheNamespace.objects.filter(tenant=world["acme"]).count() == 1


def test_engines(world, real_version) -> None:
    bob = world["clients"]["bob"]
    version, namespace = real_version
    with override_settings(TENANT_QUOTAS=_quotas(engines=2)):  # e-acme is live already
        assert (
            bob.post("/api/engines/", {"model_version": version.pk, "namespace": namespace.pk}, format="json").status_code == 202
        )
        answer = bob.post("/api/engines/", {"model_version": version.pk, "namespace": namespace.pk, "name": "x"}, format="json")
        assert (answer.status_code, answer.json()) == _refusal("engines", 2, "live engines serving the tenant's namespaces")
        assert Engine.objects.filter(namespace__tenant=world["acme"]).count() == 2
        # A stopped engine frees its place.
        Engine.objects.filter(name="e-acme").update(status="stopped")
        assert bob.post("/api/engines/", {"model_version": version.pk, "namespace": namespace.pk, "name": "y"},
                        format="json").status_code == 202  # fmt: skip


def test_jobs_in_flight(world) -> None:
    bob = world["clients"]["bob"]
    with override_settings(TENANT_QUOTAS=_quotas(jobs=1)):  # world's prewarm job is queued
        answer = bob.post("/api/prewarm-jobs/", {"namespace": world["ns"]["acme"].pk, "engine": world["engine"].pk},
                          format="json")  # fmt: skip
        assert (answer.status_code, answer.json()) == _refusal(
            "jobs", 1, "queued or running prewarm and comparison jobs of the tenant"
        )
        # The finished job frees its place.
        PrewarmJob.objects.filter(pk=world["job"].pk).update(status="succeeded")
        with transaction.atomic():
            quota_check(tenant=world["acme"], kind="jobs")
    assert PrewarmJob.objects.count() == 1


def test_prefix_heat_holds_a_bounded_number_of_prompts_per_namespace(world) -> None:
    bob, ns = world["clients"]["bob"], world["ns"]["acme"]
    with override_settings(TENANT_QUOTAS=_quotas(prefix_heat=2)):
        for n in range(2):
            body = {"messages": [{"role": "user", "content": f"question {n}"}], "hits": 1}
            assert bob.post(f"/api/namespaces/{ns.pk}/prefix-heat/", body, format="json").status_code == 200
        more = bob.post(f"/api/namespaces/{ns.pk}/prefix-heat/", {"messages": [{"role": "user", "content": "new"}]},
                        format="json")  # fmt: skip
        assert (more.status_code, more.json()) == _refusal("prefix_heat", 2, "distinct prompts in this namespace's prefix heat")
        # A prompt already there still adds hits; the gateway's reports of new ones are dropped, not errors.
        again = bob.post(f"/api/namespaces/{ns.pk}/prefix-heat/", {"messages": [{"role": "user", "content": "question 0"}],
                         "hits": 3}, format="json")  # fmt: skip
        assert again.status_code == 200 and again.json()["hits"] == 4
        gateway_flush([], [(ns.pk, "d", [{"role": "user", "content": "from the gateway"}], None, 1)])
    assert PrefixHeat.objects.filter(namespace=ns).count() == 2


@pytest.mark.django_db(transaction=True)
def test_a_quota_is_checked_inside_the_creating_transaction() -> None:
    with pytest.raises(RuntimeError, match="must run inside the creating transaction"):
        quota_check(tenant=Tenant(pk=1, slug="t"), kind="engines")


@pytest.mark.django_db(transaction=True)
def test_concurrent_creates_never_pass_the_last_place_together(world) -> None:
    """Eight threads issue a key at once with one place left: exactly one succeeds."""
    with override_settings(TENANT_QUOTAS=_quotas(gateway_keys=1)):
        results: list[str] = []
        barrier = threading.Barrier(8)

        def issue(n: int) -> None:
            barrier.wait()
            try:
                gateway_key_issue(tenant=world["acme"], name=f"race-{n}", actor="race")
                results.append("issued")
            except QuotaExceeded:
                results.append("refused")
            except Exception as exc:  # SQLite's writer lock: a busy database is a refusal too, never a second key
                results.append(f"busy: {type(exc).__name__}")
            finally:
                connection.close()

        threads = [threading.Thread(target=issue, args=(n,)) for n in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert results.count("issued") == 1, results
    assert GatewayKey.objects.filter(tenant=world["acme"], created_at__lte=timezone.now()).count() == 1
