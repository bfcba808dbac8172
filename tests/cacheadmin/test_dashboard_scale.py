"""What keeps the dashboard fast at 10,000 namespaces stays correct: serving now
reused only while the routing epoch stands, paged with what needs attention
first; the gateway's busiest namespaces summed in SQL as the API sums them;
namespace pages ordered on ids then loaded; the cleanup preview, which lists
each tier once, planning what a recorded plan plans (real disk and Redis tiers),
and reused only within its poll interval and routing epoch."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.db import connection, transaction
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from cacheadmin import selectors_dashboard, views_dashboard
from cacheadmin.models import (
    AccountingScan,
    CacheNamespace,
    Engine,
    EvictionRun,
    GatewayStat,
    ModelVersion,
    Release,
    ResidentSample,
    RetentionPolicy,
    Tenant,
    TierUsageSample,
)
from cacheadmin.selectors import gateway_overview, resident_by_engine
from cacheadmin.selectors_dashboard import ATTENTION_ORDER, namespace_page, serving_now, serving_page
from cacheadmin.services.eviction import eviction_plan
from cacheadmin.services.eviction.plan import eviction_preview
from cacheadmin.services.gateway import gateway_figures
from tests.cacheadmin.test_dashboard import _reader, gray  # noqa: F401  (fixture)
from tests.cacheadmin.test_eviction import kv, write_entry  # noqa: F401  (fixture)
from tests.cacheadmin.test_eviction import world as tiered  # noqa: F401  (fixture)

pytestmark = pytest.mark.django_db


def _namespace(world: dict, name: str) -> CacheNamespace:
    """A namespace of v1 for a tenant of its own (a boundary has one namespace per version)."""
    tenant = Tenant.objects.create(slug=name, name=name)
    owner = world["ns"]["acme"].retention_owner
    return CacheNamespace.objects.create(namespace_key=name.ljust(64, "0"), model_version=world["v1"], tenant=tenant,
                                         retention_owner=owner, storage_prefix=f"ns-{name}")  # fmt: skip


@pytest.fixture(autouse=True)
def _fresh_caches() -> None:
    """Each test starts without the process's serving-now and preview renders."""
    selectors_dashboard._serving_cache.clear()
    views_dashboard._preview_cache.clear()


# --- serving now -------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_serving_now_is_reused_while_the_epoch_stands_and_rebuilt_when_it_moves(gray: dict) -> None:  # noqa: F811
    first = serving_now()
    with CaptureQueriesContext(connection) as ctx:
        again = serving_now()
    assert again is first and len(ctx) == 1 and "cacheadmin_routingepoch" in ctx.captured_queries[0]["sql"]
    acme = next(p for p in first if p["tenant"] == "acme")
    assert [r["percent"] for r in acme["routes"]] == [90, 10]
    # A bulk update moves the epoch when it commits (autocommit here): the next render rebuilds.
    Release.objects.filter(pk=gray["release"].pk).update(traffic_percent=50)
    moved = serving_now()
    assert moved is not first
    assert [r["percent"] for r in next(p for p in moved if p["tenant"] == "acme")["routes"]] == [50, 50]
    # Inside a transaction the epoch has not moved yet for its own changes: nothing is reused.
    with transaction.atomic():
        Release.objects.filter(pk=gray["release"].pk).update(traffic_percent=20)
        with CaptureQueriesContext(connection) as ctx:
            inside = serving_now()
        assert len(ctx) > 1
        assert [r["percent"] for r in next(p for p in inside if p["tenant"] == "acme")["routes"]] == [80, 20]
    assert [r["percent"] for r in next(p for p in serving_now() if p["tenant"] == "acme")["routes"]] == [80, 20]


def test_serving_pages_list_what_needs_attention_first(gray: dict, client) -> None:  # noqa: F811
    # v1 active: globex is served as operators set it up, by its v1 namespace (no engine of its own).
    ModelVersion.objects.filter(pk=gray["v1"].pk).update(status="active")
    rows = serving_now()
    assert [p["attention"] for p in rows] == sorted((p["attention"] for p in rows), key=ATTENTION_ORDER.index)
    acme = next(p for p in rows if p["tenant"] == "acme")
    # v2 takes 10 % and only an unverified engine serves its namespace.
    assert acme["attention"] == "not verified" and rows[0] is acme
    assert acme["routes"][1]["namespace_url"] == f"/namespaces/{gray['new'].pk}/"
    assert acme["routes"][1]["release_url"] == f"/releases/{gray['release'].pk}/"
    total = len(rows)
    assert total >= 2
    second = serving_page(page=2, per_page=1)
    assert (second["rows"], second["total"], second["page"], second["pages"]) == ([rows[1]], total, 2, total)
    assert serving_page(page=999, per_page=1)["page"] == total
    assert [p["tenant"] for p in rows] == ["acme", "globex"]
    assert serving_page(per_page=1)["attention"] == {"not verified": 2}
    _reader(client)
    body = client.get("/fragments/dashboard/serving-now?serving_page=2").content.decode()
    assert 'id="serving-pages"' not in body  # 25 a page: one page here
    assert 'hx-get="/fragments/dashboard/serving-now?serving_page=1"' in body
    assert f'data-tenant="acme" data-served-name="tiny" data-version-id="{gray["v2"].pk}" data-percent="10"' in body
    assert "2 not verified" in body


# --- gateway -----------------------------------------------------------------


def test_gateway_overview_sums_the_busiest_namespaces_as_the_api_does(world: dict) -> None:
    minute = timezone.now().replace(second=0, microsecond=0) - timedelta(minutes=1)
    namespaces = [world["ns"]["acme"], world["ns"]["globex"]]
    for i in range(10):
        namespaces.append(_namespace(world, f"gw{i:02d}"))
    for i, ns in enumerate(namespaces):
        for m, layer in ((0, "prefix"), (1, "prefix"), (0, "response")):
            GatewayStat.objects.create(
                namespace=ns, layer=layer, minute=minute - timedelta(minutes=m), requests=10 + i, hits=3 + m, misses=7 + i - m,
                prompt_tokens=1000, cached_prompt_tokens=300, output_tokens=20, ttft_hit_ms_sum=30.0, ttft_hit_count=3,
                ttft_miss_ms_sum=700.0, ttft_miss_count=7, lookup_ms_sum=4.0, lookup_count=10, bypasses=2,
                bypass={"sampling": 1, "kill_switch": 1} if m else {"sampling": 2},
            )  # fmt: skip
    # Outside the window: counted by neither.
    GatewayStat.objects.create(namespace=namespaces[0], layer="prefix", minute=minute - timedelta(hours=3), requests=10**6)
    overview = gateway_overview(limit=4)
    assert overview["namespaces_with_traffic"] == 12 and overview["limit"] == 4
    busiest = [ns.pk for ns in namespaces[::-1][:4]]
    assert [r["namespace"].pk for r in overview["rows"]] == [pk for pk in busiest for _ in ("response", "prefix")]
    assert [r["layer"] for r in overview["rows"]] == ["response", "prefix"] * 4
    figures = gateway_figures(since=timezone.now() - timedelta(minutes=60))
    for row in overview["rows"]:
        expected = figures[row["namespace"].pk][row["layer"]]
        assert {k: v for k, v in row.items() if k not in ("namespace", "layer")} == expected
    top = overview["rows"][1]
    assert top["requests"] == 2 * 21 and top["bypass"] == {"sampling": 3, "kill_switch": 1}
    assert top["hit_ratio"] == 7 / 42


# --- namespace pages -----------------------------------------------------------


def test_namespace_pages_order_every_namespace_and_load_only_the_page(world: dict) -> None:
    now = timezone.now()
    extra = [_namespace(world, f"pg{i:02d}") for i in range(4)]
    for ns in [*world["ns"].values(), *extra]:
        RetentionPolicy.objects.get_or_create(namespace=ns)
    # Created a month ago: a namespace's creation is its last hit until it has one.
    CacheNamespace.objects.update(created_at=now - timedelta(days=30))
    old_scan = AccountingScan.objects.create(status="succeeded", corpus="", finished_at=now - timedelta(hours=1))
    scan = AccountingScan.objects.create(status="succeeded", corpus="", finished_at=now)
    for i, ns in enumerate(extra):
        for tier, size in (("disk", 1000 * (i + 1)), ("redis", 10)):
            TierUsageSample.objects.create(
                scan=scan, namespace=ns, storage_prefix=ns.storage_prefix, tier=tier, bytes=size, allocated_bytes=0, entries=1,
                last_access_at=now - timedelta(hours=10 - i), sampled_at=now,
            )  # fmt: skip
        # An older scan's bigger sample is not the storage now.
        TierUsageSample.objects.create(scan=old_scan, namespace=ns, storage_prefix=ns.storage_prefix, tier="disk",
                                       bytes=10**9, allocated_bytes=0, entries=1, sampled_at=now)  # fmt: skip
    # extra[0]'s last access is the oldest, but the gateway hit it a minute ago; a minute without hits counts for nothing.
    GatewayStat.objects.create(namespace=extra[0], layer="prefix", minute=now - timedelta(minutes=1), requests=1, hits=1)
    GatewayStat.objects.create(namespace=extra[1], layer="prefix", minute=now - timedelta(minutes=1), requests=1, misses=1)
    biggest, total = namespace_page(order="biggest", limit=2)
    assert total == 6 and [ns.pk for ns in biggest] == [extra[3].pk, extra[2].pk]
    assert [ns.scan_bytes for ns in biggest] == [4010, 3010]
    with CaptureQueriesContext(connection) as ctx:
        stalest, _ = namespace_page(order="stalest", limit=3, offset=2)
    assert len(ctx) == 4
    # Never hit (acme, globex: their creation, in id order), then the oldest last access:
    # extra[1] (9 h), extra[2] (8 h), extra[3] (7 h); extra[0] was hit a minute ago.
    assert [ns.pk for ns in stalest] == [extra[1].pk, extra[2].pk, extra[3].pk]
    assert stalest[0].last_hit == now - timedelta(hours=9)  # extra[1]: its tiers' access; its gateway minute had no hit
    assert stalest[0].tenant.slug == "pg01" and stalest[0].policy.versions_kept == 1
    everything, _ = namespace_page(order="stalest", limit=10)
    assert everything[-1].pk == extra[0].pk and everything[-1].last_hit == now - timedelta(minutes=1)


# --- cleanup preview -------------------------------------------------------------


def test_the_preview_plans_what_a_recorded_plan_plans(tiered: dict, kv: dict) -> None:  # noqa: F811
    # v3 (active, hot) over a small budget: entry evictions inside it, measured from the tier's own entries.
    v3 = tiered["ns"]["v3"]
    RetentionPolicy.objects.filter(namespace=v3).update(max_bytes=2500)
    # A namespace with nothing in any tier: the listing holds no prefix of it.
    zeta = Tenant.objects.create(slug="zeta", name="Zeta")
    CacheNamespace.objects.create(namespace_key="empty".ljust(64, "0"), model_version=v3.model_version, tenant=zeta,
                                  retention_owner=tiered["owner"], storage_prefix="ns-nothing-stored")  # fmt: skip
    RetentionPolicy.objects.create(namespace=CacheNamespace.objects.get(storage_prefix="ns-nothing-stored"), max_bytes=1)
    # A prefix no namespace owns, older than the grace period: an orphan both purge, from the listing the preview read once.
    write_entry(kv["tiers"].disk.root, "ns-orphan-left-behind", "f" * 64, size=700, age_s=7200)
    preview = eviction_preview()
    run = eviction_plan(actor="alice")
    kinds: dict[str, dict[str, int]] = {}
    for action in run.actions.all():
        row = kinds.setdefault(action.kind, {"actions": 0, "bytes": 0})
        row["actions"] += 1
        row["bytes"] += action.bytes_planned
    assert preview["kinds"] == dict(sorted(kinds.items()))
    assert (preview["actions"], preview["bytes"]) == (run.progress_total, run.bytes_planned)
    assert preview["kinds"]["delete_entries"]["actions"] >= 1
    assert set(preview["kinds"]) == {"archive", "delete_archive", "delete_entries", "delete_prefix", "set_residency"}
    orphan = run.actions.get(storage_prefix="ns-orphan-left-behind")
    assert (orphan.kind, orphan.tier, orphan.bytes_planned) == ("delete_prefix", "disk", 2 * 700)


@pytest.mark.django_db(transaction=True)
def test_the_preview_is_reused_within_its_interval_and_epoch(world: dict, client, settings, tmp_path) -> None:
    settings.KV_STORE_ROOT = tmp_path / "kv"
    settings.KV_COLD_ROOT = tmp_path / "cold"
    for ns in world["ns"].values():
        RetentionPolicy.objects.create(namespace=ns)
    _reader(client)
    first = client.get("/fragments/cleanup-preview").content.decode()
    with CaptureQueriesContext(connection) as ctx:
        second = client.get("/fragments/cleanup-preview").content.decode()
    assert not any("cacheadmin_cachenamespace" in q["sql"] for q in ctx.captured_queries)
    planned = first.split('class="planned-at" title="')[1].split('"')[0]
    assert second.split('class="planned-at" title="')[1].split('"')[0] == planned
    # A routing row changed (a policy): the epoch moved and the next request plans again.
    policy = RetentionPolicy.objects.get(namespace=world["ns"]["acme"])
    policy.max_bytes = 5
    policy.save()
    with CaptureQueriesContext(connection) as ctx:
        client.get("/fragments/cleanup-preview")
    assert any("cacheadmin_cachenamespace" in q["sql"] for q in ctx.captured_queries)
    assert not EvictionRun.objects.exists()  # a preview records nothing


# --- engines -------------------------------------------------------------------


def test_residency_shows_each_engines_biggest_namespaces_from_their_latest_samples(world: dict, client) -> None:
    engine = world["engine"]
    Engine.objects.filter(pk=engine.pk).update(kv_events_endpoint="tcp://127.0.0.1:5557")
    now = timezone.now()
    held = [world["ns"]["acme"], world["ns"]["globex"], *(_namespace(world, f"rs{i}") for i in range(5))]
    for i, ns in enumerate(held):
        # An older sample with more tokens is not what the engine holds now.
        ResidentSample.objects.create(engine=engine, namespace=ns, medium="GPU", sampled_at=now - timedelta(seconds=90),
                                      blocks=100, tokens=3200)  # fmt: skip
        ResidentSample.objects.create(engine=engine, namespace=ns, medium="GPU", sampled_at=now - timedelta(seconds=5),
                                      blocks=i + 1, tokens=32 * (i + 1))  # fmt: skip
    ResidentSample.objects.create(engine=engine, namespace=None, medium="GPU", sampled_at=now, blocks=0, tokens=0)
    # Outside the window: not resident any more as far as the consumer knows.
    ResidentSample.objects.create(engine=engine, namespace=None, medium="CPU", sampled_at=now - timedelta(minutes=10), blocks=9,
                                  tokens=288)  # fmt: skip
    engines = list(Engine.objects.all())
    with CaptureQueriesContext(connection) as ctx:
        rows = resident_by_engine(engines, per_engine=5)
    assert len(ctx) == 2
    assert {r["engine_url"] for r in rows} == {f"/engines/{engine.pk}/"}
    assert [(r["boundary"], r["blocks"], r["tokens"], r["others"]) for r in rows] == [
        ("rs4", 7, 224, 0), ("rs3", 6, 192, 0), ("rs2", 5, 160, 0), ("rs1", 4, 128, 0), ("rs0", 3, 96, 2),
    ]  # fmt: skip
    _reader(client)
    body = client.get("/fragments/dashboard/engines").content.decode()
    assert f'and 4 more namespaces in <a href="/engines/{engine.pk}/">e-acme</a>' in body  # 3 shown of 7
