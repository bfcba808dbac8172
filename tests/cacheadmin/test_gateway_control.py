"""The control plane's side of the gateway through the API and the CLI: keys,
the routing epoch every routing change moves (bulk updates included), explain,
kill switches, tenant policies, figures, semantic-cache invalidation, routing
holds and the deceptive-hit path of shadow verification."""

from __future__ import annotations

import json
import socket
from datetime import timedelta
from pathlib import Path

import pytest
from django.contrib.auth.models import User
from django.core.exceptions import ImproperlyConfigured
from django.utils import timezone

from cacheadmin.models import (
    AuditEvent,
    CacheNamespace,
    Engine,
    EngineAlarm,
    GatewayKey,
    GatewayStat,
    NamespaceRouting,
    Release,
    ShadowCheck,
)
from cacheadmin.services.gateway import (
    gateway_explain,
    gateway_flush,
    gateway_key_issue,
    namespace_routing_suspend,
    routing_epoch,
    routing_snapshot_build,
    semantic_rules,
)
from cacheadmin.services.shadow import _deceptive
from gateway.routing import key_hash
from tests.helpers import manage, subprocess_env

pytestmark = pytest.mark.django_db(transaction=True)

BODY = {"model": "tiny", "messages": [{"role": "user", "content": "What is 2+2?"}], "temperature": 0}


@pytest.fixture
def served(world) -> dict:
    v1 = world["v1"]
    v1.status = "active"
    v1.save()
    Engine.objects.filter(pk=world["engine"].pk).update(verification="verified")
    return world


def test_a_key_is_issued_once_listed_without_its_secret_and_revoked(served) -> None:
    alice = served["clients"]["alice"]
    issued = alice.post(
        "/api/gateway-keys/", {"tenant": "acme", "name": "support-bot", "rate_per_s": 5.0, "burst": 10}, format="json"
    )
    assert issued.status_code == 201, issued.json()
    key = issued.json()["key"]
    assert key.startswith("kvgw_") and GatewayKey.objects.get().key_hash == key_hash(key)
    assert key_hash(key) in routing_snapshot_build().keys
    listed = alice.get("/api/gateway-keys/").json()["results"]
    assert [(k["name"], k["tenant"], k["rate_per_s"], k["burst"]) for k in listed] == [("support-bot", "acme", 5.0, 10)]
    assert "key" not in listed[0]
    # A token bound to globex sees none of acme's keys and cannot issue one for acme.
    charlie = served["clients"]["charlie"]
    assert charlie.get("/api/gateway-keys/").json()["results"] == []
    assert (
        served["clients"]["bob"].post("/api/gateway-keys/", {"tenant": "globex", "name": "x"}, format="json").status_code == 400
    )
    revoked = alice.post(f"/api/gateway-keys/{listed[0]['id']}/revoke/")
    assert revoked.status_code == 200 and revoked.json()["revoked_at"]
    assert key_hash(key) not in routing_snapshot_build().keys
    assert AuditEvent.objects.filter(action__in=["gateway_key.issue", "gateway_key.revoke"]).count() == 2


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"tenant": "acme", "name": ""}, "name"),
        ({"tenant": "acme", "name": "x", "burst": 0}, "burst"),
        ({"tenant": "nope", "name": "x"}, "tenant"),
    ],
)
def test_bad_key_requests_are_refused_and_change_nothing(served, body, field) -> None:
    answer = served["clients"]["alice"].post("/api/gateway-keys/", body, format="json")
    assert answer.status_code == 400 and field in answer.json()["error"]["fields"]
    assert GatewayKey.objects.count() == 0


def test_every_routing_change_moves_the_epoch_and_health_clocks_do_not(served) -> None:
    start = routing_epoch()
    engine = served["engine"]
    Engine.objects.filter(pk=engine.pk).update(health_checked_at=timezone.now(), health_failures=0)
    assert routing_epoch() == start
    Engine.objects.filter(pk=engine.pk).update(status="failed")  # a bulk update: no signal, still counted
    assert routing_epoch() == start + 1
    engine.refresh_from_db()
    engine.status = "ready"
    engine.save(update_fields=["status"])
    assert routing_epoch() == start + 2
    release = Release.objects.create(
        served_name="tiny", tenant=served["acme"], from_version=served["v1"], to_version=served["v2"],
        classification="incompatible", created_by="t",
    )  # fmt: skip
    assert routing_epoch() == start + 3
    Release.objects.filter(pk=release.pk).update(traffic_percent=10)
    assert routing_epoch() == start + 4
    namespace_routing_suspend(namespace=served["ns"]["acme"], reason="deceptive hit", actor="t")
    assert routing_epoch() > start + 4  # the hold's row is created, then stamped: one move or two, never none
    assert routing_snapshot_build().namespaces[served["ns"]["acme"].pk].suspended == "deceptive hit"


def test_explain_through_the_api_and_the_cli_answers_the_same(served, tmp_path: Path) -> None:
    api = served["clients"]["alice"].post("/api/gateway/explain/", {"tenant": "acme", "request": BODY}, format="json")
    assert api.status_code == 200, api.json()
    out = api.json()
    assert set(out) == {"route", "canonical_request", "response_cache", "semantic_cache"}
    assert out["route"]["label"] == "v1" and out["route"]["namespace"] == served["ns"]["acme"].pk
    assert out["route"]["engine"] == {"id": served["engine"].pk, "name": "e-acme"}
    assert out["response_cache"]["admitted"] is True and out["response_cache"]["reason"] == "greedy"
    assert len(out["response_cache"]["key"]) == 64
    assert out["semantic_cache"] == {"admitted": True, "reason": "admitted"}
    request = tmp_path / "request.json"
    request.write_text(json.dumps(BODY))
    cli = manage("gateway", "explain", "--tenant", "acme", "--request", str(request), "--json", env=subprocess_env())
    assert cli.returncode == 0, cli.stderr
    assert json.loads(cli.stdout) == out
    # No engine up: the key is still computed, the route says why there is no engine.
    Engine.objects.update(status="stopped")
    cold = served["clients"]["alice"].post("/api/gateway/explain/", {"tenant": "acme", "request": BODY}, format="json").json()
    assert cold["route"]["engine"] is None and "no engine in service" in cold["route"]["engine_reason"]
    assert cold["response_cache"]["key"] == out["response_cache"]["key"]
    sampled = dict(BODY, temperature=0.7)
    answer = (
        served["clients"]["alice"].post("/api/gateway/explain/", {"tenant": "acme", "request": sampled}, format="json").json()
    )
    assert (answer["response_cache"]["admitted"], answer["response_cache"]["reason"]) == (False, "sampling")
    # The request's X-Cache-Tags: a tagged answer is kept where a tag can invalidate it, never as an exact one.
    asked = {"tenant": "acme", "request": BODY, "tags": ["order-17"]}
    tagged = served["clients"]["alice"].post("/api/gateway/explain/", asked, format="json").json()
    assert tagged["response_cache"] == {"admitted": False, "reason": "tagged", "key": out["response_cache"]["key"]}
    cli = manage("gateway", "explain", "--tenant", "acme", "--request", str(request), "--tags", "order-17", "--json",
                 env=subprocess_env())  # fmt: skip
    assert json.loads(cli.stdout)["response_cache"] == tagged["response_cache"]
    # A question the bundled embedder does not read bypasses the semantic layer, as on the live path.
    german = dict(BODY, messages=[{"role": "user", "content": "Wie sortiere ich die Tabelle absteigend?"}])
    foreign = served["clients"]["alice"].post("/api/gateway/explain/", {"tenant": "acme", "request": german}, format="json")
    assert foreign.json()["semantic_cache"] == {"admitted": False, "reason": "language_unsupported"}
    refused = served["clients"]["alice"].post("/api/gateway/explain/", {**asked, "tags": ["a\tb"]}, format="json")
    assert refused.status_code == 400 and refused.json()["error"]["fields"]["tags"] == [
        "at most 32 printable tags of at most 200 characters"
    ]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--tenant", "nope", "--request", "{path}"], "no tenant"),
        (["--tenant", "acme", "--request", "/does/not/exist"], "--request"),
        (["--tenant", "acme", "--request", "{bad}"], "not JSON"),
        (["--tenant", "acme", "--request", "{salted}"], "cache_salt"),
        # The API refuses a duplicate key; the CLI twin must not keep the last value.
        (["--tenant", "acme", "--request", "{twice}"], "duplicate key 'model'"),
        (["--tenant", "acme", "--request", "{path}", "--tags", "a\tb"], "tags: at most 32 printable tags"),
    ],
)
def test_explain_cli_refuses_bad_input_with_exit_2(served, tmp_path: Path, args, message) -> None:
    good, bad, salted = tmp_path / "good.json", tmp_path / "bad.json", tmp_path / "salted.json"
    twice = tmp_path / "twice.json"
    twice.write_text('{"model": "tiny", "model": "other", "messages": []}')
    good.write_text(json.dumps(BODY))
    bad.write_text("{nope")
    salted.write_text(json.dumps(dict(BODY, cache_salt="x")))
    args = [a.format(path=good, bad=bad, salted=salted, twice=twice) for a in args]
    result = manage("gateway", "explain", *args, env=subprocess_env())
    assert result.returncode == 2 and message in result.stderr


def test_kill_switches_need_admin_and_a_reason_and_reach_the_snapshot(served) -> None:
    bob, alice = served["clients"]["bob"], served["clients"]["alice"]
    assert (
        bob.post("/api/gateway/layers/", {"layer": "semantic", "enabled": False, "reason": "x"}, format="json").status_code == 403
    )
    refused = alice.post("/api/gateway/layers/", {"layer": "semantic", "enabled": False}, format="json")
    assert refused.status_code == 400 and routing_snapshot_build().layers["semantic"] is True
    off = alice.post("/api/gateway/layers/", {"layer": "semantic", "enabled": False, "reason": "bad answers"}, format="json")
    assert off.status_code == 200 and off.json()["enabled"] is False and off.json()["reason"] == "bad answers"
    assert routing_snapshot_build().layers == {"response": True, "semantic": False}
    assert alice.get("/api/gateway/layers/").json()["semantic"]["changed_by"].startswith("alice")


def test_a_tenant_policy_is_read_and_patched_with_checked_values(served) -> None:
    alice = served["clients"]["alice"]
    acme = served["acme"].pk
    assert alice.get(f"/api/tenants/{acme}/gateway-policy/").json()["allow_seeded"] is False
    bad = alice.patch(f"/api/tenants/{acme}/gateway-policy/", {"semantic_threshold": 1.5}, format="json")
    assert bad.status_code == 400 and "semantic_threshold" in bad.json()["error"]["fields"]
    wrong_type = alice.patch(f"/api/tenants/{acme}/gateway-policy/", {"shadow_sample_rate": "0.5"}, format="json")
    assert wrong_type.status_code == 400
    ok = alice.patch(f"/api/tenants/{acme}/gateway-policy/", {"allow_seeded": True, "semantic_threshold": 0.9}, format="json")
    assert ok.status_code == 200 and ok.json()["allow_seeded"] is True and ok.json()["semantic_threshold"] == 0.9
    policy = routing_snapshot_build().tenants[acme].policy
    assert (policy.allow_seeded, policy.semantic_threshold) == (True, 0.9)


def test_keeping_answers_cut_at_max_tokens_is_off_by_default_and_switched_through_the_api_and_the_cli(served) -> None:
    alice = served["clients"]["alice"]
    acme = served["acme"].pk
    assert alice.get(f"/api/tenants/{acme}/gateway-policy/").json()["admit_length"] is False
    assert routing_snapshot_build().tenants[acme].policy.admit_length is False
    for wrong in ("true", 1, None):
        bad = alice.patch(f"/api/tenants/{acme}/gateway-policy/", {"admit_length": wrong}, format="json")
        assert bad.status_code == 400 and "admit_length" in bad.json()["error"]["fields"], wrong
    assert routing_snapshot_build().tenants[acme].policy.admit_length is False  # refused: nothing changed
    ok = alice.patch(f"/api/tenants/{acme}/gateway-policy/", {"admit_length": True}, format="json")
    assert ok.status_code == 200 and ok.json()["admit_length"] is True
    assert routing_snapshot_build().tenants[acme].policy.admit_length is True
    result = manage("gateway", "policy", "--tenant", "acme", "--set", "admit_length=false", env=subprocess_env())
    assert result.returncode == 0 and json.loads(result.stdout)["admit_length"] is False, result.stderr
    assert routing_snapshot_build().tenants[acme].policy.admit_length is False


def test_a_policy_change_is_stored_as_said_and_a_change_to_the_same_value_writes_nothing(served) -> None:
    acme = served["acme"]
    audits = AuditEvent.objects.filter(action="gateway.policy_update")
    twice = manage("gateway", "policy", "--tenant", "acme", "--set", "admit_length=false", "--set", "admit_length=true",
                   env=subprocess_env())  # fmt: skip
    assert (twice.returncode, twice.stderr.strip().splitlines()[-1]) == (2, "CommandError: --set admit_length: given twice")
    assert audits.count() == 0
    zero = manage("gateway", "policy", "--tenant", "acme", "--set", "benefit_floor=-0.0", env=subprocess_env())
    assert zero.returncode == 0 and json.loads(zero.stdout)["benefit_floor"] == 0.0, zero.stderr
    assert str(json.loads(zero.stdout)["benefit_floor"]) == "0.0"
    (event,) = audits
    assert event.after == {"benefit_floor": 0.0} and str(event.after["benefit_floor"]) == "0.0"
    alice = served["clients"]["alice"]
    same = alice.patch(f"/api/tenants/{acme.pk}/gateway-policy/", {"admit_length": False, "benefit_floor": 0}, format="json")
    assert same.status_code == 200 and audits.count() == 1


def test_figures_are_summed_across_processes_and_derived(served) -> None:
    ns = served["ns"]["acme"].pk
    minute = timezone.now().replace(second=0, microsecond=0)
    prefix = {"requests": 4, "hits": 3, "misses": 1, "prompt_tokens": 400, "cached_prompt_tokens": 300, "output_tokens": 40,
              "ttft_hit_ms_sum": 60.0, "ttft_hit_count": 3, "ttft_miss_ms_sum": 80.0, "ttft_miss_count": 1}  # fmt: skip
    response = {"requests": 2, "hits": 1, "misses": 1, "prompt_tokens": 100, "output_tokens": 10, "ttft_hit_ms_sum": 2.0,
                "ttft_hit_count": 1, "lookup_ms_sum": 1.0, "lookup_count": 2}  # fmt: skip
    for _ in range(2):  # two gateway processes flushing the same minute
        gateway_flush([(ns, "prefix", minute, prefix, {}), (ns, "response", minute, response, {"sampling": 2})], [])
    assert GatewayStat.objects.count() == 2
    answer = served["clients"]["alice"].get("/api/gateway/figures/?minutes=5").json()["namespaces"][str(ns)]
    assert answer["prefix"]["requests"] == 8 and answer["prefix"]["cached_prompt_tokens"] == 600
    assert answer["response"]["bypass"] == {"sampling": 4}
    # Tokens asked for: 2 x (400 + 40 + 100 + 10) = 1100; the response cache avoided 220, the prefix cache 600.
    assert answer["response"]["cost_savings_rate"] == pytest.approx(220 / 1100)
    assert answer["prefix"]["cost_savings_rate"] == pytest.approx(600 / 1100)
    assert answer["response"]["hit_ratio"] == 0.5
    # Benefit: (mean miss TTFT 80 ms of the engine path is not the response layer's; its own miss TTFT is unknown) → None.
    assert answer["response"]["benefit_ratio"] is None
    assert served["clients"]["alice"].get("/api/gateway/figures/?minutes=0").status_code == 400
    assert served["clients"]["alice"].get("/api/gateway/figures/?since=1").status_code == 400
    assert served["clients"]["charlie"].get("/api/gateway/figures/").json()["namespaces"] == {}


def test_a_deceptive_hit_on_live_traffic_raises_an_alarm_and_suspends_routing(served) -> None:
    ns, engine = served["ns"]["acme"], served["engine"]
    witness = Engine.objects.create(
        name="ref-v1", role="reference", model_version=engine.model_version, base_url="http://127.0.0.1:4", status="ready",
        prefix_caching=False,
    )  # fmt: skip
    check = ShadowCheck.objects.create(namespace=ns, engine=engine, request=BODY, cached_tokens=32)
    # A witness not verified against its identity (now) suspends nothing: the alarm alone is raised.
    _deceptive(check, engine, witness, 3)
    assert EngineAlarm.objects.filter(kind="deceptive_hit").count() == 1
    assert not NamespaceRouting.objects.filter(namespace=ns, suspended_at__isnull=False).exists()
    verified_at = timezone.now()
    Engine.objects.filter(pk=witness.pk).update(verification="verified", verified_at=verified_at)
    _deceptive(check, engine, witness, 3)
    alarm = EngineAlarm.objects.get(kind="deceptive_hit")
    assert alarm.engine_id == engine.pk and alarm.count == 2
    hold = NamespaceRouting.objects.get(namespace=ns)
    assert hold.suspended_at is not None
    # The suspension names the verified witness that judged it.
    assert hold.suspended_reason == (
        f"shadow check #{check.pk}: live request with 32 cached tokens diverged at token 3 from reference engine ref-v1 "
        f"(#{witness.pk}, verified {verified_at:%Y-%m-%d %H:%M:%S} UTC) in namespace {ns.namespace_key[:12]}…"
    )
    assert routing_snapshot_build().namespaces[ns.pk].suspended == hold.suspended_reason
    refused = served["clients"]["alice"].post(f"/api/namespaces/{ns.pk}/resume-routing/", {}, format="json")
    assert refused.status_code == 400 and NamespaceRouting.objects.get(namespace=ns).suspended_at is not None
    resumed = served["clients"]["alice"].post(
        f"/api/namespaces/{ns.pk}/resume-routing/", {"reason": "weights fixed"}, format="json"
    )
    assert resumed.status_code == 200
    assert routing_snapshot_build().namespaces[ns.pk].suspended is None
    again = served["clients"]["alice"].post(f"/api/namespaces/{ns.pk}/resume-routing/", {"reason": "again"}, format="json")
    assert again.status_code == 409


def test_semantic_invalidation_needs_tags_and_is_confined_to_the_tenant(served) -> None:
    alice = served["clients"]["alice"]
    assert alice.post("/api/semantic-cache/invalidate/", {"tenant": "acme", "tags": []}, format="json").status_code == 400
    answer = alice.post("/api/semantic-cache/invalidate/", {"tenant": "acme", "tags": ["product:42"]}, format="json")
    assert answer.status_code == 200 and answer.json() == {"removed": 0}
    bob = served["clients"]["bob"]  # bound to acme
    assert bob.post("/api/semantic-cache/invalidate/", {"tenant": "globex", "tags": ["x"]}, format="json").status_code == 400


def test_old_figures_are_outside_the_window(served) -> None:
    old = timezone.now().replace(second=0, microsecond=0) - timedelta(hours=3)
    gateway_flush([(served["ns"]["acme"].pk, "prefix", old, {"requests": 5}, {})], [])
    assert served["clients"]["alice"].get("/api/gateway/figures/?minutes=60").json()["namespaces"] == {}
    assert CacheNamespace.objects.count() == 2


def test_gateway_key_cli_issues_lists_and_revokes(served) -> None:
    issued = manage(
        "gateway_key", "issue", "--tenant", "acme", "--name", "cli-bot", "--rate", "2.5", "--json", env=subprocess_env()
    )
    assert issued.returncode == 0, issued.stderr
    out = json.loads(issued.stdout)
    assert out["key"].startswith("kvgw_") and out["tenant"] == "acme"
    listed = json.loads(manage("gateway_key", "list", "--json", env=subprocess_env()).stdout)
    assert [(k["name"], k["rate_per_s"], k["revoked"]) for k in listed] == [("cli-bot", 2.5, False)]
    assert manage("gateway_key", "issue", "--tenant", "acme", "--name", "x", "--rate", "-1", env=subprocess_env()).returncode == 2
    assert manage("gateway_key", "issue", "--tenant", "nope", "--name", "x", env=subprocess_env()).returncode == 2
    assert (
        manage("gateway_key", "revoke", out["key"], env=subprocess_env()).stdout == f"revoked {out['prefix']}\n"
    )  # the whole key
    assert GatewayKey.objects.get().revoked_at is not None
    again = manage("gateway_key", "revoke", out["prefix"], env=subprocess_env())  # idempotent, like the API
    assert again.returncode == 0 and again.stdout == f"already revoked {out['prefix']}\n"
    assert manage("gateway_key", "revoke", "000000000000", env=subprocess_env()).returncode == 2
    _, key = gateway_key_issue(tenant=served["acme"], name="after", actor="t")
    assert key_hash(key) in routing_snapshot_build().keys


def test_the_dashboard_shows_the_gateway_layers_figures_and_holds(served, client) -> None:

    ns = served["ns"]["acme"]
    minute = timezone.now().replace(second=0, microsecond=0)
    counters = {"requests": 4, "hits": 1, "misses": 1, "bypasses": 2, "prompt_tokens": 100, "output_tokens": 10,
                "ttft_hit_ms_sum": 2.0, "ttft_hit_count": 1, "lookup_ms_sum": 1.0, "lookup_count": 2}  # fmt: skip
    gateway_flush([(ns.pk, "response", minute, counters, {"sampling": 2})], [])
    served["clients"]["alice"].post(
        "/api/gateway/layers/", {"layer": "semantic", "enabled": False, "reason": "incident 7"}, format="json"
    )
    namespace_routing_suspend(namespace=ns, reason="deceptive hit on live traffic", actor="t")
    client.force_login(User.objects.create_user("viewer"))
    page = client.get("/").content.decode()
    assert "<h1>Gateway</h1>" in page
    assert "semantic cache off (incident 7, alice (token alice-ci))" in page
    assert "Routing suspended" in page and "deceptive hit on live traffic" in page
    row = page[page.index("acme/v1</a></td><td>response</td>") :].split("</tr>")[0]
    assert "<td>4</td>" in row and "<td>50.0 %</td>" in row and "sampling 2" in row and "<td>2 ms</td>" in row


def test_key_limits_are_the_same_through_the_api_and_the_cli(served) -> None:
    alice = served["clients"]["alice"]
    for body in ({"rate_per_s": 0.0001}, {"rate_per_s": True}, {"rate_per_s": 1e308}, {"burst": 2_000_000}, {"burst": "5"}):
        answer = alice.post("/api/gateway-keys/", {"tenant": "acme", "name": "k", **body}, format="json")
        assert answer.status_code == 400, (body, answer.json())
    for args in (["--rate", "0.0001"], ["--burst", "2000000"]):
        assert manage("gateway_key", "issue", "--tenant", "acme", "--name", "k", *args, env=subprocess_env()).returncode == 2
    assert GatewayKey.objects.count() == 0


def test_the_gateway_cli_refuses_a_taken_address_and_deep_json_in_one_line(served, tmp_path: Path) -> None:

    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        result = manage("gateway", "--addr", f"127.0.0.1:{port}", env=subprocess_env())
    assert result.returncode == 3 and "cannot listen on 127.0.0.1" in result.stderr and "Traceback" not in result.stderr
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000 + "]" * 100_000)
    result = manage("gateway", "explain", "--tenant", "acme", "--request", str(deep), env=subprocess_env())
    assert result.returncode == 2 and "nested deeper" in result.stderr and "Traceback" not in result.stderr
    deep_setting = "semantic_threshold=" + "[" * 5000 + "]" * 5000
    result = manage("gateway", "policy", "--tenant", "acme", "--set", deep_setting, env=subprocess_env())
    assert result.returncode == 2 and "Traceback" not in result.stderr


def test_semantic_admission_rules_come_from_configuration(served, settings) -> None:
    question = {
        "model": "tiny", "messages": [{"role": "user", "content": "What is the price of the pro plan?"}], "temperature": 0,
    }  # fmt: skip
    assert gateway_explain(tenant=served["acme"], endpoint="chat", body=question)["semantic_cache"]["reason"] == "admitted"
    settings.GATEWAY_SEMANTIC_RULES = '[{"name": "pricing", "pattern": "\\\\bprice"}]'
    assert [r.name for r in semantic_rules()] == ["pricing"]
    assert gateway_explain(tenant=served["acme"], endpoint="chat", body=question)["semantic_cache"] == {
        "admitted": False, "reason": "pricing"
    }  # fmt: skip
    settings.GATEWAY_SEMANTIC_RULES = '[{"name": "pricing", "pattern": "(unclosed"}]'
    with pytest.raises(ImproperlyConfigured, match=r"GATEWAY_SEMANTIC_RULES: rules\[0\]\.pattern"):
        semantic_rules()
