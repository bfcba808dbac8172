"""Prompt templates in the gateway: the index that recognises a request's
template by its fixed leading text, and the warm/cold counts of requests
through the real gateway app (database snapshot, the deployment's response
store, an engine emulated at the HTTP level), in Prometheus and in the
per-minute rows the control plane writes."""

from __future__ import annotations

from typing import Any

import pytest
from prometheus_client import REGISTRY

from cacheadmin.models import TemplateStat
from cacheadmin.services.gateway import gateway_flush
from cacheadmin.services.prompt_templates import prompt_template_create, prompt_template_delete, template_hit_ratios
from gateway.templates import CHUNK_CHARS, Classified, TemplateIndex, classify, current, fingerprint, leading_text
from tests.gateway.harness import call, chat, refresh

SUPPORT = "You are the support assistant of Acme Corporation. Answer briefly. Customer: {customer}. Question: {question}"
SUPPORT_FIXED = "You are the support assistant of Acme Corporation. Answer briefly. Customer: "
BILLING_FIXED = "You are the support assistant of Acme Corporation. Billing desk only, invoices and refunds. Ask: "
BILLING = BILLING_FIXED + "{question}"


def test_the_longest_fixed_text_a_prompt_starts_with_wins() -> None:
    short = fingerprint("short", "You are the support assistant of Acme")  # 37 characters: one chunk
    long = fingerprint("long", SUPPORT_FIXED)
    other = fingerprint(
        "billing", "You are the support assistant of Acme Corporation. Billing desk only, invoices and refunds. Ask: "
    )
    index = TemplateIndex.of([short, long, other])
    assert (short.chunks, long.chunks, other.chunks) == (1, 2, 3)
    assert index.match(SUPPORT_FIXED + "Ada. Question: where is my parcel?") == "long"
    assert (
        index.match("You are the support assistant of Acme Corporation. Billing desk only, invoices and refunds. Ask: x")
        == "billing"
    )
    # Shares the first chunk and a half with "long" but not all of its fixed text: the shorter template.
    assert index.match("You are the support assistant of Acme Corporation. Answer at length.") == "short"
    # Same first chunk, different characters before the short template's 37th.
    assert index.match("You are the support assistant of ACME products") is None
    assert index.match("Hello") is None
    assert TemplateIndex().match(SUPPORT_FIXED) is None
    # A tenant without templates of its own is classified by the global ones.
    indexes = {7: index, None: TemplateIndex.of([other])}
    assert classify(indexes, 8, 1, "k", {"prompt": BILLING_FIXED + "x"}) == "billing"
    assert classify(indexes, 8, 1, "k", {"prompt": SUPPORT_FIXED + "x"}) is None
    assert classify(indexes, 7, 1, "k", {"prompt": SUPPORT_FIXED + "x"}) == "long"
    assert current.get() == Classified("long", 1, "k")
    current.set(None)
    with pytest.raises(ValueError, match="has 5 characters; at least 32 are needed"):
        fingerprint("tiny", "Hello")


def test_leading_text_is_the_first_message_or_the_prompt() -> None:
    assert leading_text({"messages": [{"role": "system", "content": "abc"}, {"role": "user", "content": "d"}]}) == "abc"
    assert (
        leading_text({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]})
        == "ab"
    )
    assert leading_text({"prompt": ["first", "second"]}) == "first"
    assert leading_text({"messages": []}) == "" and leading_text({"prompt": 3}) == ""
    assert CHUNK_CHARS == 32


def _prom(template: str, result: str, namespace_key: str) -> float:
    value = REGISTRY.get_sample_value(
        "kvcp_gateway_template_requests_total", {"namespace": namespace_key, "template": template, "result": result}
    )
    return value or 0.0


@pytest.mark.django_db(transaction=True)
def test_requests_are_counted_warm_or_cold_per_template(setup: dict[str, Any]) -> None:  # noqa: F811
    acme, ns = setup["acme"], setup["ns"]
    support = prompt_template_create(
        name="support", tenant=acme, text=SUPPORT, samples=[{"customer": "Ada", "question": "Where?"}], actor="test"
    )
    prompt_template_create(name="billing", tenant=None, text=BILLING, samples=[{"question": "Why?"}], actor="test")
    refresh(setup)
    indexes = setup["holder"]["snap"].templates
    assert (set(indexes), indexes[acme.pk].max_chunks, indexes[None].max_chunks) == ({acme.pk, None}, 3, 3)
    key = ns.namespace_key
    before = {(t, r): _prom(t, r, key) for t in ("support", "billing") for r in ("warm", "cold")}

    ada = chat(SUPPORT_FIXED + "Ada. Question: where is my parcel?", temperature=0)
    assert call(setup, ada).headers["x-kvcp-served-by"] == "engine"  # cold: nothing cached
    assert call(setup, ada).headers["x-kvcp-served-by"] == "response"  # warm: the response cache
    grace = chat(SUPPORT_FIXED + "Grace. Question: can I change the address?")  # sampling: past the response cache
    assert call(setup, grace).headers["x-kvcp-served-by"] == "engine"  # cold
    assert call(setup, grace).headers["x-kvcp-served-by"] == "engine"  # warm: the engine reports 32 cached tokens
    billing = chat(BILLING_FIXED + "refund?")
    assert call(setup, billing, path="/v1/chat/completions").status_code == 200  # cold, a global template
    assert call(setup, chat("What is the capital of France?")).status_code == 200  # no template: not counted
    assert call(setup, chat(SUPPORT_FIXED + "x", model="unknown")).status_code == 404  # no answer: not counted

    after = {(t, r): _prom(t, r, key) - before[(t, r)] for t, r in before}
    assert after == {("support", "warm"): 2.0, ("support", "cold"): 2.0, ("billing", "warm"): 0.0, ("billing", "cold"): 1.0}

    rows = setup["runtime"].recorder.templates.drain()
    assert [(t, n, req, warm) for t, n, _, req, warm in rows] == [("billing", ns.pk, 1, 0), ("support", ns.pk, 4, 2)]
    gateway_flush([], [], rows)
    gateway_flush([], [], [(name, ns.pk, minute, 1, 1) for name, _, minute, _, _ in rows[1:]])  # a second process
    stats = {(s.template.name, s.requests, s.warm) for s in TemplateStat.objects.select_related("template")}
    assert stats == {("billing", 1, 0), ("support", 5, 3)}
    assert template_hit_ratios([support])[support.pk] == {"requests": 5, "warm": 3, "hit_ratio": 0.6}

    # Deleted: the next snapshot classifies nothing, and late counts of it are skipped.
    prompt_template_delete(template=support, actor="test")
    refresh(setup)
    assert call(setup, ada).headers["x-kvcp-served-by"] == "response"
    assert setup["runtime"].recorder.templates.drain() == []
    gateway_flush([], [], rows)
    assert TemplateStat.objects.count() == 1


def test_the_template_counter_is_named_as_the_catalogue_names_it() -> None:
    from cacheadmin.metrics.catalogue import METRICS
    from gateway.templates import METRIC_NAME, template_counter

    spec = next(m for m in METRICS if m.name == METRIC_NAME)
    counter = template_counter()
    assert (spec.kind, spec.labels, spec.source) == ("counter", ("namespace", "template", "result"), "gateway")
    assert (counter._name, counter._labelnames, counter._documentation) == (METRIC_NAME, spec.labels, spec.help)
