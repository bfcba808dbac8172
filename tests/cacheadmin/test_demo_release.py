"""The main job's release tooling and measurements, without engines: the API
client against the real WSGI application and database, the figures summed
from real rows, the demo's command-line numbers, and the order in which a
batch of engines is booted (a launcher stand-in: the demo's own test boots
real ones)."""

from __future__ import annotations

import argparse
from datetime import timedelta
from types import SimpleNamespace

import httpx
import pytest
from django.core.wsgi import get_wsgi_application
from django.utils import timezone

from cacheadmin.management.base import float_within
from cacheadmin.models import ApiToken, AuditEvent, Engine, GatewayStat, Release, ShadowCheck
from cacheadmin.services import engines as service
from cacheadmin.services.demo_release import (
    TOOLING_USER,
    ApiCallFailed,
    ControlPlaneApi,
    shadow_figures,
    tooling_token,
    traffic_figures,
)
from cacheadmin.services.engines import engines_boot
from cacheadmin.services.namespaces import DEMO_POLICY, namespace_get_or_create, tenant_get_or_create
from inference.errors import EngineError
from tests.helpers import manage, subprocess_env

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def api() -> ControlPlaneApi:
    client = httpx.Client(transport=httpx.WSGITransport(app=get_wsgi_application()), base_url="http://127.0.0.1")
    yield ControlPlaneApi(client, tooling_token(actor="demo"))
    client.close()


def test_release_tooling_acts_as_its_service_account_and_each_change_is_keyed(api: ControlPlaneApi, world) -> None:
    token = ApiToken.objects.get(user__username=TOOLING_USER)
    assert (token.user.username, token.scope, token.tenant, token.user.has_usable_password()) == (
        TOOLING_USER, "admin", None, False,
    )  # fmt: skip
    assert AuditEvent.objects.filter(action="api_token.issue", actor="demo").count() == 1
    v1, initech = world["v1"], tenant_get_or_create(slug="initech", name="Initech", actor="t")
    namespace_get_or_create(model_version=v1, tenant=initech, retention_owner=world["ns"]["acme"].retention_owner,
                            policy=DEMO_POLICY, actor="t")  # fmt: skip
    planned = api.post("/api/releases/", {"served_name": "tiny", "tenant": "initech", "to_version": v1.pk})
    assert (planned["classification"], planned["traffic_percent"]) == ("first_deployment", 100)
    release = Release.objects.get(pk=planned["id"])
    assert release.created_by == f"{TOOLING_USER} (token {token.name})"
    assert api.get(f"/api/releases/{release.pk}/")["status"] == "ready"


def test_a_refused_call_raises_with_the_envelope_and_changes_nothing(api: ControlPlaneApi, world) -> None:
    with pytest.raises(ApiCallFailed) as refused:
        api.post("/api/releases/", {"served_name": "tiny", "tenant": "acme", "to_version": world["v1"].pk, "extra": 1})
    assert str(refused.value).startswith("POST /api/releases/ answered 400 (invalid: ")
    assert "extra" in str(refused.value)
    with pytest.raises(ApiCallFailed, match=r"^GET /api/releases/999999/ answered 404 \(not_found: "):
        api.get("/api/releases/999999/")
    assert not Release.objects.exists()


def _stat(namespace, layer: str, minute, **counters: float) -> GatewayStat:
    return GatewayStat.objects.create(namespace=namespace, layer=layer, minute=minute, **counters)


def test_traffic_figures_add_up_the_layers_of_every_namespace_given(world) -> None:
    ns_a, ns_b = world["ns"]["acme"], world["ns"]["globex"]
    now = timezone.now().replace(second=0, microsecond=0)
    _stat(ns_a, "response", now, requests=10, hits=4, misses=6, prompt_tokens=400, output_tokens=40)
    _stat(ns_b, "response", now, requests=10, hits=1, misses=4, bypasses=5, prompt_tokens=100, output_tokens=10)
    _stat(ns_a, "semantic", now, requests=6, hits=2, misses=4, prompt_tokens=200, output_tokens=20)
    _stat(ns_a, "prefix", now, requests=4, hits=3, misses=1, prompt_tokens=400, cached_prompt_tokens=300, output_tokens=40)
    _stat(ns_b, "prefix", now, requests=4, prompt_tokens=400, cached_prompt_tokens=100, output_tokens=40)
    _stat(ns_a, "prefix", now - timedelta(hours=2), requests=99, prompt_tokens=9900, cached_prompt_tokens=0)  # before
    figures = traffic_figures([ns_a, ns_b], since=now - timedelta(minutes=5))
    # asked: prefix 800 + 80, response 500 + 50, semantic 200 + 20 = 1650 tokens;
    # not computed: 400 cached by the engines, 550 answered by the response cache, 220 by the semantic one.
    assert figures == {
        "response_cache_hit_ratio": round(5 / 15, 4),
        "semantic_cache_hit_ratio": round(2 / 6, 4),
        "prefix_cached_token_ratio": 0.5,
        "cost_savings_rate": round(400 / 1650 + 550 / 1650 + 220 / 1650, 4),
        "layers": {
            "response": {"requests": 20, "hits": 5, "misses": 10},
            "semantic": {"requests": 6, "hits": 2, "misses": 4},
            "prefix": {"requests": 8, "hits": 3, "misses": 1},
        },
    }
    assert traffic_figures([ns_b], since=now + timedelta(minutes=1))["response_cache_hit_ratio"] is None


def test_shadow_figures_count_judged_checks_by_outcome(world) -> None:
    ns_a, ns_b = world["ns"]["acme"], world["ns"]["globex"]
    for namespace, status in ((ns_a, "matched"), (ns_a, "matched"), (ns_b, "deceptive"), (ns_a, "failed"), (ns_b, "pending")):
        ShadowCheck.objects.create(namespace=namespace, request={}, cached_tokens=32, status=status)
    since = timezone.now() - timedelta(minutes=1)
    assert shadow_figures([ns_a, ns_b], since=since) == {
        "shadow_sampled": 5, "shadow_checked": 3, "shadow_deceptive_hits": 1, "shadow_failed": 1, "shadow_pending": 1,
    }  # fmt: skip
    assert shadow_figures([ns_a], since=since)["shadow_checked"] == 2
    assert shadow_figures([ns_a, ns_b], since=timezone.now() + timedelta(minutes=1))["shadow_sampled"] == 0


@pytest.mark.parametrize(("text", "value"), [("2", 2.0), (" 0.5 ", 0.5), ("1e1", 10.0), ("50", 50.0), ("0.1", 0.1)])
def test_a_rate_is_a_number_within_bounds(text: str, value: float) -> None:
    assert float_within(0.1, 50.0)(text) == value


@pytest.mark.parametrize(
    ("text", "message"),
    [("0", "0 is not within 0.1..50"), ("51", "51 is not within 0.1..50"), ("nan", "nan is not within 0.1..50"),
     ("inf", "inf is not within 0.1..50"), ("abc", "'abc' is not a number"), ("٢", "'٢' is not a number"),
     ("", "'' is not a number")],
)  # fmt: skip
def test_a_rate_outside_bounds_or_not_a_number_is_refused(text: str, message: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError) as refused:
        float_within(0.1, 50.0)(text)
    assert str(refused.value) == message


def test_the_demo_refuses_a_bad_rate_before_doing_anything() -> None:
    proc = manage("demo", "--no-serve", "--rate", "0", env=subprocess_env())
    assert proc.returncode == 2 and proc.stdout == ""
    assert "argument --rate: 0 is not within 0.1..50" in proc.stderr
    assert not Release.objects.exists()


class _Server:
    """A launcher stand-in (the unit here is how a batch of boots is sequenced, not vLLM):
    records when each process started and was waited for; ``fails`` never comes up."""

    events: list[str] = []

    def __init__(self, spec: object) -> None:
        self.name = str(getattr(spec, "log_path", "")).rsplit("/", 1)[-1].removesuffix(".log")
        self.pid = 4_000_000 + len(self.events)

    def start(self, detach: bool = False) -> None:
        self.events.append(f"start {self.name}")

    def wait_ready(self, timeout_s: float) -> None:
        self.events.append(f"wait {self.name}")
        if self.name == "fails":
            raise EngineError("vLLM server fails exited before it was ready")

    def stop(self) -> None:
        self.events.append(f"stop {self.name}")


def test_engines_started_together_are_all_spawned_before_any_wait_and_each_ends_on_its_own(world, monkeypatch) -> None:
    _Server.events = []
    monkeypatch.setattr(service, "LocalEngine", _Server)
    monkeypatch.setattr(service, "_spec_for", lambda engine, **_: SimpleNamespace(log_path=f"/x/{engine.name}.log"))
    verified: list[str] = []
    monkeypatch.setattr(service, "engine_verify", lambda *, engine, actor, trigger: verified.append(engine.name))
    rows = [
        Engine.objects.create(name=name, model_version=world["v1"], base_url="http://127.0.0.1:1", status="starting")
        for name in ("first", "fails", "third")
    ]
    with pytest.raises(EngineError, match="fails exited before it was ready"):
        engines_boot(rows, actor="ops")
    assert _Server.events == [
        "start first", "start fails", "start third", "wait first", "wait fails", "stop fails", "wait third",
    ]  # fmt: skip
    assert verified == ["first", "third"]
    states = {e.name: (e.status, e.error[:40]) for e in Engine.objects.filter(pk__in=[r.pk for r in rows])}
    assert states == {
        "first": ("ready", ""), "fails": ("failed", "vLLM server fails exited before it was r"), "third": ("ready", ""),
    }  # fmt: skip
    assert AuditEvent.objects.filter(action="engine.failed", actor="ops").count() == 1
    # An engine no longer starting is left as it is.
    assert [e.status for e in engines_boot(rows[:1], actor="ops")] == ["ready"]
    assert _Server.events[-1] == "wait third"
