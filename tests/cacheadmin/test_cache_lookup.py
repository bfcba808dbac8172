"""The fleet's cache directory (``POST /api/cache/lookup``, ``manage.py gateway lookup``): for a
request body or its token ids, each engine of a tenant's namespaces reports the leading blocks it
holds per medium (the block index the gateways route by, here the embedded SQLite store), and the
response layer whether it holds the answer; a tenant-bound token reaches its own tenant only."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from django.conf import settings
from django.utils import timezone

from cacheadmin.models import Engine, ModelVersion
from cacheadmin.services.block_index import block_index_store
from cacheadmin.services.gateway import tenant_secret
from cacheadmin.services.gateway_stores import response_store
from cacheadmin.services.namespaces import namespace_salt_read
from gateway.canonical import canonical_request, response_cache_key
from gateway.prefix.index import block_set
from gateway.prefix.predict import predict
from inference.block_hashes import HashScheme
from inference.tokenization import load_chat_tokenizer
from tests.helpers import manage, subprocess_env

pytestmark = pytest.mark.django_db(transaction=True)
BODY: dict[str, Any] = {
    "model": "tiny", "temperature": 0, "max_tokens": 4,
    "messages": [{"role": "system", "content": "You answer briefly. " * 60}, {"role": "user", "content": "Where is my order?"}],
}  # fmt: skip


#: Seconds a published set stays usable here: the staleness rule is tested with the gateway's
#: index (tests/gateway/test_prefix_routing.py); here no consumer beats, and a loaded machine is slow.
STALE_S = "3600"


@pytest.fixture
def fleet(world, real_version, settings) -> dict[str, Any]:  # type: ignore[no-untyped-def]
    settings.GATEWAY_PREFIX_INDEX_STALE_S = float(STALE_S)
    version, ns = real_version
    engine = Engine.objects.create(
        name="e-lookup", model_version=version, namespace=ns, base_url="http://127.0.0.1:9", status="ready",
        verification="verified", verified_at=timezone.now(),
        verified_facts={"cache_config": {"block_size": "32", "prefix_caching_hash_algo": "sha256"}},
    )  # fmt: skip
    salt = namespace_salt_read(ns, actor="test", purpose="lookup test")
    tokenizer = load_chat_tokenizer(Path(version.path))
    prediction = predict(tokenizer, "chat", {**BODY, "cache_salt": salt})
    hashes = prediction.hashes(HashScheme(32), salt)
    assert len(hashes) >= 4
    # Blocks 0-1 in engine memory, 0-2 offloaded to CPU: 3 leading blocks held in some medium.
    held = {("GPU", 0): {h: (ns.pk, 32) for h in hashes[:2]}, ("CPU", 0): {h: (ns.pk, 32) for h in hashes[:3]}}
    block_index_store().publish([block_set(engine.pk, 1, held, complete=True)])
    return {**world, "version": version, "namespace": ns, "engine": engine, "hashes": hashes,
            "tokens": list(prediction.token_ids), "salt": salt}  # fmt: skip


def _engine_row(fleet: dict[str, Any]) -> dict[str, Any]:
    return {"engine": "e-lookup", "engine_id": fleet["engine"].pk, "block_size": 32, "blocks": len(fleet["hashes"]),
            "cached_blocks": {"GPU": 2, "CPU": 3, "STORAGE": 0, "any": 3}, "unknown": None}  # fmt: skip


def test_a_request_is_found_per_engine_and_medium_and_in_the_response_layer(fleet) -> None:
    ns = fleet["namespace"]
    alice = fleet["clients"]["alice"]
    found = alice.post("/api/cache/lookup/", {"tenant": "acme", "request": BODY}, format="json")
    assert found.status_code == 200, found.json()
    rows = {row["namespace"]: row for row in found.json()["namespaces"]}
    row = rows[ns.pk]
    assert (row["model_version"], row["prompt_tokens"], row["engines"]) == ("tiny-v1", len(fleet["tokens"]), [_engine_row(fleet)])
    assert row["response_cache"] == {"holds": False}
    # The answer is stored: the response layer holds it now (and says only that).
    key = response_cache_key(canonical_request("chat", BODY), namespace_key=ns.namespace_key,
                             tenant_secret=tenant_secret(fleet["acme"].key))  # fmt: skip
    response_store().put(ns.storage_prefix, key, json.dumps({"choices": [{"message": {"content": "secret"}}]}).encode(),
                         ttl_s=None, max_bytes=None)  # fmt: skip
    again = alice.post("/api/cache/lookup/", {"tenant": "acme", "request": BODY}, format="json").json()
    row = {r["namespace"]: r for r in again["namespaces"]}[ns.pk]
    assert row["response_cache"] == {"holds": True} and "secret" not in json.dumps(again)
    # The same prompt as token ids: the engines only.
    by_tokens = alice.post("/api/cache/lookup/", {"tenant": "acme", "tokens": fleet["tokens"]}, format="json").json()
    row = {r["namespace"]: r for r in by_tokens["namespaces"]}[ns.pk]
    assert row["engines"] == [_engine_row(fleet)] and "response_cache" not in row
    # The CLI twin answers the same.
    path = Path(fleet["version"].path).parent / "lookup-body.json"
    path.write_text(json.dumps(BODY))
    try:
        env = subprocess_env(GATEWAY_DIR=str(settings.GATEWAY_DIR), GATEWAY_PREFIX_INDEX_STALE_S=STALE_S)  # this test's stores
        cli = manage("gateway", "lookup", "--tenant", "acme", "--request", str(path), env=env)
    finally:
        path.unlink()
    assert cli.returncode == 0, cli.stderr
    assert json.loads(cli.stdout) == again


def test_an_engine_whose_index_is_missing_or_stale_says_so(fleet) -> None:
    block_index_store().drop([fleet["engine"].pk])
    answer = fleet["clients"]["alice"].post("/api/cache/lookup/", {"tenant": "acme", "request": BODY}, format="json").json()
    (engine,) = {r["namespace"]: r for r in answer["namespaces"]}[fleet["namespace"].pk]["engines"]
    assert (engine["cached_blocks"], engine["unknown"]) == (None, "no_index")


@pytest.mark.parametrize(
    ("payload", "field"),
    [
        ({"tenant": "acme"}, "request"),
        ({"tenant": "acme", "request": BODY, "tokens": [1, 2]}, "request"),
        ({"tenant": "acme", "tokens": [1, -2]}, "tokens"),
        ({"tenant": "acme", "tokens": []}, "tokens"),
        ({"tenant": "acme", "tokens": [1, True]}, "tokens"),
        ({"tenant": "acme", "endpoint": "embeddings", "request": BODY}, "endpoint"),
        ({"tenant": "acme", "request": {**BODY, "messages": "hello"}}, "messages"),
        ({"tenant": "nobody", "request": BODY}, "tenant"),
        ({"tenant": "acme", "request": BODY, "extra": 1}, "extra"),
    ],
)
def test_bad_lookups_are_refused_by_field(fleet, payload: dict[str, Any], field: str) -> None:
    refused = fleet["clients"]["alice"].post("/api/cache/lookup/", payload, format="json")
    assert refused.status_code == 400, refused.json()
    assert any(f == field or f.startswith(field) for f in refused.json()["error"].get("fields", {})), refused.json()


def test_a_tenant_bound_token_looks_up_its_own_tenant_only(fleet) -> None:
    bob, charlie = fleet["clients"]["bob"], fleet["clients"]["charlie"]  # bound to acme, and to globex
    assert bob.post("/api/cache/lookup/", {"tenant": "acme", "request": BODY}, format="json").status_code == 200
    other = charlie.post("/api/cache/lookup/", {"tenant": "acme", "request": BODY}, format="json")
    assert other.status_code in (400, 403, 404) and "e-lookup" not in other.content.decode()
    assert (
        fleet["clients"]["anonymous"].post("/api/cache/lookup/", {"tenant": "acme", "tokens": [1]}, format="json").status_code
        == 401
    )


def test_the_cli_refuses_bad_input_with_exit_2(fleet, tmp_path: Path) -> None:
    bad = tmp_path / "tokens.json"
    bad.write_text('{"not": "a list"}')
    done = manage("gateway", "lookup", "--tenant", "acme", "--tokens", str(bad), env=subprocess_env())
    assert (done.returncode, done.stderr.strip().splitlines()[-1]) == (
        2,
        "CommandError: --tokens must hold a JSON list of token ids",
    )
    bad.write_text("[1, -1]")
    done = manage("gateway", "lookup", "--tenant", "acme", "--tokens", str(bad), env=subprocess_env())
    assert done.returncode == 2 and "tokens" in done.stderr


def test_explain_shows_each_candidates_cached_blocks_load_and_cost(fleet) -> None:
    ModelVersion.objects.filter(pk=fleet["version"].pk).update(status="active")  # routed: the tenant's active version
    explained = fleet["clients"]["alice"].post("/api/gateway/explain/", {"tenant": "acme", "request": BODY}, format="json")
    assert explained.status_code == 200, explained.json()
    routing = explained.json()["route"]["routing"]
    n = len(fleet["hashes"])
    assert routing == {
        "engine": "e-lookup", "mode": "precise", "reason": None, "blocks": n,
        "predicted_cached_tokens": 3 * 32,
        "candidates": [{"engine": "e-lookup", "engine_id": fleet["engine"].pk, "cached_blocks": 3, "confirmed_blocks": 3,
                        "weighted_blocks": 2.75, "load": 0, "cost": round(n - 2.75, 3), "index": "used"}],
    }  # fmt: skip
    path = Path(fleet["version"].path).parent / "explain-body.json"
    path.write_text(json.dumps(BODY))
    try:
        env = subprocess_env(GATEWAY_DIR=str(settings.GATEWAY_DIR), GATEWAY_PREFIX_INDEX_STALE_S=STALE_S)
        cli = manage("gateway", "explain", "--tenant", "acme", "--request", str(path), env=env)
    finally:
        path.unlink()
    assert cli.returncode == 0, cli.stderr
    lines = cli.stdout.splitlines()
    chosen = f"engine choice: precise, {n} blocks, 96 prompt tokens predicted cached on the winner"
    assert lines[1] == chosen + " (lowest cost: blocks to compute + load)"
    held = "3 leading blocks held (3 confirmed by its events, weight 2.75)"
    assert lines[2] == f"  e-lookup: {held}, load 0, cost {round(n - 2.75, 3)}, index used"
