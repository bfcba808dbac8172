"""A busy database (another process holds SQLite's write lock): reads go on,
token bookkeeping is skipped, writes answer 503 with Retry-After, and
/healthz says writes are unavailable."""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Callable, Iterator

import pytest
from django.contrib.auth.models import User
from django.db import connection
from rest_framework.test import APIClient

from cacheadmin.models import ApiToken, Tenant
from cacheadmin.services.api_tokens import api_token_issue

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def write_lock() -> Iterator[Callable[[], None]]:
    """``take()`` starts another process's write transaction on the same
    database file (a worker mid-job); it ends after the test."""
    held: list[sqlite3.Connection] = []

    def take() -> None:
        other = sqlite3.connect(connection.settings_dict["NAME"], isolation_level=None, timeout=0)
        other.execute("BEGIN IMMEDIATE")
        held.append(other)

    yield take
    for other in held:
        other.execute("ROLLBACK")
        other.close()


@pytest.fixture
def short_busy_timeout() -> Iterator[None]:
    """This process waits 1 s for the lock instead of 30 (same behaviour, quicker test)."""
    options = connection.settings_dict["OPTIONS"]
    previous = options.get("timeout")
    connection.close()
    options["timeout"] = 1
    yield
    connection.close()
    options["timeout"] = previous


def test_reads_go_on_and_writes_answer_503_while_another_writer_holds_the_lock(write_lock, short_busy_timeout) -> None:
    if connection.vendor != "sqlite":
        pytest.skip("SQLite's one-writer lock; PostgreSQL locks rows, and its readers never wait for writers")
    user = User.objects.create_user("ops")
    token, key = api_token_issue(user=user, name="t", scope="admin", tenant=None, actor="setup")
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {key}")
    write_lock()

    started = time.monotonic()
    listed = client.get("/api/tenants/")
    assert listed.status_code == 200, listed.content
    assert time.monotonic() - started < 0.9  # the token's last_used_at write was skipped, not waited for
    assert ApiToken.objects.get(pk=token.pk).last_used_at is None

    created = client.post("/api/tenants/", {"slug": "acme", "name": "Acme"}, format="json")
    assert created.status_code == 503
    assert created["Retry-After"] == "5"
    assert created.json()["error"]["code"] == "database_busy"

    health = APIClient().get("/healthz")
    assert (health.status_code, health.json()) == (503, {"status": "degraded", "database": {"read": True, "write": False}})
    assert health["Retry-After"] == "5"


def test_healthz_reports_writes_available_when_no_one_holds_the_lock() -> None:
    health = APIClient().get("/healthz")
    assert (health.status_code, health.json()) == (200, {"status": "ok", "database": {"read": True, "write": True}})
    assert not Tenant.objects.filter(slug="acme").exists()
