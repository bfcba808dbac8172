"""Incremental routing snapshots: each kind of routing change records what it changed
(``RoutingChange`` rows written in the changing transaction, stamped by the epoch's move), and a snapshot brought up to date
from those rows alone equals one built whole, on whichever database the suite runs on
(SQLite by default, PostgreSQL with ``DATABASE_URL``)."""

from __future__ import annotations

from dataclasses import replace

import pytest
from django.db import transaction

from cacheadmin.models import (
    CacheLayerSwitch,
    CacheNamespace,
    Engine,
    GatewayKey,
    LayerNotPaying,
    ModelVersion,
    Release,
    RetentionOwner,
    RetentionPolicy,
    RoutingChange,
    Tenant,
)
from cacheadmin.models.gateway import routing_changes_recover
from cacheadmin.services.gateway import (
    SnapshotParts,
    gateway_key_issue,
    gateway_key_revoke,
    layer_switch_set,
    namespace_routing_resume,
    namespace_routing_suspend,
    routing_addresses_recheck,
    routing_changes,
    routing_epoch,
    routing_snapshot_build,
    routing_snapshot_parts,
    routing_snapshot_update,
    tenant_gateway_policy_update,
)
from cacheadmin.services.prompt_templates import prompt_template_create
from gateway.asgi import SnapshotHolder

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def served(world: dict) -> dict:
    """world with v1 active and its engine verified: acme's namespace routes to it."""
    ModelVersion.objects.filter(pk=world["v1"].pk).update(status="active")
    Engine.objects.filter(pk=world["engine"].pk).update(verification="verified")
    return world


def follow(parts: SnapshotParts, tenants: set[int], namespaces: set[int], sections: set[str]) -> SnapshotParts:
    """``parts`` brought up to date incrementally, after checking what the log says changed; the
    result must equal a full build, indexes included."""
    assert routing_changes(parts.epoch, routing_epoch()) == (tenants, namespaces, sections)
    updated = routing_snapshot_update(parts)
    assert updated is not None and updated is not parts
    assert updated.epoch == routing_epoch()
    assert updated == routing_snapshot_parts()
    assert updated.snapshot() == routing_snapshot_build()
    return updated


def test_an_unchanged_epoch_reads_nothing_more_and_keeps_the_same_parts(served) -> None:
    parts = routing_snapshot_parts()
    assert routing_snapshot_update(parts) is parts
    assert parts.snapshot().namespaces[served["ns"]["acme"].pk].engines[0].name == "e-acme"


def test_tenants_keys_and_policies_update_their_tenant_only(served) -> None:
    acme = served["acme"]
    parts = routing_snapshot_parts()
    key, plain = gateway_key_issue(tenant=acme, name="bot", actor="t", rate_per_s=5.0, burst=10)
    parts = follow(parts, {acme.pk}, set(), set())
    assert parts.keys_of[acme.pk] == frozenset({key.key_hash}) and parts.keys[key.key_hash].rate_per_s == 5.0
    gateway_key_revoke(key=key, actor="t")
    parts = follow(parts, {acme.pk}, set(), set())
    assert key.key_hash not in parts.keys and acme.pk not in parts.keys_of
    tenant_gateway_policy_update(tenant=acme, actor="t", changes={"response_cache": False, "semantic_threshold": 0.9})
    parts = follow(parts, {acme.pk}, set(), set())
    assert parts.tenants[acme.pk].policy.response_cache is False and parts.tenants[acme.pk].policy.semantic_threshold == 0.9
    initech = Tenant.objects.create(slug="initech", name="Initech")
    parts = follow(parts, {initech.pk}, set(), set())
    assert parts.tenants[initech.pk].slug == "initech"
    Tenant.objects.filter(pk=initech.pk).update(slug="initech-2")  # a bulk update names its rows too
    parts = follow(parts, {initech.pk}, set(), set())
    gone = initech.pk
    initech.delete()
    parts = follow(parts, {gone}, set(), set())
    assert gone not in parts.tenants


def test_namespaces_and_suspensions_update_their_entries(served) -> None:
    acme, globex, ns = served["acme"], served["globex"], served["ns"]
    parts = routing_snapshot_parts()
    RetentionPolicy.objects.create(namespace=ns["acme"], max_age_since_last_hit_s=3600, max_bytes=1 << 20)
    parts = follow(parts, set(), {ns["acme"].pk}, set())
    assert parts.namespaces[ns["acme"].pk].ttl_s == 3600.0 and parts.namespaces[ns["acme"].pk].max_bytes == 1 << 20
    namespace_routing_suspend(namespace=ns["acme"], reason="deceptive hit", actor="t")
    parts = follow(parts, set(), {ns["acme"].pk}, set())
    assert parts.namespaces[ns["acme"].pk].suspended == "deceptive hit"
    namespace_routing_resume(namespace=ns["acme"], actor="t", reason="checked")
    parts = follow(parts, set(), {ns["acme"].pk}, set())
    assert parts.namespaces[ns["acme"].pk].suspended is None
    CacheNamespace.objects.filter(pk=ns["globex"].pk).update(residency="dropped")
    parts = follow(parts, {globex.pk}, {ns["globex"].pk}, set())
    assert ns["globex"].pk not in parts.namespaces and (globex.pk, "tiny") not in parts.routes
    owner = RetentionOwner.objects.get()
    extra = CacheNamespace.objects.create(
        namespace_key="e" * 64, model_version=served["v2"], tenant=acme, retention_owner=owner, storage_prefix="ns-extra"
    )
    parts = follow(parts, {acme.pk}, {extra.pk}, set())
    assert parts.namespaces[extra.pk].version_label == "v2"


def test_engines_and_their_attachments_update_the_namespaces_they_serve(served) -> None:
    engine, ns = served["engine"], served["ns"]
    parts = routing_snapshot_parts()
    Engine.objects.get(pk=engine.pk).attached_namespaces.add(ns["globex"])
    parts = follow(parts, set(), set(), {"engines"})
    assert [e.name for e in parts.namespaces[ns["globex"].pk].engines] == ["e-acme"]
    Engine.objects.filter(pk=engine.pk).update(status="failed")
    parts = follow(parts, set(), set(), {"engines"})
    assert parts.namespaces[ns["acme"].pk].engines == () and parts.namespaces[ns["globex"].pk].engines == ()
    assert parts.engines_of == {} and parts.addresses == {}


def test_a_release_route_updates_its_tenant_routes(served) -> None:
    acme, v1, v2, ns = served["acme"], served["v1"], served["v2"], served["ns"]
    parts = routing_snapshot_parts()
    assert [r.version_label for r in parts.routes[(acme.pk, "tiny")]] == ["v1"]
    release = Release.objects.create(
        served_name="tiny", tenant=acme, from_version=v1, to_version=v2, from_namespace=ns["acme"], to_namespace=ns["acme"],
        classification="incompatible", created_by="t",
    )  # fmt: skip
    parts = follow(parts, {acme.pk}, set(), set())
    assert [(r.version_label, r.percent) for r in parts.routes[(acme.pk, "tiny")]] == [("v1", 100)]
    Release.objects.filter(pk=release.pk).update(status="ready", traffic_percent=10)
    parts = follow(parts, {acme.pk}, set(), set())
    assert [(r.version_label, r.percent, r.canary) for r in parts.routes[(acme.pk, "tiny")]] == [
        ("v1", 90, False),
        ("v2", 10, True),
    ]


def test_layer_switches_holds_and_templates_update_their_sections(served) -> None:
    parts = routing_snapshot_parts()
    layer_switch_set(layer="semantic", enabled=False, actor="t", reason="incident")
    parts = follow(parts, set(), set(), {"layers"})
    assert parts.layers == {"response": True, "semantic": False}
    LayerNotPaying.objects.create(namespace=served["ns"]["acme"], layer="response", floor=1.0)
    parts = follow(parts, set(), set(), {"not_paying"})
    assert parts.not_paying == frozenset({(served["ns"]["acme"].pk, "response")})
    prompt_template_create(
        name="greeting",
        tenant=None,
        text="You are the support assistant of Acme Corporation. Customer: {name}",
        samples=[{"name": "Ada"}],
        actor="t",
    )
    parts = follow(parts, set(), set(), {"templates"})
    assert list(parts.templates) == [None]


def test_changes_of_everything_a_pruned_log_or_a_broad_bulk_write_ask_for_a_full_build(served) -> None:
    parts = routing_snapshot_parts()
    ModelVersion.objects.filter(pk=served["v2"].pk).update(label="v2b")  # a version: every section may name it
    assert routing_changes(parts.epoch, routing_epoch()) is None and routing_snapshot_update(parts) is None
    parts = routing_snapshot_parts()
    CacheLayerSwitch.objects.create(layer="response", enabled=False)
    CacheLayerSwitch.objects.create(layer="semantic", enabled=False)
    RoutingChange.objects.filter(epoch=parts.epoch + 1).delete()  # pruned past this process's epoch
    assert routing_changes(parts.epoch, routing_epoch()) is None
    parts = routing_snapshot_parts()
    GatewayKey.objects.bulk_create(
        GatewayKey(tenant=served["acme"], name=f"k{i}", prefix=f"p{i}", key_hash=f"{i:064x}", created_by="t") for i in range(101)
    )
    assert list(RoutingChange.objects.filter(epoch=routing_epoch()).values_list("section", "ref")) == [("all", None)]
    assert routing_snapshot_update(parts) is None


def test_the_address_recheck_reads_again_only_when_an_address_moved(served) -> None:
    engine = served["engine"]
    Engine.objects.filter(pk=engine.pk).update(base_url="http://localhost:1")  # a name: DNS may move it
    parts = routing_snapshot_parts()
    assert parts.namespaces[served["ns"]["acme"].pk].engines[0].headers[0] == ("Host", "localhost:1")
    assert routing_addresses_recheck(parts) is parts
    # As if the name had not resolved at the last build: it does now, so the engines are read again.
    stale = replace(
        parts,
        addresses={engine.pk: ("http://localhost:1", None)},
        engines_of={},
        identity_of={},
        namespaces={**parts.namespaces, served["ns"]["acme"].pk: replace(parts.namespaces[served["ns"]["acme"].pk], engines=())},
    )
    assert routing_addresses_recheck(stale) == parts


def test_the_holder_builds_once_and_then_only_updates(served) -> None:
    holder = SnapshotHolder(routing_snapshot_parts, routing_snapshot_update, poll_s=0.05)
    assert holder.refresh_if_moved() is False and (holder.full_builds, holder.updates) == (1, 0)
    gateway_key_issue(tenant=served["acme"], name="bot", actor="t")
    assert holder.refresh_if_moved() is True and (holder.full_builds, holder.updates) == (1, 1)
    assert holder.current() == routing_snapshot_build()
    ModelVersion.objects.filter(pk=served["v2"].pk).update(label="v2b")
    assert holder.refresh_if_moved() is True and (holder.full_builds, holder.updates) == (2, 1)
    assert holder.current() == routing_snapshot_build()


def test_a_change_whose_epoch_move_was_lost_after_its_commit_is_counted_by_the_recovery(served, monkeypatch) -> None:
    """The change is on record in its own transaction: a writer that dies between its commit and the
    epoch's move (here: the move never runs) loses nothing; the scheduled recovery counts it."""
    acme = served["acme"]
    parts = routing_snapshot_parts()
    monkeypatch.setattr("django.db.transaction.on_commit", lambda func, using=None, robust=False: None)
    tenant_gateway_policy_update(tenant=acme, actor="t", changes={"response_cache": False})
    monkeypatch.undo()
    assert routing_epoch() == parts.epoch  # no gateway heard of it yet
    assert list(RoutingChange.objects.filter(epoch__isnull=True).values_list("section", "ref")) == [("tenant", acme.pk)]
    assert routing_snapshot_update(parts) is parts
    assert routing_changes_recover() == parts.epoch + 1
    assert routing_changes_recover() is None  # nothing left: the epoch stays
    assert routing_epoch() == parts.epoch + 1
    parts = follow(parts, {acme.pk}, set(), set())
    assert parts.tenants[acme.pk].policy.response_cache is False


def test_a_bump_that_finds_its_change_counted_already_leaves_the_epoch(served) -> None:
    """Two writers commit; the first bump stamps both changes: the second finds none and does not move
    the epoch (an epoch without rows would send every gateway to a full build)."""
    acme, globex = served["acme"], served["globex"]
    parts = routing_snapshot_parts()
    with transaction.atomic():
        tenant_gateway_policy_update(tenant=acme, actor="t", changes={"response_cache": False})
        tenant_gateway_policy_update(tenant=globex, actor="t", changes={"response_cache": False})
    # One transaction, two on-commit bumps: the first counts both changes, the second none.
    assert routing_epoch() == parts.epoch + 1
    follow(parts, {acme.pk, globex.pk}, set(), set())
