"""Release-critical jobs, housekeeping and shadow checks have queues of their own, and
the shadow backlog is bounded (dropped and counted, never queued)."""

from __future__ import annotations

import pytest
from django.conf import settings

import cacheadmin.tasks  # noqa: F401 - registers every task
from cacheadmin.celery import app
from cacheadmin.metrics.worker import families
from cacheadmin.models import ShadowCheck
from cacheadmin.services.shadow import shadow_check_enqueue

RELEASE = {"prewarm_job", "comparison_job", "registration_job", "eviction_run", "engine_boot"}


def test_every_task_has_a_queue_and_release_work_comes_first() -> None:
    queues = [q.name for q in settings.CELERY_TASK_QUEUES]
    assert queues == ["release", "default", "housekeeping", "shadow"]
    routed = {name: app.amqp.router.route({}, name)["queue"].name for name in app.tasks if name.startswith("cacheadmin.")}
    assert {n.removeprefix("cacheadmin.") for n, q in routed.items() if q == "release"} == RELEASE
    assert routed["cacheadmin.shadow_check"] == "shadow"
    assert set(routed.values()) == {"release", "housekeeping", "shadow"}  # nothing falls through to default
    if settings.CELERY_BROKER_URL.startswith("redis"):
        assert settings.CELERY_BROKER_TRANSPORT_OPTIONS["queue_order_strategy"] == "priority"


@pytest.mark.django_db
def test_shadow_samples_past_the_backlog_are_dropped_and_counted(world, settings) -> None:
    settings.SHADOW_BACKLOG_MAX = 2
    dropped = families()["shadow_dropped"]
    before = dropped._value.get()
    sample = {"namespace_pk": world["ns"]["acme"].pk, "engine_id": world["engine"].pk, "endpoint": "chat",
              "body": {"messages": [{"role": "user", "content": "hi"}]}, "cached_tokens": 32}  # fmt: skip
    made = [shadow_check_enqueue(**sample) for _ in range(3)]
    assert [m is not None for m in made] == [True, True, False]
    assert ShadowCheck.objects.count() == 2 and dropped._value.get() - before == 1
    ShadowCheck.objects.filter(pk=made[0].pk).update(status="matched")  # one judged: room for one more
    assert shadow_check_enqueue(**sample) is not None
