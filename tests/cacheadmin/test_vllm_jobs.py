"""Jobs on real vLLM engines through a real Celery worker: a killed worker
loses nothing, a dying engine fails the job with the reason and keeps its
partial results, an engine that cannot start is recorded as failed."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from django.conf import settings

from cacheadmin.models import ComparisonJob, Engine, JobStatus, PrewarmJob, Tenant
from cacheadmin.services.comparison import comparison_job_create
from cacheadmin.services.engines import engine_launch
from cacheadmin.services.model_versions import model_version_register
from cacheadmin.services.namespaces import (
    DEMO_POLICY,
    namespace_get_or_create,
    namespace_storage_path,
    retention_owner_get_or_create,
)
from cacheadmin.services.prewarm import prewarm_job_create
from cacheadmin.services.workers import WorkerProcess
from inference.corpus import load_corpus
from inference.engines.launcher import EngineSpec, LocalEngine, free_port
from inference.engines.vllm_http import VllmHttpClient
from inference.errors import EngineError
from inference.identity import LayoutOptions, fingerprint_checkpoint, namespace_key, storage_prefix
from tests.helpers import subprocess_env, wait_for, worker_log

pytestmark = [pytest.mark.vllm, pytest.mark.django_db(transaction=True)]
LAYOUT = LayoutOptions(dtype="float32", kv_connector="ExampleConnector")
CORPUS = load_corpus("diagnostic")


def _start(spec: EngineSpec) -> LocalEngine:
    engine = LocalEngine(spec)
    engine.start()
    engine.wait_ready(settings.ENGINE_START_TIMEOUT_S)
    return engine


def _spec(path: Path, name: str, *, prefix_caching: bool, storage: Path | None) -> EngineSpec:
    return EngineSpec(
        model_path=path,
        served_name="tiny",
        dtype="float32",
        port=free_port(),
        prefix_caching=prefix_caching,
        kv_storage_path=storage,
        log_path=settings.ENGINE_LOG_DIR / f"test-{name}.log",
    )


#: Tenant acme's boundary key, fixed here so that the module's engines can be
#: started on its namespace's disk tier before the test database has the tenant.
ACME_KEY = "a" * 32


def _storage_for(path: Path, tenant: str = "acme") -> Path:
    identity = fingerprint_checkpoint(path, layout=LAYOUT).identity
    return settings.KV_STORE_ROOT / storage_prefix(namespace_key(identity, f"tenant:{tenant}:{ACME_KEY}"))


@pytest.fixture(scope="module")
def v1_engine(demo_checkpoints) -> Iterator[LocalEngine]:
    """tiny-v1 serving tenant acme's namespace with the ExampleConnector disk tier."""
    engine = _start(
        _spec(demo_checkpoints["tiny-v1"], "v1", prefix_caching=True, storage=_storage_for(demo_checkpoints["tiny-v1"]))
    )
    yield engine
    engine.stop()


@pytest.fixture(scope="module")
def v2_reference(demo_checkpoints) -> Iterator[LocalEngine]:
    """tiny-v2 with no prefix caching and no connector."""
    engine = _start(_spec(demo_checkpoints["tiny-v2"], "v2-ref", prefix_caching=False, storage=None))
    yield engine
    engine.stop()


@pytest.fixture
def worker() -> Iterator[WorkerProcess]:
    proc = WorkerProcess(worker_log("test-worker"), env=subprocess_env(), name="test")
    proc.start()
    yield proc
    proc.stop()


def _setup(demo_checkpoints, label: str):
    version, _ = model_version_register(
        path=demo_checkpoints[label], label=label, served_name="tiny", layout=LAYOUT, actor="alice"
    )
    tenant = Tenant.objects.get_or_create(slug="acme", defaults={"name": "Acme", "key": ACME_KEY})[0]
    owner = retention_owner_get_or_create(name="platform", email="p@example.com", actor="alice")
    return version, namespace_get_or_create(
        model_version=version, tenant=tenant, retention_owner=owner, policy=DEMO_POLICY, actor="alice"
    )[0]


def _record(engine: LocalEngine, version, namespace, name: str, *, connector: bool = True) -> Engine:
    """The Engine row of an engine this test session started."""
    return Engine.objects.create(
        name=name,
        model_version=version,
        namespace=namespace,
        base_url=engine.base_url,
        pid=engine.pid,
        prefix_caching=engine.spec.prefix_caching,
        kv_connector="ExampleConnector" if connector and engine.spec.kv_storage_path else "",
        kv_storage_path=str(engine.spec.kv_storage_path or ""),
        status=Engine.Status.READY,
        role=Engine.Role.SERVING if namespace else Engine.Role.REFERENCE,
        # Started here from the version's own checkpoint: what verification would find.
        verification=Engine.Verification.VERIFIED,
    )


def test_killed_worker_loses_nothing_and_the_job_resumes(demo_checkpoints, v1_engine, worker) -> None:
    version, namespace = _setup(demo_checkpoints, "tiny-v1")
    assert Path(v1_engine.spec.kv_storage_path) == namespace_storage_path(namespace)
    engine = _record(v1_engine, version, namespace, "v1")
    job = prewarm_job_create(namespace=namespace, engine=engine, corpus="diagnostic", actor="alice")
    wait_for(lambda: PrewarmJob.objects.get(pk=job.pk).progress_done >= 2, timeout=120, what="two prompts filled")
    worker.kill()
    job.refresh_from_db()
    assert job.status == JobStatus.RUNNING and job.attempts == 1
    filled_before = job.results.count()
    assert 2 <= filled_before < 2 * len(CORPUS)

    restarted = WorkerProcess(worker_log("test-worker-2"), env=subprocess_env(), name="test2")
    restarted.start()  # on start it finds the dead worker's job and requeues it
    try:
        wait_for(
            lambda: PrewarmJob.objects.get(pk=job.pk).status not in (JobStatus.QUEUED, JobStatus.RUNNING),
            timeout=180,
            what="job end",
        )
    finally:
        restarted.stop()
    job.refresh_from_db()
    assert job.status == JobStatus.SUCCEEDED, job.error
    assert job.attempts == 2
    assert "was lost during attempt 1; retrying" in job.log
    assert job.results.count() == len(CORPUS)
    assert job.verified == len(CORPUS)
    for result in job.results.all():
        assert result.expected_cached_tokens == (result.prompt_tokens - 1) // 32 * 32
        assert result.verify_cached_tokens == result.expected_cached_tokens
    assert (job.progress_done, job.progress_total) == (2 * len(CORPUS), 2 * len(CORPUS))
    # The verification pass read the prompts back through the connector: vLLM counts them as external hits.
    with VllmHttpClient(v1_engine.base_url, "tiny") as client:
        metrics = client.metrics()
    assert metrics["vllm:external_prefix_cache_hits"] >= max(r.verify_cached_tokens for r in job.results.all())
    assert metrics["vllm:prefix_cache_queries"] > 0
    stored = list(Path(v1_engine.spec.kv_storage_path).iterdir())
    assert len(stored) >= len(CORPUS)


def test_engine_dying_mid_job_fails_it_with_reason_and_keeps_results(demo_checkpoints, v2_reference, worker) -> None:
    version, namespace = _setup(demo_checkpoints, "tiny-v2")
    doomed = _start(_spec(demo_checkpoints["tiny-v2"], "doomed", prefix_caching=True, storage=namespace_storage_path(namespace)))
    try:
        engine = _record(doomed, version, namespace, "doomed")
        reference = _record(v2_reference, version, None, "v2-ref")
        job = comparison_job_create(
            engine=engine, reference_engine=reference, namespace=namespace, corpus="diagnostic", max_tokens=8, actor="alice"
        )
        wait_for(lambda: ComparisonJob.objects.get(pk=job.pk).progress_done >= 2, timeout=120, what="two prompts compared")
        doomed.stop(timeout_s=5)
    finally:
        doomed.stop()
    wait_for(lambda: ComparisonJob.objects.get(pk=job.pk).status == JobStatus.FAILED, timeout=120, what="job failed")
    job.refresh_from_db()
    kept = job.results.count()
    assert 2 <= kept < len(CORPUS)
    assert job.progress_done == kept
    assert f"engine at {doomed.base_url}" in job.error
    assert job.finished_at is not None
    # Same weights, own namespace: what was compared before the engine died is clean.
    assert job.deceptive_hits == 0
    assert all(r.tokens_equal for r in job.results.all())


def test_engine_that_cannot_start_is_recorded_failed(demo_checkpoints, model_root: Path) -> None:
    broken = model_root / "broken-arch"
    shutil.copytree(demo_checkpoints["tiny-v1"], broken, dirs_exist_ok=True)
    config = json.loads((broken / "config.json").read_text())
    config["architectures"] = ["NoSuchModelForCausalLM"]
    (broken / "config.json").write_text(json.dumps(config))
    try:
        version, _ = model_version_register(
            path=broken, label="broken", served_name="tiny", layout=LayoutOptions(), actor="alice"
        )
        with pytest.raises(EngineError, match="exited with code"):
            engine_launch(name="broken", model_version=version, namespace=None, actor="alice")
        engine = Engine.objects.get(name="broken")
        assert engine.status == Engine.Status.FAILED
        assert "NoSuchModelForCausalLM" in engine.error
    finally:
        shutil.rmtree(broken)


def test_eviction_on_a_disk_tier_written_by_vllm_confirms_every_tier_and_restores(
    demo_checkpoints, v1_engine, settings, tmp_path: Path
) -> None:
    from cacheadmin.models import EngineMetricsSample, ModelVersion, Residency, TierUsageSample
    from cacheadmin.services.accounting import accounting_scan_scheduled, engine_metrics_scrape
    from cacheadmin.services.eviction import eviction_plan, eviction_run_approve, eviction_run_execute
    from cacheadmin.services.model_versions import model_version_transition
    from cacheadmin.services.namespaces import RetentionPolicySpec, namespace_policy_update, namespace_salt_read
    from cacheadmin.services.prewarm import prewarm_job_run
    from cacheadmin.services.tiers import tiers_configured

    settings.KV_COLD_ROOT, settings.KV_REDIS_URL = tmp_path / "cold", ""
    version, namespace = _setup(demo_checkpoints, "tiny-v1")
    engine = _record(v1_engine, version, namespace, "v1-evict")
    job = prewarm_job_create(namespace=namespace, engine=engine, corpus="diagnostic", actor="alice")
    prewarm_job_run(job_id=job.pk)  # here, not in a worker: this test is about the tiers
    job.refresh_from_db()
    assert job.status == JobStatus.SUCCEEDED, job.error
    tiers = tiers_configured()
    prefix = namespace.storage_prefix
    on_disk = tiers.disk.usage(prefix)
    assert on_disk.entries >= len(CORPUS) and on_disk.bytes > 0

    scan = accounting_scan_scheduled()
    sample = TierUsageSample.objects.get(scan=scan, namespace=namespace, tier="disk")
    assert (sample.bytes, sample.entries, sample.allocated_bytes) == (on_disk.bytes, on_disk.entries, on_disk.allocated_bytes)
    (metrics,) = engine_metrics_scrape()
    assert metrics.ok and metrics.prefix_cache_queries > 0 and metrics.external_prefix_cache_hits > 0
    assert EngineMetricsSample.objects.filter(engine=engine).count() == 1

    # A release moved tiny to v2: v1 is draining and, with 1 hot version kept, goes to the cold tier.
    v2, _ = model_version_register(
        path=demo_checkpoints["tiny-v2"], label="tiny-v2", served_name="tiny", layout=LAYOUT, actor="a"
    )
    model_version_transition(version=v2, to=ModelVersion.Status.ACTIVE, actor="alice")
    model_version_transition(version=version, to=ModelVersion.Status.ACTIVE, actor="alice")
    model_version_transition(version=version, to=ModelVersion.Status.DRAINING, actor="alice")
    namespace_policy_update(
        namespace=namespace, policy=RetentionPolicySpec(None, None, versions_kept=1, cold_versions_kept=1), actor="a", reason="r"
    )
    run = eviction_plan(actor="alice", only=[namespace])
    assert [(a.kind, a.tier) for a in run.actions.order_by("seq")] == [
        ("archive", "cold"), ("delete_prefix", "disk"), ("reset_engine", "engine"), ("set_residency", ""),
    ]  # fmt: skip
    eviction_run_approve(run=run, actor="bob", reason="v2 released")
    assert eviction_run_execute(run_id=run.pk) == "succeeded", run.log
    probe = run.actions.get(kind="reset_engine").confirmation
    assert probe["cached_tokens"] == 0 and probe["prompt_tokens"] > 0 and probe["corpus"] == "diagnostic"
    # The probe itself was computed and written to the disk tier by the connector; that was removed again.
    assert probe["probe_bytes_removed"] > 0
    assert not tiers.disk.exists(prefix) and tiers.cold.exists(prefix)
    assert run.actions.get(kind="archive").confirmation["entries"] == on_disk.entries
    namespace.refresh_from_db()
    assert namespace.residency == Residency.COLD

    # Rollback: the archive restores what vLLM wrote, and the engine reads it again.
    assert tiers.cold.restore(prefix, disk=tiers.disk, redis=None) == on_disk.entries
    restored = tiers.disk.usage(prefix)
    assert (restored.entries, restored.bytes) == (on_disk.entries, on_disk.bytes)
    conversation = next(c for c in CORPUS if c.id == probe["probe"])
    with VllmHttpClient(v1_engine.base_url, "tiny") as client:
        client.reset_prefix_cache()
        again = client.chat(
            conversation.messages,
            cache_salt=namespace_salt_read(namespace, actor="ci", purpose="test"),
            max_tokens=1,
            tools=conversation.tools,
        )
    assert again.cached_tokens > 0
