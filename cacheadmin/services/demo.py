"""The main job: the unsafe and the safe upgrade of a model version, for real.

1. Build the demo checkpoints (tiny-v1, tiny-v2: same tokenizer, config and
   served name; different weights) and register both.
2. A tenant, a retention owner, and a namespace per (version, tenant).
3. Serve v1 with the ExampleConnector disk tier under v1's namespace prefix;
   prewarm it from the diagnostic corpus (Celery job, verified).
4. Unsafe upgrade (what name-keyed caches do today): v2 serves v1's namespace
   and storage prefix. Comparison job against a reference engine.
5. Safe upgrade: v2 gets its own namespace, prewarmed, then compared.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from django.conf import settings

from cacheadmin.models import ComparisonJob, Engine, JobStatus, ModelVersion, PrewarmJob
from cacheadmin.models.jobs import Job
from cacheadmin.services.comparison import comparison_job_create
from cacheadmin.services.engines import engine_launch, engine_stop, engines_reconcile
from cacheadmin.services.model_versions import checkpoint_fingerprint, model_version_register, model_version_transition
from cacheadmin.services.namespaces import (
    DEMO_POLICY,
    namespace_get_or_create,
    retention_owner_get_or_create,
    tenant_get_or_create,
)
from cacheadmin.services.prewarm import prewarm_job_create
from inference.checkpoints import ensure_demo_checkpoints
from inference.identity import LayoutOptions

ACTOR = "demo"
#: Recorded on the unsafe engine: why the identity check was overridden.
UNSAFE_REASON = (
    "demo of the unsafe upgrade: v2 reads v1's persistent KV tier under the same model name, "
    "as a cache keyed on token ids and model name does"
)
#: float32 on purpose: "auto" would serve these float32 checkpoints in bfloat16
#: on a CPU (vLLM's rule), and the demo's tiny random-weight models need the
#: cold-vs-cold control of float32 to tell a deceptive hit from rounding.
DEMO_LAYOUT = LayoutOptions(dtype="float32", block_size=32, kv_connector="ExampleConnector")


class DemoError(RuntimeError):
    """A step of the main job failed; the message names the step."""


def _wait(job: Job, *, timeout_s: float, log: Callable[[str], None], watchdog: Callable[[], None]) -> Job:
    deadline = time.monotonic() + timeout_s
    last = -1
    while time.monotonic() < deadline:
        job.refresh_from_db()
        if job.progress_done != last:
            last = job.progress_done
            log(f"  {job} {job.progress_done}/{job.progress_total}")
        if job.status not in (JobStatus.QUEUED, JobStatus.RUNNING):
            return job
        watchdog()
        time.sleep(0.5)
    raise DemoError(f"{job} did not finish within {timeout_s:.0f} s")


def _register(path: Path, label: str) -> ModelVersion:
    _, report = checkpoint_fingerprint(path=path, layout=DEMO_LAYOUT)
    existing = ModelVersion.objects.filter(label=label).first()
    if existing is not None and existing.identity != report.identity:
        # The demo checkpoint was rebuilt (new spec): register it beside the old
        # row, whose jobs and namespaces stay as history.
        label = f"{label}-{report.identity[:8]}"
    version, _ = model_version_register(path=path, label=label, served_name="tiny", layout=DEMO_LAYOUT, actor=ACTOR)
    return version


def _activate(version: ModelVersion, *, reason: str) -> None:
    version.refresh_from_db()
    if version.status != ModelVersion.Status.ACTIVE:
        model_version_transition(version=version, to=ModelVersion.Status.ACTIVE, actor=ACTOR, reason=reason)


def _summary(job: ComparisonJob) -> dict[str, Any]:
    return {
        "job": job.pk,
        "prompts": job.results.count(),
        "deceptive_hits": job.deceptive_hits,
        "cached_tokens": job.cached_tokens,
        "ttft_cold_ms": round(job.ttft_cold_ms, 2) if job.ttft_cold_ms is not None else None,
        "ttft_warm_ms": round(job.ttft_warm_ms, 2) if job.ttft_warm_ms is not None else None,
    }


def demo_run(
    *,
    log: Callable[[str], None],
    watchdog: Callable[[], None] = lambda: None,
    corpus: str = "diagnostic",
    max_tokens: int = 16,
    job_timeout_s: float = 600.0,
    keep_serving: bool = False,
) -> dict[str, Any]:
    """Run the main job and return its summary.

    Args:
        log: receives one line per step.
        watchdog: called while waiting on jobs (the caller checks its worker).
        keep_serving: leave the v2 engine of v2's namespace running (the served
            demo: an operator goes on working with it); it still stops with
            this process. The summary then has ``serving`` (id, name, base_url).

    Returns:
        ``{"unsafe": {...}, "safe": {...}, "caught": bool, "clean": bool,
        "warm_faster": bool}``; each upgrade has prompts, deceptive_hits,
        cached_tokens, ttft_cold_ms, ttft_warm_ms and its job id.

    Raises:
        DemoError: a job failed or timed out.
        CheckpointError, EngineError, EngineRefused: from the steps.
    """
    engines_reconcile(actor=ACTOR)
    run = uuid.uuid4().hex[:6]
    paths = ensure_demo_checkpoints(settings.DEMO_MODELS_DIR)
    log(f"checkpoints: {', '.join(str(p) for p in paths.values())}")
    v1 = _register(paths["tiny-v1"], "tiny-v1")
    v2 = _register(paths["tiny-v2"], "tiny-v2")
    changed = [f for f in v1.IDENTITY_FIELDS if getattr(v1, f) != getattr(v2, f)]
    log(f"registered tiny-v1 {v1.identity[:12]} and tiny-v2 {v2.identity[:12]}; fields that differ: {changed}")
    tenant = tenant_get_or_create(slug="acme", name="Acme Corp", actor=ACTOR)
    owner = retention_owner_get_or_create(name="platform-team", email="platform@example.com", actor=ACTOR)
    ns1, _ = namespace_get_or_create(model_version=v1, tenant=tenant, retention_owner=owner, policy=DEMO_POLICY, actor=ACTOR)
    ns2, _ = namespace_get_or_create(model_version=v2, tenant=tenant, retention_owner=owner, policy=DEMO_POLICY, actor=ACTOR)
    log(f"namespaces: v1 {ns1.storage_prefix}, v2 {ns2.storage_prefix}")

    started: list[Engine] = []

    def launch(name: str, **kwargs: Any) -> Engine:
        log(f"starting engine {name}…")
        engine = engine_launch(name=f"{name}-{run}", actor=ACTOR, **kwargs)
        started.append(engine)
        log(f"  {engine.name} ready at {engine.base_url} in {engine.start_seconds:.1f} s")
        return engine

    def finish(job: Job, what: str) -> Job:
        job = _wait(job, timeout_s=job_timeout_s, log=log, watchdog=watchdog)
        if job.status != JobStatus.SUCCEEDED:
            raise DemoError(f"{what} {job} ended {job.status}: {job.error}")
        return job

    try:
        e1 = launch("tiny-v1", model_version=v1, namespace=ns1)
        job = finish(prewarm_job_create(namespace=ns1, engine=e1, corpus=corpus, actor=ACTOR), "prewarm of v1")
        assert isinstance(job, PrewarmJob)
        log(f"v1 prewarmed: {job.verified} prompts verified from the disk tier")
        _activate(v1, reason="demo: v1 serves tenant acme")
        engine_stop(engine=e1, actor=ACTOR)
        reference = launch("tiny-v2-reference", model_version=v2, namespace=None)

        unsafe_engine = launch("tiny-v2-unsafe", model_version=v2, namespace=ns1, identity_override_reason=UNSAFE_REASON)
        unsafe = finish(
            comparison_job_create(
                engine=unsafe_engine, reference_engine=reference, namespace=ns1, corpus=corpus, max_tokens=max_tokens, actor=ACTOR
            ),
            "unsafe comparison",
        )
        engine_stop(engine=unsafe_engine, actor=ACTOR)

        safe_engine = launch("tiny-v2-safe", model_version=v2, namespace=ns2)
        finish(prewarm_job_create(namespace=ns2, engine=safe_engine, corpus=corpus, actor=ACTOR), "prewarm of v2")
        safe = finish(
            comparison_job_create(
                engine=safe_engine, reference_engine=reference, namespace=ns2, corpus=corpus, max_tokens=max_tokens, actor=ACTOR
            ),
            "safe comparison",
        )
        _activate(v2, reason="demo: upgrade to v2 in its own namespace")
        v1.refresh_from_db()
        if v1.status == ModelVersion.Status.ACTIVE:
            model_version_transition(version=v1, to=ModelVersion.Status.DRAINING, actor=ACTOR, reason="demo: replaced by v2")
        kept = safe_engine if keep_serving else None
    except BaseException:
        kept = None
        raise
    finally:
        for engine in started:
            engine.refresh_from_db()
            if engine.status == Engine.Status.READY and (kept is None or engine.pk != kept.pk):
                engine_stop(engine=engine, actor=ACTOR)
    assert isinstance(unsafe, ComparisonJob) and isinstance(safe, ComparisonJob)
    result: dict[str, Any] = {"unsafe": _summary(unsafe), "safe": _summary(safe)}
    if kept is not None:
        result["serving"] = {"id": kept.pk, "name": kept.name, "base_url": kept.base_url}
    result["caught"] = result["unsafe"]["deceptive_hits"] > 0
    result["clean"] = result["safe"]["deceptive_hits"] == 0 and result["safe"]["cached_tokens"] > 0
    result["warm_faster"] = (result["safe"]["ttft_warm_ms"] or 0) < (result["safe"]["ttft_cold_ms"] or 0)
    return result
