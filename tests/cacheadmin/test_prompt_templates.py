"""Prompt templates: the analysis of shared tokens and blocks on the real demo
checkpoints' tokenizers (mistral_common v3, checked against mistral_common
itself), validation, the pages and the API."""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from django.contrib.auth.models import User
from django.utils import timezone
from django.utils.html import escape

from cacheadmin.models import AuditEvent, ModelVersion, PromptTemplate, TemplateStat
from cacheadmin.services.prompt_templates import (
    prompt_template_analysis,
    prompt_template_create,
    template_hit_ratios,
    template_parts,
    template_render_moved,
)
from inference.errors import InvalidField
from tests.cacheadmin.conftest import make_version

pytestmark = pytest.mark.django_db

#: The customer's name comes early: every block after it differs between customers.
TEXT = (
    "You are the Acme Corporation support assistant. The customer is {customer}. "
    "Our assistants answer in plain English, cite the manual section that applies, never promise refunds or "
    "discounts, and hand the conversation to a person when the customer asks for one or sounds upset. "
    "Keep every answer under one hundred words and end it with a question that checks the customer is helped. "
    "Question: {question}"
)
SAMPLES = [
    {"customer": "Ada Lovelace", "question": "Where is my parcel?"},
    {"customer": "Grace Hopper", "question": "Can I change the delivery address?"},
    {"customer": "Ada Lovelace", "question": "Why was I charged twice?"},
]


def _versions(demo_checkpoints: dict[str, Path]) -> tuple[ModelVersion, ModelVersion]:
    v1 = make_version("tiny-v1", "1" * 64)
    v2 = make_version("tiny-v2", "2" * 64, weights="f" * 64)
    ModelVersion.objects.filter(pk=v1.pk).update(path=str(demo_checkpoints["tiny-v1"]), status="active")
    ModelVersion.objects.filter(pk=v2.pk).update(
        path=str(demo_checkpoints["tiny-v2"]), inputs={"layout": {"block_size": 64}}, tokenizer="c" * 64
    )
    return ModelVersion.objects.get(pk=v1.pk), ModelVersion.objects.get(pk=v2.pk)


def _mistral_shared(checkpoint: Path, texts: list[str]) -> int:
    """The expected answer, from mistral_common directly (as vLLM's mistral tokenizer mode encodes)."""
    from mistral_common.protocol.instruct.messages import UserMessage
    from mistral_common.protocol.instruct.request import ChatCompletionRequest
    from mistral_common.tokens.tokenizers.mistral import MistralTokenizer

    files = sorted(checkpoint.glob("tokenizer.model.v*")) + sorted(checkpoint.glob("tekken*.json"))
    tok = MistralTokenizer.from_file(str(files[0]))
    ids = [tok.encode_chat_completion(ChatCompletionRequest(messages=[UserMessage(content=t)])).tokens for t in texts]
    n = 0
    while all(len(i) > n for i in ids) and len({i[n] for i in ids}) == 1:
        n += 1
    return n


def test_analysis_counts_shared_tokens_and_blocks_per_version(demo_checkpoints: dict[str, Path]) -> None:
    v1, v2 = _versions(demo_checkpoints)
    template = prompt_template_create(name="support", tenant=None, text=TEXT, samples=SAMPLES, actor="test")
    assert template.fixed_chars == len("You are the Acme Corporation support assistant. The customer is ")
    rows = prompt_template_analysis(template)
    # The expected token counts, from mistral_common itself.
    parts = template_parts(TEXT)
    rendered = [TEXT.format(**s) for s in SAMPLES]
    moved = [template_render_moved(parts, s, ["customer"]) for s in SAMPLES]
    assert moved[0].endswith("Question: Where is my parcel?\n\ncustomer: Ada Lovelace")
    assert (_mistral_shared(demo_checkpoints["tiny-v1"], rendered), _mistral_shared(demo_checkpoints["tiny-v1"], moved)) == (
        14,
        78,
    )
    common = {"tokenizer": "mistral_common 1.13.1 SentencePiece v3 (tokenizer.model.v3)", "shared_tokens": 14,
              "shared_blocks": 0, "breaking_variable": "customer", "break_token": 14, "moved_variables": ["customer"],
              "moved_shared_tokens": 78, "error": ""}  # fmt: skip
    assert rows == [
        {**common, "version": "tiny-v1", "version_id": v1.pk, "status": "active", "block_size": 32, "moved_shared_blocks": 2,
         "extra_blocks": 2, "recommendation": "move {customer} to the end: 2 more shared blocks (64 tokens)"},
        {**common, "version": "tiny-v2", "version_id": v2.pk, "status": "registered", "block_size": 64,
         "moved_shared_blocks": 1, "extra_blocks": 1,
         "recommendation": "move {customer} to the end: 1 more shared block (64 tokens)"},
    ]  # fmt: skip


def test_a_template_whose_variables_are_at_the_end_gets_no_recommendation(demo_checkpoints: dict[str, Path]) -> None:
    _versions(demo_checkpoints)
    ModelVersion.objects.create(
        label="gone", served_name="tiny", path="/nowhere", weights="9" * 64, tokenizer="9" * 64, config="9" * 64,
        layout="9" * 64, adapters="9" * 64, identity="9" * 64, inputs={"layout": {"block_size": 32}},
    )  # fmt: skip
    text = TEXT.replace("The customer is {customer}. ", "")
    samples = [{"question": s["question"]} for s in SAMPLES]
    template = prompt_template_create(name="tail", tenant=None, text=text, samples=samples, actor="test")
    rows = {r["version"]: r for r in prompt_template_analysis(template)}
    assert list(rows) == ["tiny-v1", "gone", "tiny-v2"]  # serving first, then the newest
    v1 = rows["tiny-v1"]
    assert (v1["breaking_variable"], v1["moved_variables"], v1["recommendation"], v1["extra_blocks"]) == ("question", [], "", 0)
    assert (v1["shared_tokens"], v1["moved_shared_tokens"], v1["break_token"], v1["shared_blocks"]) == (74, 74, 74, 2)
    assert _mistral_shared(demo_checkpoints["tiny-v1"], [text.format(**s) for s in samples]) == 74
    assert rows["gone"]["error"] == "/nowhere does not exist" and rows["gone"]["shared_tokens"] is None
    # Identical samples: nothing varies, nothing breaks (another opening: two global templates never share one).
    same = prompt_template_create(
        name="same", tenant=None, text="Be brief. " + text, samples=[samples[0], samples[0]], actor="test"
    )
    row = prompt_template_analysis(same)[0]
    assert (row["breaking_variable"], row["break_token"], row["recommendation"]) == (None, None, "")


@pytest.mark.parametrize(
    ("changes", "field", "problem"),
    [
        ({"name": "has space"}, "name", "letters, digits"),
        ({"text": "Hi {customer}, welcome to Acme Corporation"}, "text", "3 characters here, at least 32 needed"),
        ({"text": "You are the Acme Corporation support assistant {customer"}, "text", "expected '}' before end of string"),
        ({"text": "You are the Acme Corporation support assistant {}"}, "text", "variable {} must be a name"),
        ({"text": "You are the Acme Corporation support assistant {customer:>9}"}, "text", "takes no format spec"),
        ({"samples": []}, "samples", "must be a non-empty JSON list"),
        ({"samples": [{"customer": "Ada"}]}, "samples.0", "no value for question"),
        ({"samples": [{"customer": "Ada", "question": "Why?", "x": "1"}]}, "samples.0", "x is not a variable"),
        ({"samples": [{"customer": 7, "question": "Why?"}]}, "samples.0.customer", "must be a string, got int"),
        ({"samples": [{"customer": "Ada", "question": "?"}] * 21}, "samples", "at most 20 samples, got 21"),
    ],
)
def test_bad_templates_are_refused_with_the_field_and_nothing_is_stored(
    changes: dict[str, Any], field: str, problem: str
) -> None:
    values = {"name": "support", "tenant": None, "text": TEXT, "samples": SAMPLES, **changes}
    with pytest.raises(InvalidField) as refused:
        prompt_template_create(**values, actor="test")
    assert refused.value.field == field and problem in refused.value.problem
    assert PromptTemplate.objects.count() == 0 and AuditEvent.objects.filter(action="prompt_template.create").count() == 0


def _templates() -> list[tuple[str, str | None, str]]:
    """Every template as (name, tenant slug, text), and the audit's count of creations."""
    rows = PromptTemplate.objects.order_by("id").values_list("name", "tenant__slug", "text")
    return [*rows, ("audited", None, str(AuditEvent.objects.filter(action="prompt_template.create").count()))]


def test_names_are_unique_across_global_and_tenant_templates_on_every_surface(world: dict[str, Any], admin_client: Any) -> None:
    alice, bob = world["clients"]["alice"], world["clients"]["bob"]
    prompt_template_create(name="support.v1", tenant=None, text=TEXT, samples=SAMPLES, actor="test")
    prompt_template_create(name="ac.own", tenant=world["acme"], text="Acme only. " + TEXT, samples=SAMPLES, actor="test")
    before = _templates()
    body = {"text": "Globex. " + TEXT, "samples": SAMPLES}
    # A tenant's token naming its template as a global one is called: 400 with the clash, nothing stored.
    taken = bob.post("/api/prompt-templates/", {**body, "name": "support.v1", "tenant": "acme"}, format="json")
    assert taken.status_code == 400
    assert taken.json()["error"]["fields"] == {
        "name": [
            "a template named 'support.v1' already exists for all tenants: names are unique across every tenant "
            "(the name is the template label of the gateway's metrics, which carry no tenant)"
        ]
    }
    # A global template named as a tenant's: refused too; the name is "taken", by whom is not said.
    taken = (
        "a template named 'ac.own' already exists: names are unique across every tenant "
        "(the name is the template label of the gateway's metrics, which carry no tenant)"
    )
    clash = alice.post("/api/prompt-templates/", {**body, "name": "ac.own"}, format="json")
    assert clash.status_code == 400
    assert clash.json()["error"]["fields"]["name"] == [taken]
    own = bob.post("/api/prompt-templates/", {**body, "name": "ac.own", "tenant": "acme"}, format="json")
    assert own.json()["error"]["fields"]["name"][0].startswith("a template named 'ac.own' already exists for acme:")
    page = admin_client.post("/prompt-templates/", {**body, "samples": json.dumps(SAMPLES), "name": "ac.own", "tenant": "globex"})
    assert page.status_code == 400
    assert f"name: {escape(taken)}" in page.content.decode()
    assert "another tenant" not in page.content.decode()
    with pytest.raises(InvalidField, match="'support.v1' already exists for all tenants"):
        prompt_template_create(name="support.v1", tenant=world["globex"], text="G. " + TEXT, samples=SAMPLES, actor="t")
    assert _templates() == before


def test_templates_of_one_precedence_never_share_their_fixed_text(world: dict[str, Any], admin_client: Any) -> None:
    from cacheadmin.services.prompt_templates import template_indexes

    alice, bob = world["clients"]["alice"], world["clients"]["bob"]
    prompt_template_create(name="support", tenant=None, text=TEXT, samples=SAMPLES, actor="test")
    prompt_template_create(name="acme-support", tenant=world["acme"], text="Acme. " + TEXT, samples=SAMPLES, actor="test")
    before = _templates()
    # Same fixed text, other variables after it: the gateway could not tell the two apart.
    copy = TEXT.replace("Question: {question}", "Ask: {question}")
    twice = alice.post("/api/prompt-templates/", {"name": "support-2", "text": copy, "samples": SAMPLES}, format="json")
    message = (
        "template 'support' (for all tenants) has the same fixed text before {customer}: the gateway could not tell "
        "which of the two a request follows (change the opening, or delete 'support' first)"
    )
    assert twice.status_code == 400 and twice.json()["error"]["fields"] == {"text": [message]}
    form = {"name": "support-2", "tenant": "", "text": copy, "samples": json.dumps(SAMPLES)}
    page = admin_client.post("/prompt-templates/", form)
    assert page.status_code == 400 and "text: template &#x27;support&#x27; (for all tenants) has the same fixed text" in (
        page.content.decode()
    )
    mine = bob.post(
        "/api/prompt-templates/", {"name": "acme-2", "tenant": "acme", "text": "Acme. " + copy, "samples": SAMPLES}, format="json"
    )
    assert mine.status_code == 400
    assert mine.json()["error"]["fields"]["text"][0].startswith("template 'acme-support' (for acme) has the same fixed text")
    assert _templates() == before
    # A tenant's own template may repeat a global one's opening: it wins for that tenant, the global one elsewhere.
    override = bob.post(
        "/api/prompt-templates/", {"name": "acme-3", "tenant": "acme", "text": TEXT, "samples": SAMPLES}, format="json"
    )
    assert override.status_code == 201, override.json()
    indexes = template_indexes()
    request = TEXT.split("{customer}")[0] + "Ada. Question: where?"
    assert (indexes[world["acme"].pk].match(request), indexes[None].match(request)) == ("acme-3", "support")


def test_the_database_holds_the_uniqueness_under_concurrent_creates(
    world: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    from django.db import IntegrityError, transaction

    from cacheadmin.services import prompt_templates

    first = prompt_template_create(name="support", tenant=world["acme"], text=TEXT, samples=SAMPLES, actor="test")
    assert first.fixed_digest is not None and len(first.fixed_digest) == 32
    for values in (
        {"name": "support", "tenant": world["globex"], "fixed_digest": "0" * 32},  # a name taken anywhere
        {"name": "other", "tenant": world["acme"], "fixed_digest": first.fixed_digest},  # one tenant's fixed text
    ):
        with pytest.raises(IntegrityError), transaction.atomic():
            PromptTemplate.objects.create(text=TEXT, samples=SAMPLES, **values)
    PromptTemplate.objects.create(name="g1", text=TEXT, samples=SAMPLES, fixed_digest="1" * 32)
    with pytest.raises(IntegrityError), transaction.atomic():
        PromptTemplate.objects.create(name="g2", text=TEXT, samples=SAMPLES, fixed_digest="1" * 32)
    # Two templates of no digest (kept from before the constraint) do not clash.
    PromptTemplate.objects.create(name="old1", text=TEXT, samples=SAMPLES)
    PromptTemplate.objects.create(name="old2", text=TEXT, samples=SAMPLES)
    # Another create commits between the check and the insert: the constraint refuses, the service says which.
    real = prompt_templates._clash
    calls: list[str] = []

    def late(**kwargs: Any) -> Any:
        calls.append(kwargs["name"])
        return None if len(calls) == 1 else real(**kwargs)

    monkeypatch.setattr(prompt_templates, "_clash", late)
    before = _templates()
    with pytest.raises(InvalidField, match="a template named 'support' already exists for acme") as refused:
        prompt_template_create(name="support", tenant=world["acme"], text="Other. " + TEXT, samples=SAMPLES, actor="t")
    assert (refused.value.field, calls, _templates()) == ("name", ["support", "support"], before)


#: (page form changes, API body changes, field, problem): each refused alike by the page and the API.
SAME_RULES = [
    ({"text": TEXT + "\x00"}, {"text": TEXT + "\x00"}, "text", "must not contain the NUL character (U+0000)"),
    (
        {"samples": json.dumps([{**SAMPLES[0], "question": "Why?\x00"}])},
        {"samples": [{**SAMPLES[0], "question": "Why?\x00"}]},
        "samples.0.question",
        "must not contain the NUL character (U+0000)",
    ),
    (
        {"text": "You are the Acme Corporation support assistant. Answer briefly.", "samples": "[{}]"},
        {"text": "You are the Acme Corporation support assistant. Answer briefly.", "samples": [{}]},
        "text",
        "a template needs at least one {variable}: write one where each request's own text goes, e.g. {question} "
        "(the gateway recognises a template by the fixed text before its first variable)",
    ),
    (
        {"text": "You are the Acme Corporation support assistant. Answer briefly.", "samples": "[]"},
        {"text": "You are the Acme Corporation support assistant. Answer briefly.", "samples": []},
        "text",
        "a template needs at least one {variable}",
    ),
    ({"name": "support\n"}, {"name": "support\n"}, "name", "1-64 characters: letters, digits"),
    ({"name": ""}, {"name": ""}, "name", "1-64 characters: letters, digits"),
    ({"text": "x" * 20_001}, {"text": "x" * 20_001}, "text", "at most 20000 characters"),
]


@pytest.mark.parametrize(("form_changes", "body_changes", "field", "problem"), SAME_RULES)
def test_the_page_and_the_api_refuse_the_same_input_alike(
    world: dict[str, Any], admin_client: Any, form_changes: dict[str, str], body_changes: dict[str, Any], field: str,
    problem: str,
) -> None:  # fmt: skip
    from django.utils.html import escape

    before = _templates()
    form = {"name": "support", "tenant": "", "text": TEXT, "samples": json.dumps(SAMPLES), **form_changes}
    page = admin_client.post("/prompt-templates/", form)
    assert page.status_code == 400 and f'id="form-error">{escape(field + ": " + problem)}' in page.content.decode()
    body = {"name": "support", "text": TEXT, "samples": SAMPLES, **body_changes}
    api = world["clients"]["alice"].post("/api/prompt-templates/", body, format="json")
    assert api.status_code == 400
    assert api.json()["error"]["fields"][field][0].startswith(problem)
    assert _templates() == before


def test_duplicate_keys_and_unpaired_surrogates_are_refused_on_both_surfaces(world: dict[str, Any], admin_client: Any) -> None:
    before = _templates()
    text = "You are the Acme Corporation support assistant, answering {x}"
    page = admin_client.post("/prompt-templates/", {"name": "dup", "tenant": "", "text": text, "samples": '[{"x":"1","x":"2"}]'})
    assert page.status_code == 400
    assert "samples: not JSON: duplicate key &#x27;x&#x27; in a JSON object" in page.content.decode()
    raw = '{"name": "dup", "text": "' + text + '", "samples": [{"x": "1", "x": "2"}]}'
    api = world["clients"]["alice"].post("/api/prompt-templates/", raw, content_type="application/json")
    assert api.status_code == 400 and "duplicate key 'x' in a JSON object" in api.json()["error"]["message"]
    # A JSON "\ud800" escape is no character: no database stores it.
    for body, field in (
        # json.dumps writes a lone surrogate as its \\u escape, as a client's JSON library would.
        (json.dumps({"name": "lone", "text": text + " \ud800", "samples": [{"x": "1"}]}), "text"),
        (json.dumps({"name": "lone", "text": text, "samples": [{"x": "\udfff"}]}), "samples.0.x"),
    ):
        api = world["clients"]["alice"].post("/api/prompt-templates/", body, content_type="application/json")
        assert api.status_code == 400, api.json()
        problem = api.json()["error"]["fields"][field][0]
        assert problem.startswith("must not contain the unpaired surrogate U+D") and problem.endswith("which is not a character")
    assert _templates() == before


def test_computed_fields_are_read_only_in_options_and_the_schema(world: dict[str, Any]) -> None:
    alice = world["clients"]["alice"]
    # OPTIONS describes POST by the body it takes: every field writable, nothing computed.
    post = alice.options("/api/prompt-templates/").json()["actions"]["POST"]
    assert {k: (v["read_only"], v["required"]) for k, v in post.items()} == {
        "name": (False, True), "tenant": (False, False), "text": (False, True), "samples": (False, True),
    }  # fmt: skip
    schema = alice.get("/api/schema/?format=json").json()["components"]["schemas"]
    props = schema["PromptTemplate"]["properties"]
    assert [k for k in ("fixed_chars", "created_by", "created_at", "name") if props[k].get("readOnly")] == [
        "fixed_chars", "created_by", "created_at"
    ]  # fmt: skip
    request_props = schema["PromptTemplateCreateRequest"]["properties"]
    assert sorted(request_props) == ["name", "samples", "tenant", "text"]


def _stats(template: PromptTemplate, ns: Any) -> None:
    now = timezone.now().replace(second=0, microsecond=0)
    TemplateStat.objects.create(template=template, namespace=ns, minute=now, requests=8, warm=6)
    TemplateStat.objects.create(template=template, namespace=ns, minute=now - timedelta(minutes=5), requests=2, warm=0)
    TemplateStat.objects.create(template=template, namespace=ns, minute=now - timedelta(hours=2), requests=50, warm=50)


def test_pages_list_create_and_analyse_for_staff_and_read_only_operators(
    world: dict[str, Any], admin_client: Any, client: Any, demo_checkpoints: dict[str, Path]
) -> None:
    _versions(demo_checkpoints)
    created = admin_client.post(
        "/prompt-templates/", {"name": "support", "tenant": "acme", "text": TEXT, "samples": json.dumps(SAMPLES)}
    )
    template = PromptTemplate.objects.get()
    assert created.status_code == 302 and created["Location"] == f"/prompt-templates/{template.pk}/"
    assert (template.tenant, template.created_by) == (world["acme"], "admin (page)")
    _stats(template, world["ns"]["acme"])
    listing = admin_client.get("/prompt-templates/").content.decode()
    assert f'<a href="/prompt-templates/{template.pk}/">support</a></td><td>acme</td>' in listing
    assert "<td>10</td><td>6</td><td>60.0 %</td>" in listing  # the last hour only
    page = admin_client.get(f"/prompt-templates/{template.pk}/").content.decode()
    assert "<strong>60.0 %</strong>, 6 warm of 10 requests" in page
    assert "<td>32 tokens</td><td>14</td><td>0</td>" in page and "<td>64 tokens</td><td>14</td><td>0</td>" in page
    assert "<strong>move {customer} to the end: 2 more shared blocks (64 tokens)</strong>" in page
    live = admin_client.get(f"/prompt-templates/{template.pk}/live").content.decode()
    assert 'id="template-live"' in live and "6 warm of 10 requests" in live
    for url in (f"/prompt-templates/{template.pk}/", f"/prompt-templates/{template.pk}/live"):
        assert admin_client.post(url).status_code == 405 and PromptTemplate.objects.count() == 1
    # Bad input: the form again with the error, 400, nothing stored.
    bad = admin_client.post("/prompt-templates/", {"name": "x", "tenant": "", "text": TEXT, "samples": "[{"})
    assert bad.status_code == 400 and "samples: not JSON" in bad.content.decode() and 'value="x"' in bad.content.decode()
    unknown = admin_client.post("/prompt-templates/", {"name": "x", "tenant": "nope", "text": TEXT, "samples": "[]"})
    assert unknown.status_code == 400 and "tenant: no tenant &#x27;nope&#x27;" in unknown.content.decode()
    assert PromptTemplate.objects.count() == 1
    # A read-only operator sees everything, acts on nothing.
    client.force_login(User.objects.create_user("viewer"))
    assert "60.0 %" in client.get("/prompt-templates/").content.decode()
    assert 'id="template-form"' not in client.get("/prompt-templates/").content.decode()
    assert client.get(f"/prompt-templates/{template.pk}/").status_code == 200
    refused = client.post("/prompt-templates/", {"name": "y", "tenant": "", "text": TEXT, "samples": json.dumps(SAMPLES)})
    assert refused.status_code == 403
    assert client.post(f"/prompt-templates/{template.pk}/delete").status_code == 403
    assert PromptTemplate.objects.count() == 1
    assert admin_client.post(f"/prompt-templates/{template.pk}/delete").status_code == 302
    assert PromptTemplate.objects.count() == 0 and TemplateStat.objects.count() == 0


def test_api_lists_creates_and_deletes_with_the_error_envelope(world: dict[str, Any]) -> None:
    alice, bob, charlie = (world["clients"][n] for n in ("alice", "bob", "charlie"))
    created = alice.post("/api/prompt-templates/", {"name": "support", "text": TEXT, "samples": SAMPLES}, format="json")
    assert created.status_code == 201
    body = created.json()
    assert {k: body[k] for k in ("name", "tenant", "fixed_chars", "requests", "warm", "hit_ratio")} == {
        "name": "support", "tenant": None, "fixed_chars": 64, "requests": 0, "warm": 0, "hit_ratio": None,
    }  # fmt: skip
    template = PromptTemplate.objects.get(pk=body["id"])
    _stats(template, world["ns"]["acme"])
    # bob's token is bound to acme: it creates for acme only.
    own = bob.post("/api/prompt-templates/", {"name": "mine", "tenant": "acme", "text": TEXT, "samples": SAMPLES}, format="json")
    assert own.status_code == 201 and own.json()["tenant"] == "acme"
    other = bob.post("/api/prompt-templates/", {"name": "g", "text": TEXT, "samples": SAMPLES}, format="json")
    assert other.status_code == 400
    assert other.json()["error"]["fields"] == {"tenant": ["a token bound to a tenant creates templates for its own tenant only"]}
    bad = alice.post("/api/prompt-templates/", {"name": "b", "text": TEXT, "samples": [{"customer": "Ada"}]}, format="json")
    assert bad.status_code == 400 and bad.json()["error"]["fields"] == {"samples.0": ["no value for question"]}
    unknown = alice.post("/api/prompt-templates/", {"name": "b", "text": TEXT, "samples": SAMPLES, "x": 1}, format="json")
    assert unknown.status_code == 400
    # charlie (read, globex) sees the global template and not acme's; cannot write. Its figures are
    # globex's own traffic alone (none): acme's 10 requests are not another tenant's business.
    listed = charlie.get("/api/prompt-templates/").json()
    assert [(r["name"], r["requests"], r["warm"], r["hit_ratio"]) for r in listed["results"]] == [("support", 0, 0, None)]
    one = charlie.get(f"/api/prompt-templates/{template.pk}/").json()
    assert (one["requests"], one["warm"], one["hit_ratio"]) == (0, 0, None)
    # acme's token sees acme's traffic; an unbound token sees every tenant's.
    mine = {r["name"]: (r["requests"], r["warm"], r["hit_ratio"]) for r in bob.get("/api/prompt-templates/").json()["results"]}
    assert mine["support"] == (10, 6, 0.6)
    every = {r["name"]: r["requests"] for r in alice.get("/api/prompt-templates/").json()["results"]}
    assert every["support"] == 10
    assert (
        charlie.post("/api/prompt-templates/", {"name": "c", "text": TEXT, "samples": SAMPLES}, format="json").status_code == 403
    )
    assert charlie.get(f"/api/prompt-templates/{own.json()['id']}/").status_code == 404
    assert bob.delete(f"/api/prompt-templates/{template.pk}/").status_code == 403  # a global one
    assert PromptTemplate.objects.count() == 2
    assert alice.delete(f"/api/prompt-templates/{template.pk}/").status_code == 204
    assert list(PromptTemplate.objects.values_list("name", flat=True)) == ["mine"]
    assert template_hit_ratios([]) == {}


@pytest.mark.parametrize("rows", [10, 200])
def test_the_list_runs_a_constant_number_of_queries(world: dict[str, Any], django_assert_num_queries: Any, rows: int) -> None:
    from cacheadmin.models import ApiToken

    PromptTemplate.objects.bulk_create(
        PromptTemplate(name=f"t{i}", tenant=world["acme"] if i % 2 else None, text=TEXT, samples=SAMPLES, fixed_chars=64)
        for i in range(rows)
    )
    ApiToken.objects.update(last_used_at=timezone.now())  # not written again within a minute
    # The token, the count, the page and every hit ratio of the page in one.
    with django_assert_num_queries(4):
        listed = world["clients"]["bob"].get("/api/prompt-templates/?limit=1000")
    assert listed.status_code == 200 and listed.json()["count"] == rows


def test_the_admin_creates_and_deletes_through_the_service(world: dict[str, Any], admin_client: Any) -> None:
    add = "/admin/cacheadmin/prompttemplate/add/"
    form = {"name": "support", "tenant": world["acme"].pk, "text": TEXT, "samples": json.dumps(SAMPLES)}
    short = admin_client.post(add, {**form, "text": "Hi {customer}"})
    assert short.status_code == 200 and "3 characters here, at least 32 needed" in short.content.decode()
    assert PromptTemplate.objects.count() == 0
    assert admin_client.post(add, form).status_code == 302
    template = PromptTemplate.objects.get()
    assert (template.tenant, template.fixed_chars, template.created_by) == (world["acme"], 64, "admin (admin)")
    change = admin_client.get(f"/admin/cacheadmin/prompttemplate/{template.pk}/change/").content.decode()
    assert 'name="text"' not in change and "Our assistants answer in plain English" in change  # read-only
    # The admin reads samples as the page and the API do: a key written twice is refused, nothing stored.
    twice = admin_client.post(add, {**form, "name": "twice", "text": "Other. " + TEXT,
                                    "samples": '[{"customer": "Ada", "customer": "Bob", "question": "?"}]'})  # fmt: skip
    assert twice.status_code == 200 and "duplicate key &#x27;customer&#x27; in a JSON object" in twice.content.decode()
    assert list(PromptTemplate.objects.values_list("name", flat=True)) == ["support"]
    deleted = admin_client.post(f"/admin/cacheadmin/prompttemplate/{template.pk}/delete/", {"post": "yes"})
    assert deleted.status_code == 302 and PromptTemplate.objects.count() == 0
    assert AuditEvent.objects.filter(action="prompt_template.delete").count() == 1
