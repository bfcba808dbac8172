"""``python manage.py demo --no-serve``: the main job, end to end, as CI runs it.

Real vLLM engines, a real Celery worker on the filesystem broker, the test
database on SQLite: the embedded default, which the demo is the main job of.
Asserts the unsafe upgrade is caught on every prompt and the safe one is
clean, then checks the rows the dashboard reads. The scale-out run
(PostgreSQL + Redis) leaves it out: the same prewarm and comparison jobs run
there through a worker on Redis in ``test_vllm_jobs.py``.
"""

from __future__ import annotations

import json

import pytest

from cacheadmin.models import (
    AuditEvent,
    CacheNamespace,
    ComparisonJob,
    Engine,
    EngineAlarm,
    JobStatus,
    KvEventStream,
    ModelVersion,
    PrewarmJob,
)
from cacheadmin.services.demo import UNSAFE_REASON
from inference.corpus import load_corpus
from tests.helpers import manage, subprocess_env

pytestmark = [pytest.mark.vllm, pytest.mark.embedded_default, pytest.mark.django_db(transaction=True)]


def test_demo_catches_the_unsafe_upgrade_and_passes_the_safe_one(client, django_user_model) -> None:
    proc = manage("demo", "--no-serve", env=subprocess_env(), timeout=1800)
    assert proc.returncode == 0, proc.stderr[-4000:]
    summary = json.loads(proc.stdout)
    n = len(load_corpus("diagnostic"))
    assert summary["caught"] is True and summary["clean"] is True and summary["warm_faster"] is True

    v1, v2 = ModelVersion.objects.get(label="tiny-v1"), ModelVersion.objects.get(label="tiny-v2")
    assert [f for f in ModelVersion.IDENTITY_FIELDS if getattr(v1, f) != getattr(v2, f)] == ["weights"]
    assert CacheNamespace.objects.count() == 2

    unsafe = ComparisonJob.objects.get(pk=summary["unsafe"]["job"])
    safe = ComparisonJob.objects.get(pk=summary["safe"]["job"])
    assert unsafe.namespace.model_version == v1 and unsafe.engine.model_version == v2
    assert safe.namespace.model_version == v2
    assert unsafe.engine.identity_override == UNSAFE_REASON
    for job, deceptive in ((unsafe, n), (safe, 0)):
        assert job.status == JobStatus.SUCCEEDED
        assert summary["unsafe" if job == unsafe else "safe"] == {
            "job": job.pk,
            "prompts": n,
            "deceptive_hits": deceptive,
            "cached_tokens": job.cached_tokens,
            "ttft_cold_ms": round(job.ttft_cold_ms, 2),
            "ttft_warm_ms": round(job.ttft_warm_ms, 2),
        }
        results = list(job.results.all())
        assert len(results) == n
        for r in results:
            # Every prompt was served from the persistent tier or engine memory, whole blocks.
            assert r.cached_tokens == (r.prompt_tokens - 1) // 32 * 32
            assert r.control_tokens_equal is True
        assert job.cached_tokens == sum(r.cached_tokens for r in results)
    assert all(r.deceptive and not r.tokens_equal for r in unsafe.results.all())
    assert all(r.tokens_equal and r.max_logprob_delta <= r.tolerance and not r.deceptive for r in safe.results.all())
    assert safe.ttft_warm_ms < safe.ttft_cold_ms

    prewarms = list(PrewarmJob.objects.order_by("pk"))
    assert [(p.namespace.model_version.label, p.status, p.verified) for p in prewarms] == [
        ("tiny-v1", JobStatus.SUCCEEDED, n),
        ("tiny-v2", JobStatus.SUCCEEDED, n),
    ]
    assert (v1.status, v2.status) == ("draining", "active")
    assert Engine.objects.count() == 4
    assert set(Engine.objects.values_list("status", flat=True)) == {Engine.Status.STOPPED}
    assert AuditEvent.objects.filter(action="engine.start", reason=UNSAFE_REASON).count() == 1
    # Every engine was verified before use; the KV-event consumer watched the three serving ones,
    # and every block they stored belonged to the namespace each served: no isolation alarm.
    assert set(Engine.objects.values_list("verification", flat=True)) == {"verified"}
    streams = KvEventStream.objects.select_related("engine")
    assert sorted(s.engine.name.rsplit("-", 1)[0] for s in streams) == ["tiny-v1", "tiny-v2-safe", "tiny-v2-unsafe"]
    assert all(s.events > 0 and s.gaps == 0 and s.complete for s in streams)
    assert not EngineAlarm.objects.exists()

    # The dashboard shows it all; the detail page lists every prompt's verdict.
    client.force_login(django_user_model.objects.create_user("viewer", password="x"))
    page = client.get("/").content.decode()
    for text in ("tiny-v1", "tiny-v2", v1.weights[:12], v2.weights[:12], v1.tokenizer[:12], unsafe.namespace.storage_prefix):
        assert text in page
    detail = client.get(f"/comparison-jobs/{unsafe.pk}/").content.decode()
    assert detail.count("deceptive hit</td>") == n
    assert client.get(f"/comparison-jobs/{safe.pk}/").content.decode().count("correct hit</td>") == n
