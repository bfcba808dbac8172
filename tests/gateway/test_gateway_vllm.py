"""The gateway as operators run it (``manage.py gateway``, several uvicorn
processes) in front of a real vLLM engine: salted requests, the engine's
prefix cache reused across a tenant's requests, the response cache, a client
that goes away mid-stream cancelling the engine's work, and the figures
written to the database."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from django.conf import settings
from prometheus_client.parser import text_string_to_metric_families

from cacheadmin.models import AnswerRetirement, Engine, GatewayKey, GatewayStat, ShadowCheck, Tenant
from cacheadmin.services.gateway import (
    gateway_key_issue,
    gateway_key_revoke,
    namespace_routing_resume,
    routing_epoch,
    tenant_gateway_policy_update,
)
from cacheadmin.services.gateway_stores import response_store
from cacheadmin.services.model_versions import model_version_register
from cacheadmin.services.namespaces import DEMO_POLICY, namespace_get_or_create, retention_owner_get_or_create
from cacheadmin.services.shadow import shadow_check_run
from gateway.answers import AnswerAssembler
from inference.engines.launcher import EngineSpec, LocalEngine, free_port
from inference.identity import LayoutOptions
from inference.keepalive import SERVER_IDLE_S, VLLM_KEEPALIVE_ENV
from tests.helpers import kept_alive_get, running_gateway, subprocess_env, wait_for

pytestmark = [pytest.mark.vllm, pytest.mark.django_db(transaction=True)]

SYSTEM = "You are a careful assistant for the Acme travel desk. " * 30


def _tiny_v1(checkpoints: dict[str, Path], name: str, *, prefix_caching: bool) -> Iterator[LocalEngine]:
    """tiny-v1 served as ``tiny`` (no connector), stopped when the module's tests end."""
    spec = EngineSpec(
        model_path=checkpoints["tiny-v1"], served_name="tiny", dtype="float32", port=free_port(), prefix_caching=prefix_caching,
        kv_storage_path=None, log_path=settings.ENGINE_LOG_DIR / f"test-{name}.log",
    )  # fmt: skip
    local = LocalEngine(spec)
    local.start()
    local.wait_ready(settings.ENGINE_START_TIMEOUT_S)
    yield local
    local.stop()


@pytest.fixture(scope="module")
def engine(demo_checkpoints) -> Iterator[LocalEngine]:
    """The engine the gateway routes to (prefix caching on)."""
    yield from _tiny_v1(demo_checkpoints, "gateway", prefix_caching=True)


@pytest.fixture(scope="module")
def reference(demo_checkpoints) -> Iterator[LocalEngine]:
    """The same checkpoint without prefix caching: what shadow verification compares against."""
    yield from _tiny_v1(demo_checkpoints, "gateway-reference", prefix_caching=False)


@pytest.fixture
def served(engine: LocalEngine, demo_checkpoints, tmp_path: Path) -> Iterator[dict]:
    version, _ = model_version_register(
        path=demo_checkpoints["tiny-v1"], label="tiny-v1", served_name="tiny", layout=LayoutOptions(dtype="float32"), actor="t"
    )
    version.status = "active"
    version.save()
    tenant = Tenant.objects.create(slug="acme", name="Acme")
    owner = retention_owner_get_or_create(name="platform", email="p@example.com", actor="t")
    namespace = namespace_get_or_create(
        model_version=version, tenant=tenant, retention_owner=owner, policy=DEMO_POLICY, actor="t"
    )[0]
    Engine.objects.create(
        name="gw-engine", model_version=version, namespace=namespace, base_url=engine.base_url, pid=engine.pid,
        status=Engine.Status.READY, verification=Engine.Verification.VERIFIED,
    )  # fmt: skip
    _, key = gateway_key_issue(tenant=tenant, name="app", actor="t")
    env = subprocess_env(GATEWAY_SEMANTIC="0", GATEWAY_FLUSH_S="1", GATEWAY_DIR=str(tmp_path))
    with running_gateway(env, tmp_path / "gateway.log", workers=2) as base:
        yield {"base": base, "key": key, "namespace": namespace, "engine": engine, "log": tmp_path / "gateway.log",
               "tenant": tenant, "version": version}  # fmt: skip


def _post(served: dict, body: dict, **kw) -> httpx.Response:
    return httpx.post(f"{served['base']}/v1/chat/completions", json=body, headers={"authorization": f"Bearer {served['key']}"},
                      timeout=120, **kw)  # fmt: skip


def _change_landed(served: dict) -> None:
    """Wait until every gateway process routes by the control plane's current routing epoch (the
    change just made, a policy or a key, moved it): ``kvcp_gateway_routing_epoch`` is the oldest among them."""
    target = routing_epoch()

    def landed() -> bool:
        text = httpx.get(f"{served['base']}/metrics", headers={"authorization": f"Bearer {settings.METRICS_TOKEN}"},
                         timeout=10).text  # fmt: skip
        (family,) = [f for f in text_string_to_metric_families(text) if f.name == "kvcp_gateway_routing_epoch"]
        return [s.value for s in family.samples] == [float(target)]

    wait_for(landed, timeout=30, what=f"every gateway process to route by epoch {target}")


def _metric(engine: LocalEngine, name: str, **labels: str) -> float:
    text = httpx.get(f"{engine.base_url}/metrics", timeout=10).text
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_the_gateway_serves_salted_requests_caches_greedy_answers_and_records_figures(served: dict) -> None:
    models = httpx.get(f"{served['base']}/v1/models", headers={"authorization": f"Bearer {served['key']}"}, timeout=10)
    assert [m["id"] for m in models.json()["data"]] == ["tiny"]
    # The tiny model's greedy answer runs to max_tokens: kept only where the tenant admits length.
    tenant_gateway_policy_update(tenant=served["tenant"], actor="t", changes={"admit_length": True})
    _change_landed(served)
    greedy = {"model": "tiny", "messages": [{"role": "user", "content": "Name a colour."}], "temperature": 0, "max_tokens": 8}
    first = _post(served, greedy)
    assert first.status_code == 200, first.text
    assert first.headers["x-kvcp-served-by"] == "engine"
    second = _post(served, greedy)
    assert second.headers["x-kvcp-served-by"] == "response"
    assert second.json()["choices"] == first.json()["choices"]
    # The tenant's long system prompt is reused by the engine's prefix cache (under the namespace's salt).
    usages = []
    for question in ("Where is Paris?", "Where is Rome?"):
        body = {"model": "tiny", "max_tokens": 4, "temperature": 0.8, "stream": True, "stream_options": {"include_usage": True},
                "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]}  # fmt: skip
        answer = _post(served, body)
        assert answer.status_code == 200 and answer.headers["x-kvcp-served-by"] == "engine"
        chunks = [json.loads(line[6:]) for line in answer.text.splitlines() if line.startswith("data: {")]
        usages.append(next((c["usage"] for c in chunks if c.get("usage")), answer.text[-800:]))
    assert isinstance(usages[0], dict) and isinstance(usages[1], dict), usages
    assert usages[0]["prompt_tokens_details"]["cached_tokens"] < usages[1]["prompt_tokens_details"]["cached_tokens"]
    assert usages[1]["prompt_tokens_details"]["cached_tokens"] >= 320  # the shared system prompt's whole blocks
    wait_for(
        lambda: GatewayStat.objects.filter(namespace=served["namespace"], layer="prefix").exists(), timeout=15, what="figures"
    )
    prefix = GatewayStat.objects.filter(namespace=served["namespace"], layer="prefix")
    wait_for(lambda: sum(prefix.values_list("requests", flat=True)) == 3, timeout=15, what="three engine requests recorded")
    response = GatewayStat.objects.filter(namespace=served["namespace"], layer="response")

    def figures() -> tuple[int, int, int]:
        # A fresh query each time: a QuerySet read once keeps its rows, and a poll over it would
        # keep answering the first reading (before the other process's flush) until it timed out.
        rows = list(response.all())
        return sum(r.hits for r in rows), sum(r.misses for r in rows), sum(r.bypass.get("sampling", 0) for r in rows)

    # Each gateway process flushes its own figures (GATEWAY_FLUSH_S): the hit may come from the other one, later.
    try:
        wait_for(lambda: figures() == (1, 1, 2), timeout=30, what="1 response hit, 1 miss and 2 sampling bypasses recorded")
    except AssertionError as exc:
        # What was recorded instead says which way it went (a bypass of another kind, a figure not flushed).
        recorded = [(r.hits, r.misses, r.bypass) for r in response.all()]
        raise AssertionError(f"{exc}; the response layer recorded (hits, misses, bypasses): {recorded}") from None


def test_an_engine_it_starts_keeps_an_idle_connection_past_uvicorns_default_keep_alive(engine: LocalEngine) -> None:
    # uvicorn's default (5 s) would close it while the gateway's pool may still pick it (inference.keepalive).
    assert engine.spec.environment()[VLLM_KEEPALIVE_ENV] == str(SERVER_IDLE_S) == "75"
    host, port = engine.base_url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        for pause in (0.0, 6.0):
            time.sleep(pause)
            answer = kept_alive_get(sock, "/health")
            assert answer.startswith(b"HTTP/1.1 200 "), answer


def test_a_client_that_goes_away_mid_stream_cancels_the_engine_request(served: dict) -> None:
    engine = served["engine"]
    max_len = httpx.get(f"{engine.base_url}/v1/models", timeout=10).json()["data"][0]["max_model_len"]
    wanted = max_len - 64  # ignore_eos: left alone, the engine generates exactly this many tokens
    generated = _metric(engine, "vllm:generation_tokens_total")
    body = {"model": "tiny", "max_tokens": wanted, "ignore_eos": True, "temperature": 0.5, "stream": True,
            "messages": [{"role": "user", "content": "Count."}]}  # fmt: skip
    with httpx.stream("POST", f"{served['base']}/v1/chat/completions", json=body,
                      headers={"authorization": f"Bearer {served['key']}"}, timeout=60) as answer:  # fmt: skip
        assert answer.status_code == 200
        for line in answer.iter_lines():
            if line.startswith("data: {") and '"content"' in line:
                break  # the first tokens arrived: hang up
    wait_for(lambda: _metric(engine, "vllm:num_requests_running") == 0, timeout=10, what="the engine to drop the request")
    spent = _metric(engine, "vllm:generation_tokens_total") - generated
    assert 0 < spent < wanted / 2, (spent, wanted)


def test_a_revoked_key_is_refused_at_the_gateways_next_snapshot(served: dict) -> None:

    ok = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "temperature": 0, "max_tokens": 2}
    assert _post(served, ok).status_code == 200
    gateway_key_revoke(key=GatewayKey.objects.get(tenant=served["tenant"]), actor="t")
    # The epoch is polled every GATEWAY_EPOCH_POLL_MS (250) and the snapshot rebuilt at once: well under a
    # second on an idle machine. Once every process routes by the new epoch, none takes the key.
    _change_landed(served)
    assert [_post(served, ok).status_code for _ in range(6)] == [401] * 6


def test_shadow_verification_replays_a_live_cached_request_against_a_reference(served: dict, reference: LocalEngine) -> None:
    Engine.objects.create(
        name="gw-reference", model_version=served["version"], base_url=reference.base_url, pid=reference.pid,
        prefix_caching=False, status=Engine.Status.READY, verification=Engine.Verification.VERIFIED, role=Engine.Role.REFERENCE,
    )  # fmt: skip
    tenant_gateway_policy_update(tenant=served["tenant"], actor="t", changes={"shadow_sample_rate": 1.0})
    _change_landed(served)
    body = {"model": "tiny", "max_tokens": 4, "temperature": 0.9,
            "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Which desk?"}]}  # fmt: skip
    for _ in range(2):  # the second reports the first's prefix as cached
        assert _post(served, body).status_code == 200
    wait_for(lambda: ShadowCheck.objects.exists(), timeout=15, what="a shadow check recorded by the gateway")
    check = ShadowCheck.objects.get()
    assert check.cached_tokens > 0 and check.status == "pending" and check.request["messages"] == body["messages"]
    assert shadow_check_run(check.pk) == "matched"
    check.refresh_from_db()
    assert check.detail["tokens_equal"] is True and check.detail["reference_engine"] == "gw-reference"
    assert check.detail["replay_cached_tokens"] > 0
    assert shadow_check_run(check.pk) is None  # idempotent: judged once


def _chunks(answer: httpx.Response) -> list[dict]:
    assert answer.status_code == 200 and answer.text.endswith("data: [DONE]\n\n"), answer.text[-300:]
    return [json.loads(line[6:]) for line in answer.text.splitlines() if line.startswith("data: {")]


def _folded(answer: httpx.Response) -> dict:
    fold = AnswerAssembler("chat")
    for chunk in _chunks(answer):
        fold.feed(chunk)
    return fold.answer()


def _but(answer: dict, *names: str) -> dict:
    return {k: v for k, v in answer.items() if k not in names}


def test_a_replay_carries_every_field_vllm_returned_and_a_cut_answer_is_kept_only_where_admitted(served: dict) -> None:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Name a city."}], "temperature": 0, "max_tokens": 6,
            "ignore_eos": True, "return_token_ids": True, "logprobs": True, "top_logprobs": 2}  # fmt: skip
    stream = {"stream": True, "stream_options": {"include_usage": True}}
    # Cut at max_tokens: served, kept nowhere under the default policy, streamed or not.
    for params in ({}, stream, {}):
        assert _post(served, {**body, **params}).headers["x-kvcp-served-by"] == "engine"
    tenant_gateway_policy_update(tenant=served["tenant"], actor="t", changes={"admit_length": True})
    _change_landed(served)
    live = _post(served, body)
    assert live.headers["x-kvcp-served-by"] == "engine"
    original = live.json()
    choice = original["choices"][0]
    assert choice["finish_reason"] == "length" and "stop_reason" in choice and len(choice["token_ids"]) == 6
    assert len(choice["logprobs"]["content"]) == 6 and len(original["prompt_token_ids"]) == original["usage"]["prompt_tokens"]
    hit = _post(served, body)
    assert hit.headers["x-kvcp-served-by"] == "response"
    replay = hit.json()
    assert _but(replay, "id", "created", "usage") == _but(original, "id", "created", "usage")
    prompt = original["usage"]["prompt_tokens"]
    assert replay["usage"]["prompt_tokens_details"]["cached_tokens"] == prompt
    assert replay["usage"]["completion_tokens_details"]["cached_tokens"] == replay["usage"]["completion_tokens"] == 6
    assert original["usage"]["prompt_tokens_details"]["cached_tokens"] < prompt  # the engine computed part of it
    # The whole answer replayed as a stream: the same fields, on vLLM's chunks.
    streamed = _post(served, {**body, **stream})
    assert streamed.headers["x-kvcp-served-by"] == "response"
    out = _chunks(streamed)[1]["choices"][0]
    assert out["token_ids"] == choice["token_ids"] and out["stop_reason"] == choice["stop_reason"]
    assert _chunks(streamed)[0]["prompt_token_ids"] == original["prompt_token_ids"]
    assert _but(_folded(streamed), "usage") == _but(original, "id", "created", "model", "usage")
    # A streamed answer of the engine, replayed streamed and whole.
    other = {**body, "messages": [{"role": "user", "content": "Name a river."}], **stream}
    live_stream = _post(served, other)
    assert live_stream.headers["x-kvcp-served-by"] == "engine"
    assert all("token_ids" in c["choices"][0] for c in _chunks(live_stream)[1:] if c["choices"])
    first = _folded(live_stream)
    assert len(first["choices"][0]["token_ids"]) == 6 and "stop_reason" in first["choices"][0]
    again = _post(served, other)
    assert again.headers["x-kvcp-served-by"] == "response"
    assert _but(_folded(again), "usage") == _but(first, "usage")
    whole = _post(served, {k: v for k, v in other.items() if k not in stream})
    assert whole.headers["x-kvcp-served-by"] == "response"
    # Whole, it also carries as null what vLLM's whole answer always has and its stream left unset.
    (got,) = whole.json()["choices"]
    (streamed,) = first["choices"]
    assert {k: v for k, v in got.items() if k in streamed and k != "message"} == {
        k: v for k, v in streamed.items() if k != "message"
    }
    assert {k: v for k, v in got["message"].items() if k in streamed["message"]} == streamed["message"]
    assert {k: v for k, v in got.items() if k not in streamed} == {"routed_experts": None}
    assert {k: v for k, v in got["message"].items() if k not in streamed["message"]} == dict.fromkeys(
        ("refusal", "annotations", "audio", "function_call", "reasoning")
    )


def test_shadow_verification_judges_the_answer_served_and_a_deceptive_hit_retires_it_before_resuming(
    served: dict, reference: LocalEngine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(settings, "GATEWAY_DIR", tmp_path)  # the control plane's stores are the gateways'
    Engine.objects.create(
        name="gw-reference", model_version=served["version"], base_url=reference.base_url, pid=reference.pid,
        prefix_caching=False, status=Engine.Status.READY, verification=Engine.Verification.VERIFIED, role=Engine.Role.REFERENCE,
    )  # fmt: skip
    # admit_length: the tiny model answers until max_tokens, so its answer ends with "length".
    tenant_gateway_policy_update(tenant=served["tenant"], actor="t", changes={"shadow_sample_rate": 1.0, "admit_length": True})
    _change_landed(served)
    body = {"model": "tiny", "max_tokens": 6, "temperature": 0,
            "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Which desk answers?"}]}  # fmt: skip
    first = _post(served, body)
    assert first.status_code == 200 and first.headers["x-kvcp-served-by"] == "engine"
    truth = first.json()["choices"][0]["message"]["content"]
    # The answer the engine computed is corrupted once, as it sits in the response cache.
    # The deployment's store (Redis in scale-out; else the gateways' SQLite file under GATEWAY_DIR).
    store, prefix = response_store(), served["namespace"].storage_prefix
    (entry,) = store.entries(prefix)
    provenance = store.provenance(prefix, entry.key)
    assert provenance is not None and provenance.engine_id == Engine.objects.get(name="gw-engine").pk
    record = json.loads(store.get(prefix, entry.key) or b"{}")
    record["choices"][0]["message"]["content"] = "Zebra zebra zebra"
    store.put(prefix, entry.key, json.dumps(record).encode(), ttl_s=None, max_bytes=None, provenance=provenance)
    second = _post(served, body)
    assert second.headers["x-kvcp-served-by"] == "response"
    assert second.json()["choices"][0]["message"]["content"] == "Zebra zebra zebra"
    wait_for(lambda: ShadowCheck.objects.filter(served_layer="response").exists(), timeout=15, what="the hit sampled")
    check = ShadowCheck.objects.get(served_layer="response")
    assert (check.served_answer or {}).get("text") == "Zebra zebra zebra" and check.engine_id == provenance.engine_id
    # Replaying the request would have matched (the engine answers right again); the answer served does not.
    assert shadow_check_run(check.pk) == "deceptive"
    check.refresh_from_db()
    assert check.detail["judged"] == "served" and check.detail["reference_text"] == truth
    assert check.first_divergence == 0 and check.noise_divergence is None
    retirement = AnswerRetirement.objects.get(shadow_check=check)
    assert retirement.completed_at is not None and retirement.removed == {"response": 1, "semantic": 0}
    assert store.entries(prefix) == []
    wait_for(lambda: _post(served, body).status_code == 503, timeout=5, what="the namespace suspended")
    namespace_routing_resume(namespace=served["namespace"], actor="t", reason="engine checked")
    wait_for(lambda: _post(served, body).status_code == 200, timeout=5, what="routing resumed")
    again = _post(served, body)
    assert again.json()["choices"][0]["message"]["content"] == truth
    store.close()
