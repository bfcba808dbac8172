"""One gate between personal data and every store (gateway.pii.gate), through
the real gateway app, the deployment's response store and the database.

Found: the response cache stored answers to requests with personal data
unredacted, and forms the detector missed were kept in the semantic store and
in prefix heat, which tenants read and prewarm replays."""

from __future__ import annotations

import json
from typing import Any

import pytest

from cacheadmin.models import PrefixHeat
from cacheadmin.services.gateway import gateway_flush, tenant_gateway_policy_update, tenant_secret
from gateway.canonical import canonical_request, response_cache_key
from gateway.pii.gate import Verdict, answer_text, gate
from tests.gateway.harness import call, chat, refresh

pytestmark = pytest.mark.django_db(transaction=True)

EMAIL = "jane.doe@example.com"
SPELLED = "jane dot doe at example dot com"
IBAN = "DE89 3704 0044 0532 0130 00"


def _stored(setup: dict[str, Any], body: dict[str, Any]) -> bytes | None:
    """The response-cache entry of ``body`` (None: nothing kept)."""
    canonical = canonical_request("chat", body)
    key = response_cache_key(canonical, namespace_key=setup["ns"].namespace_key, tenant_secret=tenant_secret(setup["acme"].key))
    return setup["store"].get(setup["ns"].storage_prefix, key)


@pytest.mark.parametrize("content", [f"My e-mail is {EMAIL}, please confirm", f"write to {SPELLED}", f"IBAN {IBAN}"])
def test_a_request_with_personal_data_is_kept_nowhere_by_default(setup, content: str) -> None:
    body = chat(content, temperature=0, stream=False)
    first = call(setup, body)
    assert first.status_code == 200 and first.headers["x-kvcp-served-by"] == "engine"
    assert _stored(setup, body) is None
    # Asked again: computed again, never answered from a cache.
    assert call(setup, body).headers["x-kvcp-served-by"] == "engine"
    assert len(setup["fake"].received) == 2
    rows, heat = setup["runtime"].recorder.drain()
    assert heat == []
    gateway_flush(rows, heat)
    assert PrefixHeat.objects.count() == 0


def test_an_answer_with_personal_data_is_not_kept_either(setup) -> None:
    setup["fake"].answer = f"Sure, I wrote to {EMAIL} for you."
    body = chat("Please confirm my booking", temperature=0)
    assert call(setup, body).status_code == 200
    assert _stored(setup, body) is None
    assert call(setup, body).headers["x-kvcp-served-by"] == "engine"


def test_a_clean_request_is_cached_as_before(setup) -> None:
    body = chat("What is the capital of France?", temperature=0)
    assert call(setup, body).headers["x-kvcp-served-by"] == "engine"
    assert json.loads(_stored(setup, body))["choices"][0]["message"]["content"] == "Paris is the capital."
    assert call(setup, body).headers["x-kvcp-served-by"] == "response"


def test_under_the_redact_policy_heat_keeps_the_conversation_redacted(setup) -> None:
    tenant_gateway_policy_update(tenant=setup["acme"], actor="t", changes={"personal_data": "redact"})
    refresh(setup)
    body = chat(f"My e-mail is {EMAIL}, please confirm", temperature=0)
    assert call(setup, body).status_code == 200
    assert _stored(setup, body) is None  # a cache served verbatim keeps nothing of it under any policy
    rows, heat = setup["runtime"].recorder.drain()
    assert [(h[2], h[3]) for h in heat] == [([{"role": "user", "content": "My e-mail is [EMAIL], please confirm"}], None)]
    gateway_flush(rows, heat)
    assert list(PrefixHeat.objects.values_list("messages", flat=True)) == [
        [{"role": "user", "content": "My e-mail is [EMAIL], please confirm"}]
    ]


def test_heat_reported_over_the_api_follows_the_tenants_policy(setup) -> None:
    from tests.cacheadmin.conftest import token_client

    client = token_client(setup["acme"], "operate", "router")
    ns = setup["ns"]
    body = {"messages": [{"role": "user", "content": f"call me on +44 20 7946 0958 or {EMAIL}"}], "hits": 2}
    refused = client.post(f"/api/namespaces/{ns.pk}/prefix-heat/", body, format="json")
    assert refused.status_code == 400
    assert refused.json()["error"]["fields"] == {
        "messages": [
            "holds personal data (email, phone); the tenant's policy (personal_data: skip) keeps none of it in prefix heat"
        ]
    }
    assert PrefixHeat.objects.count() == 0
    tenant_gateway_policy_update(tenant=setup["acme"], actor="t", changes={"personal_data": "redact"})
    kept = client.post(f"/api/namespaces/{ns.pk}/prefix-heat/", body, format="json")
    assert kept.status_code == 200
    assert kept.json()["messages"] == [{"role": "user", "content": "call me on [PHONE] or [EMAIL]"}]
    policy = client.get(f"/api/tenants/{setup['acme'].pk}/gateway-policy/").json()
    assert policy["personal_data"] == "redact"


def test_the_gate_decides_every_store() -> None:
    clean, personal = {"m": "hello"}, {"m": f"mail {EMAIL}"}
    assert gate("heat", clean) == Verdict(True, clean, frozenset())
    for store in ("response", "semantic", "heat", "shadow"):
        assert gate(store, personal) == Verdict(False, None, frozenset({"email"})), store
    assert gate("heat", personal, policy="redact") == Verdict(True, {"m": "mail [EMAIL]"}, frozenset({"email"}))
    assert gate("shadow", personal, policy="redact").value == {"m": "mail [EMAIL]"}
    for store in ("response", "semantic"):
        assert not gate(store, personal, policy="redact").keep, store
    assert gate("output", f"I wrote to {EMAIL}").value == "I wrote to [EMAIL]"
    with pytest.raises(ValueError, match="unknown store"):
        gate("logs", clean)
    with pytest.raises(ValueError, match="unknown personal-data policy"):
        gate("heat", clean, policy="keep")
    record = {
        "created": 1733212345, "usage": {"prompt_tokens": 4155551234},
        "choices": [{"message": {"content": "a", "reasoning": "b", "tool_calls": [{"function": {"arguments": "{}"}}]}},
                    {"text": "c"}],
    }  # fmt: skip
    assert answer_text(record) == ["a", "b", "{}", "c"]
