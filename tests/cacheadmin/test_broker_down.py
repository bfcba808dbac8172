"""A broker that does not answer: a write that starts a job still answers with the
job it recorded (the row is the outbox), a retry under the same Idempotency-Key gets
that job, and the job is sent once the broker answers again."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta

import pytest
from django.utils import timezone

from cacheadmin.celery import app
from cacheadmin.models import PrewarmJob, RetentionPolicy
from cacheadmin.services.jobs import jobs_recover_lost
from inference.engines.launcher import free_port


@pytest.fixture
def broker_down(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """Celery's broker moved to a Redis address where nothing listens (a Redis taken down);
    the real broker's connection pools are set aside untouched and put back afterwards."""
    conf = ("broker_url", "broker_write_url", "broker_transport", "broker_transport_options")
    saved_conf = {name: app.conf[name] for name in conf}
    saved_pools = (app._pool, app.amqp._producer_pool)
    port = free_port()
    url = f"redis://127.0.0.1:{port}/0"
    app._pool, app.amqp._producer_pool = None, None
    # Celery reads CELERY_BROKER_URL from the environment before its configuration (the scale-out run sets it).
    monkeypatch.setenv("CELERY_BROKER_URL", url)
    monkeypatch.delenv("CELERY_BROKER_WRITE_URL", raising=False)
    # As a deployment with a Redis broker has it: no transport of the embedded default's.
    app.conf.update(broker_url=url, broker_write_url=None, broker_transport=None, broker_transport_options={})
    try:
        connection = app.connection_for_write()
        assert (connection.transport_cls, connection.hostname, connection.port) == ("redis", "127.0.0.1", port)
        yield url
    finally:
        # Put back whatever happened: a test after this one publishes on the real broker.
        if app._pool is not None:
            app._pool.force_close_all()  # the unreachable broker's pool alone
        app._pool, app.amqp._producer_pool = saved_pools
        app.conf.update(saved_conf)


@pytest.mark.django_db
def test_a_job_started_while_the_broker_is_down_is_answered_kept_and_sent_later(
    world, broker_down, django_capture_on_commit_callbacks, caplog
) -> None:
    c, acme_ns = world["clients"], world["ns"]["acme"]
    RetentionPolicy.objects.get_or_create(namespace=acme_ns, defaults={"versions_kept": 1})
    body = {"namespace": acme_ns.pk, "engine": world["engine"].pk}
    before = PrewarmJob.objects.count()
    with django_capture_on_commit_callbacks(execute=True):
        first = c["bob"].post("/api/prewarm-jobs/", body, format="json", HTTP_IDEMPOTENCY_KEY="down-1")
    assert first.status_code == 201, first.content[:300]
    job = PrewarmJob.objects.get(pk=first.json()["id"])
    assert job.status == "queued"
    assert "stays recorded; jobs_recover_lost" in caplog.text and f"PrewarmJob #{job.pk}" in caplog.text
    with django_capture_on_commit_callbacks(execute=True):
        again = c["bob"].post("/api/prewarm-jobs/", body, format="json", HTTP_IDEMPOTENCY_KEY="down-1")
    assert (again.status_code, again.json()["id"], again["Idempotent-Replayed"]) == (201, job.pk, "true")
    assert PrewarmJob.objects.count() == before + 1
    # Still down: the recovery's own send fails the same way and keeps the job queued.
    PrewarmJob.objects.filter(pk=job.pk).update(created_at=timezone.now() - timedelta(hours=1))
    with django_capture_on_commit_callbacks(execute=True):
        assert jobs_recover_lost()["resent"] >= 1
    assert PrewarmJob.objects.get(pk=job.pk).status == "queued"
