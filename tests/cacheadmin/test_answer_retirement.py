"""A confirmed deceptive hit retires the suspect engine's cached answers of the
namespace from both gateway layers, on the deployment's stores (SQLite files by
default; Redis when ``GATEWAY_REDIS_URL`` is set), before routing resumes:
recorded with the verdict, run once committed, run again at resume, and resume
refuses while a store cannot complete it."""

from __future__ import annotations

import socket
import sqlite3
from datetime import UTC, datetime, timedelta

import numpy as np
import pytest
from django.conf import settings
from django.db import transaction
from django.utils import timezone

from cacheadmin.models import AnswerRetirement, AuditEvent, Engine, NamespaceRouting, ShadowCheck
from cacheadmin.services.gateway import namespace_routing_resume
from cacheadmin.services.gateway_stores import response_store, semantic_store
from cacheadmin.services.retirement import answer_retirement_run
from cacheadmin.services.shadow import _deceptive, served_verdict, shadow_checks_recover
from gateway.layers.base import Provenance
from gateway.layers.semantic.entries import SemanticEntry
from inference.errors import Refused
from tests.helpers import manage, subprocess_env

pytestmark = pytest.mark.django_db(transaction=True)

ANSWER = {"text": "Four.", "completion_tokens": 3, "finish_reason": "stop"}
GOOD_AT = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)


def k(n: int) -> str:
    return f"{n:064x}"


@pytest.fixture
def suspect(world) -> dict:
    """acme's namespace with answers of its engine and of another one in both layers, a good
    check of the engine (its answer computed at GOOD_AT), and a verified reference engine."""
    ns, engine = world["ns"]["acme"], world["engine"]
    other = Engine.objects.create(name="e-other", model_version=engine.model_version, base_url="http://127.0.0.1:2",
                                  status="ready")  # fmt: skip
    witness = Engine.objects.create(
        name="ref-v1", role="reference", model_version=engine.model_version, base_url="http://127.0.0.1:4", status="ready",
        prefix_caching=False, verification="verified", verified_at=timezone.now(),
    )  # fmt: skip
    ShadowCheck.objects.create(namespace=ns, engine=engine, request={}, status="matched", served_layer="response",
                               served_answer=ANSWER, computed_at=GOOD_AT)  # fmt: skip
    good = GOOD_AT.timestamp()
    responses, semantic = response_store(), semantic_store()
    prefix = ns.storage_prefix
    for n, prov in ((1, Provenance(engine.pk, good - 60)), (2, Provenance(engine.pk, good + 60)),
                    (3, Provenance(other.pk, good + 60))):  # fmt: skip
        responses.put(prefix, k(n), b'{"choices":[]}', ttl_s=None, max_bytes=None, provenance=prov)
    for name, prov in (("s-suspect", Provenance(engine.pk, good + 60)), ("s-other", Provenance(other.pk, good + 60))):
        vector = np.ones(8, dtype=np.float32) / np.sqrt(8, dtype=np.float32)
        entry = SemanticEntry(entry_id=name, prefix=prefix, partition="ab", tenant="1", model_id="m", text=name,
                              vector=vector, response=b"{}", tags=(), created_at=good - 600, expires_at=None)  # fmt: skip
        semantic.add(entry, provenance=prov)
    check = ShadowCheck.objects.create(
        namespace=ns, engine=engine, request={}, cached_tokens=32, served_layer="response", served_answer=ANSWER,
        computed_at=GOOD_AT + timedelta(minutes=2),
    )  # fmt: skip
    return {**world, "responses": responses, "semantic": semantic, "check": check, "witness": witness, "other": other}


def _confirm(suspect: dict) -> AnswerRetirement:
    check = ShadowCheck.objects.select_related("namespace", "namespace__tenant").get(pk=suspect["check"].pk)
    with transaction.atomic():
        retirement = _deceptive(check, suspect["engine"], suspect["witness"], 0)
    assert retirement is not None
    return retirement


def test_a_confirmed_deceptive_hit_retires_the_engines_answers_since_its_last_good_check_before_routing_resumes(
    suspect,
) -> None:
    ns, prefix = suspect["ns"]["acme"], suspect["ns"]["acme"].storage_prefix
    retirement = _confirm(suspect)
    # Intent recorded with the verdict, the hold in the same transaction.
    assert (retirement.engine_ref, retirement.since, retirement.completed_at) == (suspect["engine"].pk, GOOD_AT, None)
    assert NamespaceRouting.objects.get(namespace=ns).suspended_at is not None
    done = answer_retirement_run(retirement=retirement, actor="t")
    assert done.completed_at is not None and done.removed == {"response": 1, "semantic": 1} and done.runs == 1
    assert [e.key for e in suspect["responses"].entries(prefix)] == [k(1), k(3)]
    assert [e.key for e in suspect["semantic"].entries(prefix)] == ["s-other"]
    # A gateway that had not yet seen the suspension stores one more answer of the engine.
    late = Provenance(suspect["engine"].pk, timezone.now().timestamp())
    suspect["responses"].put(prefix, k(4), b"{}", ttl_s=None, max_bytes=None, provenance=late)
    resumed = suspect["clients"]["alice"].post(f"/api/namespaces/{ns.pk}/resume-routing/", {"reason": "fixed"}, format="json")
    assert resumed.status_code == 200, resumed.json()
    assert [e.key for e in suspect["responses"].entries(prefix)] == [k(1), k(3)]
    row = AnswerRetirement.objects.get()
    assert (row.runs, row.removed) == (2, {"response": 2, "semantic": 1})
    assert NamespaceRouting.objects.get(namespace=ns).suspended_at is None
    assert AuditEvent.objects.filter(action="gateway.answers_retire").count() == 2


def test_resume_refuses_while_a_store_cannot_retire_and_a_lost_worker_loses_nothing(suspect, monkeypatch) -> None:
    ns, prefix = suspect["ns"]["acme"], suspect["ns"]["acme"].storage_prefix
    _confirm(suspect)  # the worker is killed before it carries the retirement out
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        closed = sock.getsockname()[1]
    monkeypatch.setattr(settings, "GATEWAY_REDIS_URL", f"redis://127.0.0.1:{closed}/2")
    with pytest.raises(Refused, match="stays suspended: the cached answers of engine"):
        namespace_routing_resume(namespace=ns, actor="t", reason="fixed")
    assert NamespaceRouting.objects.get(namespace=ns).suspended_at is not None
    refused = suspect["clients"]["alice"].post(f"/api/namespaces/{ns.pk}/resume-routing/", {"reason": "x"}, format="json")
    assert refused.status_code == 409 and NamespaceRouting.objects.get(namespace=ns).suspended_at is not None
    row = AnswerRetirement.objects.get()
    assert row.completed_at is None and "response:" in row.error and "semantic:" in row.error
    monkeypatch.undo()
    # The periodic recovery carries it out.
    shadow_checks_recover()
    row.refresh_from_db()
    assert row.completed_at is not None and row.removed == {"response": 1, "semantic": 1} and row.error == ""
    assert [e.key for e in suspect["responses"].entries(prefix)] == [k(1), k(3)]
    namespace_routing_resume(namespace=ns, actor="t", reason="fixed")
    assert NamespaceRouting.objects.get(namespace=ns).suspended_at is None


@pytest.mark.embedded_default  # the SQLite stores; the scale-out run's Redis case is the test above
def test_resume_refuses_with_409_while_the_embedded_sqlite_store_is_locked_and_records_the_attempt(suspect) -> None:
    """The embedded default: the semantic store's SQLite file held by another process's write lock.
    Resume is refused as documented (409, exit 4), names no file path, counts the run and its error,
    and goes through once the lock is released."""
    ns = suspect["ns"]["acme"]
    _confirm(suspect)
    path = settings.GATEWAY_DIR / "semantic-cache.sqlite3"
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")
    try:
        refused = suspect["clients"]["bob"].post(f"/api/namespaces/{ns.pk}/resume-routing/", {"reason": "x"}, format="json")
        assert refused.status_code == 409, refused.json()
        message = refused.json()["error"]["message"]
        assert "(the semantic cache store did not answer)" in message and str(settings.GATEWAY_DIR) not in message
        cli = manage(
            "gateway", "resume", str(ns.pk), "--reason", "fixed", env=subprocess_env(GATEWAY_DIR=str(settings.GATEWAY_DIR))
        )
        assert cli.returncode == 4, cli.stderr
        row = AnswerRetirement.objects.get()
        assert (row.runs, row.completed_at) == (2, None) and row.error.startswith("semantic: ")
        assert NamespaceRouting.objects.get(namespace=ns).suspended_at is not None
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    resumed = suspect["clients"]["bob"].post(f"/api/namespaces/{ns.pk}/resume-routing/", {"reason": "x"}, format="json")
    assert resumed.status_code == 200, resumed.json()
    row = AnswerRetirement.objects.get()
    assert (row.runs, row.error, row.removed) == (3, "", {"response": 1, "semantic": 1})


def test_an_unconfirmed_deceptive_hit_retires_nothing(suspect) -> None:
    Engine.objects.filter(pk=suspect["witness"].pk).update(verification="unverified")
    check = ShadowCheck.objects.select_related("namespace", "namespace__tenant").get(pk=suspect["check"].pk)
    with transaction.atomic():
        assert _deceptive(check, suspect["engine"], suspect["witness"], 0) is None
    assert AnswerRetirement.objects.count() == 0
    assert len(suspect["responses"].entries(suspect["ns"]["acme"].storage_prefix)) == 3


@pytest.mark.parametrize(
    ("served", "candidates", "control_delta", "expected"),
    [
        # The same tokens: matched.
        ([5, 6, 7], [{5: -0.1}, {6: -0.2}, {7: -0.3}], 0.0, (False, None, None, None)),
        # Another token at 1, far below the reference's (2.0 nats): deceptive.
        ([5, 9, 7], [{5: -0.1}, {6: -0.2, 9: -2.2}, {7: -0.3}], 0.0, (True, 1, None, None)),
        # Another token at 1 that was not among the reference's candidates at all: deceptive.
        ([5, 8, 7], [{5: -0.1}, {6: -0.2, 9: -2.2}, {7: -0.3}], 0.0, (True, 1, None, None)),
        # A near tie (0.004 nats under the reference's token): batching may flip it, not deceptive.
        ([5, 9, 7], [{5: -0.1}, {6: -0.7, 9: -0.704}, {7: -0.3}], 0.0, (False, 1, None, 0.004)),
        # 0.05 nats apart: a tie only because the reference's own runs differ by 0.02 nats (x4 = 0.08).
        ([5, 9, 7], [{5: -0.1}, {6: -0.7, 9: -0.75}, {7: -0.3}], 0.02, (False, 1, None, 0.05)),
        ([5, 9, 7], [{5: -0.1}, {6: -0.7, 9: -0.75}, {7: -0.3}], 0.0, (True, 1, None, None)),
        # Candidates not aligned with the ids: no tie recognised.
        ([5, 9, 7], None, 0.0, (True, 1, None, None)),
    ],
)
def test_served_verdict_tells_a_near_tie_from_a_deceptive_answer(served, candidates, control_delta, expected) -> None:
    deceptive, divergence, noise, tie = served_verdict([5, 6, 7], [5, 6, 7], served, candidates, control_delta)
    assert (deceptive, divergence, noise) == expected[:3]
    assert (tie is None and expected[3] is None) or tie == pytest.approx(expected[3])


def test_served_verdict_after_the_control_diverged_is_noise() -> None:
    # The reference's own second run diverged at 1: a served divergence at 2 is within its noise.
    assert served_verdict([5, 6, 7], [5, 8, 7], [5, 6, 9], None, 0.0) == (False, 2, 1, None)
    assert served_verdict([5, 6, 7], [5, 6, 8], [5, 9, 7], None, 0.0) == (True, 1, 2, None)
