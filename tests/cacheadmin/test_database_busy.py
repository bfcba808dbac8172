"""A busy database (another process holds SQLite's write lock): reads go on,
token bookkeeping is skipped, writes answer 503 with Retry-After, and
/healthz says writes are unavailable."""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Callable, Iterator

import pytest
from django.contrib.auth.models import User
from django.core.exceptions import ImproperlyConfigured
from django.db import connection
from rest_framework.test import APIClient

from cacheadmin.env import database_from_url
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


@pytest.fixture
def short_lock_timeout() -> Iterator[None]:
    """PostgreSQL: this process waits 1 s for a lock instead of DATABASE_LOCK_TIMEOUT_MS (quicker test)."""
    options = connection.settings_dict.setdefault("OPTIONS", {})
    previous = options.get("options")
    connection.close()
    options["options"] = "-c lock_timeout=1000 -c statement_timeout=25000"
    yield
    connection.close()
    if previous is None:
        options.pop("options", None)
    else:
        options["options"] = previous


def test_a_postgresql_table_lock_answers_503_with_retry_after_and_healthz_probes_the_write(short_lock_timeout) -> None:
    """The example: another session's LOCK TABLE made a write wait until gunicorn's
    timeout (HTML 500 after 31 s) while /healthz said writable."""
    if connection.vendor != "postgresql":
        pytest.skip("PostgreSQL's lock timeout; SQLite's one-writer lock is the test above")
    import psycopg

    user = User.objects.create_user("ops")
    _, key = api_token_issue(user=user, name="t", scope="admin", tenant=None, actor="setup")
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {key}")
    db = connection.settings_dict
    other = psycopg.connect(
        host=db["HOST"], port=db["PORT"] or 5432, user=db["USER"], password=db["PASSWORD"], dbname=db["NAME"]
    )  # fmt: skip
    try:
        other.execute(f"LOCK TABLE {Tenant._meta.db_table} IN ACCESS EXCLUSIVE MODE")  # a migration's ALTER takes this
        started = time.monotonic()
        created = client.post("/api/tenants/", {"slug": "acme", "name": "Acme"}, format="json")
        assert time.monotonic() - started < 5  # the lock timeout, not gunicorn's
        assert (created.status_code, created["Retry-After"]) == (503, "5")
        assert created.json()["error"] == {
            "status": 503, "code": "database_busy", "message": "the database is busy; retry in 5 s",
        }  # fmt: skip
        health = APIClient().get("/healthz")
        assert (health.status_code, health.json()) == (503, {"status": "degraded", "database": {"read": True, "write": False}})
    finally:
        other.rollback()
        other.close()
    health = APIClient().get("/healthz")
    assert (health.status_code, health.json()) == (200, {"status": "ok", "database": {"read": True, "write": True}})
    assert not Tenant.objects.filter(slug="acme").exists()


def test_postgresql_connections_carry_lock_and_statement_timeouts(monkeypatch) -> None:
    assert database_from_url("postgres://u@db/kvcp")["OPTIONS"] == {"options": "-c lock_timeout=5000 -c statement_timeout=25000"}
    monkeypatch.setenv("DATABASE_LOCK_TIMEOUT_MS", "250")
    monkeypatch.setenv("DATABASE_STATEMENT_TIMEOUT_MS", "0")
    assert database_from_url("postgres://u@db/kvcp")["OPTIONS"] == {"options": "-c lock_timeout=250 -c statement_timeout=0"}


@pytest.mark.parametrize("url", ["postgres://u@db/kvcp", "sqlite:////tmp/kvcp.sqlite3"])
def test_connections_persist_with_health_checks(monkeypatch, url) -> None:
    monkeypatch.delenv("DATABASE_CONN_MAX_AGE", raising=False)
    entry = database_from_url(url)
    assert (entry["CONN_MAX_AGE"], entry["CONN_HEALTH_CHECKS"]) == (300, True)
    monkeypatch.setenv("DATABASE_CONN_MAX_AGE", "0")
    assert database_from_url(url)["CONN_MAX_AGE"] == 0
    for bad in ("-1", "5m", ""):
        monkeypatch.setenv("DATABASE_CONN_MAX_AGE", bad)
        with pytest.raises(ImproperlyConfigured, match="DATABASE_CONN_MAX_AGE"):
            database_from_url(url)
