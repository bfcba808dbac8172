"""The main job: a model release under live traffic, governed end to end, on
real vLLM engines, with the unsafe upgrade beside it as the baseline.

1. v1 serves tenant ``acme`` through the gateway (a first deployment, planned
   over the REST API); a traffic generator sends a steady mix of prompt
   templates (long shared system prompts, short varying questions,
   heavy-tailed popularity, repeated greedy requests, paraphrases) for the
   whole run.
2. v2 (new weights) is registered; a release v1 → v2 is planned over the
   API: classified ``incompatible``, with the identity diff.
3. The baseline: v2 on v1's persistent tier (what a cache keyed on token ids
   and model name does), caught by a comparison job.
4. Decision ``new_namespace``: v2's namespace (created before traffic, with
   the engine that serves it) is prewarmed from the hottest prefixes the gateway recorded from the
   live traffic; the release is ready only after the prewarm's verification;
   a comparison job finds v2 in its own namespace clean.
5. Gray release: 10 % of conversations to v2, then 100 %; shadow
   verification replays sampled live requests against reference engines.
6. The next eviction sweep demotes v1's namespace to the cold tier by policy;
   a rollback to v1 restores it from there and traffic goes back to it.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from django.conf import settings
from django.utils import timezone

from cacheadmin.models import (
    CacheNamespace,
    ComparisonJob,
    Engine,
    EvictionRun,
    JobStatus,
    ModelVersion,
    PrewarmJob,
    PromptTemplate,
    Residency,
    Tenant,
)
from cacheadmin.models.jobs import Job
from cacheadmin.models.releases import Release
from cacheadmin.services.comparison import comparison_job_create
from cacheadmin.services.demo_models import DEFAULT_DEMO_MODEL, DEMO_MODELS, DemoModel, checkpoint_parameters, stated_release
from cacheadmin.services.demo_release import (
    ControlPlaneApi,
    release_summary,
    shadow_drain,
    shadow_figures,
    tooling_token,
    traffic_figures,
)
from cacheadmin.services.demo_traffic import TemplateSpec, TrafficRunner, TrafficStats
from cacheadmin.services.engines import engine_client, engine_create, engine_stop, engines_boot, engines_reconcile
from cacheadmin.services.eviction.resume import eviction_sweep
from cacheadmin.services.gateway import gateway_key_issue, tenant_gateway_policy_update
from cacheadmin.services.jobs import job_cancel
from cacheadmin.services.model_versions import checkpoint_fingerprint, model_version_register, model_version_transition
from cacheadmin.services.namespaces import (
    RetentionPolicySpec,
    namespace_get_or_create,
    namespace_policy_update,
    retention_owner_get_or_create,
    tenant_get_or_create,
)
from cacheadmin.services.prewarm import prewarm_job_create
from cacheadmin.services.prompt_templates import prompt_template_create
from cacheadmin.services.releases import release_rollback
from inference.corpus import load_corpus
from inference.keepalive import CLIENT_IDLE_S
from inference.policies import load_policies

ACTOR = "demo"
#: Recorded on the unsafe engine: why the identity check was overridden.
UNSAFE_REASON = (
    "demo of the unsafe upgrade: v2 reads v1's persistent KV tier under the same model name, "
    "as a cache keyed on token ids and model name does"
)
#: The tiny models' layout (float32; see :data:`cacheadmin.services.demo_models.DEMO_MODELS`).
DEMO_LAYOUT = DEMO_MODELS["tiny"].layout


class DemoError(RuntimeError):
    """A step of the main job failed; the message names the step."""


#: The variable after a demo template's system prompt: the demo's first message is the system
#: prompt alone (the question is the second message), so its sample appends nothing.
DEMO_TEMPLATE_VARIABLE = "appended"


def demo_templates_register(*, tenant: Tenant, templates: Sequence[TemplateSpec], log: Callable[[str], None]) -> list[str]:
    """Register the traffic's prompt templates for ``tenant``, so the gateway counts each request
    against its template and the prompt-templates page shows them. A template already
    registered under its name (an earlier run on this database) is left as it is.

    Each template's text is its system prompt (the request's first message, which the gateway
    matches templates against: :func:`gateway.templates.leading_text`) followed by
    ``{appended}``; braces in the prompt are escaped.

    Returns:
        The names registered by this call.
    """
    made = []
    for spec in templates:
        if PromptTemplate.objects.filter(name=spec.name).exists():
            continue
        text = spec.system.replace("{", "{{").replace("}", "}}") + "{" + DEMO_TEMPLATE_VARIABLE + "}"
        prompt_template_create(name=spec.name, tenant=tenant, text=text, samples=[{DEMO_TEMPLATE_VARIABLE: ""}], actor=ACTOR)
        made.append(spec.name)
    if made:
        log(f"  prompt templates registered for {tenant.slug}: {', '.join(made)}")
    return made


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


def _register(path: Path, label: str, model: DemoModel) -> ModelVersion:
    _, report = checkpoint_fingerprint(path=path, layout=model.layout)
    existing = ModelVersion.objects.filter(label=label).first()
    if existing is not None and existing.identity != report.identity:
        # The demo checkpoint was rebuilt (new spec): register it beside the old
        # row, whose jobs and namespaces stay as history.
        label = f"{label}-{report.identity[:8]}"
    version, _ = model_version_register(path=path, label=label, served_name=model.served_name, layout=model.layout, actor=ACTOR)
    return version


def _summary(job: ComparisonJob) -> dict[str, Any]:
    return {
        "job": job.pk,
        "prompts": job.results.count(),
        "deceptive_hits": job.deceptive_hits,
        "cross_version_hits": job.cross_version_hits,
        "reused": job.results.filter(cached_tokens__gt=0).count(),
        "cached_tokens": job.cached_tokens,
        "ttft_cold_ms": round(job.ttft_cold_ms, 2) if job.ttft_cold_ms is not None else None,
        "ttft_warm_ms": round(job.ttft_warm_ms, 2) if job.ttft_warm_ms is not None else None,
    }


def _policy_answers(model: DemoModel, unsafe: ComparisonJob, reference_v1: Engine, max_tokens: int) -> list[dict[str, Any]]:
    """For each changed-policy question of the unsafe comparison: v1's answer (v1's reference engine,
    no cache), v2's without cache and v2's on v1's tier (the job's two texts), and the release each states."""
    if not model.policies:
        return []
    data = load_policies()
    by_id = {c.id: c for c in load_corpus(unsafe.corpus)}
    changed = {p["id"]: p for p in data["policies"] if p.get("changed")}
    rows = []
    with engine_client(reference_v1) as client:
        for result in unsafe.results.order_by("index"):
            conv = by_id.get(result.conversation_id)
            policy = changed.get(result.conversation_id.rsplit("-", 1)[0])
            if conv is None or policy is None:
                continue
            v1 = client.chat(conv.messages, cache_salt=None, max_tokens=max_tokens).text
            answers = {"v1": v1, "v2_cold": result.reference_text, "v2_on_v1_tier": result.cached_text}
            rows.append({
                "policy": policy["id"], "question": conv.messages[-1]["content"], **answers,
                "states": {k: stated_release(v, policy, data["versions"]) for k, v in answers.items()},
                "deceptive": result.deceptive, "cached_tokens": result.cached_tokens,
            })  # fmt: skip
    return rows


#: Retention policy of the demo's namespaces: one version hot, the one before it
#: kept cold (so the sweep after a release demotes the old version, and a
#: rollback restores it).
RELEASE_POLICY = RetentionPolicySpec(max_age_since_last_hit_s=86400, max_bytes=1 << 30, versions_kept=1, cold_versions_kept=1)
#: Share of live requests with cached tokens that shadow verification replays.
SHADOW_SAMPLE_RATE = 0.05
#: The same share for the release's canary (the gateway samples a gray release's new version at the
#: higher of the two): every v2 answer of a gray step is judged. Tenant-wide, a rate high enough to
#: judge a 10 % step soon queued checks faster than they ran on the real model (a check costs about
#: 3 s of the two cores), and the canary's first judgement waited behind v1's: the 10 % step took 116 s.
CANARY_SHADOW_SAMPLE_RATE = 1.0
#: Requests per second the traffic generator sends through the gateway.
TRAFFIC_RATE_PER_S = 2.0
#: Answers of v2 each gray step waits for (after HOLD_S) before the next one.
MIN_ANSWERS_PER_STEP = 3
#: Seconds traffic runs at each gray step (10 %, 100 %) and after the rollback.
HOLD_S = 20.0
#: Seconds between the lines that say engines are still starting (a silent terminal looks hung).
START_PROGRESS_S = 15.0


@dataclass
class Stage:
    """What the served demo and its summary need from the run: the processes'
    endpoints and the client release tooling uses."""

    gateway_url: str
    api_client: httpx.Client


def _policy_ensure(namespace: CacheNamespace) -> None:
    """Give a namespace the demo's retention policy (one from an earlier run may have another)."""
    current = RetentionPolicySpec(**{k: getattr(namespace.policy, k) for k in RetentionPolicySpec.__dataclass_fields__})
    if current != RELEASE_POLICY:
        namespace_policy_update(namespace=namespace, policy=RELEASE_POLICY, actor=ACTOR, reason="demo: one version hot, one cold")


def _settle(tenant: Tenant, v1: ModelVersion, v2: ModelVersion, log: Callable[[str], None]) -> Release | None:
    """Bring tenant acme's served model back to v1 when an earlier run stopped mid-release.

    Returns:
        A release v1 → v2 still awaiting its decision (the run continues it), else None.

    Raises:
        DemoError: a release that neither rolls back nor is the demo's own.
    """
    latest = Release.objects.filter(tenant=tenant, served_name=v1.served_name).order_by("-pk").first()
    if latest is None:
        v2.refresh_from_db()
        if v2.status == ModelVersion.Status.ACTIVE:
            # An earlier run of the main job upgraded without releases: v1 is deployed first again.
            model_version_transition(
                version=v2, to=ModelVersion.Status.DRAINING, actor=ACTOR, reason="demo: a new run starts from v1"
            )
        return None
    if latest.status == Release.Status.ROLLED_BACK or latest.from_version_id is None:
        return None
    if latest.status == Release.Status.DECISION_REQUIRED:
        if (latest.from_version_id, latest.to_version_id) == (v1.pk, v2.pk):
            log(f"release #{latest.pk} of an earlier run awaits its decision: continuing it")
            return latest
        raise DemoError(
            f"release #{latest.pk} of {v1.served_name} for acme awaits a decision: decide it (page, API or CLI) first"
        )
    if latest.to_version_id == v1.pk and latest.traffic_percent == 100:
        return None
    release_rollback(release=latest, actor=ACTOR, reason="demo: a new run starts from v1")
    log(f"release #{latest.pk} of an earlier run rolled back: the run starts from v1")
    return None


def _gateway_answers(gateway_url: str, key: str, served_name: str, *, timeout_s: float) -> None:
    """Wait until the gateway routes tenant acme's ``served_name`` (its snapshot follows the first deployment).

    Raises:
        DemoError: no 200 within ``timeout_s`` (the last answer included).
    """
    body = {"model": served_name, "messages": [{"role": "user", "content": "Hello."}], "max_tokens": 1, "temperature": 0}
    deadline, last = time.monotonic() + timeout_s, ""
    with httpx.Client(timeout=60, limits=httpx.Limits(keepalive_expiry=CLIENT_IDLE_S)) as client:
        while time.monotonic() < deadline:
            try:
                answer = client.post(f"{gateway_url}/v1/chat/completions", json=body, headers={"authorization": f"Bearer {key}"})
                if answer.status_code == 200:
                    return
                last = f"{answer.status_code} {answer.text[:300]}"
            except httpx.TransportError as exc:
                last = repr(exc)
            time.sleep(0.5)
    raise DemoError(f"the gateway did not route {served_name} for acme within {timeout_s:.0f} s: {last}")


def _sweep(namespace: CacheNamespace, *, log: Callable[[str], None], finish: Callable[[Job, str], Job]) -> EvictionRun:
    """The next scheduled sweep, with no notice to owners: plan by policy (auto-approved), start, wait.

    A scheduled run an earlier serving left waiting out its notice is
    cancelled first: only one scheduled run is open at a time.

    Raises:
        DemoError: the run failed, or left ``namespace`` anywhere but cold.
    """
    waiting = EvictionRun.objects.filter(trigger=EvictionRun.Trigger.SCHEDULED, status=JobStatus.QUEUED)
    for run in waiting:
        job_cancel(job=run, actor=ACTOR, reason="demo: the demo's sweep runs now")
    planned = eviction_sweep(actor="scheduler", notice_s=0)["planned"]
    if planned is None:
        raise DemoError("the sweep planned nothing: another scheduled eviction run is open")
    run = EvictionRun.objects.get(pk=planned)
    log(f"  sweep planned eviction run #{run.pk}: {run.progress_total} actions, {run.bytes_planned} bytes")
    eviction_sweep(actor="scheduler", notice_s=0)  # its notice (none) has passed: it starts
    run = finish(run, "the eviction sweep")
    assert isinstance(run, EvictionRun)
    namespace.refresh_from_db()
    if namespace.residency != Residency.COLD:
        raise DemoError(f"eviction run #{run.pk} left v1's namespace {namespace.residency}, not cold")
    return run


def _phase_summary(stats: TrafficStats) -> dict[str, Any]:
    """One step's traffic as the generator saw it: counts, layers, versions, ratios, latency per layer."""
    out = stats.as_dict()
    for name in ("phase", "cross_version_examples", "engine_prompt_tokens", "engine_cached_tokens", "completion_tokens",
                 "routing", "predictions", "prediction_accuracy"):  # fmt: skip
        out.pop(name)
    for name in ("response_hit_ratio", "semantic_hit_ratio", "prefix_cached_token_ratio", "duration_s", "rate_per_s"):
        out[name] = round(out[name], 4)
    return out


#: Seconds per engine when several start together on 2 cores (their start-ups overlap): measured here,
#: 4 real-model engines in 81 s and 5 in 107 s. Said while a deployment's first engines start.
START_S_PER_ENGINE_TOGETHER = 22


def _start_estimate(count: int) -> str:
    """What earlier engine starts on this deployment took (the last ten), to say while new ones start; on
    a deployment's first start, what ``count`` engines starting together took on 2 cores here."""
    recent = Engine.objects.filter(start_seconds__isnull=False).order_by("-id").values_list("start_seconds", flat=True)[:10]
    took = sorted(t for t in recent if t is not None)
    if not took:
        return f"; {count} together took about {count * START_S_PER_ENGINE_TOGETHER} s on 2 cores elsewhere"
    return f"; earlier starts here took {took[0]:.0f}-{took[-1]:.0f} s (engines started together share the cores)"


class StartProgress:
    """While engines start, a line every :data:`START_PROGRESS_S` seconds: how many, for how long, and
    what earlier starts took.

    Args:
        log: where lines go.
        count: engines starting.
        estimate: :func:`_start_estimate`'s text.
    """

    def __init__(self, log: Callable[[str], None], count: int, estimate: str, *, every_s: float = START_PROGRESS_S) -> None:
        self.log, self.count, self.estimate, self.every_s = log, count, estimate, every_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._tick, name="engine-start-progress", daemon=True)

    def _tick(self) -> None:
        started = time.monotonic()
        while not self._stop.wait(self.every_s):
            self.log(f"  still starting {self.count} engine(s): {time.monotonic() - started:.0f} s so far{self.estimate}")

    def __enter__(self) -> StartProgress:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def demo_run(
    *,
    log: Callable[[str], None],
    stage: Stage,
    watchdog: Callable[[], None] = lambda: None,
    model: DemoModel = DEMO_MODELS[DEFAULT_DEMO_MODEL],
    checkpoints: tuple[Path, Path] | None = None,
    max_tokens: int | None = None,
    job_timeout_s: float = 600.0,
    keep_serving: bool = False,
    rate_per_s: float = TRAFFIC_RATE_PER_S,
    hold_s: float = HOLD_S,
) -> dict[str, Any]:
    """Run the main job and return its summary.

    Args:
        log: receives one line per step.
        stage: the running gateway's URL and an HTTP client of the control
            plane's API (a served dashboard, or the WSGI app in process).
        watchdog: called while waiting on jobs (the caller checks its worker).
        model: the checkpoints, layout, corpus and traffic (:mod:`cacheadmin.services.demo_models`).
        checkpoints: v1's and v2's checkpoints, built already (the command builds them before it starts
            its processes: training shares the cores with nothing); None builds them here.
        max_tokens: tokens per answer when comparing (default the model's).
        keep_serving: leave v1's engine and reference running after the run
            (the served demo: the gateway keeps answering); they still stop
            with this process. The summary then has ``serving`` (id, name, base_url).
        rate_per_s: the traffic generator's steady rate.
        hold_s: seconds of traffic at each gray step and after the rollback.

    Returns:
        ``{"unsafe": {...}, "safe": {...}, "release": {...}, "traffic": {...},
        "caught", "clean", "warm_faster", "released", "shadow_verified", "ok"}``;
        see the README's "What the main job shows".

    Raises:
        DemoError: a job failed or timed out, an API call was refused, the
            gateway did not route, the sweep did not demote.
        CheckpointError, EngineError, EngineRefused: from the steps.
    """
    began, say = time.monotonic(), log

    def log(line: str) -> None:  # every line with the seconds since the run began
        say(f"[{time.monotonic() - began:5.0f} s] {line}")

    engines_reconcile(actor=ACTOR)
    run = uuid.uuid4().hex[:6]
    since = timezone.now()
    corpus, max_tokens = model.corpus, max_tokens or model.max_tokens
    path_v1, path_v2 = checkpoints or model.checkpoints(settings.DEMO_MODELS_DIR, log)
    log(f"checkpoints: {path_v1}, {path_v2}")
    label_v1, label_v2 = model.labels
    v1 = _register(path_v1, label_v1, model)
    tenant = tenant_get_or_create(slug="acme", name="Acme Corp", actor=ACTOR)
    owner = retention_owner_get_or_create(name="platform-team", email="platform@example.com", actor=ACTOR)
    ns1, _ = namespace_get_or_create(model_version=v1, tenant=tenant, retention_owner=owner, policy=RELEASE_POLICY, actor=ACTOR)
    _policy_ensure(ns1)
    tenant_gateway_policy_update(
        tenant=tenant,
        actor=ACTOR,
        changes={
            "shadow_sample_rate": SHADOW_SAMPLE_RATE,
            "canary_shadow_sample_rate": CANARY_SHADOW_SAMPLE_RATE,
            "admit_length": model.admit_length,
        },
    )
    api = ControlPlaneApi(stage.api_client, tooling_token(actor=ACTOR))

    started: list[Engine] = []
    traffic: TrafficRunner | None = None
    traffic_stopped = False

    def launch(**specs: dict[str, Any]) -> list[Engine]:
        """Start engines together (their start-ups overlap), each verified before use."""
        log(f"starting engines {', '.join(specs)} together…")
        # Attached to this process (detached=False): they die with it, even when it is killed.
        rows = [engine_create(name=f"{name}-{run}", actor=ACTOR, detached=False, **kwargs) for name, kwargs in specs.items()]
        started.extend(rows)
        with StartProgress(log, len(rows), _start_estimate(len(rows))):
            engines = engines_boot(rows, actor=ACTOR, kv_cache_gib=model.kv_cache_gib)
        for engine in engines:
            engine.refresh_from_db()
            if engine.status != Engine.Status.READY:
                # Failed under the boot by something else (a health round, an operator): one line, not a traceback.
                why = (engine.error.splitlines() or ["no reason recorded"])[0]
                raise DemoError(f"engine {engine.name} is {engine.status} after its start: {why}")
            took = f" in {engine.start_seconds:.1f} s" if engine.start_seconds is not None else ""
            log(f"  {engine.name} ready and verified at {engine.base_url}{took}")
        return engines

    def finish(job: Job, what: str) -> Job:
        job = _wait(job, timeout_s=job_timeout_s, log=log, watchdog=watchdog)
        if job.status != JobStatus.SUCCEEDED:
            raise DemoError(f"{what} {job} ended {job.status}: {job.error}")
        return job

    def stop(engine: Engine) -> None:
        engine_stop(engine=engine, actor=ACTOR)

    kept: list[Engine] = []
    try:
        # 1. v1 serves acme through the gateway; traffic starts.
        log("step 1: v1 serves tenant acme through the gateway")
        v2 = _register(path_v2, label_v2, model)  # registered now so an earlier run's release can be settled
        pending = _settle(tenant, v1, v2, log)
        # Before any traffic, the run's whole fleet starts together: an engine started while traffic runs shares
        # two cores with it (measured here: over 300 s). v2's engine serves v2's namespace, created for it over
        # the API (empty until the decision fills it); v2 also runs on v1's persistent tier for the baseline.
        created = api.post(
            "/api/namespaces/",
            {"model_version": v2.pk, "tenant": "acme", "retention_owner": owner.pk, "policy": RELEASE_POLICY.as_dict()},
        )
        ns2 = CacheNamespace.objects.get(pk=created["id"])
        _policy_ensure(ns2)
        log(f"  POST /api/namespaces/ → v2's namespace {ns2.storage_prefix}, for v2's engine")
        e1, reference_v1, e2, reference_v2, unsafe_engine = launch(
            **{
                label_v1: {"model_version": v1, "namespace": ns1},
                f"{label_v1}-reference": {"model_version": v1, "namespace": None},
                label_v2: {"model_version": v2, "namespace": ns2},
                f"{label_v2}-reference": {"model_version": v2, "namespace": None},
                f"{label_v2}-unsafe": {"model_version": v2, "namespace": ns1, "identity_override_reason": UNSAFE_REASON},
            }
        )
        job = finish(prewarm_job_create(namespace=ns1, engine=e1, corpus=corpus, actor=ACTOR), "prewarm of v1")
        assert isinstance(job, PrewarmJob)
        log(f"  v1's namespace {ns1.storage_prefix} prewarmed: {job.verified} prompts verified from the disk tier")
        if not Release.objects.filter(tenant=tenant, served_name=model.served_name).exists():
            first = api.post("/api/releases/", {"served_name": model.served_name, "tenant": "acme", "to_version": v1.pk})
            what = f"{first['classification']}, {first['traffic_percent']} % on {v1.label}"
            log(f"  POST /api/releases/ → release #{first['id']} {what}")
        demo_templates_register(tenant=tenant, templates=model.workload().templates, log=log)
        _, key = gateway_key_issue(tenant=tenant, name=f"demo traffic {run}", actor=ACTOR)
        _gateway_answers(stage.gateway_url, key, model.served_name, timeout_s=120)
        runner = TrafficRunner(stage.gateway_url, key, model.workload(), rate_per_s=rate_per_s, log=log)
        runner.start("v1")
        traffic = runner
        log(f"  traffic: {rate_per_s:g} requests/s through {stage.gateway_url}/v1 as tenant acme")

        # 2. v2 registered; the release planned over the API.
        log("step 2: v2 registered; release v1 → v2 planned over the API")
        changed = [f for f in v1.IDENTITY_FIELDS if getattr(v1, f) != getattr(v2, f)]
        log(f"  {v1.label} {v1.identity[:12]} → {v2.label} {v2.identity[:12]}; identity fields that differ: {changed}")
        if pending is None:
            planned = api.post(
                "/api/releases/",
                {"served_name": model.served_name, "tenant": "acme", "from_version": v1.pk, "to_version": v2.pk},
            )
        else:
            planned = api.get(f"/api/releases/{pending.pk}/")
        release_id = planned["id"]
        diff = planned["diff"]
        log(f"  POST /api/releases/ → release #{release_id}: {planned['classification']}, differing {diff['differing']}")
        for name in diff["differing"]:
            changes = diff["fields"].get(name, {})
            log(f"    {name}: {json.dumps(changes)[:300]}")

        # 3. The baseline, while v1 serves: v2 on v1's persistent tier, then compared.
        log("step 3 (the baseline): v2 on v1's persistent tier, as a name-keyed cache does it")
        unsafe = finish(
            comparison_job_create(
                engine=unsafe_engine, reference_engine=reference_v2, namespace=ns1, corpus=corpus, max_tokens=max_tokens,
                actor=ACTOR,
            ),
            "unsafe comparison",
        )  # fmt: skip
        stop(unsafe_engine)
        assert isinstance(unsafe, ComparisonJob)
        log(
            f"  unsafe upgrade: {unsafe.cross_version_hits} of {unsafe.prompts} prompts served from v1's KV "
            f"(cross-version hits), {unsafe.deceptive_hits} of them with a changed answer (deceptive hits); "
            "the gateway never routed acme's traffic to it"
        )
        policy_answers = _policy_answers(model, unsafe, reference_v1, max_tokens)
        for row in policy_answers:
            log(f"  {row['question']!r}")
            for key, what in (("v1", "v1 (release 1.2)"), ("v2_cold", "v2 without cache"), ("v2_on_v1_tier", "v2 on v1's tier")):
                log(f"    {what:>18}: {row[key]!r} → {row['states'][key] or 'neither release'}")

        # 4. Decision new_namespace: v2's namespace prewarmed from live heat on v2's engine, verified.
        log(f"step 4: decision new_namespace: v2's namespace {ns2.storage_prefix} prewarmed from live heat")
        decided = api.post(
            f"/api/releases/{release_id}/decide/",
            {"decision": "new_namespace", "engine": e2.pk, "reason": "demo: new weights, new namespace prewarmed from live heat"},
        )
        prewarm = PrewarmJob.objects.get(pk=decided["prewarm_job"])
        log(f"  POST …/decide/ → {decided['status']}; prewarm job #{prewarm.pk} on corpus {prewarm.corpus}")
        prewarm = finish(prewarm, "prewarm of v2's namespace")
        assert isinstance(prewarm, PrewarmJob)
        ready = api.post(f"/api/releases/{release_id}/ready/")
        log(f"  POST …/ready/ → {ready['status']}: {prewarm.verified} prompts verified from v2's disk tier")
        safe = finish(
            comparison_job_create(
                engine=e2, reference_engine=reference_v2, namespace=ns2, corpus=corpus, max_tokens=max_tokens, actor=ACTOR
            ),
            "safe comparison",
        )
        assert isinstance(safe, ComparisonJob)
        log(f"  safe upgrade: {safe.deceptive_hits} deceptive hits, {safe.cached_tokens} cached tokens")
        ready_before_traffic = ready["status"] == Release.Status.READY

        # 5. Gray release with shadow verification.
        highest = 0
        for percent in (10, 100):
            phase = f"v2 {percent}%"
            # Marked before the call: the new split routes from its commit, early in the call, while the call
            # itself may return much later (at 100 % it retires v1's cached answers after the commit), and
            # requests sent meanwhile belong to the new split.
            traffic.mark(phase)
            moved = api.post(f"/api/releases/{release_id}/traffic/", {"percent": percent})
            highest = max(highest, moved["traffic_percent"])
            log(f"step 5: POST …/traffic/ → {moved['traffic_percent']} % of conversations on {v2.label}")
            # Each step lasts hold_s, and until v2 answered some conversations and shadow verification judged
            # one of v2's live answers (a small share of a low rate can take a while), at most six times as long.
            started_step = time.monotonic()
            while time.monotonic() - started_step < 6 * hold_s:
                on_v2 = traffic.stats(phase).by_version.get(v2.label, 0)
                judged = shadow_figures([ns2], since=since)["shadow_checked"]
                if time.monotonic() - started_step >= hold_s and on_v2 >= MIN_ANSWERS_PER_STEP and judged:
                    break
                watchdog()
                time.sleep(0.5)
        # Not waited for here: the checks still queued (the canary's, sampled at its own rate) are judged
        # while the sweep and the rollback run, and drained before the summary.
        so_far = shadow_figures([ns1, ns2], since=since)
        log(f"  shadow checks so far: {so_far} ({so_far['shadow_pending']} still pending)")

        # 6. v1 demoted by policy in the next sweep; rollback from the cold tier.
        log("step 6: the next eviction sweep demotes v1's namespace by policy")
        swept = _sweep(ns1, log=log, finish=finish)
        log(f"  eviction run #{swept.pk}: v1's namespace is cold ({swept.bytes_freed} bytes left the hot tiers)")
        rolled = api.post(f"/api/releases/{release_id}/rollback/", {"reason": "demo: roll back to v1"})
        traffic.mark("rolled back to v1")
        log(f"  POST …/rollback/ → {rolled['status']}: all traffic back on {v1.label}")
        time.sleep(hold_s)
        stats = traffic.stop()
        traffic_stopped = True
        shadow_drain([ns1, ns2], since=since, timeout_s=120, watchdog=watchdog)
        kept = [e1, reference_v1] if keep_serving else []
    finally:
        if traffic is not None and not traffic_stopped:
            traffic.stop()
        for engine in started:
            engine.refresh_from_db()
            if engine.status == Engine.Status.READY and engine not in kept:
                stop(engine)
    release = Release.objects.get(pk=release_id)
    # The gateway flushes its figures every GATEWAY_FLUSH_S: wait for the last ones.
    time.sleep(settings.GATEWAY_FLUSH_S + 1)
    result: dict[str, Any] = {
        "model": {
            "key": model.key,
            "title": model.title,
            "served_name": model.served_name,
            "parameters": checkpoint_parameters(path_v2),
            "dtype": model.layout.dtype,
            "versions": [v1.label, v2.label],
        },
        "policy_answers": policy_answers,
        "unsafe": _summary(unsafe),
        "safe": _summary(safe),
        "release": release_summary(release, highest_percent=highest, ready_before_traffic=ready_before_traffic),
        "traffic": {
            "requests": stats.sent,
            "answered": stats.answered,
            **{k: v for k, v in traffic_figures([ns1, ns2], since=since).items() if k != "layers"},
            **shadow_figures([ns1, ns2], since=since),
            "cross_version_answers": stats.cross_version,
            "cross_version_examples": [vars(e).copy() for e in stats.cross_version_examples],
            # How the gateway chose engines (precise by what they hold, or affinity and why), and how often
            # a precise choice's predicted cached tokens were exactly what the engine reported.
            "routing": stats.routing,
            "predictions": stats.predictions,
            "prediction_accuracy": None if stats.prediction_accuracy is None else round(stats.prediction_accuracy, 4),
            "phases": {phase: _phase_summary(traffic.stats(phase)) for phase in traffic.phases},
        },
    }
    if kept:
        result["serving"] = {"id": kept[0].pk, "name": kept[0].name, "base_url": kept[0].base_url}
    # Caught: every prompt that reused v1's KV was flagged (the namespace's identity is not the engine's),
    # and where the stale state changed an answer beyond the noise, the comparison says so (deceptive hits).
    u = result["unsafe"]
    result["caught"] = u["cross_version_hits"] == u["reused"] > 0
    result["clean"] = result["safe"]["deceptive_hits"] == 0 and result["safe"]["cached_tokens"] > 0
    result["warm_faster"] = (result["safe"]["ttft_warm_ms"] or 0) < (result["safe"]["ttft_cold_ms"] or 0)
    t, r = result["traffic"], result["release"]
    result["released"] = r["ready"] and r["traffic_percent"] == 100 and r["rolled_back_from_cold"]
    result["shadow_verified"] = t["shadow_checked"] > 0 and t["shadow_deceptive_hits"] == 0 and t["cross_version_answers"] == 0
    result["ok"] = result["caught"] and result["clean"] and result["released"] and result["shadow_verified"]
    return result
