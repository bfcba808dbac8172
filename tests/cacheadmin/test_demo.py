"""``python manage.py demo --no-serve``: the main job, end to end, as CI runs it.

Real vLLM engines, a real Celery worker on the filesystem broker, the real
gateway (uvicorn processes) under a steady traffic generator, the test
database on SQLite: the embedded default, which the demo is the main job of.
Asserts the release under live traffic (planned and moved over the API,
prewarmed from live heat, shadow-verified, demoted by the sweep, rolled back
from the cold tier), the unsafe upgrade caught on every prompt and the safe
one clean, then checks the rows the dashboard reads. The scale-out run
(PostgreSQL + Redis) leaves it out: the same jobs run there through a worker
on Redis in ``test_vllm_jobs.py``, the gateway in ``tests/gateway``.
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
    EvictionAction,
    EvictionRun,
    GatewayStat,
    JobStatus,
    KvEventStream,
    ModelVersion,
    PrewarmJob,
    ShadowCheck,
)
from cacheadmin.models.releases import PrefixHeat, Release
from cacheadmin.services.demo import UNSAFE_REASON
from inference.corpus import load_corpus
from inference.engines.launcher import free_port
from tests.helpers import manage, purge_broker, subprocess_env


def _shown(value: object) -> str:
    """A check's findings in full (pytest cuts a message that is not a string to 240 characters)."""
    return json.dumps(value, default=str)


pytestmark = [pytest.mark.vllm, pytest.mark.embedded_default, pytest.mark.django_db(transaction=True)]


def test_demo_ships_v2_under_live_traffic_catches_the_unsafe_upgrade_and_rolls_back_from_cold(
    client, django_user_model, tmp_path
) -> None:
    env = subprocess_env(
        GATEWAY_ADDR=f"127.0.0.1:{free_port()}", GATEWAY_DIR=str(tmp_path / "gateway"),
        KV_EVENTS_METRICS_ADDR=f"127.0.0.1:{free_port()}",
    )  # fmt: skip
    proc = manage("demo", "--no-serve", "--model", "tiny", env=env, timeout=1800)
    purge_broker()  # what the demo's beat sent last is not for the next test's worker
    assert proc.returncode == 0, proc.stderr[-6000:]
    summary = json.loads(proc.stdout)
    n = len(load_corpus("diagnostic"))
    assert (summary["caught"], summary["clean"], summary["released"], summary["shadow_verified"], summary["ok"]) == (
        True, True, True, True, True,
    )  # fmt: skip

    v1, v2 = ModelVersion.objects.get(label="tiny-v1"), ModelVersion.objects.get(label="tiny-v2")
    assert summary["model"] == {
        "key": "tiny", "title": "tiny random-weight models (v1, v2)", "served_name": "tiny",
        "parameters": summary["model"]["parameters"], "dtype": "float32", "versions": ["tiny-v1", "tiny-v2"],
    }  # fmt: skip
    assert summary["model"]["parameters"] > 0 and summary["policy_answers"] == []
    assert [f for f in ModelVersion.IDENTITY_FIELDS if getattr(v1, f) != getattr(v2, f)] == ["weights"]
    ns1, ns2 = CacheNamespace.objects.get(model_version=v1), CacheNamespace.objects.get(model_version=v2)
    assert CacheNamespace.objects.count() == 2

    # The release: planned over the API by release tooling, prewarmed from live heat, 10 % then 100 %,
    # demoted by the sweep, rolled back from the cold tier.
    release = Release.objects.get(from_version=v1)
    first = Release.objects.get(from_version=None)
    tooling = release.created_by  # the service account and its token, as the audit trail names them
    assert tooling.startswith("release-tooling (token demo release ")
    assert (first.classification, first.to_version, first.created_by) == ("first_deployment", v1, tooling)
    assert summary["release"] == {
        "id": release.pk, "classification": "incompatible", "differing": ["weights"], "decision": "new_namespace",
        "ready": True, "traffic_percent": 100, "status": "rolled_back", "rolled_back_from_cold": True,
        "entries_restored": summary["release"]["entries_restored"],
    }  # fmt: skip
    assert summary["release"]["entries_restored"] > 0
    assert (release.decided_by, release.to_namespace, release.from_namespace) == (tooling, ns2, ns1)
    events = list(release.events.order_by("at", "id").values_list("kind", "actor"))
    assert events == [
        ("created", tooling), ("decided", tooling), ("ready", "policy"), ("marked_ready", tooling), ("traffic", tooling),
        ("traffic", tooling), ("rolled_back", tooling),
    ]  # fmt: skip
    assert [e.detail["after"] for e in release.events.filter(kind="traffic").order_by("at", "id")] == [10, 100]
    prewarm = PrewarmJob.objects.get(pk=release.prewarm_job_id)
    assert (prewarm.corpus, prewarm.status, prewarm.namespace) == (f"heat:{ns1.pk}", JobStatus.SUCCEEDED, ns2)
    # The hottest prompts of v1's live traffic when the decision was taken, pinned for the job; every one
    # holding a whole block was verified from v2's disk tier (a prompt shorter than a block has none to cache).
    heat = PrefixHeat.objects.filter(namespace=ns1)
    results = prewarm.results.all()
    assert prewarm.prompts == len(prewarm.corpus_digests) == results.count()
    assert 0 < prewarm.prompts <= 32  # HEAT_CORPUS_SIZE
    assert set(prewarm.corpus_digests) <= set(heat.values_list("digest", flat=True))
    assert prewarm.verified == results.filter(verified=True).count() == results.exclude(expected_cached_tokens=0).count() > 0
    sweep = EvictionRun.objects.get(trigger=EvictionRun.Trigger.SCHEDULED)
    assert (sweep.status, sweep.approved_by) == (JobStatus.SUCCEEDED, "policy")
    archived = EvictionAction.objects.get(run=sweep, kind="archive")
    assert (archived.namespace, archived.status) == (ns1, "done")
    ns1.refresh_from_db()
    assert (ns1.residency, ns2.residency) == ("hot", "hot")  # v1 restored by the rollback
    v1.refresh_from_db()
    v2.refresh_from_db()
    assert (v1.status, v2.status) == ("active", "draining")

    # Live traffic: every answer computed by the version it was routed to; the figures the dashboard
    # reads count exactly what the generator saw (plus the one request that waited for routing).
    traffic = summary["traffic"]
    assert traffic["cross_version_answers"] == 0
    counts = {name: {k: p[k] for k in ("sent", "answered", "dropped", "errors")} for name, p in traffic["phases"].items()}
    assert traffic["requests"] == traffic["answered"] > 100, _shown(counts)
    served = {
        layer: sum(p["served_by"].get(layer, 0) for p in traffic["phases"].values())
        for layer in ("response", "semantic", "engine")
    }
    stats = GatewayStat.objects.filter(namespace__in=[ns1, ns2])
    assert sum(s.hits for s in stats if s.layer == "response") == served["response"] > 0
    assert sum(s.hits for s in stats if s.layer == "semantic") == served["semantic"]
    assert sum(s.requests for s in stats if s.layer == "prefix") == served["engine"] + 1
    for ratio in ("response_cache_hit_ratio", "prefix_cached_token_ratio", "cost_savings_rate"):
        assert 0 < traffic[ratio] < 1, _shown([ratio, traffic])
    assert traffic["prefix_cached_token_ratio"] > 0.5  # the long shared system prompts
    # The gateway chose engines by what they hold (precise routing), and says how often its prediction held.
    routing = traffic["routing"]
    assert routing.get("precise", 0) > 0 and sum(routing.values()) == served["engine"], _shown(routing)
    assert sum(traffic["predictions"].values()) == routing["precise"]
    assert traffic["prediction_accuracy"] == round(traffic["predictions"].get("exact", 0) / routing["precise"], 4)
    phases = traffic["phases"]
    assert list(phases) == ["v1", "v2 10%", "v2 100%", "rolled back to v1"]
    assert set(phases["v1"]["by_version"]) == {"tiny-v1"}
    gray = phases["v2 10%"]["by_version"]
    assert 0 < gray.get("tiny-v2", 0) < gray["tiny-v1"]
    assert phases["v2 100%"]["by_version"]["tiny-v2"] > 0.9 * phases["v2 100%"]["answered"]
    assert phases["rolled back to v1"]["by_version"]["tiny-v1"] > 0.9 * phases["rolled back to v1"]["answered"]
    # Shadow verification judged live requests of both versions, against references of their own version.
    checks = ShadowCheck.objects.filter(namespace__in=[ns1, ns2])
    assert traffic["shadow_checked"] == checks.filter(status="matched").count() > 0
    assert traffic["shadow_deceptive_hits"] == checks.filter(status="deceptive").count() == 0
    assert {c.namespace_id for c in checks.filter(status="matched")} == {ns1.pk, ns2.pk}
    assert all(c.reference_engine.model_version_id == c.namespace.model_version_id for c in checks.filter(status="matched"))

    # The baseline, unchanged: the unsafe upgrade caught on every prompt, the safe one clean.
    unsafe = ComparisonJob.objects.get(pk=summary["unsafe"]["job"])
    safe = ComparisonJob.objects.get(pk=summary["safe"]["job"])
    assert unsafe.namespace == ns1 and unsafe.engine.model_version == v2
    assert safe.namespace == ns2 and safe.engine.model_version == v2
    assert unsafe.engine.identity_override == UNSAFE_REASON
    for job, deceptive in ((unsafe, n), (safe, 0)):
        assert job.status == JobStatus.SUCCEEDED
        assert summary["unsafe" if job == unsafe else "safe"] == {
            "job": job.pk,
            "prompts": n,
            "deceptive_hits": deceptive,
            # Every prompt of the unsafe comparison reused v1's KV; the safe one reused v2's own.
            "cross_version_hits": deceptive,
            "reused": n if job == unsafe else job.results.filter(cached_tokens__gt=0).count(),
            "cached_tokens": job.cached_tokens,
            "ttft_cold_ms": round(job.ttft_cold_ms, 2),
            "ttft_warm_ms": round(job.ttft_warm_ms, 2),
        }
        results = list(job.results.all())
        assert len(results) == n
        for r in results:
            assert r.control_tokens_equal is True
        assert job.cached_tokens == sum(r.cached_tokens for r in results) > 0
    # v1's namespace was prewarmed with the diagnostic corpus: every prompt of the unsafe comparison came from
    # its persistent tier, whole blocks. (v2's was prewarmed from live heat, not from this corpus.)
    unsafe_rows = list(unsafe.results.values_list("prompt_tokens", "cached_tokens", "deceptive", "tokens_equal"))
    assert all(cached == (prompt - 1) // 32 * 32 for prompt, cached, _, _ in unsafe_rows), _shown(unsafe_rows)
    assert all(deceptive and not equal for _, _, deceptive, equal in unsafe_rows), _shown(unsafe_rows)
    safe_rows = list(safe.results.values_list("tokens_equal", "max_logprob_delta", "tolerance", "deceptive"))
    clean = [equal and delta <= tolerance and not deceptive for equal, delta, tolerance, deceptive in safe_rows]
    assert all(clean), _shown(safe_rows)

    engines = {e.name.rsplit("-", 1)[0] for e in Engine.objects.all()}
    assert engines == {"tiny-v1", "tiny-v1-reference", "tiny-v2-reference", "tiny-v2-unsafe", "tiny-v2"}
    states = [(e.name, e.status, e.error[:300]) for e in Engine.objects.all()]
    assert {status for _, status, _ in states} == {Engine.Status.STOPPED}, _shown(states)
    assert AuditEvent.objects.filter(action="engine.start", reason=UNSAFE_REASON).count() == 1
    assert AuditEvent.objects.filter(action="release.rollback", actor=tooling).count() == 1
    # Every engine was verified before use; the KV-event consumer watched the serving ones, and every
    # block they stored belonged to the namespace each served: no isolation alarm.
    verification = list(Engine.objects.values_list("name", "verification"))
    assert {v for _, v in verification} == {"verified"}, _shown(verification)
    streams = KvEventStream.objects.select_related("engine")
    assert sorted(s.engine.name.rsplit("-", 1)[0] for s in streams) == ["tiny-v1", "tiny-v2", "tiny-v2-unsafe"]
    figures = [(s.engine.name, s.events, s.gaps, s.complete) for s in streams]
    assert all(events > 0 and gaps == 0 and complete for _, events, gaps, complete in figures), _shown(figures)
    alarms = [(a.engine.name, a.kind, a.detail[:300], a.count) for a in EngineAlarm.objects.select_related("engine")]
    assert alarms == [], _shown(alarms)

    # The dashboard shows it all; the detail pages list every prompt's verdict and the release's timeline.
    client.force_login(django_user_model.objects.create_user("viewer", password="x"))
    page = client.get("/").content.decode()
    for text in ("tiny-v1", "tiny-v2", v1.weights[:12], v2.weights[:12], v1.tokenizer[:12], ns1.storage_prefix):
        assert text in page
    detail = client.get(f"/comparison-jobs/{unsafe.pk}/").content.decode()
    assert detail.count("deceptive hit</td>") == n
    safe_page = client.get(f"/comparison-jobs/{safe.pk}/").content.decode()
    hits = safe.results.filter(cached_tokens__gt=0).count()
    assert (safe_page.count("correct hit</td>"), safe_page.count("miss</td>"), safe_page.count("deceptive hit</td>")) == (
        hits, n - hits, 0,
    )  # fmt: skip
    assert "restored from the cold tier" in client.get(f"/releases/{release.pk}/").content.decode()
