"""The API's rows by compiled read shape (``cacheadmin.api.serializers.rows``)
answer exactly what DRF's generic path answers, for every list and for rows
of every shape (null relations, a missing reverse one-to-one, a many-to-many,
a property, times)."""

from __future__ import annotations

import pytest
from django.utils import timezone
from rest_framework import serializers

import cacheadmin.api.serializers.fields as fields_module
from cacheadmin.api import serializers as s
from cacheadmin.api.serializers.fields import RowSerializer
from cacheadmin.api.serializers.rows import represent_row, row_plan
from cacheadmin.models import ApiToken, CacheNamespace, Engine, RetentionPolicy
from tests.cacheadmin.test_api_query_counts import LISTS, _namespaces

pytestmark = pytest.mark.django_db


def _drf_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every serializer on DRF's generic path from here on (the baseline)."""
    monkeypatch.setattr(fields_module, "row_plan", lambda serializer_class: None)


def _subclasses(klass: type) -> set[type]:
    found = set()
    for sub in klass.__subclasses__():
        found |= {sub, *_subclasses(sub)}
    return found


@pytest.mark.parametrize(("url", "factory", "persona", "queries"), LISTS, ids=[f"{u}:{p}" for u, _, p, _ in LISTS])
def test_a_list_answers_what_drf_answers(world, monkeypatch, url, factory, persona, queries) -> None:
    factory(world, 12)
    ApiToken.objects.update(last_used_at=timezone.now())
    client = world["clients"][persona]
    planned = client.get(f"{url}?limit=1000")
    assert planned.status_code == 200
    _drf_only(monkeypatch)
    generic = client.get(f"{url}?limit=1000")
    assert planned.json() == generic.json()
    assert planned.content == generic.content  # the same keys in the same order, byte for byte
    assert planned.json()["count"] >= 12


def test_details_answer_what_drf_answers_with_and_without_a_policy(world, monkeypatch) -> None:
    _namespaces(world, 4)
    acme_ns = world["ns"]["acme"]  # the world's namespaces have no policy row: "policy" is null
    with_policy = CacheNamespace.objects.filter(policy__isnull=False).first()
    assert with_policy is not None and not RetentionPolicy.objects.filter(namespace=acme_ns).exists()
    urls = [f"/api/namespaces/{acme_ns.pk}/", f"/api/namespaces/{with_policy.pk}/", f"/api/engines/{world['engine'].pk}/"]
    urls += [f"/api/prewarm-jobs/{world['job'].pk}/", f"/api/model-versions/{world['v1'].pk}/"]
    client = world["clients"]["alice"]
    planned = [client.get(url) for url in urls]
    _drf_only(monkeypatch)
    generic = [client.get(url) for url in urls]
    assert [r.status_code for r in planned] == [200] * len(urls)
    assert [r.content for r in planned] == [r.content for r in generic]
    assert planned[0].json()["policy"] is None
    assert planned[1].json()["policy"]["versions_kept"] == with_policy.policy.versions_kept
    assert planned[0].json()["tenant"] == "acme" and planned[0].json()["group"] is None


class _GroupSlugOfRow(RowSerializer):
    """A dotted source through a null relation: DRF leaves a read-only key out (SkipField)."""

    group_slug = serializers.CharField(source="group.slug", read_only=True)
    label = serializers.CharField(source="model_version.label", read_only=True)
    superseded = serializers.BooleanField(read_only=True)

    class Meta:
        model = CacheNamespace
        fields = ("id", "group_slug", "label", "superseded", "created_at")


class _WithMethod(RowSerializer):
    """A method field may read anything: its class stays on DRF's path."""

    kind = serializers.SerializerMethodField()

    class Meta:
        model = Engine
        fields = ("id", "kind")

    def get_kind(self, engine: Engine) -> str:
        return "reference" if engine.namespace_id is None else "serving"


def test_a_null_relation_in_a_dotted_source_is_left_out_as_drf_does(world) -> None:
    _namespaces(world, 2)
    tenant_ns = world["ns"]["acme"]
    group_ns = CacheNamespace.objects.filter(group__isnull=False).first()
    plan = row_plan(_GroupSlugOfRow)
    assert plan is not None and [p.name for p in plan] == ["id", "group_slug", "label", "superseded", "created_at"]
    for row in (tenant_ns, group_ns):
        generic = serializers.ModelSerializer.to_representation(_GroupSlugOfRow(), row)
        assert represent_row(plan, row) == generic
    assert "group_slug" not in represent_row(plan, tenant_ns)
    assert represent_row(plan, group_ns)["group_slug"] == "shared"
    assert represent_row(plan, tenant_ns)["created_at"] == tenant_ns.created_at.isoformat().replace("+00:00", "Z")


def test_a_serializer_that_may_read_the_request_is_not_planned(world) -> None:
    assert row_plan(_WithMethod) is None
    assert _WithMethod(world["engine"]).data == {"id": world["engine"].pk, "kind": "serving"}


def test_every_api_row_serializer_is_planned() -> None:
    # A new field kind the plan does not know sends its whole class back to
    # DRF's path (correct, slower): this names the classes that went back.
    unplanned = {klass.__name__ for klass in _subclasses(RowSerializer) if klass.__module__.startswith("cacheadmin.")}
    unplanned = {name for name in unplanned if row_plan(getattr(s, name, None) or _by_name(name)) is None}
    # The base of the strict write serializers has no model; prompt templates
    # answer their last hour's hit ratio from the request's context (method fields).
    assert unplanned == {"StrictModelSerializer", "PromptTemplateSerializer"}


def _by_name(name: str) -> type:
    return next(klass for klass in _subclasses(RowSerializer) if klass.__name__ == name)
