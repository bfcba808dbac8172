"""Idempotency-Key records: no secret at rest, replays of secret-issuing calls,
expiry, the expiry sweep and the in-flight lease (cacheadmin.api.idempotency,
cacheadmin.services.idempotency)."""

from __future__ import annotations

import importlib
import threading
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import pytest
from django.apps import apps
from django.db import connection
from django.utils import timezone

from cacheadmin.models import GatewayKey
from cacheadmin.models.releases import IdempotencyKey
from cacheadmin.schedules import SCHEDULES
from cacheadmin.services.gateway import gateway_key_issue as real_gateway_key_issue
from cacheadmin.services.idempotency import (
    idempotency_key_claim,
    idempotency_key_record,
    idempotency_key_take_over,
    idempotency_key_withdraw,
    idempotency_keys_expire,
)
from cacheadmin.tasks import idempotency_keys_expire_task
from tests.helpers import rows_holding

pytestmark = pytest.mark.django_db

ISSUE = {"tenant": "acme", "name": "support-bot"}


def _issue(world: dict, key: str, body: dict | None = None) -> Any:
    return world["clients"]["alice"].post("/api/gateway-keys/", body or ISSUE, format="json", HTTP_IDEMPOTENCY_KEY=key)


def _age(record_key: str, seconds: float) -> None:
    """Move the record's attempt ``seconds`` into the past."""
    IdempotencyKey.objects.filter(key=record_key).update(created_at=timezone.now() - timedelta(seconds=seconds))


def test_an_issued_gateway_key_is_stored_nowhere_and_its_replay_says_so(world) -> None:
    first = _issue(world, "issue-1")
    assert first.status_code == 201, first.json()
    plain = first.json()["key"]
    secret = plain.split("_", 2)[2]
    assert plain.startswith("kvgw_") and len(secret) >= 40
    # Every text of every table, the Idempotency-Key record and the audit trail included.
    assert rows_holding(secret) == []
    record = IdempotencyKey.objects.get(key="issue-1")
    assert (record.status_code, record.response["key"], record.response["id"]) == (201, None, first.json()["id"])
    assert {k: v for k, v in record.response.items() if k != "key"} == {k: v for k, v in first.json().items() if k != "key"}

    replay = _issue(world, "issue-1")
    kid = first.json()["id"]
    assert replay.status_code == 409
    assert replay.json() == {
        "error": {
            "status": 409,
            "code": "already_issued",
            "message": f"the request with Idempotency-Key 'issue-1' already issued gateway key #{kid}; its key is shown "
            f"only once and is not kept, so it cannot be answered again: if that answer was lost, revoke gateway key "
            f"#{kid} and issue a new one",
        }
    }
    assert "Idempotent-Replayed" not in replay
    assert GatewayKey.objects.count() == 1  # the retry issued nothing
    other = _issue(world, "issue-1", {**ISSUE, "name": "other-bot"})
    assert (other.status_code, other.json()["error"]["code"]) == (409, "idempotency_conflict")
    assert GatewayKey.objects.count() == 1


def test_a_refused_issue_is_not_recorded_and_its_retry_acts(world) -> None:
    refused = _issue(world, "issue-2", {**ISSUE, "burst": 0})
    assert refused.status_code == 400
    assert not IdempotencyKey.objects.filter(key="issue-2").exists()
    assert _issue(world, "issue-2", {**ISSUE, "burst": 5}).status_code == 201


def test_an_expired_key_is_unknown_and_the_request_acts_again(world, settings) -> None:
    settings.IDEMPOTENCY_TTL_S = 3600
    first = _issue(world, "issue-3")
    _age("issue-3", 3599)
    assert _issue(world, "issue-3").json()["error"]["code"] == "already_issued"  # not yet expired
    _age("issue-3", 3601)
    again = _issue(world, "issue-3")
    assert again.status_code == 201 and again.json()["id"] != first.json()["id"]
    assert GatewayKey.objects.count() == 2
    record = IdempotencyKey.objects.get(key="issue-3")  # the same row, now the second request's
    assert (record.attempt, record.status_code, record.response["id"], record.response["key"]) == (
        2,
        201,
        again.json()["id"],
        None,
    )
    # An expired key may carry another body: it is unknown, not a conflict.
    _age("issue-3", 3601)
    other = _issue(world, "issue-3", {**ISSUE, "name": "other-bot"})
    assert (other.status_code, other.json()["name"]) == (201, "other-bot")


def test_a_replay_of_a_call_without_secrets_still_answers_the_first_answer(world) -> None:
    tenants = [
        world["clients"]["alice"].post(
            "/api/tenants/", {"slug": "initech", "name": "Initech"}, format="json", HTTP_IDEMPOTENCY_KEY="t-1"
        )
        for _ in range(2)
    ]
    assert [t.status_code for t in tenants] == [201, 201]
    assert tenants[1].json() == tenants[0].json() and tenants[1]["Idempotent-Replayed"] == "true"


def test_a_stale_in_flight_key_is_taken_over_once(world, settings, monkeypatch) -> None:
    settings.IDEMPOTENCY_LEASE_S = 120
    calls = []

    def killed_once(**kwargs: object) -> object:
        calls.append(kwargs["name"])
        if len(calls) == 1:
            raise SystemExit("worker killed")  # not an Exception: nothing withdraws the record, as with SIGKILL
        return real_gateway_key_issue(**kwargs)

    monkeypatch.setattr("cacheadmin.api.gateway_views.gateway_key_issue", killed_once)
    with pytest.raises(SystemExit):
        _issue(world, "issue-4")
    stuck = IdempotencyKey.objects.get(key="issue-4")
    assert (stuck.status_code, stuck.attempt) == (None, 1)
    busy = _issue(world, "issue-4")  # within the lease: the first request may still be running
    assert busy.status_code == 409 and busy.json()["error"]["message"] == (
        "the request with Idempotency-Key 'issue-4' is still being answered"
    )
    _age("issue-4", 119)
    assert _issue(world, "issue-4").status_code == 409
    # Another body never takes a key over, stale or not.
    _age("issue-4", 121)
    other = _issue(world, "issue-4", {**ISSUE, "name": "other-bot"})
    assert (other.status_code, other.json()["error"]["code"]) == (409, "idempotency_conflict")
    taken = _issue(world, "issue-4")
    assert taken.status_code == 201 and GatewayKey.objects.count() == 1
    record = IdempotencyKey.objects.get(key="issue-4")
    assert (record.attempt, record.status_code, record.response["key"]) == (2, 201, None)
    assert _issue(world, "issue-4").json()["error"]["code"] == "already_issued"
    assert calls == ["support-bot"] * 2 and GatewayKey.objects.count() == 1


def test_of_two_retries_holding_the_same_stale_record_one_takes_it_over(world) -> None:
    stale = IdempotencyKey.objects.create(key="k", actor="user:1", method="POST", path="/api/tenants", request_digest="d")
    _age("k", 3600)
    first, second = IdempotencyKey.objects.get(pk=stale.pk), IdempotencyKey.objects.get(pk=stale.pk)
    now = timezone.now()
    assert idempotency_key_take_over(record=first, method="POST", path="/api/tenants", digest="d", now=now) is True
    assert idempotency_key_take_over(record=second, method="POST", path="/api/tenants", digest="d", now=now) is False
    assert (first.attempt, IdempotencyKey.objects.get(pk=stale.pk).attempt) == (2, 2)
    # The attempt that lost the row (second's snapshot is attempt 1) can neither record nor withdraw it.
    assert idempotency_key_record(record=second, status_code=201, response={"id": 9}) is False
    idempotency_key_withdraw(record=second)
    assert IdempotencyKey.objects.get(pk=stale.pk).status_code is None
    assert idempotency_key_record(record=first, status_code=201, response={"id": 7, "token": "t"}, secret_fields=["token"])
    assert IdempotencyKey.objects.get(pk=stale.pk).response == {"id": 7, "token": None}


@pytest.mark.django_db(transaction=True)
def test_concurrent_retries_of_a_stale_key_take_it_over_once(settings) -> None:
    settings.IDEMPOTENCY_LEASE_S = 120
    IdempotencyKey.objects.create(key="k", actor="user:1", method="POST", path="/api/tenants", request_digest="d")
    _age("k", 121)
    start = threading.Barrier(4)

    def retry() -> bool:
        try:
            start.wait(timeout=30)
            return idempotency_key_claim(key="k", actor="user:1", method="POST", path="/api/tenants", digest="d").acting
        finally:
            connection.close()

    with ThreadPoolExecutor(4) as pool:
        acting = [f.result(timeout=60) for f in [pool.submit(retry) for _ in range(4)]]
    assert sorted(acting) == [False, False, False, True]
    assert IdempotencyKey.objects.get(key="k").attempt == 2


def test_the_sweep_deletes_exactly_the_expired_records_in_batches(world, settings, monkeypatch) -> None:
    settings.IDEMPOTENCY_TTL_S, settings.IDEMPOTENCY_EXPIRE_BATCH = 3600, 2
    ages = {"old-1": 7200, "old-2": 5000, "old-in-flight": 3700, "fresh": 3500, "fresh-in-flight": 10}
    for key, age in ages.items():
        done = "in-flight" not in key
        IdempotencyKey.objects.create(
            key=key, actor="user:1", method="POST", path="/api/tenants", request_digest="d",
            status_code=201 if done else None, response={"id": 1} if done else None,
        )  # fmt: skip
        _age(key, age)
    queued = []
    monkeypatch.setattr(idempotency_keys_expire_task, "delay", lambda: queued.append(1))
    idempotency_keys_expire_task()  # a full batch: the two oldest, and the next batch queued
    assert sorted(IdempotencyKey.objects.values_list("key", flat=True)) == ["fresh", "fresh-in-flight", "old-in-flight"]
    assert queued == [1]
    idempotency_keys_expire_task()
    assert sorted(IdempotencyKey.objects.values_list("key", flat=True)) == ["fresh", "fresh-in-flight"]
    assert queued == [1]  # 1 of 2: the backlog is drained
    assert idempotency_keys_expire() == {"deleted": 0, "more": False}


def test_the_sweep_is_scheduled_and_its_task_registered() -> None:
    from celery import current_app

    import cacheadmin.tasks  # noqa: F401 - registers the tasks

    spec = next(s for s in SCHEDULES if s.name == "idempotency-keys-expire")
    assert (spec.task, spec.every_s, spec.expires_s) == ("cacheadmin.idempotency_keys_expire", 3600, 3000)
    assert spec.task in current_app.tasks


def test_the_migration_blanks_keys_recorded_before_it(db) -> None:
    migration = importlib.import_module("cacheadmin.migrations.0017_idempotency_secrets_expiry")
    answer = {"id": 3, "name": "bot", "prefix": "abc", "key": "kvgw_abc_secret"}
    issued = IdempotencyKey.objects.create(
        key="a", actor="user:1", method="POST", path="/api/gateway-keys", request_digest="d", status_code=201, response=answer
    )
    other = IdempotencyKey.objects.create(
        key="b", actor="user:1", method="POST", path="/api/tenants", request_digest="d", status_code=201, response={"key": "k"}
    )
    migration.withhold_recorded_keys(apps, None)
    assert IdempotencyKey.objects.get(pk=issued.pk).response == {**answer, "key": None}
    assert IdempotencyKey.objects.get(pk=other.pk).response == {"key": "k"}  # not a secret-issuing call
